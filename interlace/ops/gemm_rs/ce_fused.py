"""GEMM+RS / GEMM+AR ``ce_fused``: as ``fused``, but a partial tile is stored locally and
the copy engine ships each finished chunk to its owner (a one-program wait per chunk on the
comm stream, then the copy, which raises the owner's flag); the owner's own tiles add the
landed partials in their epilogue. No reduction kernel, and no NVLink stores from the
epilogue, which cost the fused kernel 12-19 % on 2 x H200 (``benchmarks/NOTES.md``,
epilogue probe).

Reduce-scatter: own chunks last. All-reduce: in rounds (:func:`gather_order`), each own
chunk reduced a round after the peers computed it, its sums sent to every rank by the
epilogue (``gather="epilogue"``) or the copy engine (``gather="copy"``) while the GEMM goes
on. Eager calls alternate buffer sets; the comm stream's device barrier before the first
copy (beside the GEMM) makes ranks that called with other arguments raise
``CallMismatchError`` at once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ... import schedule
from ...language.primitives import wait_kernel
from ...runtime import fork, join, stream_write_value32, use_stream
from ...schedule import Schedule
from .. import segment_gemm
from .._launch import PreparedLaunch
from ..segment_gemm import MAX_SPLIT, GemmConfig, Segment, tiles_of
from .copies import ChunkCopy


@dataclass(frozen=True)
class CeFusedStep:
    """One launch of the ``ce_fused`` GEMM (its segments ``tiles.first .. tiles.count -
    1``) and the copies its tiles release, in finishing order."""

    tiles: segment_gemm.Tiles
    copies: list[ChunkCopy]


@dataclass
class CeFusedPlan:
    """A ``ce_fused`` call's plan for one shape and buffer set: the tile config; the GEMM's
    launches (one on a GPU; on the interpreter, which runs a launch to completion, cut
    where a reduction must wait for copies); the all-reduce's final wait (``gather="copy"``,
    else None); whether the epilogue stores reduced tiles into every rank
    (``gather="epilogue"``); the buffer set; the one-loop tables (GPU, eligible layouts) or
    None; the prepared launches per bias / no bias."""

    cfg: GemmConfig
    steps: list[CeFusedStep]
    final: PreparedLaunch | None
    broadcast: bool
    set: int
    one_loop: segment_gemm.OneLoop | None = None
    launchers: dict = field(default_factory=dict)


def gather_order(chunks, rank: int, world: int) -> list:
    """GEMM+AR ``ce_fused``'s chunk order: round ``j`` holds every peer's ``j``-th chunk
    (rank-rotated), and this rank's own ``j``-th chunk follows round ``j + 1`` (a round
    late, so the peers' copies of it have landed; its reduced rows are then gathered to
    the peers while the GEMM goes on). Only the last own chunk's gather is a tail."""
    by_owner: dict[int, list] = {}
    for c in chunks:
        by_owner.setdefault(c.owner, []).append(c)
    for cs in by_owner.values():
        cs.sort(key=lambda c: c.lo)
    own = by_owner.pop(rank)
    if any(len(cs) != len(own) for cs in by_owner.values()):
        raise ValueError("gather_order: every rank needs the same number of chunks")
    peers = sorted(by_owner, key=lambda o: (o - rank) % world)
    order = []
    for j in range(len(own)):
        order += [by_owner[o][j] for o in peers]
        if j:
            order.append(own[j - 1])
    return order + [own[-1]]


def _steps(segments, released, cut: bool) -> list:
    """The GEMM's launches as ``(first segment, end segment, copies)``: one, with every
    copy (``released[i]``: the copies segment ``i``'s tiles release, in segment order);
    or, ``cut`` (the interpreter, which runs a launch to completion), a launch ending
    before each reduce segment that follows a push segment, each with its own copies."""
    ends = [
        i for i in range(1, len(segments))
        if cut and segments[i].kind == "reduce" and segments[i - 1].kind == "push"
    ] + [len(segments)]  # fmt: skip
    steps, lo = [], 0
    for hi in ends:
        steps.append((lo, hi, [c for r in released[lo:hi] for c in r]))
        lo = hi
    return steps


@dataclass(frozen=True)
class CeFusedLayout:
    """What one rank's ``ce_fused`` GEMM computes, in its order: the checked schedule,
    its chunks in compute order, one segment per chunk, and each chunk's number in the
    schedule's row order (its signal slots are numbered by it)."""

    schedule: Schedule
    chunks: list
    segments: list
    slot_of: dict


def cef_layout(
    world: int, rank: int, m: int, n: int, cfg: GemmConfig, split: int, *,
    all_reduce: bool, gather_epilogue: bool, arrival: int, done: int,
) -> CeFusedLayout:  # fmt: skip
    """The ``ce_fused`` GEMM's segments for ``rank`` (no buffers:
    ``interlace.testing.emulated`` builds the same kernel layout on one device). Chunks for
    other ranks are staged locally and counted in ``done + chunk``; this rank's own chunks
    wait for one arrival flag per peer (from ``arrival + chunk * (world - 1)``), then
    reduce in their epilogue. Reduce-scatter: own chunks last; all-reduce: in rounds
    (:func:`gather_order`). ``gather_epilogue``: own chunks raise the peers' broadcast
    counters (after the arrival flags), which every staged chunk waits for at the kernel's
    end; else (all-reduce) they count their reduced tiles in ``done`` for the gather
    copies."""
    m_loc = m // world
    template = schedule.partition_all_reduce if all_reduce else schedule.full_mesh_reduce_scatter
    sched = template(world, m_loc, split, backend="ce", align=cfg.block_m)
    schedule.check(sched)
    slot_of = {c.id: i for i, c in enumerate(sched.row_order)}
    broadcast = arrival + world * MAX_SPLIT * (world - 1)
    chunks = [c for c, _ in schedule.chunk_order(sched, rank)]
    if all_reduce:
        chunks = gather_order(chunks, rank, world)
    segments = []
    for chunk in chunks:
        o, cid = chunk.owner, slot_of[chunk.id]
        common = dict(row0=chunk.lo, rows=chunk.rows, owner=o, out_row0=chunk.lo - o * m_loc)
        if o != rank:
            final = tiles_of(chunk.rows, n, cfg) if gather_epilogue else 0
            segments.append(
                Segment(
                    kind="push", notify=done + cid, final_slot=broadcast + cid,
                    final_expected=final, **common,
                )
            )  # fmt: skip
        else:
            notify = broadcast + cid if gather_epilogue else done + cid if all_reduce else 0
            segments.append(
                Segment(
                    kind="reduce", wait_first=arrival + cid * (world - 1),
                    wait_count=world - 1, wait_expected=1, notify=notify, **common,
                )
            )  # fmt: skip
    return CeFusedLayout(sched, chunks, segments, slot_of)


class CeFused:
    """Mixed into the GEMM+RS / GEMM+AR context (:class:`.base.ScatterGemm`)."""

    #: Run the ``ce_fused`` GEMM in the kernel's one-loop mode where the layout allows
    #: (chunks of whole tile rows, own chunks last): push tiles in one pipelined loop,
    #: then reduce tiles in another. On one H200 as rank 0 of 4, M 8192, the kernel took
    #: GEMM+RS 7B / 8B / 70B 0.296 / 0.410 / 1.478 ms against 0.324 / 0.457 / 1.535 with
    #: a loop per segment, GEMM+AR 0.319 / 0.446 / 1.520 against 0.343 / 0.479 / 1.558
    #: (cuBLAS 0.264 / 0.365 / 1.440):
    #: ``history/2026-11-24-h200-ce-fused-{two-loops,reduce-unrolled}-probe.txt``.
    ONE_LOOP_CE_FUSED = True

    def _cef_set_slots(self, s: int) -> tuple[int, int]:
        """(first, count): buffer set ``s``'s signal slots (region ``ce_sets``): the
        arrival flags (chunk, source), the broadcast counters (chunk; all-reduce with
        ``gather="epilogue"``), then the GEMM's "go" and "done" slots. The set's GEMM
        zeroes them as it ends, and only them."""
        count = self.cef_set_size(self.world_size)
        return self.pad.offset("ce_sets") + s * count, count

    @staticmethod
    def cef_set_size(world: int) -> int:
        """Signal slots of one ``ce_fused`` buffer set (see ``_cef_set_slots``)."""
        return world * MAX_SPLIT * (world - 1) + world * MAX_SPLIT + 2

    def _cef_plan(self, m: int, n: int, s: int) -> CeFusedPlan:
        """``ce_fused`` for buffer set ``s``, from a checked schedule (full-mesh
        reduce-scatter; all-reduce: partition all-reduce):

        * segments: the chunks for other ranks are stored into the local staging buffer
          and counted per chunk in ``ce_done``; this rank's own chunks wait for one copy
          per peer, then reduce in their epilogue. Reduce-scatter: own chunks last.
          All-reduce: in rounds (:func:`gather_order`), each own chunk reduced one round
          after the peers computed it. ``gather="copy"``: its reduced tiles counted in
          ``ce_done`` too; ``gather="epilogue"``: the epilogue stores them into every
          rank's result and raises each peer's broadcast counter of the chunk, and the
          kernel ends once every peer's chunks have landed here;
        * copies, in the order their chunks finish: per peer chunk, into its owner's
          receive rows of set ``s``, raising the owner's arrival flag of (chunk, this
          rank); ``gather="copy"``, per own chunk, its reduced rows into every peer's
          result, raising the peer's ``ce_gathered`` slot of this rank to the chunk's
          number, and a final wait for every peer's last gathered chunk."""
        key = ("ce_fused", m, n, s)
        if (found := self._known_plan(key)) is not None:
            return found
        w, r = self.world_size, self.rank
        m_loc, rows = m // w, self.max_m // w
        cfg = self._cfg(m, n, self.k)
        arrival = self._cef_set_slots(s)[0]
        bcast = self.BROADCAST and self.gather == "epilogue"
        copy_gather = self.BROADCAST and not bcast
        done, gathered = self.pad.offset("ce_done"), self.pad.offset("ce_gathered")
        layout = cef_layout(
            w, r, m, n, cfg, self._split_of("ce_fused"), all_reduce=self.BROADCAST,
            gather_epilogue=bcast, arrival=arrival, done=done,
        )  # fmt: skip
        dev = self.group.device
        one_loop = None
        if self.ONE_LOOP_CE_FUSED and self.group.backend == "cuda":  # (the interpreter
            # cuts the launch into steps)
            one_loop = segment_gemm.one_loop_tables(
                layout.segments, m, n, self.k, cfg, self.dtype, dev
            )
        unit = segment_gemm.count_unit(one_loop, cfg)  # what a finished tile adds to its counter
        own_number = {c.id: i + 1 for i, c in enumerate(x for x in layout.chunks if x.owner == r)}
        sends, gathers = {}, {}  # per chunk: its reduce-scatter copy; its gather copies
        for t in schedule.transfers(layout.schedule, r):
            if t.reduce:
                sends[t.chunk_id] = t
            else:
                gathers.setdefault(t.chunk_id, []).append(t)
        segments = [replace(g, final_expected=g.final_expected * unit) for g in layout.segments]
        released = []
        for chunk in layout.chunks:
            o, cid = chunk.owner, layout.slot_of[chunk.id]
            tiles = tiles_of(chunk.rows, n, cfg) * unit
            if o != r:
                t = sends[chunk.id]
                lo, hi = t.lo - o * m_loc, t.hi - o * m_loc  # in the owner's rows
                dst = self.recv.peers[o][s].view(-1)[(r * rows + lo) * n : (r * rows + hi) * n]
                released.append([
                    self._copy(
                        dst.view(hi - lo, n), self._rows(self.partials, t.lo, t.hi, n), o,
                        arrival + cid * (w - 1) + (r - o - 1) % w, done + cid, tiles,
                    )
                ])  # fmt: skip
                continue
            released.append([  # gather="copy": the reduced rows to every peer
                self._copy(
                    self._rows(self.result.peers[t.dst], t.lo, t.hi, n),
                    self._rows(self.result.local, t.lo, t.hi, n), t.dst, gathered + r,
                    done + cid, tiles, value=own_number[chunk.id], wait=i == 0,
                )
                for i, t in enumerate(gathers.get(chunk.id, []) if copy_gather else [])
            ])  # fmt: skip
        final = self._gathered_wait(len(own_number)) if copy_gather else None
        whole = segment_gemm.plan_tiles(
            segments, m, n, cfg, dev, self.group.backend, one_loop=one_loop,
            comm_sms=1,  # the comm stream's wait kernels run beside the GEMM
        )  # fmt: skip
        cuts = _steps(segments, released, cut=self.group.backend != "cuda")
        quiet = whole.table
        if bcast and len(cuts) > 1:
            # The interpreter: the kernel's final waits (its last program, for every
            # segment up to the launch's last) can only be met in the last step.
            quiet_segments = [replace(seg, final_expected=0) for seg in segments]
            quiet = segment_gemm.segment_table(quiet_segments, n, cfg, dev)
        steps = [
            CeFusedStep(
                replace(whole, table=whole.table if i == len(cuts) - 1 else quiet, first=lo,
                        count=hi),
                copies,
            )
            for i, (lo, hi, copies) in enumerate(cuts)
        ]  # fmt: skip
        plan = CeFusedPlan(cfg, steps, final, bcast, s, one_loop)
        return self._keep_plan(key, plan)

    def _gathered_wait(self, chunks: int) -> PreparedLaunch:
        """All-reduce ``ce_fused``: the wait (bounded, one program) until every peer's
        ``ce_gathered`` slot reaches ``chunks`` (its last reduced chunk has landed here),
        zeroing them."""
        args = (
            self.pad.buffer.local, self.pad.offset("ce_gathered"), self.world_size, chunks,
            self.error.address, self.rank, self.max_spins, self.rank,
        )  # fmt: skip
        return PreparedLaunch(wait_kernel, 1, args, {"RESET": True}, ())

    def _cef_launchers(self, plan: CeFusedPlan, m: int, n: int, has_bias: bool) -> list:
        """The plan's GEMM launches, one per step (one on a GPU), prepared once per bias /
        no bias; the last clears the set's slots. On a GPU every wait of the plan runs once
        here, on counters raised for it: the first launch of a kernel blocks the host
        while a kernel spins on the device (benchmarks/NOTES.md, "Overlapped GEMMs"), and
        this GEMM spins in its own segments."""
        runs = plan.launchers.get(has_bias)
        if runs is not None:
            return runs
        first, count = self._cef_set_slots(plan.set)
        peers = segment_gemm.PeerStores(
            push=True, broadcast=plan.broadcast, recv=self.recv.local[plan.set],
            recv_rows=self.max_m // self.world_size, stage=self.partials,
            out_table=self.result.ptrs if plan.broadcast else None,
        )  # fmt: skip
        signals = segment_gemm.Signals(
            sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
            max_spins=self.max_spins, world=self.world_size, sig_table=self.pad.ptrs,
            go_slot=first + count - 2,
        )  # fmt: skip
        last = len(plan.steps) - 1
        runs = [
            segment_gemm.launcher(
                m, n, self.k, step.tiles, dtype=self.dtype, device=self.group.device,
                has_bias=has_bias, peers=peers,
                signals=replace(signals, clear=(first, count) if i == last else None),
            )
            for i, step in enumerate(plan.steps)
        ]  # fmt: skip
        if self.group.backend == "cuda" and not self._capturing():
            self._barrier()  # its first launch too, before any kernel of the call spins
            signals = self.pad.buffer.local.view(torch.uint32)
            for copy in plan.steps[0].copies:
                if copy.wait is not None:
                    stream_write_value32(signals, copy.done, copy.tiles)
                    copy.wait()
            if plan.final is not None:
                gathered, chunks = self.pad.offset("ce_gathered"), plan.final.args[3]
                for q in range(self.world_size):
                    if q != self.rank:
                        stream_write_value32(signals, gathered + q, chunks)
                plan.final()
        plan.launchers[has_bias] = runs
        return runs

    def _ce_fused(self, a, b, bias, c):
        """GEMM on the caller's stream (it stages the peers' partials and reduces its own
        rows as their copies land); on the comm stream, per finished chunk, a wait for its
        tiles and its copies. All-reduce: ``c`` is the whole symmetric result, this rank's
        rows of which the GEMM reduces; the caller's stream then waits for every peer's
        rows. Eager calls alternate buffer sets (``AlternatingSets``); the comm stream
        runs a device barrier before its first copy (a mismatch check; a captured call's
        one buffer set needs it too). (On the
        interpreter, which runs a launch to completion, the GEMM is cut into steps with
        the copies they release shipped in between.)"""
        m, n = a.shape[0], b.shape[1]
        s = self._buffer_set()
        plan = self._cef_plan(m, n, s)
        runs = self._cef_launchers(plan, m, n, bias is not None)
        if plan.final is not None:  # gather="copy": the GEMM writes this rank's rows
            m_loc = m // self.world_size
            c = c[self.rank * m_loc : (self.rank + 1) * m_loc]
        stream = fork(self.group)
        for i, (run, step) in enumerate(zip(runs, plan.steps)):
            run(a, b, c, bias)
            with use_stream(stream):
                if i == 0:
                    # every peer is in this call, with these arguments (the barrier
                    # carries the call's fingerprint), before any chunk moves; overlapped
                    # with the GEMM. (A captured call also needs it for its one buffer set.)
                    self._barrier()
                self._ship(step.copies)
        if plan.final is not None:
            plan.final()
        join(self.group, stream)
