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

This reports, for a tiny Pallas kernel lowered through Triton (as our kernels are) and through Mosaic GPU (as the
`impl="mosaic"` ports are):
- `custom_call_targets`: the custom calls it lowers to for CUDA on this JAX (a CPU host can lower for CUDA);
- `chains`: the device time per kernel of `--kernels` tiny dependent kernels run `--steps` times in one jitted loop,
  as Pallas kernels of each lowering and as XLA kernels (elementwise ops kept apart by optimisation barriers, so each
  is a kernel of its own). Kernels in a graph cost a launch gap of about a microsecond or two each; kernels the
  host launches cost what the host takes to launch them, several microseconds.

    python bench/graph_capture.py           # GPU: graph_capture.json
    python bench/graph_capture.py --tiny    # CPU smoke test (interpret mode): graph_capture_tiny.json
"""
from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import common
from pallas_kernels.mosaic_gpu import interpret_params
from pallas_kernels.windowed_attention import _triton_compiler_params

TARGETS = re.compile(r"custom_call_target\s*=\s*\"([^\"]+)\"|stablehlo\.custom_call\s*@([\w$.]+)")


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


LOWERINGS = ("triton", "mosaic")
"""The lowerings of `pallas_add_one`: Triton (our kernels' `_triton_compiler_params`) and Mosaic GPU (`plgpu.kernel`,
as the `impl="mosaic"` ports are written)."""


def pallas_add_one(x: jax.Array, lowering: str, interpret: bool) -> jax.Array:
    """One tiny Pallas kernel: `x + 1`, a single program, in `lowering`."""
    if lowering == "triton":
        return pl.pallas_call(_add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret,
                              compiler_params=_triton_compiler_params(4, 1), name="graph_capture_add_one")(x)

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


def custom_call_targets(lowering: str) -> list:
    """The custom-call targets of one Pallas kernel in `lowering`, lowered for CUDA (which a CPU host can do)."""
    lowered = jax.jit(lambda x: pallas_add_one(x, lowering, False)).trace(jnp.zeros((8, 128), jnp.float32))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    return sorted({a or b for a, b in TARGETS.findall(text)})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: Pallas in interpret mode, a short chain")
    ap.add_argument("--kernels", type=int, default=None, help="kernels per loop iteration (default 200; tiny 4)")
    ap.add_argument("--steps", type=int, default=None, help="loop iterations (default 50; tiny 2)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    interpret = args.tiny or jax.default_backend() != "gpu"
    args.kernels = args.kernels or (4 if args.tiny else 200)
    args.steps = args.steps or (2 if args.tiny else 50)
    kernels, steps = args.kernels, args.steps
    x = jnp.zeros((8, 128), jnp.float32)
    payload = common.environment(**vars(args)) | {
        "custom_call_targets": {lowering: custom_call_targets(lowering) for lowering in LOWERINGS}, "chains": {}}
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
    print(f"custom calls of a Pallas kernel, by lowering: {payload['custom_call_targets']}")
    common.write_json(f"graph_capture{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
