"""Stream operations through the CUDA driver API, for the per-call host path.

An overlapped op enqueues a few stream operations around its kernels on every call: an
event record and a stream wait to fork the comm stream, a copy-engine copy and a signal
write per transfer, and the join. Through torch each goes through the dispatcher and its
Python wrappers: on an idle 2 x H200 host a fork cost 17-26 µs and one copy plus its signal
write 37-53 µs (``benchmarks/results/history/2026-11-22-h200-w2-host-timeline-before.txt``),
while the driver calls behind them take
a microsecond or two. Here they are called directly (``ctypes`` on ``libcuda``, which every
CUDA process has loaded), on raw handles: a stream's ``cuda_stream``, an event's
``cuda_event``, a tensor's ``data_ptr()``. They are the same operations torch enqueues
(``cuEventRecord``, ``cuStreamWaitEvent``, ``cuMemcpyAsync``, ``cuStreamWriteValue32``), so
they are captured into CUDA graphs the same way.

:func:`enabled` is false where ``libcuda`` or a symbol is missing, or when
``INTERLACE_DRIVER_CALLS=0``; callers then use torch's calls. A failing driver call raises
:class:`~interlace.errors.InterlaceError` with the driver's error name.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ..errors import InterlaceError

_u64 = ctypes.c_uint64
_SIGNATURES = {
    "cuEventRecord": (_u64, _u64),
    "cuStreamWaitEvent": (_u64, _u64, ctypes.c_uint),
    "cuMemcpyAsync": (_u64, _u64, ctypes.c_size_t, _u64),
    "cuStreamWriteValue32_v2": (_u64, _u64, ctypes.c_uint32, ctypes.c_uint),
}


@functools.cache
def _lib():
    """``{name: function}`` of the driver calls used here, or None if any is missing."""
    if os.environ.get("INTERLACE_DRIVER_CALLS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    calls = {}
    for name, argtypes in (*_SIGNATURES.items(), ("cuGetErrorName", None)):
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        if argtypes is not None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        calls[name] = fn
    return calls


@functools.cache
def enabled() -> bool:
    """The driver calls can be used in this process (a CUDA device and ``libcuda``);
    decided once."""
    return torch.cuda.is_available() and _lib() is not None


def check(result: int, what: str) -> None:
    """Raise :class:`InterlaceError` naming ``what`` and the driver's error, unless
    ``result`` is 0 (``CUDA_SUCCESS``)."""
    if result != 0:
        name = ctypes.c_char_p()
        try:
            ctypes.CDLL("libcuda.so.1").cuGetErrorName(result, ctypes.byref(name))
        except (OSError, AttributeError):
            pass
        text = name.value.decode() if name.value else f"error {result}"
        raise InterlaceError(f"{what} failed: {text}")


def current_stream(device_index: int) -> int:
    """The raw handle of the current stream on ``device_index``."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def record(event: int, stream: int) -> None:
    """``cuEventRecord(event, stream)``."""
    check(_lib()["cuEventRecord"](event, stream), "cuEventRecord")


def wait(stream: int, event: int) -> None:
    """Make ``stream`` wait for the last record of ``event``."""
    check(_lib()["cuStreamWaitEvent"](stream, event, 0), "cuStreamWaitEvent")


def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy ``nbytes`` from device address ``src`` to ``dst`` on ``stream`` (copy engine;
    either may be a peer's memory mapped into this process)."""
    check(_lib()["cuMemcpyAsync"](dst, src, nbytes, stream), "cuMemcpyAsync")


def write_value32(address: int, value: int, stream: int) -> None:
    """Write the 32-bit ``value`` at device address ``address`` from ``stream``, after the
    work enqueued before it."""
    check(_lib()["cuStreamWriteValue32_v2"](stream, address, value, 0), "cuStreamWriteValue32")
