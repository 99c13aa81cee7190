"""GEMM+RS ``ce_scatter`` (and GEMM+AR ``ce_scatter``: the same, then a copy-engine
gather): the GEMM stores every partial tile locally (chunks for other ranks first) and
counts each chunk's finished tiles; on the comm stream a one-program wait per chunk, then
the copy engine ships it to its owner and raises the owner's flag; the owner's reduction
kernel (fp32) adds the pieces as they land, after its GEMM. More launches than ``fused``
(slower eager), less work in the GEMM's epilogue (faster as a CUDA graph on 2 x H200)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import schedule
from ...kernels.collective import reduce_arrivals_kernel
from ...language.primitives import wait_kernel
from ...runtime import copy_and_signal, fork, join, use_stream
from .. import segment_gemm
from .._context import cdiv, persistent_grid
from .._launch import launch
from ..collectives import REDUCE_BLOCK
from ..segment_gemm import Segment, tiles_of
from .copies import ChunkCopy

#: Reduction programs per SM: the reduction spins on arrivals while the comm stream's
#: one-program waits still need a place on some SM (four per SM could fill one).
REDUCE_PER_SM = 1


@dataclass
class CeScatterPlan:
    """One shape's ``ce_scatter`` plan: the partials GEMM's tiles; per chunk for another
    rank its shipment, in finishing order; the rows of each piece of this rank's own rows
    (``step``, the last may be shorter) and their number; the prepared GEMM launches per
    bias / no bias; whether the chunk waits are compiled."""

    tiles: segment_gemm.Tiles
    copies: list[ChunkCopy]
    step: int
    pieces: int
    launchers: dict = field(default_factory=dict)
    waits_compiled: bool = False


class CeScatter:
    """Mixed into the GEMM+RS / GEMM+AR context (:class:`.base.ScatterGemm`)."""

    def _ce_plan(self, m: int, n: int) -> CeScatterPlan:
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
        tiles = segment_gemm.plan_tiles(
            segments, m, n, cfg, self.group.device, self.group.backend,
            comm_sms=1,  # the comm stream's wait kernels run beside the GEMM
        )  # fmt: skip
        plan = CeScatterPlan(tiles, copies, step, len(mine))
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
        plan = self._ce_plan(m, n)
        copies, step, pieces = plan.copies, plan.step, plan.pieces
        run = self._partials_gemm(plan.launchers, m, n, plan.tiles, a, b, bias)
        if not plan.waits_compiled:  # the plan's first call
            plan.waits_compiled = self._compile_waits(copies)
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
