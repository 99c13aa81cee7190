"""What a trace says about overlap: per rank and for the op, the overlap ratio as TileLink
defines it, exposed communication, wait time per program, and the longest wait chain.

* ``T`` (overlap time): from the rank's first traced event to its last.
* ``comp``: the compute-only estimate: the busiest program's compute time (its tile spans;
  a persistent kernel's programs run fixed tiles, so with no waits it would end when its
  busiest program does).
* ``comm``: the communication-only estimate: the union of the rank's copy spans (None
  where the op moves data from its epilogue and no copy is traced).
* overlap ratio (TileLink, section 7.2): ``(comp + comm - T) / comm``: the share of the
  communication time hidden under compute (1: all of it; 0: none; below 0: overlapping
  cost more than it hid). For the op: the same from ``T`` over all ranks (first event to
  last) and the largest ``comp`` and ``comm`` of any rank.
* exposed communication: the times when something of the communication is under way (a
  copy in flight, or a program waiting on a chunk or barrier) and no program of the rank
  computes a tile.
* clock gap: how far apart the rank's stream spans (CUDA events) and its kernels' events
  (the GPU timer) lie when their time ranges do not overlap; beyond ``CLOCK_GAP_NS`` the
  printed summary says the clocks disagree (``T`` and the ratio are then meaningless).
* longest wait chain: waits linked through what released them: a wait on a chunk ends
  after the peer's copy or notify that released it; that notify came from a program whose
  own previous wait held it back, and so on. The chain with the most wait time in it.
"""

from __future__ import annotations

from .spans import TID_EXPOSED, TID_STREAM, Span

#: a signal may be dated this much after the wait it released ends (clock alignment)
SLACK_NS = 2_000
#: a rank's stream spans (CUDA events) and kernel events (GPU timer) this far apart, with
#: no overlap, cannot come from the same calls: the two clocks disagree
CLOCK_GAP_NS = 50_000_000


def _union(intervals) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> int:
    return sum(b - a for a, b in _union(intervals))


def _subtract(base, cut) -> list[tuple[int, int]]:
    """Parts of the union of ``base`` outside the union of ``cut``."""
    out = []
    cut = _union(cut)
    for a, b in _union(base):
        pos = a
        for c, d in cut:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out


def exposed_spans(trace, rank: int) -> list[Span]:
    """Spans of the rank's exposed communication (see the module docstring)."""
    busy = [(s.t0, s.t1) for s in trace.of(rank, "compute")]
    comm = [(s.t0, s.t1) for s in trace.spans if s.rank == rank and s.cat in ("copy", "wait")]
    return [Span(rank, TID_EXPOSED, "exposed", "exposed", a, b) for a, b in _subtract(comm, busy)
            if b > a]  # fmt: skip


def clock_gap_ns(trace, rank: int) -> int:
    """How far apart the rank's stream spans and its kernels' events lie (ns; 0 where
    their time ranges overlap or one kind is missing): a gap beyond :data:`CLOCK_GAP_NS`
    means the CUDA-event and GPU-timer clocks were not aligned."""
    own = [s for s in trace.spans if s.rank == rank and s.cat != "exposed"]
    stream = [s for s in own if s.tid >= TID_STREAM]
    kernel = [s for s in own if s.tid < TID_STREAM]
    if not stream or not kernel:
        return 0
    s0, s1 = min(s.t0 for s in stream), max(s.t1 for s in stream)
    k0, k1 = min(s.t0 for s in kernel), max(s.t1 for s in kernel)
    return max(0, k0 - s1, s0 - k1)


def _rank_summary(trace, rank: int) -> dict:
    own = [s for s in trace.spans if s.rank == rank and s.cat != "exposed"]
    if not own:
        return dict(rank=rank, traced=False)
    t_first = min(s.t0 for s in own)
    t_last = max(s.t1 for s in own)
    programs = sorted({s.tid for s in own if s.cat == "program"})
    compute = {p: sum(s.dur for s in own if s.tid == p and s.cat == "compute") for p in programs}
    waits = {p: sum(s.dur for s in own if s.tid == p and s.cat == "wait") for p in programs}
    copies = [(s.t0, s.t1) for s in own if s.cat == "copy"]
    comm = _length(copies) if copies else None
    comp = max(compute.values(), default=0)
    total = t_last - t_first
    exposed = sum(s.dur for s in trace.of(rank, "exposed"))
    ratio = None if not comm else (comp + comm - total) / comm
    ms = 1e-6
    return dict(
        rank=rank, traced=True, t_ms=total * ms, comp_ms=comp * ms,
        comm_ms=None if comm is None else comm * ms, overlap_ratio=ratio,
        exposed_comm_ms=exposed * ms, programs=len(programs),
        tiles=sum(1 for s in own if s.cat == "compute"),
        wait_ms_per_program={str(p): round(waits[p] * ms, 6) for p in programs},
        wait_ms_max=max(waits.values(), default=0) * ms,
        wait_ms_mean=(sum(waits.values()) / len(waits) if waits else 0) * ms,
        copies=len(copies),
        bytes_copied=sum(s.args.get("bytes", 0) for s in own if s.cat == "copy"),
        clock_gap_ms=clock_gap_ns(trace, rank) * ms,
    )  # fmt: skip


def _signals_to(trace, rank: int) -> list[tuple[int, int, object]]:
    """``(time, source rank, what)`` of everything that can release a wait on ``rank``:
    copy ends into it and notifies addressed to it (or to every peer)."""
    out = []
    for s in trace.spans:
        if s.cat == "copy" and s.args.get("peer") == rank and s.rank != rank:
            out.append((s.t1, s.rank, s))
    for i in trace.instants:
        if i.cat == "notify" and i.rank != rank and i.args.get("dest") in (rank, -1):
            out.append((i.t, i.rank, i))
    return out


def wait_chain(trace) -> list[dict]:
    """The longest wait chain (see the module docstring), first wait first."""
    waits = sorted((s for s in trace.spans if s.cat == "wait" and s.dur > 0), key=lambda s: s.t1)
    signals = {r: _signals_to(trace, r) for r in range(trace.world)}
    best: dict[int, tuple[int, Span | None]] = {}  # id(wait) -> (chain wait ns, previous)

    def previous_wait(rank, tid, before):
        cands = [w for w in waits if w.rank == rank and w.tid == tid and w.t1 <= before]
        return max(cands, key=lambda w: w.t1, default=None)

    for w in waits:
        prev = None
        cands = [
            (t, src, what) for t, src, what in signals[w.rank]
            if t <= w.t1 + SLACK_NS
            and (w.args.get("peer", -1) in (-1, src) or w.args.get("peer") is None)
        ]  # fmt: skip
        if cands:
            t, src, what = max(cands, key=lambda c: c[0])
            if isinstance(what, Span):  # a copy: the chunk wait before it on its stream
                prev = previous_wait(src, what.tid, what.t0)
                if prev is None:
                    chunk = [s for s in trace.spans if s.rank == src and s.tid == what.tid
                             and s.cat == "chunk_wait" and s.t1 <= what.t0]  # fmt: skip
                    prev = max(chunk, key=lambda s: s.t1, default=None)
            else:  # a notify: the program's own wait before it
                prev = previous_wait(src, what.tid, what.t)
        own = best.get(id(prev), (0, None))[0] if prev is not None else 0
        best[id(w)] = (w.dur + own, prev)
        if prev is not None and id(prev) not in best:
            best[id(prev)] = (prev.dur, None)
    if not best:
        return []
    by_id = {id(s): s for s in trace.spans}
    last = max(best, key=lambda k: best[k][0])
    chain = []
    node = by_id.get(last)
    while node is not None:
        chain.append(node)
        node = best.get(id(node), (0, None))[1]
    t0 = trace.t_origin
    return [
        dict(rank=s.rank, track=trace.tracks.get((s.rank, s.tid), str(s.tid)), name=s.name,
             what=s.args.get("what", s.cat), start_us=round((s.t0 - t0) / 1e3, 3),
             wait_us=round(s.dur / 1e3, 3))
        for s in reversed(chain)
    ]  # fmt: skip


def summarize(trace) -> dict:
    """The summary of a trace (plain data, stored beside it as JSON)."""
    ranks = [_rank_summary(trace, r) for r in range(trace.world)]
    traced = [r for r in ranks if r["traced"]]
    own = [s for s in trace.spans if s.cat != "exposed"]
    total = (max(s.t1 for s in own) - min(s.t0 for s in own)) * 1e-6 if own else 0.0
    comp = max((r["comp_ms"] for r in traced), default=0.0)
    comms = [r["comm_ms"] for r in traced if r["comm_ms"]]
    comm = max(comms) if comms else None
    chain = wait_chain(trace)
    op = dict(
        t_ms=total, comp_ms=comp, comm_ms=comm,
        overlap_ratio=None if not comm else (comp + comm - total) / comm,
        exposed_comm_ms_max=max((r["exposed_comm_ms"] for r in traced), default=0.0),
        wait_ms_max=max((r["wait_ms_max"] for r in traced), default=0.0),
        longest_wait_chain_us=round(sum(c["wait_us"] for c in chain), 3),
    )  # fmt: skip
    return dict(
        label=trace.label, world=trace.world, meta=trace.meta, clock=trace.clock, op=op,
        ranks=ranks, longest_wait_chain=chain,
    )  # fmt: skip


def format_summary(summary: dict) -> str:
    """A short printable table of a summary."""

    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"trace {summary['label']} (world {summary['world']}; clock: "
        f"{summary['clock']['method']})",  # fmt: skip
        "rank    T_ms  comp_ms  comm_ms  overlap  exposed_ms  wait_max_ms  tiles  copies",
    ]
    jumps = summary["clock"].get("timer_jump_ns") or []
    if any(jumps):
        lines.insert(1, "GPU timer jumped while recording (ms, per rank): "
                     + " ".join(f"{j / 1e6:.3f}" for j in jumps)
                     + "; the stream spans are on the timer read after the calls")  # fmt: skip
    gaps = [r for r in summary["ranks"] if r.get("clock_gap_ms", 0) * 1e6 > CLOCK_GAP_NS]
    if gaps:
        lines.insert(1, "clocks disagree: stream spans and kernel events lie "
                     + ", ".join(f"{r['clock_gap_ms']:.1f} ms apart on rank {r['rank']}"
                                 for r in gaps)
                     + "; T and the overlap ratio there are not meaningful")  # fmt: skip
    for r in summary["ranks"]:
        if not r["traced"]:
            lines.append(f"{r['rank']:4d}  (nothing traced)")
            continue
        lines.append(
            f"{r['rank']:4d} {ms(r['t_ms']):>7} {ms(r['comp_ms']):>8} {ms(r['comm_ms']):>8} "
            f"{ratio(r['overlap_ratio']):>8} {ms(r['exposed_comm_ms']):>11} "
            f"{ms(r['wait_ms_max']):>12} {r['tiles']:6d} {r['copies']:7d}"
        )
    op = summary["op"]
    lines.append(
        f"  op {ms(op['t_ms']):>7} {ms(op['comp_ms']):>8} {ms(op['comm_ms']):>8} "
        f"{ratio(op['overlap_ratio']):>8} {ms(op['exposed_comm_ms_max']):>11} "
        f"{ms(op['wait_ms_max']):>12}"
    )
    chain = summary["longest_wait_chain"]
    if chain:
        lines.append(
            f"longest wait chain: {op['longest_wait_chain_us']:.1f} us over {len(chain)} waits"
        )
        for c in chain:
            lines.append(f"  rank {c['rank']} {c['track']}: {c['name']} ({c['what']}) "
                         f"at {c['start_us']:.1f} us, {c['wait_us']:.1f} us")  # fmt: skip
    return "\n".join(lines)
