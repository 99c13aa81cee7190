"""Recording a trace on each rank: ``with interlace.trace.record(group) as rec: ...`` around
op calls, then ``rec.trace()`` (collective) for the whole world's :class:`Trace`.

While a recorder is in force (``ops._trace.ACTIVE``) every segment-GEMM launch of this
process, and every launch of the MoE grouped GEMM (``AGMoE``, ``MoERS``), ``MoERS``'s finish
kernel, ``SPAttention``'s forward and backward kernels, the ``signal_reorder`` GEMM,
``FlashDecode``'s decode and merge kernels, ``EPAllToAll``'s dispatch and combine kernels
and ``EPLowLatency``'s, is made with ``TRACE`` on into a fresh buffer (``language.trace``
describes its layout, ``ops._trace.LAYOUTS`` how each kernel fills it, ``model`` how its
slots read), every
traced copy-engine transfer and chunk wait is bracketed by CUDA events on its stream (host
clock readings on the CPU backend), and eager calls skip their CUDA-graph replays (each
call runs its own launches). Calls captured in a CUDA graph are not traced.

Clocks. Kernel events carry the GPU's global timer (ns); a stream span's CUDA events are
put on that clock through an anchor taken when recording starts: an event recorded
between two one-thread kernels that read the timer (the event lies between their
readings; the tightest of ``ANCHORS`` tries is kept, its half-width stored as the
stream spans' uncertainty). A second anchor is taken when recording ends; where the timer
moved between the two by other than the events' time apart (``timer_jump``), the spans go
on the later anchor's timer and the jump is kept (``timer_jump_ns``; the trace's
``clock`` lists it per rank). Each rank's clock is then aligned to rank 0's by a measured
offset: every rank brackets a timer-reading kernel between two host clock readings (one
host clock for all ranks), keeping the tightest of several tries, and the offset is the
difference of the (device - host) readings. Ranks on one GPU share its timer (offset 0,
the measured value kept as a check), and in the CPU emulation every rank reads the host
clock.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..errors import InterlaceValueError
from ..kernels.trace import clock_kernel
from ..language.trace import buffer_stride
from ..ops import _trace as hooks
from .model import Trace, build_trace

#: timer-reading tries per rank for the clock offset (the tightest bracket is kept)
CLOCK_TRIES = 20
#: anchors taken when recording starts (the tightest is kept: where ranks time-slice one
#: GPU, a context switch between the two timer reads widens a bracket by milliseconds)
ANCHORS = 8


class Recorder:
    """One rank's recording; see the module docstring. Use through :func:`record`."""

    def __init__(self, group, label: str = "", meta: dict | None = None):
        self.group, self.label, self.meta = group, label, dict(meta or {})
        self.cuda = group.backend == "cuda"
        self.launches: list[tuple[dict, torch.Tensor]] = []
        self.spans: list[tuple] = []
        self._streams: dict[int, str] = {}
        self._anchors: list = []  # taken when recording starts, then when it ends

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> Recorder:
        if self.cuda:
            main = torch.cuda.current_stream(self.group.device)
            self._streams[main.cuda_stream] = "stream (compute)"
            self._anchors.append(self._take_anchors())
        hooks.ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        hooks.ACTIVE.remove(self)
        if self.cuda:
            self._anchors.append(self._take_anchors())

    def _take_anchors(self) -> tuple[torch.Tensor, list]:
        """``ANCHORS`` events on the current stream, each between two timer reads."""
        clock = torch.zeros(2 * ANCHORS, dtype=torch.int64, device=self.group.device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(ANCHORS)]
        main = torch.cuda.current_stream(self.group.device)
        for i, event in enumerate(events):
            clock_kernel[(1,)](clock, 2 * i)
            event.record(main)
            clock_kernel[(1,)](clock, 2 * i + 1)
        return clock, events

    # ------------------------------------------------------------------ the ops' interface
    def kernel_buffer(
        self, grid: int, tiles_per_program: int, info: dict, columns: int = 1
    ) -> torch.Tensor:
        """A zeroed trace buffer for a launch of ``grid`` programs of at most
        ``tiles_per_program`` tiles each (``info``: what decodes it); ``columns`` such
        blocks one after the other, each with its header (a 2-D grid, ``ops._trace.LAYOUTS``)."""
        stride = buffer_stride(tiles_per_program)
        rows = 1 + grid * stride
        buf = torch.zeros(columns * rows, 4, dtype=torch.int64)
        buf[::rows] = torch.tensor([stride, grid, tiles_per_program, 0], dtype=torch.int64)
        buf = buf.to(self.group.device)
        self.launches.append((info, buf))
        return buf

    def stream_begin(self, stream=None):
        if not self.cuda:
            return time.perf_counter_ns()
        stream = stream or torch.cuda.current_stream(self.group.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return stream, event

    def stream_end(self, token, kind: str, **meta) -> None:
        if not self.cuda:
            self.spans.append(
                (kind, "host (copies run in the call)", token, time.perf_counter_ns(), meta)
            )
            return
        stream, start = token
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        name = self._streams.get(stream.cuda_stream)
        if name is None:
            name = self._streams[stream.cuda_stream] = f"stream {len(self._streams)} (comm)"
        self.spans.append((kind, name, start, end, meta))

    # ------------------------------------------------------------------ results
    def rank_data(self) -> dict:
        """This rank's recording in its own clock (ns), as plain data: each launch's
        ``info`` (with the segment table as rows) and event rows, each span."""
        if self.cuda:
            torch.cuda.synchronize(self.group.device)
        launches = []
        for info, buf in self.launches:  # device tables (segments, tile tables) as lists
            info = {k: v.cpu().tolist() if isinstance(v, torch.Tensor) else v
                    for k, v in info.items()}  # fmt: skip
            launches.append((info, buf.cpu().tolist()))
        spans = []
        if self.cuda:
            brackets = [(tightest_bracket(c.cpu().tolist()), ev) for c, ev in self._anchors]
            (i, start_ns, start_w), start_ev = brackets[0]
            jump = 0
            if len(brackets) > 1:
                (j, end_ns, end_w), end_ev = brackets[-1]
                between = round(start_ev[i].elapsed_time(end_ev[j]) * 1e6)
                jump = timer_jump(start_ns, end_ns, between, start_w + end_w)
            # the timer moved by other than the events' time between the anchors: the
            # kernels' events (read during the calls) share the later anchor's timer
            use = brackets[-1] if jump else brackets[0]
            (i, anchor, window), events = use
            event = events[i]
            for kind, track, start, end, meta in self.spans:
                t0 = anchor + round(event.elapsed_time(start) * 1e6)
                t1 = anchor + round(event.elapsed_time(end) * 1e6)
                spans.append((kind, track, t0, t1, meta))
            meta = dict(anchor_window_ns=window, timer_jump_ns=jump)
        else:
            spans = list(self.spans)
            meta = dict(anchor_window_ns=0)
        return dict(rank=self.group.rank, launches=launches, spans=spans, **meta)

    def trace(self) -> Trace:
        """The whole world's trace, every rank's clock aligned to rank 0's (collective:
        call on every rank; every rank gets the same trace)."""
        clock = measure_clock(self.group)
        data = dict(self.rank_data(), clock=clock)
        pg = self.group.process_group
        everyone = [None] * self.group.world_size
        dist.all_gather_object(everyone, data, group=pg)
        return build_trace(everyone, label=self.label, meta=self.meta, shared=self._shared())

    def _shared(self) -> str | None:
        """Why every rank reads the same clock, or None where they are measured apart."""
        if not self.cuda:
            return "host clock (CPU emulation: every rank reads it)"
        if getattr(self.group, "shared_device", False):
            return "one GPU (every rank reads its global timer)"
        return None


def tightest_bracket(reads: list[int]) -> tuple[int, int, int]:
    """Of the brackets ``(reads[2 i], reads[2 i + 1])`` (timer reads before and after anchor
    ``i``), the narrowest: ``(i, its middle, its half-width)``. The anchor lies within the
    half-width of the middle."""
    if len(reads) < 2 or len(reads) % 2:
        raise InterlaceValueError(f"brackets come in pairs of reads, got {len(reads)} reads")
    i = min(range(len(reads) // 2), key=lambda i: reads[2 * i + 1] - reads[2 * i])
    lo, hi = reads[2 * i], reads[2 * i + 1]
    return i, (lo + hi) // 2, -(-(hi - lo) // 2)


#: below this the two anchors' timer difference and their events' time apart agree
TIMER_JUMP_MIN_NS = 50_000


def timer_jump(start_ns: int, end_ns: int, events_ns: int, window_ns: int) -> int:
    """How far the GPU timer moved between the start and end anchors beyond the CUDA
    events' time between them (ns; 0 where they agree within ``window_ns`` and
    :data:`TIMER_JUMP_MIN_NS`)."""
    drift = (end_ns - start_ns) - events_ns
    return drift if abs(drift) > max(window_ns, TIMER_JUMP_MIN_NS) else 0


def measure_clock(group, tries: int = CLOCK_TRIES) -> dict:
    """This rank's device clock minus the host clock (ns), from the tightest of ``tries``
    host brackets around a timer-reading kernel: ``{"delta_ns", "window_ns"}`` (the
    reading lies within ``window_ns`` of the bracket's middle)."""
    if group.backend != "cuda":
        return dict(delta_ns=0, window_ns=0)
    buf = torch.zeros(1, dtype=torch.int64, device=group.device)
    best = None
    for _ in range(tries):
        torch.cuda.synchronize(group.device)
        h0 = time.perf_counter_ns()
        clock_kernel[(1,)](buf, 0)
        torch.cuda.synchronize(group.device)
        h1 = time.perf_counter_ns()
        sample = (int(buf.item()) - (h0 + h1) // 2, (h1 - h0) // 2)
        if best is None or sample[1] < best[1]:
            best = sample
    return dict(delta_ns=best[0], window_ns=best[1])


def record(group, label: str = "", meta: dict | None = None) -> Recorder:
    """``with interlace.trace.record(group, label="ag_gemm") as rec:`` records every traced
    op call of this rank inside the block; ``rec.trace()`` afterwards (on every rank)
    returns the world's :class:`Trace`. ``meta``: fields stored with the trace (shape,
    strategy, ...)."""
    return Recorder(group, label, meta)
