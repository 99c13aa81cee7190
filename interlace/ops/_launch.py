"""Launching a ``@triton.jit`` kernel with less host work.

Triton's launch path binds and specialises the arguments, looks the compiled kernel up,
then re-checks every global the kernel read at compile time (one ``constexpr``
comparison each; the segment GEMM reads about twenty) before it calls the compiled
kernel's launcher. An overlapped op launches per call, and at M = 2048 its host cost is
as long as its GPU work (docs/design.md, "Measuring"). Two shorter paths:

* :func:`launch` keeps the binding and the lookup (Triton's own, so specialisation stays
  exact) and skips the rest once the kernel is compiled.
* :class:`PreparedLaunch` binds once: an op's kernel sees the same arguments on every call
  but for a few tensors (its operands), so later calls substitute those tensors' addresses
  into the bound argument list (the fixed tensors already turned into addresses) and call
  the compiled kernel's C launcher directly, with the scratch its device-side tensor
  descriptors need. It re-binds when an operand's 16-byte alignment (the only thing Triton
  specialises a tensor on, besides its dtype, which the op fixes) or the current device
  differs from the bound one. On an idle 2 x H200 host, Triton's own launcher wrapper
  (scratch allocation through the allocator hook, per-tensor ``data_ptr`` calls and pointer
  checks) cost 15-35 µs of a 50-120 µs eager GEMM+RS call
  (``benchmarks/results/history/2026-11-22-h200-w2-host-timeline-before.txt``).

The first launch of every specialisation, launches with Triton's launch hooks set
(profilers), and the interpreter all take Triton's full path.

Tested against Triton 3.6's internals (``JITFunction.device_caches``,
``compute_cache_key``, ``CompiledKernel.run``); where they differ the full path is used.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
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


def _hooks_clear() -> bool:
    """No Triton launch hook is set (a profiler may set them at any time)."""
    runtime = knobs.runtime
    return _no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook)


def _short_path_ok() -> bool:
    return _FAST and os.environ.get("TRITON_INTERPRET", "0") != "1" and _hooks_clear()


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


#: Scratch for device-side tensor descriptors, per (device, stream, size): launches on one
#: stream run one after another, so they can share it.
_SCRATCH: dict[tuple[int, int, int], torch.Tensor] = {}


def scratch(size: int, stream: int, device: int, capturing: bool) -> torch.Tensor:
    """``size`` bytes of descriptor scratch for a launch on ``stream``: reused per (device,
    stream, size) instead of a ``torch.empty`` per launch; a launch being captured in a
    CUDA graph gets its own, from the graph's memory pool."""
    if capturing:
        return torch.empty(size, device=device, dtype=torch.int8)
    key = (device, stream, size)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty(size, device=device, dtype=torch.int8)
    return buf


_THREAD = threading.local()


def _scratch_alloc(size: int, alignment: int, stream) -> torch.Tensor:
    capturing = torch.cuda.is_current_stream_capturing()
    return scratch(size, stream, torch.cuda.current_device(), capturing)


def install_scratch_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocator: Triton's launch asks for a
    few hundred bytes per program (:func:`scratch`). Triton keeps the allocator per thread
    (a context variable), and autograd runs a backward on a thread of its own, so every
    launch path that may need it calls this; it sets the allocator once per thread."""
    if getattr(_THREAD, "scratch", False):
        return
    triton.set_allocator(_scratch_alloc)
    _THREAD.scratch = True


def _run(compiled, grid: int, values) -> None:
    install_scratch_allocator()
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    compiled.run(
        grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *values,
    )  # fmt: skip


def launch(kernel, grid: int, *args, **kwargs) -> None:
    """``kernel[(grid,)](*args, **kwargs)``, on the short path when it can be taken."""
    found = _bind(kernel, args, kwargs) if _short_path_ok() else None
    if found is None:
        install_scratch_allocator()
        kernel[(grid,)](*args, **kwargs)
        return
    compiled, bound = found
    _run(compiled, grid, bound.values())


def _direct_launch(compiled, grid: int, values: list, where: list[int], operands):
    """What a later call needs to launch ``compiled`` through its C launcher directly:
    ``(launch, function, cooperative, pdl, scratch bytes, metadata, device, argument
    template, operand alignment)``. Every fixed tensor argument is replaced by its address
    (the caller keeps the tensors alive) and the operands' places are left empty, so that
    no reference to this call's operands is kept. None where the compiled launcher is not
    laid out as Triton 3.6's ``CudaLauncher`` or needs profiling scratch."""
    run = compiled.run
    needed = ("launch", "global_scratch_size", "num_ctas", "launch_cooperative_grid")
    if not all(hasattr(run, a) for a in (*needed, "launch_pdl", "profile_scratch_size")):
        return None
    if run.profile_scratch_size or compiled.function is None:
        return None
    template = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
    for i in where:
        template[i] = None
    return (
        run.launch, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
        grid * run.num_ctas * run.global_scratch_size, compiled.packed_metadata,
        torch.cuda.current_device(), template, [t.data_ptr() % 16 == 0 for t in operands],
    )  # fmt: skip


class PreparedLaunch:
    """``kernel[(grid,)](*args, **kwargs)`` for fixed ``args``/``kwargs`` except the tensor
    parameters named in ``operands``, which each call passes (in that order)."""

    def __init__(self, kernel, grid: int, args: tuple, kwargs: dict, operands: tuple[str, ...]):
        self.kernel, self.grid, self.args, self.kwargs = kernel, grid, args, kwargs
        names = kernel.arg_names
        self._where = [names.index(name) for name in operands]
        if any(i >= len(args) for i in self._where):
            raise ValueError(f"operands {operands} must be positional arguments")
        self._direct = None  # see ``_direct_launch``

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

    def resources(self, *operands) -> dict:
        """Registers per thread and spilled bytes of the kernel compiled for these operands
        (empty in the interpreter or where Triton does not say)."""
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return {}
        args = list(self.args)
        for i, t in zip(self._where, operands):
            args[i] = t
        compiled = self.kernel.warmup(*args, grid=(self.grid,), **self.kwargs)
        try:
            compiled._init_handles()
            return {"n_regs": int(compiled.n_regs), "n_spills": int(compiled.n_spills)}
        except Exception:  # noqa: BLE001 - a Triton without these fields: nothing to say
            return {}

    def __call__(self, *operands) -> None:
        direct = self._direct
        if direct is not None and _hooks_clear():
            launch_c, function, coop, pdl, scratch_size, meta, device, template, aligned = direct
            ptrs = [t.data_ptr() for t in operands]
            if [p % 16 == 0 for p in ptrs] == aligned and torch._C._cuda_getDevice() == device:
                values = template.copy()
                for i, p in zip(self._where, ptrs):
                    values[i] = p
                stream = torch._C._cuda_getCurrentRawStream(device)
                buf = None
                if scratch_size:
                    capturing = torch._C._cuda_isCurrentStreamCapturing()
                    buf = scratch(scratch_size, stream, device, capturing)
                grid = self.grid
                launch_c(
                    grid, 1, 1, stream, function, coop, pdl, buf, None, meta, None, None, None,
                    *values,
                )  # fmt: skip
                return
        args = list(self.args)
        for i, t in zip(self._where, operands):
            args[i] = t
        found = _bind(self.kernel, args, self.kwargs) if _short_path_ok() else None
        if found is None:
            install_scratch_allocator()
            self.kernel[(self.grid,)](*args, **self.kwargs)
            return
        compiled, bound_args = found
        values = list(bound_args.values())
        _run(compiled, self.grid, values)
        if list(bound_args) != list(self.kernel.arg_names):  # not the layout assumed here
            return
        self._direct = _direct_launch(compiled, self.grid, values, self._where, operands)


# ---------------------------------------------------------------------------- Gluon kernels
@functools.cache
def _nvmma_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a TMA block of ``dtype`` (~20 us of host time to
    compute: once per block shape and type)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def host_descriptor(x: torch.Tensor, block: list[int]):
    """A host TMA descriptor over the 2-D tensor ``x`` in blocks of ``block``, for a Gluon
    kernel's launch (``triton.experimental.gluon``; bf16 / fp16)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = _nvmma_layout(tuple(block), x.dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(block), layout)
