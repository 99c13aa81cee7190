"""The copy-engine variants of GEMM+RS / GEMM+AR and the ring: the methods they add to the
GEMM+RS / GEMM+AR context (``ops.gemm._ScatterGemm``, which mixes this class in).

* ``ce_scatter`` (GEMM+RS, and GEMM+AR with a copy-engine gather after it) and ``ring``
  (GEMM+RS) run the segment GEMM with plain stores of every partial tile into a local
  buffer (``self.partials``) and per-chunk finished-tile counters; they differ in what
  moves the chunks: the copy engine plus one reduction kernel, or a ring of a few SMs.
* ``ce_fused`` (GEMM+RS, GEMM+AR): the copy engine moves the partials, and the owner's
  own tiles add them in the GEMM's epilogue (no reduction kernel). The GEMM stores a
  partial tile locally instead of pushing it across NVLink, which cost the fused kernel
  12-19 % on 2 x H200 (``benchmarks/NOTES.md``, epilogue probe). All-reduce reduces its
  own chunks round by round (:func:`gather_order`) and gathers them while the GEMM goes
  on."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from .. import schedule
from ..kernels.collective import reduce_arrivals_kernel
from ..kernels.ring import MAX_PROGRAMS, ring_reduce_scatter_kernel
from ..language.primitives import wait_kernel
from ..runtime import copy_and_signal, fork, join, stream_write_value32, use_stream
from . import _gemm, _trace
from ._context import GRAPH_SET, cdiv, persistent_grid
from ._gemm import MAX_SPLIT, Segment, tiles_of
from ._launch import PreparedLaunch, launch
from .collectives import REDUCE_BLOCK

RING_MAX_PROGRAMS = MAX_PROGRAMS.value
#: Reduction programs per SM: the reduction spins on arrivals while the comm stream's
#: one-program waits still need a place on some SM (four per SM could fill one).
REDUCE_PER_SM = 1


class ChunkCopy(NamedTuple):
    """A chunk the comm stream ships: wait for its tiles, copy ``src`` into ``dst``, raise
    ``signal[slot]``."""

    dst: torch.Tensor
    src: torch.Tensor
    signal: torch.Tensor
    slot: int
    value: int
    wait: PreparedLaunch | None  # waits until local counter ``done`` reaches ``tiles``
    done: int
    tiles: int


class CeFusedPlan(NamedTuple):
    """A ``ce_fused`` call's plan for one shape and buffer set: the GEMM's segment tables
    and grid; its steps ``(first segment, end segment, copies released)`` (one on a GPU;
    on the interpreter cut where a reduction must wait for copies); the all-reduce's
    final wait (or None); the buffer set; the prepared launches per bias / no bias; the
    one-loop tables (GPU, eligible layouts) or None."""

    cfg: _gemm.GemmConfig
    tables: list  # per step
    grid: int
    steps: list
    final: PreparedLaunch | None
    broadcast: bool  # the epilogue stores reduced tiles into every rank (gather="epilogue")
    set: int
    launchers: dict
    one_loop: _gemm.OneLoop | None = None


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


class CeFusedLayout(NamedTuple):
    """What one rank's ``ce_fused`` GEMM computes, in its order: the checked schedule,
    its chunks in compute order, one segment per chunk, and each chunk's number in the
    schedule's row order (its signal slots are numbered by it)."""

    schedule: schedule.Schedule
    chunks: list
    segments: list
    slot_of: dict


def cef_layout(
    world: int, rank: int, m: int, n: int, cfg: _gemm.GemmConfig, split: int, *,
    all_reduce: bool, gather_epilogue: bool, arrival: int, done: int,
) -> CeFusedLayout:  # fmt: skip
    """The ``ce_fused`` GEMM's segments for ``rank`` (no buffers: the probes build the
    same kernel layout on one GPU). Chunks for other ranks are staged locally and counted
    in ``done + chunk``; this rank's own chunks wait for one arrival flag per peer (from
    ``arrival + chunk * (world - 1)``), then reduce in their epilogue. Reduce-scatter: own
    chunks last; all-reduce: in rounds (:func:`gather_order`). ``gather_epilogue``: own
    chunks raise the peers' broadcast counters (after the arrival flags), which every
    staged chunk waits for at the kernel's end; else (all-reduce) they count their reduced
    tiles in ``done`` for the gather copies."""
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


class ScatterVariants:
    """Mixed into the GEMM+RS context; uses its pad, buffers, plans and GEMM configs.

    Launch order: the partials GEMM never waits on anything, so it is enqueued first (on
    every backend), before the kernels that spin waiting for its chunks. The other order
    deadlocked on 2 x H200 until the waits timed out: the first launch of a kernel (here
    the GEMM, at each new specialisation) blocked the host for as long as a kernel was
    spinning on the device (benchmarks/NOTES.md). The GEMM's grid leaves ``comm_sms``
    SMs free for the spinning kernels."""

    #: Run the ``ce_fused`` GEMM in the kernel's one-loop mode where the layout allows
    #: (chunks of whole tile rows, own chunks last): push tiles in one pipelined loop,
    #: then reduce tiles in another. On one H200 as rank 0 of 4, M 8192 (session 10,
    #: ``history/2026-11-24-h200-ce-fused-{two-loops,reduce-unrolled}-probe.txt``) the
    #: kernel took GEMM+RS 7B / 8B / 70B 0.296 / 0.410 / 1.478 ms against 0.324 / 0.457 /
    #: 1.535 with a loop per segment, GEMM+AR 0.319 / 0.446 / 1.520 against 0.343 / 0.479
    #: / 1.558 (cuBLAS 0.264 / 0.365 / 1.440).
    ONE_LOOP_CE_FUSED = True

    # ------------------------------------------------------------------ ce_scatter
    def _ce_plan(self, m: int, n: int):
        """GEMM+RS with a copy-engine scatter: the GEMM stores every partial tile locally,
        the chunks for other ranks first, and counts each chunk's finished tiles; per chunk,
        a one-program wait on the comm stream, then a copy into the owner's receive rows
        that raises the owner's arrival flag of (this rank, piece); the owner's reduction
        kernel adds the pieces as they land."""
        key = ("ce_scatter", m, n)
        if (found := self._known_plan(key)) is not None:
            return found
        w, r = self.world_size, self.rank
        m_loc, rows = m // w, self.max_m // w
        cfg = self._store_cfg(m, n, self.k)  # plain stores: no epilogue room
        sched = schedule.full_mesh_reduce_scatter(
            w, m_loc, self._split_of("ce_scatter"), backend="ce", align=cfg.block_m
        )
        schedule.check(sched)
        slot_of = {c.id: i for i, c in enumerate(sched.row_order)}
        done, arrival = self.pad.offset("chunk_done"), self.pad.offset("arrival")
        segments = [
            Segment(
                row0=c.lo,
                rows=c.rows,
                owner=c.owner,
                notify=done + slot_of[c.id] if c.owner != r else 0,
            )  # fmt: skip
            for c, _ in schedule.chunk_order(sched, r)
        ]
        # An owner's rows come in pieces of ``step`` rows (the last may be shorter): the
        # reduction kernel finds a block's piece by division.
        mine = [c for c in sched.row_order if c.owner == r]
        step = mine[0].rows
        if any(c.lo - r * m_loc != i * step for i, c in enumerate(mine)):
            raise AssertionError(f"{self.op_name}: uneven chunks {[c.rows for c in mine]}")
        copies = []
        for t in schedule.transfers(sched, r):
            o = t.dst
            lo, hi = t.lo - o * m_loc, t.hi - o * m_loc  # in the owner's rows
            dst = self.recv.peers[o].view(-1)[(r * rows + lo) * n : (r * rows + hi) * n]
            copies.append(
                self._copy(
                    dst.view(hi - lo, n), self._rows(self.partials, t.lo, t.hi, n), o,
                    arrival + r * len(mine) + lo // step, done + slot_of[t.chunk_id],
                    tiles_of(hi - lo, n, cfg),
                )
            )  # fmt: skip
        table = _gemm.segment_table(segments, n, cfg, self.group.device)
        grid = _gemm.programs_for(
            _gemm.total_tiles(segments, n, cfg), self.group.device, self.group.backend,
            comm_sms=1,  # the comm stream's wait kernels run beside the GEMM
        )  # fmt: skip
        plan = (cfg, table, len(segments), grid, {}, copies, step, len(mine))
        return self._keep_plan(key, plan)

    def _ce_all_reduce(self, a, b, bias, result):
        """GEMM+AR ``ce_scatter``: the reduce-scatter above into this rank's rows of the
        symmetric ``result``, then the copy engine ships them into every peer's ``result``
        and a one-program wait on the caller's stream consumes the peers' flags."""
        m_loc = a.shape[0] // self.world_size
        self._ce_scatter(a, b, bias, result[self.rank * m_loc : (self.rank + 1) * m_loc], True)

    def _ce_scatter(self, a, b, bias, out, gather: bool = False):
        m, n = a.shape[0], b.shape[1]
        w, r = self.world_size, self.rank
        m_loc = m // w
        cfg, table, n_seg, grid, launchers, copies, step, pieces = self._ce_plan(m, n)
        run = self._partials_gemm(launchers, m, n, cfg, grid, table, n_seg, a, b, bias)
        if "waits" not in launchers:  # the plan's first call
            launchers["waits"] = self._compile_waits(copies)
        partials = self.partials[: m * n].view(m, n)
        arrival, size = self.pad.regions["arrival"]
        stream = fork(self.group)
        run(a, b, partials, bias)
        with use_stream(stream):
            self._barrier()  # peers are done with my receive rows
            self._ship(copies)
        # The reduction zeroes the arrival flags as it ends (its last slot counts finished
        # programs): the barrier above could not clear them in time, since nothing orders
        # it before this kernel (a CUDA-graph replay started the reduction first and read
        # the previous replay's flags).
        launch(
            reduce_arrivals_kernel,
            persistent_grid(self.group, cdiv(m_loc * n, REDUCE_BLOCK), per_sm=REDUCE_PER_SM)[0],
            out.view(-1),
            partials[r * m_loc : (r + 1) * m_loc].view(-1), self.recv.local.view(-1),
            (self.max_m // w) * n, m_loc * n, step * n, pieces, self.pad.buffer.local,
            arrival, r, w, self.error.address, self.max_spins, arrival + size - 1, size,
            BLOCK=REDUCE_BLOCK, CLEAR_AT_END=True, num_warps=8,
        )  # fmt: skip
        if gather:
            first = self.pad.offset("gathered")
            fork(self.group)  # the comm stream waits for the reduction
            with use_stream(stream):
                for p in range(1, w):
                    peer = (r + p) % w
                    dst = self.result.peers[peer].view(-1)[r * m_loc * n : (r + 1) * m_loc * n]
                    signal = self.pad.buffer.peers[peer].view(torch.uint32)
                    copy_and_signal(dst.view(m_loc, n), out, signal, first + r)
            launch(
                wait_kernel, 1, self.pad.buffer.local, first, w, 1, self.error.address, r,
                self.max_spins, skip=r, RESET=True,
            )  # fmt: skip
        join(self.group, stream)

    # ------------------------------------------------------------------ ce_fused
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
            one_loop = _gemm.one_loop_tables(layout.segments, m, n, self.k, cfg, self.dtype, dev)
        unit = _gemm.count_unit(one_loop, cfg)  # what a finished tile adds to its counter
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
        grid = _gemm.programs_for(
            _gemm.total_tiles(segments, n, cfg), dev, self.group.backend,
            comm_sms=1,  # the comm stream's wait kernels run beside the GEMM
        )  # fmt: skip
        steps = _steps(segments, released, cut=self.group.backend != "cuda")
        tables = [_gemm.segment_table(segments, n, cfg, dev)] * len(steps)
        if bcast and len(steps) > 1:
            # The interpreter: the kernel's final waits (its last program, for every
            # segment up to the launch's last) can only be met in the last step.
            quiet = [replace(seg, final_expected=0) for seg in segments]
            tables[:-1] = [_gemm.segment_table(quiet, n, cfg, dev)] * (len(steps) - 1)
        plan = CeFusedPlan(cfg, tables, grid, steps, final, bcast, s, {}, one_loop)
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
        while a kernel spins on the device (benchmarks/NOTES.md), and this GEMM spins in
        its own segments."""
        runs = plan.launchers.get(has_bias)
        if runs is not None:
            return runs
        first, count = self._cef_set_slots(plan.set)
        fixed = dict(
            dtype=self.dtype, device=self.group.device, has_bias=has_bias,
            recv=self.recv.local[plan.set], recv_rows=self.max_m // self.world_size,
            push=True, stage=self.partials, broadcast=plan.broadcast,
            out_table=self.result.ptrs if plan.broadcast else None, sig_table=self.pad.ptrs,
            sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
            max_spins=self.max_spins, world=self.world_size, go_slot=first + count - 2,
        )  # fmt: skip
        last = len(plan.steps) - 1
        runs = [
            _gemm.launcher(
                m, n, self.k, plan.cfg, plan.grid, table, hi, seg_first=lo,
                clear=(first, count) if i == last else None, one_loop=plan.one_loop, **fixed,
            )
            for i, ((lo, hi, _), table) in enumerate(zip(plan.steps, plan.tables))
        ]  # fmt: skip
        if self.group.backend == "cuda" and not self._capturing():
            signals = self.pad.buffer.local.view(torch.uint32)
            for copy in plan.steps[0][2]:
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
        rows. Eager calls alternate buffer sets (``AlternatingSets``: no barrier); a
        captured call's comm stream runs a device barrier before its first copy. (On the
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
        for i, (run, (_, _, copies)) in enumerate(zip(runs, plan.steps)):
            run(a, b, c, bias)
            with use_stream(stream):
                if i == 0 and s == GRAPH_SET:
                    self._barrier()
                self._ship(copies)
        if plan.final is not None:
            plan.final()
        join(self.group, stream)

    # ------------------------------------------------------------------ ring
    def _ring_programs(self) -> int:
        return self.comm_sms if self.group.backend == "cuda" else 2

    def _ring_plan(self, m: int, n: int):
        """GEMM+RS as a ring on a few SMs beside the GEMM (TileLink's in-kernel collective,
        here a concurrent kernel): the GEMM stores its partials owner by owner in ring
        order and counts each owner's finished tiles; ``kernels.ring`` adds and forwards."""
        key = ("ring", m, n)
        if (found := self._known_plan(key)) is not None:
            return found
        w, r = self.world_size, self.rank
        m_loc = m // w
        cfg = self._store_cfg(m, n, self.k)  # plain stores: no epilogue room
        sched = schedule.ring_reduce_scatter(w, m_loc, 1, backend="sm", align=cfg.block_m)
        schedule.check(sched)
        done = self.pad.offset("chunk_done")
        segments = [
            Segment(row0=c.lo, rows=c.rows, owner=c.owner, notify=done + c.owner)
            for c, _ in schedule.chunk_order(sched, r)
        ]
        table = _gemm.segment_table(segments, n, cfg, self.group.device)
        grid = _gemm.programs_for(
            _gemm.total_tiles(segments, n, cfg), self.group.device, self.group.backend,
            comm_sms=self._ring_programs(),
        )  # fmt: skip
        plan = (cfg, table, len(segments), grid, {}, tiles_of(m_loc, n, cfg))
        return self._keep_plan(key, plan)

    def _ring(self, a, b, bias, out):
        m, n = a.shape[0], b.shape[1]
        w, r = self.world_size, self.rank
        cfg, table, n_seg, grid, launchers, tiles = self._ring_plan(m, n)
        run = self._partials_gemm(launchers, m, n, cfg, grid, table, n_seg, a, b, bias)
        partials = self.partials[: m * n].view(m, n)
        first = self.pad.offset("arrival")  # the ring's counters and after: zeroed at its end
        ring_args = (
            partials, out, self.recv.local, self.recv.ptrs, (self.max_m // w) * n,
            (m // w) * n, tiles, self.pad.buffer.local, self.pad.ptrs,
            self.pad.offset("chunk_done"), self.pad.offset("ring"), self.pad.offset("barrier"),
            self.pad.offset("go"), first, self.pad.size - first, r, self.error.address,
            self.max_spins,
        )  # fmt: skip
        stream = fork(self.group)
        run(a, b, partials, bias)
        with use_stream(stream):
            launch(
                ring_reduce_scatter_kernel, self._ring_programs(), *ring_args, WORLD=w,
                BLOCK=REDUCE_BLOCK, num_warps=8,
            )  # fmt: skip
        join(self.group, stream)

    def _partials_gemm(self, launchers, m, n, cfg, grid, table, n_seg, a, b, bias):
        """The plan's GEMM that stores partials and counts finished tiles per chunk
        (prepared once per bias / no bias). Compiled when prepared on a GPU, so that no
        first compile (seconds) falls between kernels that wait on each other."""
        run = launchers.get(bias is not None)
        if run is None:
            run = launchers[bias is not None] = _gemm.launcher(
                m, n, self.k, cfg, grid, table, n_seg, dtype=self.dtype,
                device=self.group.device, has_bias=bias is not None, sig=self.pad.buffer.local,
                err=self.error.address, rank=self.rank, max_spins=self.max_spins,
                world=self.world_size, notify_stores=True,
            )  # fmt: skip
            if self.group.backend == "cuda":
                run.compile(a, b, self.partials[: m * n].view(m, n), bias)
        return run

    def _compile_waits(self, copies) -> bool:
        """Compile the chunk waits before the first call enqueues anything (a peer's
        reduction already spins for the chunks they release)."""
        if self.group.backend != "cuda":
            return False
        for copy in copies:
            copy.wait.compile()
        return True

    @staticmethod
    def _rows(buf, lo: int, hi: int, n: int) -> torch.Tensor:
        """Rows ``lo:hi`` of the ``[*, n]`` matrix stored flat at the start of ``buf``."""
        return buf.view(-1)[lo * n : hi * n].view(hi - lo, n)

    def _copy(self, dst, src, owner, slot, done, tiles, value=1, wait=True) -> ChunkCopy:
        """One chunk shipment: ``src`` into ``dst`` on ``owner``, raising its ``slot`` to
        ``value``, once (``wait``; else after the copy before it) local counter ``done``
        reaches ``tiles``. Views and launches are made once per plan (each costs
        microseconds of every eager call)."""
        return ChunkCopy(
            dst, src, self.pad.buffer.peers[owner].view(torch.uint32), slot, value,
            self._chunk_wait(done, tiles) if wait else None, done, tiles,
        )  # fmt: skip

    def _chunk_wait(self, done: int, tiles: int) -> PreparedLaunch:
        """The prepared one-program kernel that waits (bounded) until local counter
        ``done`` reaches ``tiles``, then zeroes it."""
        waits = self._chunk_waits
        run = waits.get((done, tiles))
        if run is None:
            args = (
                self.pad.buffer.local, done, 1, tiles, self.error.address, self.rank,
                self.max_spins,
            )  # fmt: skip
            run = waits[(done, tiles)] = PreparedLaunch(wait_kernel, 1, args, {"RESET": True}, ())
        return run

    @staticmethod
    def _ship(copies) -> None:
        """Per chunk: wait until the GEMM has finished its tiles, then copy it to its owner
        and raise the owner's flag."""
        for c in copies:
            if c.wait is not None:
                span = _trace.begin()
                c.wait()
                _trace.end(span, "chunk_wait", counter_slot=c.done)
            _trace.copy_and_signal(c.dst, c.src, c.signal, c.slot, c.value)
