"""The one timing protocol (docs/design.md, "Measuring"): CUDA events around each call, warm-up
first, median over the runs of a rank, and the caller takes the max over ranks.

``group=None`` times one process on its own (single-GPU scripts): the same protocol
without the host barrier."""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist


def _align(group) -> None:
    """Device idle and, with a group, every rank past a host barrier."""
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group=group.process_group, device_ids=[group.device.index])
        torch.cuda.synchronize()


def median_ms(group, fn, iters: int = 20, warmup: int = 5, setup=None) -> float:
    """Median time of ``fn()`` in ms on this rank, each run started with all ranks aligned
    (device idle, host barrier) and timed with CUDA events, as a user's eager call.
    ``setup()``, when given, runs before every call (warm-up too), untimed: it restores
    what a call consumes (flags raised, counters filled)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        _align(group)
        if setup is not None:
            setup()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def paired_median_ms(group, fns, iters: int = 20, warmup: int = 5, setup=None) -> list[float]:
    """Median time of each of ``fns`` in ms on this rank, each run timed as ``median_ms``
    times one (device idle, ranks aligned, CUDA events around one call), the runs
    interleaved: run ``i`` of every callable before run ``i + 1`` of any, so that slow
    drifts of the machine during a run (clocks, the allocator, other tenants) reach each
    alike. (Timed minutes apart, the same eager call at M = 2048 moved by up to 20 %.)
    ``setup()``, when given, runs before every call (warm-up too), untimed."""
    for fn in fns:
        for _ in range(warmup):
            if setup is not None:
                setup()
            fn()
    events = [[] for _ in fns]
    for _ in range(iters):
        for j, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _align(group)
            if setup is not None:
                setup()
            start.record()
            fn()
            end.record()
            events[j].append((start, end))
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in pairs) for pairs in events]


def pipelined_median_ms(group, fn, iters: int = 20, warmup: int = 5) -> float:
    """Median time of ``fn()`` in ms on this rank when calls are issued back to back, as in
    a training loop: events around each call, no synchronisation between calls, so the
    host may run ahead of the device and its launch cost is hidden when it can be."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    _align(group)
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


#: Calls per batch of :func:`host_us`: enough that the per-call figure is the steady
#: state of a loop of calls, few enough that the device's launch queue never fills (a
#: full queue would make the host wait for the device).
HOST_BATCH = 20


def host_us(group, fn, iters: int = 20, batch: int = HOST_BATCH) -> float:
    """Host time per call of ``fn()`` in µs on this rank, as a loop of calls pays it (a
    training or serving loop): the median over ``iters`` batches of ``batch`` calls made
    back to back, each batch started with all ranks aligned (device idle, host barrier).
    The device runs behind the host, so no call waits for the device."""
    samples = []
    for _ in range(iters):
        _align(group)
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - start) * 1e6 / batch)
    torch.cuda.synchronize()
    return statistics.median(samples)


def host_cold_us(group, fn, iters: int = 20) -> float:
    """Host time of a lone call of ``fn()`` in µs on this rank: the median over ``iters``
    calls, each made right after all ranks aligned (device idle, host barrier), so the
    CPU comes to it from a wait (caches and clocks as a barrier leaves them)."""
    samples = []
    for _ in range(iters):
        _align(group)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


#: The ``torch.mm`` every host-time record is put beside: LLaMA-3-8B's QKV projection of
#: 2048 tokens on one GPU, bf16 (one cuBLAS launch and the output's allocation).
REF_MM = (2048, 4096, 6144)


def torch_mm_host(group, iters: int = 20) -> dict:
    """``host_torch_mm_us`` / ``host_torch_mm_cold_us``: the host time of ``torch.mm`` at
    :data:`REF_MM`, by :func:`host_us` and :func:`host_cold_us`, on this machine in this
    run: what one plain library call costs the same CPU."""
    m, k, n = REF_MM
    dev = group.device if group is not None else torch.device("cuda")
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        torch.mm(a, b)
    return {
        "host_torch_mm_us": round(host_us(group, lambda: torch.mm(a, b), iters), 2),
        "host_torch_mm_cold_us": round(host_cold_us(group, lambda: torch.mm(a, b), iters), 2),
    }


def max_over_ranks(group, values: dict) -> dict:
    """Max of each value over the ranks; None (not measured) on any rank stays None."""
    keys = sorted(values)
    t = torch.tensor(
        [math.inf if values[k] is None else float(values[k]) for k in keys],
        dtype=torch.float64,
        device=group.device,
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.process_group)
    return {k: (v if math.isfinite(v) else None) for k, v in zip(keys, t.tolist())}


def graph_of(group, fn, reps: int = 1):
    """Capture ``reps`` calls of ``fn`` in a CUDA graph (after one warm-up call on a side
    stream), on every rank at once (``group=None``: this process alone); returns the graph
    to ``replay()``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group=group.process_group, device_ids=[group.device.index])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    return graph


def profile_text(prof, rows: int) -> str:
    """A ``cProfile.Profile``'s costliest ``rows`` functions, by own time, then by
    cumulative time, as ``pstats`` prints them."""
    import io
    import pstats

    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(rows)
    return text.getvalue()
