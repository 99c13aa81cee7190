"""Eager calls replayed from a CUDA graph: the host cost of an op's launches paid once.

An overlapped op enqueues a GEMM, copies, signal writes and stream forks on every call;
from Python that is 35-170 µs of host time per call on the GPU machines measured, which an
eager call (device idle when it starts) exposes in full, while the same work replayed
from a CUDA graph starts in a few µs. :class:`EagerGraph` captures the work of one call
once (nothing runs during the capture) and replays it for later calls that have the same
shapes but their own tensors: before each launch, every kernel parameter and every copy
address that pointed into one of the capture's *operands* (the call's inputs and output)
is moved by that operand's displacement (``cuGraphExecKernelNodeSetParams``,
``cuGraphExecMemcpyNodeSetParams``). Everything else the graph touches (the context's own
buffers, signals, tables) stays where it was, as in an eager call of the same context.

Operands are matched by address range, so they must not overlap each other in memory
(:func:`EagerGraph` raises :class:`GraphUnsupported` then, and for nodes it cannot
re-point: copies that are not one contiguous row, kernels launched through ``extra``).
Driver calls go through ``ctypes`` on ``libcuda``, as in :mod:`.driver`.
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import torch

from ..errors import InterlaceError
from . import driver

_u64, _uint, _vp, _size = ctypes.c_uint64, ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t

# CUgraphNodeType
_KERNEL, _MEMCPY = 0, 1
_CUDA_ERROR_INVALID_VALUE = 1


class GraphUnsupported(InterlaceError):
    """The call's work cannot be replayed from a graph with new operands (see the module
    docstring); the caller runs it eagerly."""


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", _vp), ("gridDimX", _uint), ("gridDimY", _uint), ("gridDimZ", _uint),
        ("blockDimX", _uint), ("blockDimY", _uint), ("blockDimZ", _uint),
        ("sharedMemBytes", _uint), ("kernelParams", _vp), ("extra", _vp), ("kern", _vp),
        ("ctx", _vp),
    ]  # fmt: skip


class _Memcpy3D(ctypes.Structure):  # CUDA_MEMCPY3D
    _fields_ = [
        ("srcXInBytes", _size), ("srcY", _size), ("srcZ", _size), ("srcLOD", _size),
        ("srcMemoryType", ctypes.c_int), ("srcHost", _vp), ("srcDevice", _u64),
        ("srcArray", _vp), ("reserved0", _vp), ("srcPitch", _size), ("srcHeight", _size),
        ("dstXInBytes", _size), ("dstY", _size), ("dstZ", _size), ("dstLOD", _size),
        ("dstMemoryType", ctypes.c_int), ("dstHost", _vp), ("dstDevice", _u64),
        ("dstArray", _vp), ("reserved1", _vp), ("dstPitch", _size), ("dstHeight", _size),
        ("WidthInBytes", _size), ("Height", _size), ("Depth", _size),
    ]  # fmt: skip


_SIGNATURES = {
    "cuGraphGetNodes": (_vp, _vp, ctypes.POINTER(_size)),
    "cuGraphNodeGetType": (_vp, ctypes.POINTER(ctypes.c_int)),
    "cuGraphKernelNodeGetParams_v2": (_vp, ctypes.POINTER(_KernelNodeParams)),
    "cuGraphExecKernelNodeSetParams_v2": (_vp, _vp, ctypes.POINTER(_KernelNodeParams)),
    "cuFuncGetParamInfo": (_vp, _size, ctypes.POINTER(_size), ctypes.POINTER(_size)),
    "cuGraphMemcpyNodeGetParams": (_vp, ctypes.POINTER(_Memcpy3D)),
    "cuGraphExecMemcpyNodeSetParams": (_vp, _vp, ctypes.POINTER(_Memcpy3D), _vp),
    "cuCtxGetCurrent": (ctypes.POINTER(_vp),),
    "cuGraphLaunch": (_vp, _u64),
}


@functools.cache
def _calls() -> dict:
    """The driver functions used here; raises :class:`GraphUnsupported` if one is missing
    (a driver older than CUDA 12.4 has no ``cuFuncGetParamInfo``)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GraphUnsupported(f"eager graphs: libcuda not found ({e})") from None
    calls = {}
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise GraphUnsupported(f"eager graphs: the driver has no {name}")
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        calls[name] = fn
    return calls


#: the raw handle of a device's current stream (``driver.current_stream``, bound once: it
#: is on every replay's path; a CPU-only torch has none)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _call(name: str, *args) -> int:
    return _calls()[name](*args)


def _checked(name: str, *args) -> None:
    result = _call(name, *args)
    if result != 0:
        driver.check(result, name)


def _ranges(operands) -> list[tuple[int, int]]:
    """``(start, end)`` byte range of each operand; raises if two overlap."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in operands]
    ordered = sorted(spans)
    for (_, end), (start, _) in zip(ordered, ordered[1:]):
        if start < end:
            raise GraphUnsupported("eager graphs: two operands overlap in memory")
    return spans


def _owner(address: int, spans) -> int | None:
    """The index of the operand whose range holds ``address``, or None."""
    for i, (start, end) in enumerate(spans):
        if start <= address < end:
            return i
    return None


class _KernelPatch:
    """A kernel node with parameters that point into operands: its parameter values, held
    in our own buffers, and which 8-byte words of them to move by which operand's
    displacement (a parameter may be a struct holding pointers, as torch's kernels take)."""

    def __init__(self, node: int, params: _KernelNodeParams, spans):
        values, self.moves = [], []  # moves: (word in a parameter buffer, captured, operand)
        self.node = node
        if not params.kernelParams:  # e.g. NCCL's kernels: one parameter buffer (``extra``)
            if _extra_buffer_points_into(params.extra, spans):
                raise GraphUnsupported(
                    "eager graphs: an operand in a kernel launched with a parameter buffer"
                )
            return  # it reads none of the operands: left as captured
        if not params.func:
            raise GraphUnsupported("eager graphs: a kernel node without a CUfunction")
        slots = ctypes.cast(params.kernelParams, ctypes.POINTER(_vp))
        offset, size = _size(), _size()
        for i in itertools.count():
            result = _call(
                "cuFuncGetParamInfo", params.func, i, ctypes.byref(offset), ctypes.byref(size)
            )  # fmt: skip
            if result == _CUDA_ERROR_INVALID_VALUE:  # past the last parameter
                break
            if result != 0:
                driver.check(result, "cuFuncGetParamInfo")
            n = size.value
            buf = ctypes.create_string_buffer(ctypes.string_at(slots[i], n), n)
            values.append(buf)
            for at in range(0, n - 7, 8):
                word = _u64.from_buffer(buf, at)
                owner = _owner(word.value, spans)
                if owner is not None:
                    self.moves.append((word, word.value, owner))
        self._values = values
        self._pointers = (_vp * len(values))(*(ctypes.addressof(b) for b in values))
        self.params = _KernelNodeParams.from_buffer_copy(params)
        self.params.kernelParams = ctypes.cast(self._pointers, _vp)

    def apply(self, exec_: int, moved) -> None:
        for word, value, owner in self.moves:
            word.value = value + moved[owner]
        _checked("cuGraphExecKernelNodeSetParams_v2", exec_, self.node, ctypes.byref(self.params))


def _extra_buffer_points_into(extra: int | None, spans) -> bool:
    """Whether a kernel launched with ``extra`` (``CU_LAUNCH_PARAM_BUFFER_POINTER``, its
    parameters in one buffer) holds an address inside an operand; raises where ``extra``
    cannot be read."""
    if not extra:
        raise GraphUnsupported("eager graphs: a kernel node with no parameters to read")
    items = ctypes.cast(extra, ctypes.POINTER(_vp))
    buffer = size = None
    for i in range(0, 16, 2):  # (key, value) pairs up to CU_LAUNCH_PARAM_END (0)
        key = items[i] or 0
        if key == 0:
            break
        if key == 1:  # CU_LAUNCH_PARAM_BUFFER_POINTER
            buffer = items[i + 1]
        elif key == 2:  # CU_LAUNCH_PARAM_BUFFER_SIZE (a pointer to a size_t)
            size = ctypes.cast(items[i + 1], ctypes.POINTER(_size))[0]
    if buffer is None or size is None:
        raise GraphUnsupported("eager graphs: a kernel node's parameter buffer is unreadable")
    words = (_u64 * (size // 8)).from_address(buffer)
    return any(_owner(w, spans) is not None for w in words)


class _CopyPatch:
    """A copy node whose source or destination lies in an operand."""

    def __init__(self, node: int, params: _Memcpy3D, spans):
        self.node, self.params = node, params
        self.moves = []  # (field, captured address, operand)
        for side in ("src", "dst"):
            address = getattr(params, f"{side}Device") + getattr(params, f"{side}XInBytes")
            owner = _owner(address, spans)
            if owner is None:
                continue
            flat = params.Height <= 1 and params.Depth <= 1
            if not flat or getattr(params, f"{side}Y") or getattr(params, f"{side}Z"):
                raise GraphUnsupported("eager graphs: an operand copy of several rows")
            setattr(params, f"{side}Device", address)  # one address, no offset
            setattr(params, f"{side}XInBytes", 0)
            self.moves.append((f"{side}Device", address, owner))

    def apply(self, exec_: int, moved, ctx: int) -> None:
        for field, address, owner in self.moves:
            setattr(self.params, field, address + moved[owner])
        _checked("cuGraphExecMemcpyNodeSetParams", exec_, self.node, ctypes.byref(self.params), ctx)


class EagerGraph:
    """``enqueue()`` (the device work of one call, on the current stream) captured once,
    with ``operands`` the tensors that call reads and writes; :meth:`launch` replays it
    with other operands of the same sizes, in the same order (None where the capture had
    None). Raises :class:`GraphUnsupported` if the capture cannot be re-pointed."""

    def __init__(self, enqueue, operands):
        self._present = [i for i, t in enumerate(operands) if t is not None]
        present = [operands[i] for i in self._present]
        self._device = torch.cuda.current_device()
        spans = _ranges(present)
        self._starts = [start for start, _ in spans]
        self._sizes = [end - start for start, end in spans]
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        # Captured on a side stream (the caller's may be the legacy default stream, which
        # cannot capture), without ``torch.cuda.graph``'s synchronize, gc and empty_cache.
        side, caller = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                enqueue()
            finally:
                graph.capture_end()
        caller.wait_stream(side)
        graph.instantiate()
        self._graph = graph  # owns the graph, its instance and its memory pool
        self._exec = graph.raw_cuda_graph_exec()
        self._kernels, self._copies = self._patches(graph.raw_cuda_graph(), spans)
        used = {owner for p in (*self._kernels, *self._copies) for *_, owner in p.moves}
        if len(used) < len(present):  # something reads it that cannot be re-pointed
            raise GraphUnsupported("eager graphs: an operand no node could be re-pointed at")
        ctx = _vp()
        _checked("cuCtxGetCurrent", ctypes.byref(ctx))
        self._ctx = ctx.value
        self._last = tuple(self._starts)  # the operands the instance now points at
        self._dense = len(present) == len(operands)  # (no None among the operands)
        self._graph_launch = _calls()["cuGraphLaunch"]

    @staticmethod
    def _patches(raw_graph: int, spans):
        count = _size(0)
        _checked("cuGraphGetNodes", raw_graph, None, ctypes.byref(count))
        nodes = (_vp * count.value)()
        _checked("cuGraphGetNodes", raw_graph, nodes, ctypes.byref(count))
        # node type -> (its parameters, the call that reads them, its patch, found)
        found = {
            _KERNEL: (_KernelNodeParams, "cuGraphKernelNodeGetParams_v2", _KernelPatch, []),
            _MEMCPY: (_Memcpy3D, "cuGraphMemcpyNodeGetParams", _CopyPatch, []),
        }
        kind = ctypes.c_int()
        for node in nodes:
            _checked("cuGraphNodeGetType", node, ctypes.byref(kind))
            if kind.value in found:
                struct, getter, patch_of, patches = found[kind.value]
                params = struct()
                _checked(getter, node, ctypes.byref(params))
                patch = patch_of(node, params, spans)
                if patch.moves:
                    patches.append(patch)
        return found[_KERNEL][3], found[_MEMCPY][3]

    @property
    def patched_nodes(self) -> int:
        """Kernel and copy nodes re-pointed at each call's operands."""
        return len(self._kernels) + len(self._copies)

    def launch(self, operands, ptrs=None) -> None:
        """Replay on the current stream with ``operands``: the same sizes, in the same
        order, None where the capture had None, each 16-byte aligned where the captured one
        was and only there (Triton specialised the kernels on it; the caller's key
        guarantees all of it). ``ptrs``: the operands' ``data_ptr()`` as a tuple (None
        where the operand is None), where the caller has them already."""
        if ptrs is None:
            ptrs = tuple([None if t is None else t.data_ptr() for t in operands])
        starts = ptrs if self._dense else tuple([ptrs[i] for i in self._present])
        if starts != self._last:
            present = [operands[i] for i in self._present]
            for t, size, old in zip(present, self._sizes, self._starts):
                if t.numel() * t.element_size() != size:
                    raise InterlaceError("eager graph: an operand's size differs")
                if (t.data_ptr() % 16 == 0) != (old % 16 == 0):  # what Triton specialised on
                    raise InterlaceError("eager graph: an operand's 16-byte alignment differs")
            moved = [new - old for new, old in zip(starts, self._starts)]
            for patch in self._kernels:
                patch.apply(self._exec, moved)
            for patch in self._copies:
                patch.apply(self._exec, moved, self._ctx)
            self._last = starts
        result = self._graph_launch(self._exec, _current_stream(self._device))
        if result != 0:
            driver.check(result, "cuGraphLaunch")


def available() -> bool:
    """The driver has every call eager graphs need (and a GPU is there)."""
    if not torch.cuda.is_available():
        return False
    try:
        _calls()
    except GraphUnsupported:
        return False
    return True
