"""Issue 19, items 3-5: `python -m dflash_jax`, the compiling notice and the persistent compilation cache,
progress bars, and timings that keep compilation out of prefill, decode and tokens/s."""
import io
import math
import os
import re
import stat
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import cli, compilation, text
from dflash_jax.config import policy
from dflash_jax.demo import DEMO_DIR
from dflash_jax.io import names
from test_hub import cache  # noqa: F401 - the fixture: the demo pair as repo ids in an offline Hugging Face cache

PROMPT = "import json\n\n\ndef load_config(path):\n"


def test_compile_cache_folder_resolution():
    assert policy.compile_cache_dir(env={"XDG_CACHE_HOME": "/c"}) == os.path.join("/c", "dflash-jax", "jax")
    assert policy.compile_cache_dir(env={"HOME": "/h"}).endswith(os.path.join(".cache", "dflash-jax", "jax"))
    assert policy.compile_cache_dir(env={"JAX_COMPILATION_CACHE_DIR": "/j", "XDG_CACHE_HOME": "/c"}) == "/j", \
        "a folder the user gave JAX wins"
    assert policy.compile_cache_dir(env={"DFLASH_COMPILE_CACHE": "0", "XDG_CACHE_HOME": "/c"}) is None
    assert policy.compile_cache_dir(env={"DFLASH_COMPILE_CACHE": "1", "XDG_CACHE_HOME": "/c"}) is not None
    assert policy.compile_cache_dir(False, env={"DFLASH_COMPILE_CACHE": "1"}) is None, "the flag beats the variable"
    with pytest.raises(ValueError, match=r"DFLASH_COMPILE_CACHE='yes': unknown compile_cache; choices: 0, 1"):
        policy.compile_cache_dir(env={"DFLASH_COMPILE_CACHE": "yes"})


def test_a_bad_cache_setting_is_a_one_line_refusal(monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_COMPILE_CACHE", "yes")
    assert cli.main(["generate", "--prompt", "x", "--max-new-tokens", "2"]) == 1
    assert capsys.readouterr().err == "refused: DFLASH_COMPILE_CACHE='yes': unknown compile_cache; choices: 0, 1\n"


def test_a_cache_folder_that_cannot_be_made_is_refused_naming_it_and_the_way_out(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DFLASH_COMPILE_CACHE", "1")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "file" / "cache"))
    assert cli.main(["generate", "--prompt", "x", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"refused: cannot use {tmp_path / 'file' / 'cache'} as the compilation cache folder")
    assert "--no-compile-cache" in err and "DFLASH_COMPILE_CACHE=0" in err


def test_watch_counts_what_compiles_and_a_second_call_compiles_nothing():
    # a program no other test compiles (its constant is new each run, and never 0 or 1, which XLA could fold
    # away), so the run's persistent cache has none of it
    salt = 2.0 + int.from_bytes(os.urandom(4), "little")
    f = jax.jit(lambda x: jnp.tanh(x) * salt + x.sum())
    x = jnp.ones(7)
    with compilation.watch() as first:
        f(x).block_until_ready()
    with compilation.watch() as again:
        f(x).block_until_ready()
    assert first.programs >= 1 and first.seconds > 0 and first.cache_hits == 0
    assert again == compilation.Compiled(), "a compiled program runs without compiling"
    assert compilation.Compiled(1.0, 3, 2).describe() == "3 programs, 2 of them read from the persistent cache"


def run_module(*args, env):
    """`python -m dflash_jax ARGS` with `env` over this process's environment, less JAX's own cache folder."""
    base = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return subprocess.run([sys.executable, "-m", "dflash_jax", *args], capture_output=True, text=True, timeout=600,
                          env={**base, "JAX_PLATFORMS": "cpu", **env})


def test_python_m_compiles_once_then_reads_the_persistent_cache(tmp_path):
    """`python -m dflash_jax` is the command; a second process reads what the first compiled."""
    env = {"DFLASH_COMPILE_CACHE": "1", "XDG_CACHE_HOME": str(tmp_path)}
    args = ("generate", "--prompt", PROMPT, "--max-new-tokens", "8")
    cold = run_module(*args, env=env)
    assert cold.returncode == 0, cold.stderr
    folder = tmp_path / "dflash-jax" / "jax"
    assert folder.is_dir() and any(folder.iterdir()), "the compiled programs are kept in the user's cache folder"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700, "JAX runs what it finds there: the folder is the user's"
    assert re.search(r"compiling speculative decoding… done in [0-9.]+ s \([0-9]+ programs\)\n", cold.stderr)
    warm = run_module(*args, env=env)
    assert warm.returncode == 0 and warm.stdout == cold.stdout, warm.stderr
    hits = re.search(r"done in [0-9.]+ s \(([0-9]+) programs, ([0-9]+) of them read from the persistent cache\)",
                     warm.stderr)
    assert hits and int(hits[2]) >= 2, warm.stderr


class WatchedSession(dflash_jax.Session):
    """A Session that records what compiled while it was built (the prefill) and during its bursts."""

    made = []

    def __init__(self, *args, **kwargs):
        with compilation.watch() as seen:
            super().__init__(*args, **kwargs)
        self.compiled = [seen.programs]
        WatchedSession.made.append(self)

    def burst(self, n):
        with compilation.watch() as seen:
            out = super().burst(n)
        self.compiled.append(seen.programs)
        return out


def numbers(line: str) -> dict:
    return {k: float(v) for v, k in re.findall(r"([0-9.]+) (ms|tokens/s)", line)}


def test_generate_streams_a_run_that_compiles_nothing_and_reports_its_times_apart(monkeypatch, capsys):
    WatchedSession.made = []
    monkeypatch.setattr(dflash_jax, "Session", WatchedSession)
    monkeypatch.setattr(text, "Session", WatchedSession)
    assert cli.main(["generate", "--prompt", PROMPT, "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    warmup, streamed = WatchedSession.made
    assert len(warmup.compiled) == 2, "the warm-up is a prefill and a one-token burst: it compiles both programs"
    assert len(streamed.compiled) > 2 and not any(streamed.compiled), \
        f"the streamed run compiled {streamed.compiled} programs (prefill, bursts)"
    assert out.startswith(PROMPT) and len(out) > len(PROMPT)
    lines = err.splitlines()
    assert lines[0].startswith("compiling speculative decoding… done in "), err
    timing = next(x for x in lines if x.startswith("[speculative] load"))
    assert re.search(r"load [0-9.]+ s, compile [0-9.]+ s, prefill [0-9]+ ms, decode [0-9]+ ms: [0-9.]+ tokens/s "
                     r"\(24 tokens over prefill \+ decode, compilation excluded\)", timing), timing
    st = streamed.stats
    assert numbers(timing)["tokens/s"] == pytest.approx(st.tokens_per_s, abs=0.051)
    assert st.tokens_per_s == pytest.approx(st.generated / (st.prefill_time_s + st.decode_time_s))


def test_compare_times_plain_and_speculative_the_same_way(capsys):
    assert cli.main(["generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--compare"]) == 0
    err = capsys.readouterr().err
    assert "compiling plain decoding… done in " in err
    plain = next(x for x in err.splitlines() if x.startswith("[compare: plain]"))
    spec = next(x for x in err.splitlines() if x.startswith("[compare: speculative]"))
    for line in (plain, spec):
        assert re.search(r"prefill [0-9]+ ms, decode [0-9]+ ms: [0-9.]+ tokens/s \(24 tokens over prefill \+ "
                         r"decode, compilation excluded\)", line), line
    shown = re.search(r"speedup ([0-9.]+)x", err)[1]
    speedup = float(shown)
    # The printed figures are rounded: tokens/s to 0.05, the speedup to three significant digits. The
    # speedup must lie in the interval the two printed rates allow, widened by its own rounding.
    s, p = numbers(spec)["tokens/s"], numbers(plain)["tokens/s"]
    ulp = 10.0 ** (math.floor(math.log10(speedup)) - 2)
    assert (s - 0.05) / (p + 0.05) - ulp / 2 <= speedup <= (s + 0.05) / (p - 0.05) + ulp / 2, (shown, s, p)
    assert len(shown.replace(".", "").lstrip("0")) <= 3, shown
    assert "outputs identical" in err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_slow_weight_load_shows_a_progress_bar_on_a_terminal(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    params = [names.Param(("w",), ("a", "b"), (2, 2), False), names.Param(("v",), ("c",), None, False)]

    def get(name):
        time.sleep(0.6)
        return np.ones((3, 2), np.float32)

    loaded = names.load_params(params, get)
    assert loaded["w"].shape == (3, 4) and loaded["v"].shape == (3, 2)
    assert "loading weights" in term.getvalue() and "3/3" in term.getvalue(), term.getvalue()
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    names.load_params(params, lambda n: np.ones((3, 2), np.float32))
    assert quiet.getvalue() == "", "a quick load prints nothing"


def test_generate_takes_hub_repo_ids(cache, capsys):  # noqa: F811 - the imported fixture
    assert cli.main(["generate", "--prompt", PROMPT, "--target", "org/demo-target", "--drafter", "org/demo-drafter",
                     "--max-new-tokens", "12", "--dtype", "float32"]) == 0
    demo = dflash_jax.load_demo()
    want = dflash_jax.generate_text(demo.target, demo.drafter, PROMPT, tokenizer=demo.tokenizer, max_new_tokens=12)
    assert capsys.readouterr().out == PROMPT + want.texts[0] + "\n"


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_sends_the_prompt_through_the_chat_template_and_prints_only_the_reply(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    for name in os.listdir(os.path.join(DEMO_DIR, "target")):
        (target / name).symlink_to(os.path.join(DEMO_DIR, "target", name))
    (target / "chat_template.jinja").write_text(TEMPLATE)
    assert cli.main(["generate", "--prompt", "Write a function.", "--chat", "--target", str(target), "--drafter",
                     os.path.join(DEMO_DIR, "drafter"), "--max-new-tokens", "12", "--dtype", "float32"]) == 0
    tokenizer = dflash_jax.load_tokenizer(str(target))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Write a function."}]) == \
        "<|user|>Write a function.\n<|assistant|>"
    demo = dflash_jax.load_demo()
    want = dflash_jax.generate_text(demo.target, demo.drafter, "Write a function.", tokenizer=tokenizer, chat=True,
                                    max_new_tokens=12)
    assert capsys.readouterr().out == want.texts[0] + "\n", "the reply, without the rendered prompt"


def test_chat_with_a_tokenizer_that_has_no_template_is_refused(capsys):
    assert cli.main(["generate", "--prompt", "x", "--chat", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("refused: the tokenizer of ") and "has no chat template" in err and err.count("\n") == 1


def test_training_shows_a_progress_bar_that_says_it_compiles_then_reports_its_figures(capsys):
    from conftest import tiny_drafter, tiny_target
    from dflash_jax import train

    target = tiny_target(seed=5)
    drafter = tiny_drafter(target, 4)
    tc = train.TrainConfig(steps=3, warmup_steps=1, seq_len=16, anchors_per_seq=4, batch_size=2, log_every=1,
                           compute_dtype="float32")
    train.train_drafter(target, np.arange(400) % 60, drafter.config, drafter.params, tc)
    err = capsys.readouterr().err
    assert "drafter:   0%" in err and "compiling…" in err, "the bar starts by saying the first step compiles"
    assert re.search(r"1/3 .*compiled \+ 1 step in [0-9.]+s", err), err
    assert re.search(r"3/3 .*loss [0-9.]+ \| acc-len [0-9.]+ \| [0-9.]+k tok/s", err), err

