"""Launching a ``@triton.jit`` kernel with less host work.

Triton's launch path binds and specialises the arguments, looks the compiled kernel up,
then re-checks every global the kernel read at compile time (one ``constexpr``
comparison each; the segment GEMM reads about twenty) before it calls the compiled
kernel's launcher. An overlapped op launches per call, and at M = 2048 its host cost is
as long as its GPU work (DESIGN.md), so :func:`launch` keeps the binding and the lookup
(Triton's own, so specialisation stays exact) and skips the rest once the kernel is
compiled. The first launch of every specialisation, launches with Triton's launch hooks
set (profilers), and the interpreter all take Triton's full path.

Tested against Triton 3.6's internals (``JITFunction.device_caches``,
``compute_cache_key``, ``CompiledKernel.run``); where they differ the full path is used.
"""

from __future__ import annotations

import os

import triton

try:  # Triton internals: any mismatch means the full launch path, always
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    _FAST = triton.__version__.startswith("3.6")
except ImportError:  # pragma: no cover - other Triton versions
    _FAST = False


def launch(kernel, grid: int, *args, **kwargs) -> None:
    """``kernel[(grid,)](*args, **kwargs)``, on the short path when it can be taken."""
    if not _FAST or os.environ.get("TRITON_INTERPRET", "0") == "1":
        kernel[(grid,)](*args, **kwargs)
        return
    if knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None:
        kernel[(grid,)](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    caches = getattr(kernel, "device_caches", {}).get(device)
    if caches is None:  # nothing compiled on this device yet
        kernel[(grid,)](*args, **kwargs)
        return
    kernel_cache, key_cache, _target, _backend, binder = caches
    # the options Triton's run adds before binding (they are part of the cache key)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    if compiled is None or hasattr(compiled, "result"):  # not compiled yet, or compiling
        del kwargs["debug"], kwargs["instrumentation_mode"]
        kernel[(grid,)](*args, **kwargs)
        return
    stream = driver.active.get_current_stream(device)
    compiled.run(
        grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *bound.values(),
    )  # fmt: skip
