"""Compilation as a user waits for it: JAX's persistent compilation cache, and what a block of code compiled.

A new process compiles every program again (seconds on a CPU). The persistent cache keeps the compiled
programs on disk, so the next process with the same shapes reads them back instead. The `dflash-jax`
command turns it on (`config.policy.compile_cache_dir`); the library leaves JAX's configuration alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import jax
from jax import monitoring

COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",  # XLA's compile, or the read from the persistent cache
)
PROGRAM_EVENT = COMPILE_EVENTS[-1]
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def enable_persistent_cache(directory) -> str:
    """Keep every compiled program under `directory`, also the small ones (JAX's defaults skip programs
    that compile in under a second, which is most of them on a CPU). The folder is created readable by
    its owner only: JAX runs the programs it finds there. Call before the first compilation."""
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


@dataclasses.dataclass
class Compiled:
    """What JAX compiled inside a `watch` block: `seconds` spent tracing, lowering and compiling (or
    reading programs back from the persistent cache), `programs` built and `cache_hits`, the programs
    read back from the persistent cache."""

    seconds: float = 0.0
    programs: int = 0
    cache_hits: int = 0

    def describe(self) -> str:
        """`12 programs, 9 of them read from the persistent cache`."""
        cached = f", {self.cache_hits} of them read from the persistent cache" if self.cache_hits else ""
        return f"{self.programs} program{'s' * (self.programs != 1)}{cached}"


@contextlib.contextmanager
def watch():
    """Yield a `Compiled` that counts what JAX compiles until the block ends (JAX's monitoring events)."""
    seen, lock = Compiled(), threading.Lock()

    def on_duration(event, duration, **_):
        if event in COMPILE_EVENTS:
            with lock:
                seen.seconds += duration
                seen.programs += event == PROGRAM_EVENT

    def on_event(event, **_):
        if event == CACHE_HIT_EVENT:
            with lock:
                seen.cache_hits += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
        monitoring.unregister_event_listener(on_event)
