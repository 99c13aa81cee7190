"""The copy-engine variants of GEMM+RS / GEMM+AR and the ring: the methods they add to the
GEMM+RS / GEMM+AR context (``ops.gemm._ScatterGemm``, which mixes this class in).

* ``ce_scatter`` (GEMM+RS, and GEMM+AR with a copy-engine gather after it) and ``ring``
  (GEMM+RS) run the segment GEMM with plain stores of every partial tile into a local
  buffer (``self.partials``) and per-chunk finished-tile counters; they differ in what
  moves the chunks: the copy engine plus one reduction kernel, or a ring of a few SMs.
* ``ce_fused`` (GEMM+RS, GEMM+AR): the copy engine moves the partials, and the owner's
  own tiles, computed last, add them in the GEMM's epilogue (no reduction kernel). The
  GEMM stores a partial tile locally instead of pushing it across NVLink, which cost
  the fused kernel 12-19 % on 2 x H200 (``benchmarks/NOTES.md``, epilogue probe)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from .. import schedule
from ..kernels.collective import reduce_arrivals_kernel
from ..kernels.ring import MAX_PROGRAMS, ring_reduce_scatter_kernel
from ..language.primitives import wait_kernel
from ..runtime import copy_and_signal, fork, join, stream_write_value32, use_stream
from . import _gemm
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
    wait: PreparedLaunch  # waits until local counter ``done`` reaches ``tiles``
    done: int
    tiles: int


class ScatterVariants:
    """Mixed into the GEMM+RS context; uses its pad, buffers, plans and GEMM configs.

    Launch order: the partials GEMM never waits on anything, so it is enqueued first (on
    every backend), before the kernels that spin waiting for its chunks. The other order
    deadlocked on 2 x H200 until the waits timed out: the first launch of a kernel (here
    the GEMM, at each new specialisation) blocked the host for as long as a kernel was
    spinning on the device (benchmarks/NOTES.md). The GEMM's grid leaves ``comm_sms``
    SMs free for the spinning kernels."""

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
                    dst.view(hi - lo, n), t.lo, t.hi, o, arrival + r * len(mine) + lo // step,
                    done + slot_of[t.chunk_id], tiles_of(hi - lo, n, cfg),
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
        arrival flags (chunk, source), the broadcast counters (chunk), then the GEMM's
        "go" and "done" slots. The set's GEMM zeroes them as it ends, and only them."""
        count = self.cef_set_size(self.world_size)
        return self.pad.offset("ce_sets") + s * count, count

    @staticmethod
    def cef_set_size(world: int) -> int:
        """Signal slots of one ``ce_fused`` buffer set (see ``_cef_set_slots``)."""
        return world * MAX_SPLIT * (world - 1) + world * MAX_SPLIT + 2

    def _cef_plan(self, m: int, n: int, s: int):
        """``ce_fused`` for buffer set ``s``: segments from a checked full-mesh
        reduce-scatter, the chunks for other ranks first (pushed into the local staging
        buffer, counted per chunk in ``ce_done``), own chunks last (each waits for one
        copy per peer, then reduces in its epilogue; all-reduce: broadcasts too); and per
        peer chunk the copy into its owner's receive rows of set ``s``, which raises the
        owner's arrival flag of (chunk, this rank)."""
        key = ("ce_fused", m, n, s)
        if (found := self._known_plan(key)) is not None:
            return found
        w, r = self.world_size, self.rank
        m_loc, rows = m // w, self.max_m // w
        cfg = self._cfg(m, n, self.k)
        sched = schedule.full_mesh_reduce_scatter(
            w, m_loc, self._split_of("ce_fused"), backend="ce", align=cfg.block_m
        )
        schedule.check(sched)
        slot_of = {c.id: i for i, c in enumerate(sched.row_order)}
        first, count = self._cef_set_slots(s)
        arrival, broadcast = first, first + w * MAX_SPLIT * (w - 1)
        done = self.pad.offset("ce_done")
        send, own = [], []
        for chunk, _ in schedule.chunk_order(sched, r):
            o, cid = chunk.owner, slot_of[chunk.id]
            tiles = tiles_of(chunk.rows, n, cfg)
            common = dict(row0=chunk.lo, rows=chunk.rows, owner=o, out_row0=chunk.lo - o * m_loc)
            if o != r:
                send.append(
                    Segment(
                        kind="push", notify=done + cid, final_slot=broadcast + cid,
                        final_expected=tiles if self.BROADCAST else 0, **common,
                    )
                )  # fmt: skip
            else:
                own.append(
                    Segment(
                        kind="reduce", wait_first=arrival + cid * (w - 1), wait_count=w - 1,
                        wait_expected=1, notify=broadcast + cid, **common,
                    )
                )  # fmt: skip
        recv = self.recv.peers
        copies = []
        for t in schedule.transfers(sched, r):
            o, cid = t.dst, slot_of[t.chunk_id]
            lo, hi = t.lo - o * m_loc, t.hi - o * m_loc  # in the owner's rows
            dst = recv[o][s].view(-1)[(r * rows + lo) * n : (r * rows + hi) * n]
            copies.append(
                self._copy(
                    dst.view(hi - lo, n), t.lo, t.hi, o, arrival + cid * (w - 1) + (r - o - 1) % w,
                    done + cid, tiles_of(hi - lo, n, cfg),
                )
            )  # fmt: skip
        dev = self.group.device
        tables = [_gemm.segment_table(send + own, n, cfg, dev)]
        if self.group.backend != "cuda":
            # The interpreter runs a launch to completion: the own segments, which wait
            # for the peers' copies, go in a second launch after this rank's copies; the
            # first launch computes the send segments only, with no final waits.
            quiet = [replace(seg, final_expected=0) for seg in send]
            tables.insert(0, _gemm.segment_table(quiet, n, cfg, dev))
        grid = _gemm.programs_for(
            _gemm.total_tiles(send + own, n, cfg), dev, self.group.backend,
            comm_sms=1,  # the comm stream's wait kernels run beside the GEMM
        )  # fmt: skip
        plan = (cfg, tables, len(send), len(send) + len(own), grid, {}, copies, s)
        return self._keep_plan(key, plan)

    def _cef_launchers(self, plan, m, n, has_bias):
        """The plan's GEMM launches (one; two on the interpreter), prepared once per bias /
        no bias. On a GPU each chunk wait of the comm stream runs once here, on a counter
        raised for it: the first launch of a kernel blocks the host while a kernel spins
        on the device (benchmarks/NOTES.md), and this GEMM spins in its own segments."""
        cfg, tables, n_send, n_seg, grid, launchers, copies, s = plan
        runs = launchers.get(has_bias)
        if runs is not None:
            return runs
        first, count = self._cef_set_slots(s)
        fixed = dict(
            dtype=self.dtype, device=self.group.device, has_bias=has_bias,
            recv=self.recv.local[s], recv_rows=self.max_m // self.world_size,
            out_table=getattr(self, "result", self.recv).ptrs, sig_table=self.pad.ptrs,
            push=True, broadcast=self.BROADCAST, stage=self.partials,
            sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
            max_spins=self.max_spins, world=self.world_size, go_slot=first + count - 2,
        )  # fmt: skip
        if len(tables) == 1:
            runs = [
                _gemm.launcher(
                    m, n, self.k, cfg, grid, tables[0], n_seg, clear=(first, count), **fixed
                )
            ]  # fmt: skip
        else:
            runs = [
                _gemm.launcher(m, n, self.k, cfg, grid, tables[0], n_send, **fixed),
                _gemm.launcher(
                    m, n, self.k, cfg, grid, tables[1], n_seg, clear=(first, count),
                    seg_first=n_send, **fixed,
                ),
            ]  # fmt: skip
        if self.group.backend == "cuda" and not self._capturing():
            signals = self.pad.buffer.local.view(torch.uint32)
            for copy in copies:
                stream_write_value32(signals, copy.done, copy.tiles)
                copy.wait()
        launchers[has_bias] = runs
        return runs

    def _ce_fused(self, a, b, bias, c):
        """GEMM on the caller's stream (it stages the peers' partials, then reduces its
        own rows as their copies land); on the comm stream, per peer chunk, a wait for
        its tiles and the copy to the owner. Eager calls alternate buffer sets
        (``AlternatingSets``: no barrier); a captured call's comm stream runs a device
        barrier before its first copy."""
        m, n = a.shape[0], b.shape[1]
        s = self._buffer_set()
        plan = self._cef_plan(m, n, s)
        runs = self._cef_launchers(plan, m, n, bias is not None)
        stream = fork(self.group)
        runs[0](a, b, c, bias)
        with use_stream(stream):
            if s == GRAPH_SET:
                self._barrier()
            self._ship(plan[6])
        if len(runs) > 1:
            runs[1](a, b, c, bias)
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

    def _copy(self, dst, lo: int, hi: int, owner: int, slot: int, done: int, tiles: int):
        """One chunk shipment: rows ``lo:hi`` of the ``[m, n]`` partial sums in
        ``self.partials`` into ``dst`` on ``owner``, raising its ``slot``, once local
        counter ``done`` reaches ``tiles``. Views and launches are made once per plan (each
        costs microseconds of every eager call)."""
        n = dst.shape[1]
        return ChunkCopy(
            dst, self.partials[lo * n : hi * n].view(hi - lo, n),
            self.pad.buffer.peers[owner].view(torch.uint32), slot,
            self._chunk_wait(done, tiles), done, tiles,
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
            c.wait()
            copy_and_signal(c.dst, c.src, c.signal, c.slot)
