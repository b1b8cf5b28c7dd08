"""The bundled demo pair: loadable by transformers, lossless with our loop, driven by the CLI."""
import os

import numpy as np
import torch
import transformers

import dflash_jax
from dflash_jax import cli
from dflash_jax.demo import DEMO_DIR

PROMPT = "import os\n\n\ndef read_lines(path):\n    "


def test_demo_pair_is_bundled_within_its_size_budget():
    files = [os.path.join(d, f) for d, _, fs in os.walk(DEMO_DIR) for f in fs]
    weights = sum(os.path.getsize(f) for f in files if f.endswith(".safetensors"))
    assert weights <= 24e6, f"demo weights are {weights / 1e6:.1f} MB, over the 24 MB budget"
    assert os.path.isfile(os.path.join(DEMO_DIR, "README.md")), "the demo pair needs its model card"


def test_transformers_greedy_continuation_of_the_shipped_target_equals_ours():
    demo = dflash_jax.load_demo()
    ids = demo.tokenizer.encode(PROMPT).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(DEMO_DIR, "target"),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    ours = dflash_jax.generate(demo.target, None, [ids], max_new_tokens=24).tokens[0]
    assert ours == ref, f"ours {ours} != transformers {ref}"
    np.testing.assert_allclose(np.asarray(demo.target.full_logits([ids]))[0, -1],
                               model(torch.tensor([ids])).logits[0, -1].detach().numpy(), rtol=1e-4, atol=1e-4)


def test_demo_drafter_is_lossless_and_accepts_drafts():
    demo = dflash_jax.load_demo()
    ids = demo.tokenizer.encode(PROMPT).ids
    spec = dflash_jax.generate(demo.target, demo.drafter, [ids], max_new_tokens=48)
    plain = dflash_jax.generate(demo.target, None, [ids], max_new_tokens=48)
    assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_length > 2.5, "the trained drafter must get drafts accepted (3.13 when shipped)"


def test_cli_generate_streams_the_demo_and_reports(capsys):
    assert cli.main(["generate", "--prompt", PROMPT, "--max-new-tokens", "16", "--compare"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT) and len(out) > len(PROMPT), "the completion is streamed after the prompt"
    assert "acceptance length" in err and "tokens/s" in err and "rounds" in err
    assert "outputs identical" in err


def test_cli_generate_refuses_half_a_pair(capsys):
    assert cli.main(["generate", "--prompt", "x", "--target", DEMO_DIR]) == 2
    assert "give both --target and --drafter" in capsys.readouterr().err
