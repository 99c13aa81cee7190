"""GEMM+RS ``ring``: TileLink's in-kernel ring, as a kernel of ``comm_sms`` programs
beside the GEMM: the GEMM stores partials owner by owner in ring order and counts each
owner's finished tiles; the ring programs add what the left neighbour sent to this rank's
partial and store the sum into the right neighbour, ``W - 1`` steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import schedule
from ...kernels.ring_reduce import MAX_PROGRAMS, ring_reduce_scatter_kernel
from ...runtime import fork, join, use_stream
from .. import segment_gemm
from .._launch import launch
from ..collectives import REDUCE_BLOCK
from ..segment_gemm import Segment, tiles_of

RING_MAX_PROGRAMS = MAX_PROGRAMS.value


@dataclass
class RingPlan:
    """One shape's ``ring`` plan: the partials GEMM's tiles, the tiles of one owner's
    rows (what each ring step waits for), the prepared GEMM launches per bias / no bias."""

    tiles: segment_gemm.Tiles
    owner_tiles: int
    launchers: dict = field(default_factory=dict)


class Ring:
    """Mixed into the GEMM+RS context (:class:`.base.ScatterGemm`)."""

    def _ring_programs(self) -> int:
        return self.comm_sms if self.group.backend == "cuda" else 2

    def _ring_plan(self, m: int, n: int) -> RingPlan:
        """GEMM+RS as a ring on a few SMs beside the GEMM (TileLink's in-kernel collective,
        here a concurrent kernel): the GEMM stores its partials owner by owner in ring
        order and counts each owner's finished tiles; ``kernels.ring_reduce`` adds and
        forwards."""
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
        tiles = segment_gemm.plan_tiles(
            segments, m, n, cfg, self.group.device, self.group.backend,
            comm_sms=self._ring_programs(),
        )  # fmt: skip
        plan = RingPlan(tiles, tiles_of(m_loc, n, cfg))
        return self._keep_plan(key, plan)

    def _ring(self, a, b, bias, out):
        m, n = a.shape[0], b.shape[1]
        w, r = self.world_size, self.rank
        plan = self._ring_plan(m, n)
        tiles = plan.owner_tiles
        run = self._partials_gemm(plan.launchers, m, n, plan.tiles, a, b, bias)
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
