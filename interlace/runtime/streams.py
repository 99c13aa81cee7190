"""Comm streams and copy-engine transfers that raise a peer's signal when they land.

A transfer is a ``copy_`` between device tensors (the copy engine moves it; no SM is used)
followed by a *stream memory operation* that writes the signal word. The signal is never
written by a kernel: a persistent consumer kernel that holds every SM could starve such a
kernel and deadlock, while a stream write needs no SM.

On the ``cpu`` backend there are no streams: the copy and the signal write happen at once,
in order, in the calling process.
"""

from __future__ import annotations

import contextlib

import torch

from . import driver
from .group import Group

_comm_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def comm_stream(group: Group, index: int = 0):
    """A high-priority side stream for communication (cached per device and index);
    ``None`` on the cpu backend."""
    if group.backend != "cuda":
        return None
    key = (group.device.index, index)
    if key not in _comm_streams:
        _comm_streams[key] = torch.cuda.Stream(group.device, priority=-1)
    return _comm_streams[key]


def _resolve_stream_write():
    op = getattr(getattr(torch.ops, "symm_mem", None), "stream_write_value32_", None)
    if op is not None:
        return op
    from torch._C._distributed_c10d import _SymmetricMemory

    return _SymmetricMemory.stream_write_value32


_stream_write = None


def stream_write_value32(signal: torch.Tensor, index: int, value: int) -> None:
    """Write ``value`` into ``signal[index]`` (an int32/uint32 tensor, any rank's memory)
    from the current stream, after all work enqueued before it on that stream."""
    global _stream_write
    if signal.device.type != "cuda":
        signal[index] = value  # in-order host store: the copy before it has landed
        return
    if driver.enabled():
        _driver_write(signal, index, value, driver.current_stream(signal.device.index))
        return
    if _stream_write is None:
        _stream_write = _resolve_stream_write()
    if signal.dtype != torch.uint32:
        signal = signal.view(torch.uint32)
    _stream_write(signal, index, value)


def copy_and_signal(
    dst: torch.Tensor, src: torch.Tensor, signal=None, index: int = 0, value: int = 1,
    stream=None,
):  # fmt: skip
    """``dst.copy_(src)`` on ``stream`` (default: the current stream), then (optionally)
    ``signal[index] = value`` on the same stream."""
    if not _raw_copy_ok(dst, src):
        with use_stream(stream):
            dst.copy_(src)
            if signal is not None:
                stream_write_value32(signal, index, value)
        return
    handle = driver.current_stream(dst.device.index) if stream is None else stream.cuda_stream
    driver.copy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), handle)
    if signal is not None:
        _driver_write(signal, index, value, handle)


def _driver_write(signal: torch.Tensor, index: int, value: int, stream: int) -> None:
    """``signal[index] = value`` from the raw stream ``stream``, through the driver."""
    driver.write_value32(signal.data_ptr() + index * signal.element_size(), value, stream)


def _raw_copy_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src)`` is one flat device-to-device copy the driver can enqueue."""
    return (
        dst.device.type == "cuda"
        and src.device == dst.device
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and driver.enabled()
    )


_events: dict[tuple, torch.cuda.Event] = {}


def _event(kind: str, device: torch.device, index: int) -> torch.cuda.Event:
    """A reusable event per (fork or join, device, comm stream): ``wait_stream`` would
    create one per call. Reuse is safe: a wait binds to the record made before it."""
    key = (kind, device.index, index)
    if key not in _events:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))  # creates its CUDA event now
        _events[key] = event
    return _events[key]


def _record(event: torch.cuda.Event, stream) -> None:
    """``event.record(stream)`` (``stream``: a torch stream)."""
    if driver.enabled():
        driver.record(event.cuda_event, stream.cuda_stream)
    else:
        event.record(stream)


def _wait(stream, event: torch.cuda.Event) -> None:
    """``stream.wait_event(event)``: binds to the last record of ``event`` made so far."""
    if driver.enabled():
        driver.wait(stream.cuda_stream, event.cuda_event)
    else:
        stream.wait_event(event)


def fork_mark(group: Group, index: int = 0) -> None:
    """Record the current stream's work so far for :func:`fork_from_mark` (a no-op on
    cpu): an op can then launch its first kernel before it spends host time on the comm
    stream's wait."""
    if group.backend == "cuda":
        _record(_event("fork", group.device, index), torch.cuda.current_stream(group.device))


def fork_from_mark(group: Group, index: int = 0):
    """The comm stream, made to wait for the current stream's work up to the last
    :func:`fork_mark` (``None`` on cpu)."""
    stream = comm_stream(group, index)
    if stream is not None:
        _wait(stream, _event("fork", group.device, index))
    return stream


def fork(group: Group, index: int = 0):
    """The comm stream, made to wait for the current stream's work so far (``None`` on cpu)."""
    fork_mark(group, index)
    return fork_from_mark(group, index)


def join(group: Group, stream, index: int = 0) -> None:
    """Make the current stream wait for everything enqueued on ``stream`` so far."""
    if stream is not None:
        event = _event("join", group.device, index)
        _record(event, stream)
        _wait(torch.cuda.current_stream(group.device), event)


class _OnStream:
    """``torch.cuda.stream(stream)`` for a stream of the current device, with less host work
    (it is entered on every overlapped call)."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.previous = torch.cuda.current_stream(self.stream.device)
        torch.cuda.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.previous)


def use_stream(stream):
    """Make ``stream`` current inside a ``with`` block (a no-op context on the cpu backend)."""
    if stream is None:
        return contextlib.nullcontext()
    if stream.device.index != torch.cuda.current_device():
        return torch.cuda.stream(stream)
    return _OnStream(stream)
