"""Does this JAX launch our Pallas (Triton) kernels inside XLA's CUDA graphs, or from the host one by one?

XLA records a loop body's kernels into CUDA graphs (its command buffers) and launches each graph once. A custom call
joins a graph only if its handler says it may. JAX's Pallas Triton lowering has emitted two custom calls:
`__gpu$xla.gpu.triton` (XLA compiles the Triton module itself: a kernel like its own fusions) and, in jaxlib after
0.10.2, `triton_kernel_call_ffi` (JAX's own launcher, whose registration in the sources we read declares no XLA
command-buffer trait). If the latter keeps our kernels out of the graphs, every Pallas call cuts its layer's graph
in two and is launched by the host, and a step with many short kernels waits on the host: the int8 target's step
(five Pallas calls a layer) sat idle 1,446 of 5,350 us on H100s where the bf16 step (one a layer, same kernel count)
sat idle 826 of 6,749 (`results/profile_round_int8_h100.json`, `run_all_h100/profile_round.json`); the 35B-A3B
hybrid's, 2,610 of 6,094.

This reports, for a tiny Pallas kernel lowered through Triton as JAX lowers our kernels, through Triton forced to
`__gpu$xla.gpu.triton` (this script's own lowering rule, on JAX internals: `triton_xla`), and through Mosaic GPU (as
the `impl="mosaic"` ports are):
- `custom_call_targets`: the custom calls it lowers to for CUDA on this JAX (a CPU host can lower for CUDA), and
  `triton_lowering_choice`, the lines of JAX's Triton lowering that pick one;
- `chains`: the device time per kernel of `--kernels` tiny dependent kernels run `--steps` times in one jitted loop,
  as Pallas kernels of each lowering and as XLA kernels (elementwise ops kept apart by optimisation barriers, so each
  is a kernel of its own). Kernels in a graph cost a launch gap of about a microsecond or two each; kernels the
  host launches cost what the host takes to launch them, several microseconds.

With `--decode` it also times the Qwen3-8B-shaped plain decode step (bf16, and int8 weights) with every one of our
Triton kernels lowered as JAX picks and forced to `__gpu$xla.gpu.triton`: the A/B that matters.

    python bench/graph_capture.py --decode  # GPU: graph_capture.json
    python bench/graph_capture.py --tiny    # CPU smoke test (interpret mode): graph_capture_tiny.json
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.pallas import core as pallas_core
from jax._src.pallas.triton import core as triton_core
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import pallas_call_registration as triton_registration
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import common
import dflash_jax
import plain_decode
from dflash_jax import quant
from pallas_kernels import (dynamic_conv, expert_matmul, gated_delta, key_sums, quant_matmul, route_top_k,
                            windowed_attention)
from pallas_kernels.mosaic_gpu import interpret_params
from pallas_kernels.windowed_attention import _triton_compiler_params

KERNEL_MODULES = (windowed_attention, quant_matmul, expert_matmul, dynamic_conv, gated_delta, route_top_k, key_sums)
"""The modules whose Triton kernels take their compiler params from `_triton_compiler_params`."""

TARGETS = re.compile(r"custom_call_target\s*=\s*\"([^\"]+)\"|stablehlo\.custom_call\s*@([\w$.]+)")


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


LOWERINGS = ("triton", "triton_xla", "mosaic")
"""The lowerings of `pallas_add_one`: Triton as JAX lowers our kernels (`_triton_compiler_params`); Triton lowered to
XLA's own `__gpu$xla.gpu.triton` whatever this JAX picks (`XlaTritonParams`); Mosaic GPU (`plgpu.kernel`, as the
`impl="mosaic"` ports are written)."""


@dataclasses.dataclass(frozen=True)
class XlaTritonParams(triton_core.CompilerParams):
    """Triton compiler params whose kernels `_xla_triton_lowering` lowers (Pallas picks a lowering rule by the
    params' exact type)."""


def _xla_triton_lowering(ctx, *in_nodes, jaxpr, debug, input_output_aliases, grid_mapping, compiler_params,
                         **unused):
    """A Pallas Triton kernel as the custom call `__gpu$xla.gpu.triton`, which XLA compiles itself, as jaxlib 0.10.2's
    Pallas lowers every Triton kernel. JAX internals: this is a probe, not a path of the package."""
    [platform] = ctx.platforms or ctx.module_context.platforms
    try:
        capability = int(str(jax.local_devices(backend="gpu")[0].compute_capability).replace(".", ""))
    except RuntimeError:
        capability = 90
    lowered = triton_lowering.lower_jaxpr_to_triton_module(jaxpr, grid_mapping, platform, capability,
                                                           mlir_ctx=ctx.module_context)
    grid = triton_registration.normalize_grid(lowered.grid)
    buf = io.BytesIO()
    lowered.module.operation.write_bytecode(buf)
    i32 = mlir.i32_attr
    config = dict(name=ir.StringAttr.get(mlir.sanitize_name(jaxpr.debug_info.func_name)),
                  ir=ir.StringAttr.get(buf.getvalue()), num_stages=i32(compiler_params.num_stages or 3),
                  num_warps=i32(compiler_params.num_warps or 4), grid_x=i32(grid[0]), grid_y=i32(grid[1]),
                  grid_z=i32(grid[2]), debug=ir.BoolAttr.get(debug))
    out_types = [ir.RankedTensorType.get(b.array_aval.shape, mlir.dtype_to_ir_type(b.array_aval.dtype))
                 for b in grid_mapping.block_mappings_output]
    return mlir.custom_call(call_target_name="__gpu$xla.gpu.triton", result_types=out_types, operands=in_nodes,
                            backend_config=config, api_version=4,
                            operand_layouts=triton_registration.avals_to_layouts(ctx.avals_in),
                            result_layouts=triton_registration.avals_to_layouts(ctx.avals_out),
                            operand_output_aliases=dict(input_output_aliases)).results


try:
    pallas_core.register_lowering_rule(XlaTritonParams, _xla_triton_lowering, "gpu")
except AttributeError as e:  # JAX internals moved: the `triton_xla` cells then record what their lowering raises
    print(f"graph_capture: could not register the triton_xla lowering rule on this JAX: {e!r}")


def pallas_add_one(x: jax.Array, lowering: str, interpret: bool) -> jax.Array:
    """One tiny Pallas kernel: `x + 1`, a single program, in `lowering`."""
    if lowering != "mosaic":
        params = (_triton_compiler_params if lowering == "triton" else forced_xla_triton)(4, 1)
        return pl.pallas_call(_add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret,
                              compiler_params=params, name="graph_capture_add_one")(x)

    def body(x_gmem, o_gmem):
        def scoped(smem, barrier):
            plgpu.copy_gmem_to_smem(x_gmem, smem, barrier)
            plgpu.barrier_wait(barrier)
            smem[...] = smem[...] + 1.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier())

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,), grid_names=("g",),
                        kernel_name="graph_capture_add_one", interpret=interpret_params(interpret))(x)


def xla_add_one(x: jax.Array) -> jax.Array:
    """The same as an XLA kernel of its own: the barrier keeps it from fusing with its neighbours."""
    return lax.optimization_barrier(x + 1.0)


def chain(step, kernels: int, steps: int):
    """A jitted loop of `steps` iterations, each `kernels` dependent applications of `step`."""
    def body(_, x):
        for _ in range(kernels):
            x = step(x)
        return x
    return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))


def lowered_targets(fn, *args) -> list:
    """The custom-call targets of `fn(*args)` lowered for CUDA (which a CPU host can do), or the error that lowering
    raised on this JAX."""
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001 - the probe's own lowering rests on JAX internals that may have moved
        return [f"error: {e!r:.500}"]
    return sorted({a or b for a, b in TARGETS.findall(text)})


def custom_call_targets(lowering: str) -> list:
    """The custom-call targets of one Pallas kernel in `lowering`, lowered for CUDA."""
    return lowered_targets(lambda x: pallas_add_one(x, lowering, False), jnp.zeros((8, 128), jnp.float32))


def forced_xla_triton(num_warps: int, num_stages: int) -> XlaTritonParams:
    """What `_triton_compiler_params` gives our kernels under `kernels_lowered("triton_xla")`."""
    return XlaTritonParams(num_warps=num_warps, num_stages=num_stages)


def kernels_lowered(lowering: str) -> None:
    """Every kernel module of `pallas_kernels` lowers its Triton kernels as JAX picks ("triton") or forced to
    `__gpu$xla.gpu.triton` ("triton_xla"), by rebinding the params factory each one imported; compiled programs are
    cleared, so the next call traces afresh."""
    factory = _triton_compiler_params if lowering == "triton" else forced_xla_triton
    for module in KERNEL_MODULES:
        module._triton_compiler_params = factory
    jax.clear_caches()


def decode_steps(tiny: bool) -> list:
    """The plain decode step (batch 1; prompt 512 and 128 new tokens, tiny 16 and 8) of the bf16 target and of its
    int8 weights, with our Triton kernels lowered each way in turn; the tokens must not change."""
    cfg, dtype = (common.TINY, jnp.float32) if tiny else (common.QWEN3_8B, jnp.bfloat16)
    prompt, new = (16, 8) if tiny else (512, 128)
    bf16 = common.random_target(cfg, dtype)
    prompts = np.random.RandomState(0).randint(0, cfg.vocab_size - 2, (1, prompt))
    cells = []
    for precision in ("bf16", "int8"):
        target = bf16 if precision == "bf16" else bf16.replace(params=quant.quantize_params(bf16.params, "int8",
                                                                                             xp=jnp))
        tokens = None
        for lowering in ("triton", "triton_xla"):
            kernels_lowered(lowering)
            try:
                res = plain_decode.measure(target, 1, prompt, new, "pallas", 2)
                out = dflash_jax.generate(target, None, prompts, max_new_tokens=new, impl="pallas").tokens[0]
            except Exception as e:  # noqa: BLE001 - a lowering this JAX cannot compile is recorded
                res, out = {"error": repr(e)[:2000]}, None
            tokens = tokens if tokens is not None else out
            cells.append({"precision": precision, "lowering": lowering, **res,
                          "same_tokens": out is not None and out == tokens})
            print(f"decode {precision} {lowering}: {res.get('decode_step_s', float('nan')) * 1e3:.3f} ms a step",
                  flush=True)
    kernels_lowered("triton")
    return cells


def lowering_choice_lines() -> list:
    """The lines of this JAX's Pallas Triton lowering that name a custom call or test a version: how it picks."""
    words = ("version", "call_target_name", "_ffi", "__gpu$")
    lines = inspect.getsource(triton_registration).splitlines()
    return [line.strip() for line in lines if any(w in line for w in words)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: Pallas in interpret mode, a short chain")
    ap.add_argument("--kernels", type=int, default=None, help="kernels per loop iteration (default 200; tiny 4)")
    ap.add_argument("--steps", type=int, default=None, help="loop iterations (default 50; tiny 2)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode", action="store_true",
                    help="also time the Qwen3-8B-shaped plain decode step, bf16 and int8, with our Triton kernels "
                         "lowered as JAX picks and forced to __gpu$xla.gpu.triton")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    interpret = args.tiny or jax.default_backend() != "gpu"
    args.kernels = args.kernels or (4 if args.tiny else 200)
    args.steps = args.steps or (2 if args.tiny else 50)
    kernels, steps = args.kernels, args.steps
    x = jnp.zeros((8, 128), jnp.float32)
    payload = common.environment(**vars(args)) | {
        "custom_call_targets": {lowering: custom_call_targets(lowering) for lowering in LOWERINGS},
        "triton_lowering_choice": lowering_choice_lines(), "chains": {}}
    steps_by_name = {f"pallas_{lowering}": (lambda y, lowering=lowering: pallas_add_one(y, lowering, interpret))
                     for lowering in LOWERINGS}
    for name, step in (*steps_by_name.items(), ("xla", xla_add_one)):
        try:
            seconds, y = common.timed(chain(step, kernels, steps), x, reps=args.reps)
        except Exception as e:  # noqa: BLE001 - a lowering this JAX cannot compile is recorded, the others still run
            payload["chains"][name] = {"error": repr(e)[:2000]}
            print(f"{name}: failed: {e!r:.300}", flush=True)
            continue
        if float(y[0, 0]) != kernels * steps:
            raise AssertionError(f"graph_capture: the {name} chain computed {float(y[0, 0])}, not {kernels * steps}")
        payload["chains"][name] = {"seconds": seconds, "us_per_kernel": seconds / (kernels * steps) * 1e6}
        print(f"{name}: {payload['chains'][name]['us_per_kernel']:.2f} us a kernel", flush=True)
    if args.decode:
        payload["decode"] = decode_steps(args.tiny)
    print(f"custom calls of a Pallas kernel, by lowering: {payload['custom_call_targets']}")
    common.write_json(f"graph_capture{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
