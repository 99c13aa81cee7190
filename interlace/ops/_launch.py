"""Launching a ``@triton.jit`` kernel with less host work.

Triton's launch path binds and specialises the arguments, looks the compiled kernel up,
then re-checks every global the kernel read at compile time (one ``constexpr``
comparison each; the segment GEMM reads about twenty) before it calls the compiled
kernel's launcher. An overlapped op launches per call, and at M = 2048 its host cost is
as long as its GPU work (DESIGN.md). Two shorter paths:

* :func:`launch` keeps the binding and the lookup (Triton's own, so specialisation stays
  exact) and skips the rest once the kernel is compiled.
* :class:`PreparedLaunch` binds once: an op's kernel sees the same arguments on every call
  but for a few tensors (its operands), so later calls substitute those tensors into the
  bound argument list and call the compiled kernel directly. It re-binds when an operand's
  16-byte alignment (the only thing Triton specialises a tensor on, besides its dtype, which
  the op fixes) differs from the bound one.

The first launch of every specialisation, launches with Triton's launch hooks set
(profilers), and the interpreter all take Triton's full path.

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


def _no_hook(hook) -> bool:
    """No launch hook is set (Triton 3.6 keeps them in a ``HookChain``, empty by default)."""
    return hook is None or not getattr(hook, "calls", True)


def _short_path_ok() -> bool:
    return (
        _FAST
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and _no_hook(knobs.runtime.launch_enter_hook)
        and _no_hook(knobs.runtime.launch_exit_hook)
    )


def _bind(kernel, args, kwargs):
    """``(compiled kernel, bound arguments)`` when ``kernel`` is compiled for this
    specialisation on the current device, else None."""
    device = driver.active.get_current_device()
    caches = getattr(kernel, "device_caches", {}).get(device)
    if caches is None:  # nothing compiled on this device yet
        return None
    kernel_cache, key_cache, _target, _backend, binder = caches
    # the options Triton's run adds before binding (they are part of the cache key)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    if compiled is None or hasattr(compiled, "result"):  # not compiled yet, or compiling
        return None
    return compiled, bound


def _run(compiled, grid: int, values) -> None:
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    compiled.run(
        grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *values,
    )  # fmt: skip


def launch(kernel, grid: int, *args, **kwargs) -> None:
    """``kernel[(grid,)](*args, **kwargs)``, on the short path when it can be taken."""
    found = _bind(kernel, args, kwargs) if _short_path_ok() else None
    if found is None:
        kernel[(grid,)](*args, **kwargs)
        return
    compiled, bound = found
    _run(compiled, grid, bound.values())


def _aligned(t) -> bool:
    return t.data_ptr() % 16 == 0


class PreparedLaunch:
    """``kernel[(grid,)](*args, **kwargs)`` for fixed ``args``/``kwargs`` except the tensor
    parameters named in ``operands``, which each call passes (in that order)."""

    def __init__(self, kernel, grid: int, args: tuple, kwargs: dict, operands: tuple[str, ...]):
        self.kernel, self.grid, self.args, self.kwargs = kernel, grid, args, kwargs
        names = kernel.arg_names
        self._where = [names.index(name) for name in operands]
        if any(i >= len(args) for i in self._where):
            raise ValueError(f"operands {operands} must be positional arguments")
        self._bound = None  # (compiled, bound values, operand alignment)

    def compile(self, *operands) -> None:
        """Compile the kernel for these operands now, without launching it (a no-op in the
        interpreter). For a kernel launched while another one already spins on the GPU
        waiting for it: compiling then could outlast that wait's bound."""
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return
        args = list(self.args)
        for i, t in zip(self._where, operands):
            args[i] = t
        self.kernel.warmup(*args, grid=(self.grid,), **self.kwargs)

    def __call__(self, *operands) -> None:
        bound = self._bound
        if bound is not None and _short_path_ok():
            compiled, values, aligned = bound
            if tuple(_aligned(t) for t in operands) == aligned:
                values = list(values)
                for i, t in zip(self._where, operands):
                    values[i] = t
                _run(compiled, self.grid, values)
                return
        args = list(self.args)
        for i, t in zip(self._where, operands):
            args[i] = t
        found = _bind(self.kernel, args, self.kwargs) if _short_path_ok() else None
        if found is None:
            self.kernel[(self.grid,)](*args, **self.kwargs)
            return
        compiled, bound_args = found
        values = list(bound_args.values())
        _run(compiled, self.grid, values)
        if list(bound_args) != list(self.kernel.arg_names):  # not the layout assumed here
            return
        # keep no reference to this call's operands
        template = list(values)
        for i in self._where:
            template[i] = None
        self._bound = (compiled, template, tuple(_aligned(t) for t in operands))
