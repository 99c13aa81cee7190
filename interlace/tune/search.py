"""Predictive wave-group search for the ``signal_reorder`` strategy (FlashOverlap).

A partition cuts the GEMM's waves into groups; each group's collective starts when the
group's tiles are done and the previous collective has finished. With the GEMM's time per
wave ``wave_ms`` and a measured curve ``comm(bytes)`` of the collective::

    t_p = t_m = 0
    for each group G_i:  t_p += wave_ms * |G_i|;  t_m = max(t_p, t_m) + comm(size_i)

and the call ends at ``t_m`` plus the post-comm reorder (``post_ms``). A collective runs
slower while the GEMM holds its SMs and memory bandwidth than after it ends, so on a GPU
there are two curves: ``comm`` measured with the GEMM running through the whole collective,
``free`` with the collective alone; a collective that starts at ``t`` before the GEMM ends
at ``t_end`` runs at the loaded pace until ``t_end`` and at the free pace after
(:func:`comm_time`). (With one curve, measured while a single GEMM ran, the large sizes
were mostly measured after that GEMM had ended: on 4 x H200 the predictor read 15-32 %
off; with the two, 4-9 % on another machine, and 9-53 % with the loaded curve alone.) A
single group is the sequential path (cuBLAS, then the collective alone), predicted from
its own measured GEMM time.
Eager calls also wait for the host: the GEMM starts once it is launched (``host0_ms`` after
the call begins, so ``t_p`` starts there) and group ``i``'s collective no earlier than its
enqueue, ``host0_ms + (i + 1) * host_ms``; both are measured on a GPU (zero otherwise, which
is the recurrence above).

Candidates: every composition of the waves whose first group has at most 2 waves (comm
starts early) and whose last has at most 4 (a short tail) (``enumerate_partitions``). The
best of them under the recurrence is found exactly by dynamic programming
(``best_predicted``): for a given prefix of waves cut into a given number of groups, ``t_p``
and the host terms are fixed and the rest only grows with ``t_m``, so the prefix with the
smallest ``t_m`` dominates.

Measurements (``measure_model``): the collective's time over sizes (per machine, collective,
world size and dtype), alone and, on a GPU, while signalling GEMMs run beside it for the
whole collective (so the curve sees the SMs and memory bandwidth the overlap leaves it),
the signalling GEMM alone (its wave time), the reorder kernel and cuBLAS.
``best_partition`` predicts (or, with ``mode="exhaustive"``, measures the candidates) and
caches the choice per shape, dtype, world size and device (``tune.cache``); rank 0 decides
and broadcasts, so every rank runs the same partition. ``grade`` measures partitions
against their predictions.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from ..errors import InterlaceValueError
from ..ops.signal_reorder import Layout, SignalReorderGemm, launch_rows, wave_groups
from ..runtime import fork, join, use_stream
from . import cache

#: First group at most this many waves, last group at most ``MAX_LAST``.
MAX_FIRST = 2
MAX_LAST = 4
#: Smallest size (bytes per rank) of the measured curve; sizes double up to the largest
#: group.
CURVE_MIN_BYTES = 1 << 16


# ----------------------------------------------------------------------------- the model
@dataclass
class CommCurve:
    """Time of a collective against the bytes each rank hands it (increasing sizes),
    interpolated linearly; below the first point the first time (latency), above the last
    the last segment's slope (bandwidth)."""

    sizes: list[int]
    times_ms: list[float]

    def __post_init__(self):
        if not self.sizes or len(self.sizes) != len(self.times_ms):
            raise InterlaceValueError("CommCurve: needs as many times as sizes, at least one")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise InterlaceValueError("CommCurve: sizes must increase")

    def time_ms(self, nbytes: int) -> float:
        s, t = self.sizes, self.times_ms
        if nbytes <= s[0] or len(s) == 1:
            return t[0] if nbytes <= s[0] else t[0] * nbytes / s[0]
        i = min(bisect.bisect_left(s, nbytes), len(s) - 1)
        slope = (t[i] - t[i - 1]) / (s[i] - s[i - 1])
        return t[i - 1] + slope * (nbytes - s[i - 1])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CommCurve:
        return cls([int(x) for x in d["sizes"]], [float(x) for x in d["times_ms"]])


def comm_time(nbytes: int, start: float, gemm_end: float, comm_ms, free_ms=None) -> float:
    """Time of a collective of ``nbytes`` that starts at ``start``: at the loaded pace
    (``comm_ms(bytes) -> ms``) while the GEMM runs, until ``gemm_end``, and at the free pace
    (``free_ms``; None: the loaded one throughout) for the share left after it. Its end,
    ``start + comm_time(...)``, never moves earlier when ``start`` moves later (the search
    relies on it)."""
    loaded = comm_ms(nbytes)
    if free_ms is None or start + loaded <= gemm_end:
        return loaded
    if start >= gemm_end:
        return free_ms(nbytes)
    overlapped = gemm_end - start
    return overlapped + (1.0 - overlapped / loaded) * free_ms(nbytes)


def predict(
    waves, group_bytes, wave_ms: float, comm_ms, host0_ms=0.0, host_ms=0.0, free_ms=None
) -> float:
    """End of the last collective for groups of ``waves[i]`` waves handing
    ``group_bytes[i]`` bytes to the collective (paced by :func:`comm_time`); the host terms
    as in the module docstring."""
    t_p, t_m = host0_ms, 0.0
    gemm_end = host0_ms + wave_ms * sum(waves)
    for i, (w, size) in enumerate(zip(waves, group_bytes)):
        t_p += wave_ms * w
        start = max(t_p, t_m, host0_ms + (i + 1) * host_ms)
        t_m = start + comm_time(size, start, gemm_end, comm_ms, free_ms)
    return t_m


def enumerate_partitions(n_waves: int, max_first: int = MAX_FIRST, max_last: int = MAX_LAST):
    """Every composition of ``n_waves`` (group sizes, in order) with a first group of at
    most ``max_first`` waves and a last of at most ``max_last``; a single group counts as
    both. Yields tuples."""
    if n_waves < 1:
        return

    def rest(left: int):
        if left <= max_last:
            yield (left,)
        for size in range(1, left):
            for tail in rest(left - size):
                yield (size, *tail)

    for first in range(1, min(max_first, n_waves) + 1):
        if first == n_waves:
            if first <= max_last:
                yield (first,)
        else:
            for tail in rest(n_waves - first):
                yield (first, *tail)


@dataclass
class Model:
    """What the predictor knows about one shape: its layout, the GEMM's time per wave, the
    collective's curves (beside the GEMM; alone), the reorder kernel's time and the
    sequential path's GEMM time."""

    layout: Layout
    itemsize: int
    wave_ms: float
    curve: CommCurve  # the collective while the GEMM runs (alone where nothing else)
    post_ms: float = 0.0
    gemm_ms: float = 0.0  # cuBLAS alone, for the single-group (sequential) path
    host0_ms: float = 0.0  # host time from the call to the GEMM's launch
    host_ms: float = 0.0  # host time to enqueue one group (wait kernel + collective)
    free_curve: CommCurve | None = None  # the collective alone (None: ``curve``)

    def _free_ms(self):
        return None if self.free_curve is None else self.free_curve.time_ms

    def group_bytes(self, partition) -> list[int]:
        lay = self.layout
        return [
            lay.group_bytes(count, self.itemsize)
            for _, count in wave_groups(partition, lay.n_tiles, lay.programs)
        ]

    def predict(self, partition) -> float:
        """Predicted time of a call with ``partition`` (ms)."""
        partition = tuple(partition)
        if len(partition) == 1:  # cuBLAS, then the collective alone
            return self.gemm_ms + (self.free_curve or self.curve).time_ms(
                self.group_bytes(partition)[0]
            )
        t = predict(partition, self.group_bytes(partition), self.wave_ms, self.curve.time_ms,
                    self.host0_ms, self.host_ms, self._free_ms())  # fmt: skip
        return t + self.post_ms

    def ranked(self, max_first: int = MAX_FIRST, max_last: int = MAX_LAST):
        """Every candidate as ``(predicted ms, partition)``, best first."""
        n = self.layout.n_waves
        cands = {p: self.predict(p) for p in enumerate_partitions(n, max_first, max_last)}
        single = (self.layout.n_waves,)
        cands.setdefault(single, self.predict(single))
        return sorted((t, p) for p, t in cands.items())

    def best_predicted(self, max_first: int = MAX_FIRST, max_last: int = MAX_LAST):
        """``(predicted ms, partition)`` of the best candidate, by dynamic programming over
        wave prefixes and group counts (exact for the recurrence; see the module
        docstring)."""
        lay, n = self.layout, self.layout.n_waves
        comm, free = self.curve.time_ms, self._free_ms()
        gemm_end = self.host0_ms + self.wave_ms * n
        unit = lay.parts * lay.unit * self.itemsize
        # best[j][w] = (t_m, sizes): the best prefix of w waves cut into j groups
        best = [[None] * (n + 1) for _ in range(n + 1)]
        best[0][0] = (0.0, ())
        for j in range(1, n + 1):
            ready = self.host0_ms + j * self.host_ms  # group j - 1 is enqueued
            for end in range(j, n + 1):
                t_p = self.host0_ms + self.wave_ms * end
                tiles_end = min(end * lay.programs, lay.n_tiles)
                for start in range(j - 1, end):
                    prev = best[j - 1][start]
                    if prev is None or (start == 0 and end > max_first):
                        continue
                    if end == n and (end - start > max_last or j == 1):
                        continue  # one group is the sequential path, below
                    size = (tiles_end - start * lay.programs) * unit
                    begin = max(t_p, prev[0], ready)
                    t_m = begin + comm_time(size, begin, gemm_end, comm, free)
                    if best[j][end] is None or t_m < best[j][end][0]:
                        best[j][end] = (t_m, (*prev[1], end - start))
        single = (n,)
        options = [(self.predict(single), single)]
        options += [(b[n][0] + self.post_ms, b[n][1]) for b in best if b[n] is not None]
        return min(options)


# ----------------------------------------------------------------------------- timing
def time_ms(group, fn, iters: int = 10, warmup: int = 3) -> float:
    """Median time of ``fn()`` (ms) on this rank, the ranks aligned before each run
    (CUDA events on a GPU, the wall clock on the cpu backend), then the max over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if group.backend == "cuda":
            torch.cuda.synchronize()
            group.host_barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            group.host_barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return _max_over_ranks(group, statistics.median(times))


def _max_over_ranks(group, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=group.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.process_group)
    return float(t.item())


def device_ms(group, fn, iters: int = 10, warmup: int = 3, after=None) -> float:
    """Device time of one ``fn()`` (ms), the max over ranks: ``iters`` calls issued back to
    back behind a device-side sleep, so the host's launch latency stays out (the
    recurrence counts the host apart, ``host0_ms``; timed aligned, as ``time_ms`` does, it
    was counted twice and the predictor read 5-15 % high on 2 x H200). ``after()`` runs
    once the device is idle (e.g. to zero counters). On the cpu backend: ``time_ms``."""
    if group.backend != "cuda":
        t = time_ms(group, fn, iters, warmup)
        if after is not None:
            after()
        return t
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if after is not None:
        after()
    group.host_barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold = getattr(torch.cuda, "_sleep", None)
    if hold is not None:
        hold(HOLD_CYCLES * max(1, iters // 2))  # the host enqueues every call meanwhile
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    if after is not None:
        after()
    return _max_over_ranks(group, start.elapsed_time(end) / iters)


def _broadcast(group, value):
    box = [value]
    src = dist.get_global_rank(group.process_group, 0)
    dist.broadcast_object_list(box, src=src, group=group.process_group, device=group.device)
    return box[0]


def device_name(group) -> str:
    if group.backend == "cuda":
        return torch.cuda.get_device_name(group.device)
    return "cpu"


# ----------------------------------------------------------------------------- measuring
def _inputs(ctx: SignalReorderGemm, m: int, n: int, seed: int = 0):
    gen = torch.Generator(device=ctx.group.device).manual_seed(seed + ctx.rank)
    scale = ctx.k**-0.25
    a = torch.randn(m, ctx.k, generator=gen, device=ctx.group.device).mul_(scale)
    b = torch.randn(ctx.k, n, generator=gen, device=ctx.group.device).mul_(scale)
    return a.to(ctx.dtype), b.to(ctx.dtype)


def _probe_plan(ctx: SignalReorderGemm, m: int, n: int):
    """A multi-group plan of the shape (the GEMM's and the reorder's cost do not depend on
    the partition)."""
    waves = ctx.waves(m, n)
    return ctx.plan(m, n, (1, waves - 1)) if waves > 1 else None


def measure_curve(
    ctx: SignalReorderGemm, max_bytes: int, *, a=None, b=None, iters=10, warmup=3, loaded=None
) -> CommCurve:
    """The collective's time at sizes doubling from ``CURVE_MIN_BYTES`` to ``max_bytes``
    (and ``max_bytes`` itself). ``loaded`` (default: on a GPU, when ``a``/``b`` are given):
    each collective runs on the comm stream while signalling GEMMs (no signals) run back to
    back on the current one, as many as it takes to outlast the collective; else it runs
    alone (on a GPU behind a device-side sleep, as the loaded one, so that both leave the
    host's enqueue latency out)."""
    group = ctx.group
    loaded = (group.backend == "cuda" and a is not None) if loaded is None else loaded
    sizes, s = [], min(CURVE_MIN_BYTES, max_bytes)
    while s < max_bytes:
        sizes.append(s)
        s *= 2
    sizes.append(max_bytes)
    plan = _probe_plan(ctx, a.shape[0], b.shape[1]) if loaded else None
    if plan is None:
        loaded = False
    if group.backend != "cuda":
        times = [
            time_ms(group, lambda size=size: ctx.comm_only(size), iters, warmup) for size in sizes
        ]
        return CommCurve(sizes, monotone(times))
    gemm_ms = 0.0
    if loaded:
        gemm_ms = device_ms(group, lambda: ctx.launch_gemm(plan, a, b, signal=False), iters, warmup)
    times = []
    for size in sizes:
        gemms = 0
        if loaded:  # enough GEMMs for the sleep and three times the collective alone
            alone = _comm_ms(ctx, None, a, b, size, 0, max(2, iters // 3), 1)
            gemms = 1 + math.ceil((HOLD_MS + 3 * alone) / max(gemm_ms, 1e-3))
        times.append(_comm_ms(ctx, plan, a, b, size, gemms, iters, warmup))
    return CommCurve(sizes, monotone(times))


def monotone(times: list[float]) -> list[float]:
    """Times made non-decreasing in size (each the least of itself and every larger
    size's): a smaller message cannot take longer than a larger one, so such a point is a
    measurement artefact. (On 2 x H200 the smallest loaded point read 0.4-2.5 ms against
    0.2 ms for the next sizes and threw the predictor off by up to 60x.)"""
    out = list(times)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


#: GPU clock cycles the comm stream idles before a timed collective (~200 µs on an H200):
#: the host has enqueued the collective by then, so its launch latency, which the
#: recurrence models apart (``host_ms``), stays out of the curve.
HOLD_CYCLES = 400_000
#: ... and that sleep in ms, rounded up (for how long the GEMMs must run before it ends).
HOLD_MS = 0.25


def _comm_ms(ctx, plan, a, b, nbytes, gemms, iters, warmup) -> float:
    """Median time of the collective on the comm stream (events on that stream, behind a
    device-side sleep, so the time is the collective's own and not the host's enqueue
    latency: without the sleep the curve measured on 2 x H200 read 0.09 ms for 64 KB, and
    the predictor then favoured a single group), while ``gemms`` signalling GEMMs (no
    signals) run back to back on the current stream; max over ranks."""
    group = ctx.group
    hold = getattr(torch.cuda, "_sleep", None)
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        group.host_barrier()
        stream = fork(group)
        for _ in range(gemms):
            ctx.launch_gemm(plan, a, b, signal=False)
        with use_stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold is not None:
                hold(HOLD_CYCLES)
            start.record()
            ctx.comm_only(nbytes)
            end.record()
        join(group, stream)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return _max_over_ranks(group, statistics.median(times))


def measure_model(
    ctx: SignalReorderGemm,
    m: int,
    n: int | None = None,
    *,
    a=None,
    b=None,
    iters: int = 10,
    warmup: int = 3,
    use_cache: bool = True,
) -> Model:
    """Measure what the predictor needs for ``M = m`` (collective on every rank). The curve
    is cached per device, collective, world size and dtype (re-measured when a larger size
    is needed); the per-shape numbers per shape as well."""
    n = ctx.n if n is None else n
    if a is None or b is None:
        a, b = _inputs(ctx, m, n)
    lay = ctx.layout(m, n)
    item = ctx.dtype.itemsize
    common = dict(
        collective=ctx.collective,
        world=ctx.world_size,
        dtype=str(ctx.dtype),
        device=device_name(ctx.group),
        comm_sms=ctx.comm_sms,
        comm_group=_comm_group_tag(ctx),
    )
    need = lay.group_bytes(lay.n_tiles, item)
    curves = {}
    kinds = ("loaded", "free") if ctx.group.backend == "cuda" else ("free",)
    for kind in kinds:  # the collective beside the GEMM (a GPU), and alone
        key = cache.cache_key("comm_curve", curve=kind, **common)
        curve = _cached(ctx, key, use_cache)
        if curve is None or curve["sizes"][-1] < need:
            curve = measure_curve(
                ctx, need, a=a, b=b, iters=iters, warmup=warmup, loaded=kind == "loaded"
            ).to_dict()
            _store(ctx, key, curve, use_cache)
        curves[kind] = CommCurve.from_dict(curve)
    block = [lay.block_m, lay.block_n]
    shape_key = cache.cache_key(
        "gemm_waves", m=m, n=n, k=ctx.k, programs=lay.programs, block=block,
        timing="device", **common,
    )  # fmt: skip
    nums = _cached(ctx, shape_key, use_cache)
    if nums is None:
        plan = _probe_plan(ctx, m, n)
        # the single-group path, timed as a call (its host latency is part of it)
        gemm_ms = time_ms(ctx.group, lambda: torch.matmul(a, b), iters, warmup)
        wave_ms = post_ms = 0.0
        if plan is not None:  # device times: the recurrence adds the host's own
            wave_ms = device_ms(
                ctx.group, lambda: ctx.launch_gemm(plan, a, b), iters, warmup,
                after=ctx.counters.zero_,
            ) / lay.n_waves  # fmt: skip
            out = torch.empty(ctx.out_shape(m, n), dtype=ctx.dtype, device=ctx.group.device)
            src = ctx.send if ctx.collective == "all_reduce" else ctx.recv
            post_ms = device_ms(
                ctx.group,
                lambda: launch_rows(src, out, slots=plan.slots, layout=plan.layout),
                iters, warmup,
            )  # fmt: skip
        nums = {"wave_ms": wave_ms, "post_ms": post_ms, "gemm_ms": gemm_ms}
        if plan is not None and ctx.group.backend == "cuda":
            nums.update(_host_costs(ctx, plan, a, b))
        _store(ctx, shape_key, nums, use_cache)
    free = curves["free"] if "loaded" in curves else None
    return Model(lay, item, nums["wave_ms"], curves.get("loaded", curves["free"]),
                 nums["post_ms"], nums["gemm_ms"], nums.get("host0_ms", 0.0),
                 nums.get("host_ms", 0.0), free)  # fmt: skip


def _host_costs(ctx, plan, a, b, reps: int = 20) -> dict:
    """Host time (ms, max over ranks) from a call's start to its GEMM launch (argument
    checks, fork, launch) and to enqueue one group (a wait that passes at once and a small
    collective), both without waiting for the device."""
    group = ctx.group
    m, n = a.shape[0], b.shape[1]
    lay = plan.layout

    def call_head():
        ctx._check_call(a, b, None, None)
        ctx.plan(m, n, plan.partition)
        stream = fork(group)
        ctx.launch_gemm(plan, a, b)
        join(group, stream)

    def one_group():  # counter MAX_GROUPS - 1 is zero: the wait passes at once
        ctx.enqueue_group(lay, len(ctx.counters) - 1, 0, 0, 1)

    # One untimed run of each first: a first launch may compile or load a kernel, or set
    # up the collective on the comm stream (2 x H200, without it: about 3 ms per group
    # for LLaMA-7B, and the predictor then ruled out every partition of several groups).
    call_head()
    torch.cuda.synchronize()
    ctx.counters.zero_()
    group.host_barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        call_head()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    ctx.counters.zero_()
    stream = fork(group)
    with use_stream(stream):
        one_group()
        t2 = time.perf_counter()
        for _ in range(reps):
            one_group()
        t3 = time.perf_counter()
    join(group, stream)
    torch.cuda.synchronize()
    host = {"host0_ms": (t1 - t0) / reps * 1e3, "host_ms": (t3 - t2) / reps * 1e3}
    return {k: _max_over_ranks(group, v) for k, v in host.items()}


def _comm_group_tag(ctx) -> str:
    """Whether the collectives run on the group's own process group (cache keys)."""
    return "own" if ctx.comm_group is ctx.group.process_group else "custom"


def _cached(ctx, key, use_cache):
    """Rank 0's cache entry, the same on every rank (None: measure)."""
    value = cache.load(key) if use_cache and ctx.rank == 0 else None
    return _broadcast(ctx.group, value)


def _store(ctx, key, value, use_cache):
    if use_cache and ctx.rank == 0:
        cache.store(key, value)


def grade(
    ctx: SignalReorderGemm,
    m: int,
    partitions,
    n: int | None = None,
    *,
    model=None,
    a=None,
    b=None,
    iters: int = 10,
    warmup: int = 3,
) -> list[dict]:
    """Measure each partition's call against its prediction:
    ``[{"partition", "predicted_ms", "measured_ms"}]``."""
    n = ctx.n if n is None else n
    if a is None or b is None:
        a, b = _inputs(ctx, m, n)
    model = model or measure_model(ctx, m, n, a=a, b=b, iters=iters, warmup=warmup)
    rows = []
    for p in partitions:
        p = tuple(p)
        t = time_ms(ctx.group, lambda p=p: ctx(a, b, partition=p), iters, warmup)
        rows.append({"partition": list(p), "predicted_ms": model.predict(p), "measured_ms": t})
    return rows


def exhaustive_candidates(model: Model, limit: int = 64) -> list[tuple]:
    """The partitions exhaustive mode measures: every candidate when there are at most
    ``limit``, else the best ``limit // 2`` predicted and the rest spread evenly over the
    ranking (so the predictor is graded away from its own favourites too)."""
    ranked = [p for _, p in model.ranked()]
    if len(ranked) <= limit:
        return ranked
    head = ranked[: limit // 2]
    rest = ranked[limit // 2 :]
    step = len(rest) / (limit - len(head))
    return head + [rest[int(i * step)] for i in range(limit - len(head))]


def best_partition(
    ctx: SignalReorderGemm,
    m: int,
    n: int | None = None,
    *,
    mode: str = "predict",
    iters: int = 10,
    warmup: int = 3,
    use_cache: bool = True,
    limit: int = 64,
    apply: bool = True,
) -> list[int]:
    """The partition for calls of ``ctx`` with ``M = m`` (collective on every rank).

    ``mode="predict"``: the predictor's best (exact over the candidates, see the module
    docstring); ``"exhaustive"``: the measured best of ``exhaustive_candidates``. Rank 0's
    choice is broadcast and cached per shape, dtype, world size and device; with ``apply``
    it is also set on the context (``ctx.set_partition``)."""
    if mode not in ("predict", "exhaustive"):
        raise InterlaceValueError(
            f"best_partition: mode must be predict or exhaustive, got {mode!r}"
        )
    n = ctx.n if n is None else n
    lay = ctx.layout(m, n)
    key = cache.cache_key(
        "partition", op=ctx.collective, m=m, n=n, k=ctx.k, dtype=str(ctx.dtype),
        world=ctx.world_size, device=device_name(ctx.group), programs=lay.programs,
        block=[lay.block_m, lay.block_n], mode=mode, comm_group=_comm_group_tag(ctx),
    )  # fmt: skip
    choice = _cached(ctx, key, use_cache)
    if choice is None:
        if lay.n_waves == 1:
            choice = [1]
        else:
            a, b = _inputs(ctx, m, n)
            model = measure_model(
                ctx, m, n, a=a, b=b, iters=iters, warmup=warmup, use_cache=use_cache
            )
            if mode == "predict":
                choice = list(model.best_predicted()[1])
            else:
                cands = exhaustive_candidates(model, limit)
                rows = grade(ctx, m, cands, n, model=model, a=a, b=b, iters=iters, warmup=warmup)
                choice = min(rows, key=lambda r: r["measured_ms"])["partition"]
        choice = _broadcast(ctx.group, choice)
        _store(ctx, key, choice, use_cache)
    if apply:
        ctx.set_partition(m, choice, n)
    return list(choice)


def errors_without(model: Model, rows) -> dict[str, float]:
    """The mean absolute error of ``grade`` rows against the model without its free curve
    (``one_curve``: the loaded pace throughout): what the second curve buys, from the same
    measurements."""
    variants = {"one_curve": replace(model, free_curve=None)}
    return {
        name: mean_abs_error([{**r, "predicted_ms": m.predict(r["partition"])} for r in rows])
        for name, m in variants.items()
    }


def mean_abs_error(rows) -> float:
    """Mean of ``|predicted - measured| / measured`` over ``grade`` rows."""
    errs = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rows]
    return sum(errs) / len(errs) if errs else math.nan


__all__ = [
    "CommCurve",
    "MAX_FIRST",
    "MAX_LAST",
    "Model",
    "best_partition",
    "comm_time",
    "device_name",
    "enumerate_partitions",
    "errors_without",
    "exhaustive_candidates",
    "grade",
    "mean_abs_error",
    "measure_curve",
    "measure_model",
    "predict",
    "time_ms",
]
