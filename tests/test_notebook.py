"""The notebooks run top to bottom (CPU, small settings through their '# Parameters' cell) without a failing
cell, and their install cell is what a Colab GPU runtime needs."""
import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
README = os.path.join(ROOT, "README.md")


@pytest.fixture(autouse=True)
def kernel_imports_this_checkout(monkeypatch):
    """The notebook's kernel imports the dflash_jax beside these tests, not whichever one is installed."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def read(name: str):
    return nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)


def parameters_cell(nb):
    params = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("# Parameters")]
    assert len(params) == 1, "a notebook needs exactly one '# Parameters' cell"
    return params[0]


def execute(nb, folder) -> tuple:
    """Run every cell (CellExecutionError if one fails); the printed text and the number of images."""
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    return "".join(o.get("text", "") for o in outputs), sum("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.parametrize("name", ["quickstart.ipynb", "train_a_drafter.ipynb"])
def test_the_install_cell_installs_cuda_jax_the_readme_repository_and_matplotlib(name):
    install = read(name).cells[1]
    assert install.cell_type == "code" and install.source.startswith("# Install (Colab only)")
    repository = re.search(r'REPOSITORY = "([^"]+)"', install.source)[1]
    assert f"git+{repository}" in open(README).read(), "the notebook installs from the repository the README gives"
    pip = next(line for line in install.source.splitlines() if "%pip install" in line)
    assert '"jax[cuda12]"' in pip and "matplotlib" in pip and '"dflash-jax @ git+{REPOSITORY}"' in pip
    assert read(name).metadata.get("accelerator") == "GPU", "Colab opens it on a GPU runtime"


def test_quickstart_notebook_executes(tmp_path):
    nb = read("quickstart.ipynb")
    params = parameters_cell(nb)
    params.source = params.source.replace("MAX_NEW_TOKENS = 128", "MAX_NEW_TOKENS = 24")
    assert "MAX_NEW_TOKENS = 24" in params.source
    text, images = execute(nb, tmp_path)
    assert ROOT in text, "the kernel imported this checkout's dflash_jax"
    assert "identical: True" in text, "the notebook must show that plain and speculative outputs match"
    assert re.search(r"speculative: first call \(compiling\) [0-9.]+ s \| timed call: prefill [0-9]+ ms", text)
    assert "acceptance length" in text and images, "the notebook must draw its acceptance and speed charts"


def test_train_a_drafter_notebook_trains_evaluates_and_compares(tmp_path):
    nb = read("train_a_drafter.ipynb")
    params = parameters_cell(nb)
    assert "STEPS = 1500 if ON_GPU else 200" in params.source, "the default: a few minutes on a GPU or a CPU"
    params.source = ("# Parameters\nON_GPU = False\nSTEPS = 4\nBATCH_SIZE = 2\nSEQ_LEN = 64\nLAYERS = 1\n"
                     "MAX_FILES = 20\nEVAL_BATCHES = 1\nN_PROMPTS = 2\nMAX_NEW_TOKENS = 16\n")
    text, images = execute(nb, tmp_path)
    assert os.path.isfile(tmp_path / "my-drafter" / "config.json"), "the trained drafter is written as a checkpoint"
    assert re.search(r"acceptance-length estimate on held-out files: yours [0-9.]+, bundled [0-9.]+", text), text
    for name in ("yours", "bundled"):
        assert re.search(rf"{name}: acceptance length [0-9.]+ tokens per round over 2 held-out prompts; identical "
                         r"to plain decoding: True", text), text
    assert images >= 2, "the loss curve and the per-slot acceptance are plotted"
