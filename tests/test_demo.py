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
    assert weights <= 32e6, f"demo weights are {weights / 1e6:.1f} MB, over the 32 MB budget"
    dspark = os.path.getsize(os.path.join(DEMO_DIR, "drafter_dspark", "model.safetensors"))
    assert dspark <= 8e6, f"the DSpark demo drafter is {dspark / 1e6:.1f} MB, over its 8 MB budget"
    assert os.path.isfile(os.path.join(DEMO_DIR, "README.md")), "the demo pair needs its model card"


def test_transformers_greedy_continuation_of_the_shipped_target_equals_ours():
    demo = dflash_jax.load_demo()
    ids = demo.tokenizer.encode(PROMPT)
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
    ids = demo.tokenizer.encode(PROMPT)
    spec = dflash_jax.generate(demo.target, demo.drafter, [ids], max_new_tokens=48)
    plain = dflash_jax.generate(demo.target, None, [ids], max_new_tokens=48)
    assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_length > 2.5, "the trained drafter must get drafts accepted (3.13 when shipped)"


def test_demo_dspark_drafter_is_lossless_and_beats_the_dflash_one_on_the_prompt():
    demo = dflash_jax.load_demo(drafter="dspark")
    ids = demo.tokenizer.encode(PROMPT)
    spec = dflash_jax.generate(demo.target, demo.drafter, [ids], max_new_tokens=48)
    assert spec.tokens == dflash_jax.generate(demo.target, None, [ids], max_new_tokens=48).tokens
    assert demo.drafter.config.family == "dspark" and demo.drafter.config.verify_policy == "confidence-slot"
    assert spec.stats.acceptance_length > 3.5, "the DSpark drafter accepts 4.27 on this prompt when shipped"


def test_demo_dspark_drafter_read_with_the_wrong_harvest_accepts_less():
    """Its rows are trained for offset k + 1; the mask-fill harvest verifies them one position early.
    Its Markov head, which chains from the token actually drafted, still rescues part of that, so the
    plain backbone (Markov off) shows the collapse: 1.81 tokens a round the right way, 1.27 the wrong way."""
    def acceptance(**overrides):
        demo = dflash_jax.load_demo(drafter="dspark", **overrides)
        ids = demo.tokenizer.encode(PROMPT)
        return dflash_jax.generate(demo.target, demo.drafter, [ids], max_new_tokens=48).stats.acceptance_length

    right, wrong = acceptance(), acceptance(harvest="dflash")
    assert right > 1.3 * wrong, f"shifted harvest {right:.2f} against mask-fill {wrong:.2f} tokens a round"
    backbone_wrong = acceptance(harvest="dflash", markov=False)
    assert backbone_wrong < 1.4 < acceptance(markov=False), "without its Markov head the wrong harvest accepts little"


def test_cli_generate_streams_the_demo_and_reports(capsys):
    assert cli.main(["generate", "--prompt", PROMPT, "--max-new-tokens", "16", "--compare"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT) and len(out) > len(PROMPT), "the completion is streamed after the prompt"
    assert "acceptance length" in err and "tokens/s" in err and "rounds" in err
    assert "outputs identical" in err


def test_cli_generate_refuses_half_a_pair(capsys):
    assert cli.main(["generate", "--prompt", "x", "--target", DEMO_DIR]) == 2
    assert "give both --target and --drafter" in capsys.readouterr().err
