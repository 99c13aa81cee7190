"""GEMM+RS / GEMM+AR ``fused``: every rank computes the row chunks in rank-rotated order
(its own rows last); the GEMM's epilogue stores each finished partial tile straight into
the owner's receive buffer and raises the owner's counter; the owner's own tiles, computed
last, add the peers' partials in fp32 in their epilogue. No separate reduction pass, no
tail. GEMM+AR: the owner's epilogue also writes each reduced tile into every rank's output
(the all-gather half, spread over the whole GEMM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import schedule
from .. import segment_gemm
from ..segment_gemm import GemmConfig, Segment, tiles_of


@dataclass
class FusedPlan:
    """One shape's ``fused`` plan: the GEMM's tiles (one launch, its program 0 running the
    entry barrier) and its prepared launches per bias / no bias."""

    tiles: segment_gemm.Tiles
    launchers: dict = field(default_factory=dict)


def fused_segments(
    world: int, rank: int, m: int, n: int, cfg: GemmConfig, split: int, *, all_reduce: bool,
    partial: int, broadcast: int, go: int,
) -> list[Segment]:  # fmt: skip
    """The ``fused`` GEMM's segments for ``rank`` (no buffers: ``interlace.testing.emulated``
    builds the same kernel layout on one device), from a checked schedule: its chunks in
    the order this rank sends them (own rows last). A chunk of another rank is pushed to
    its owner once the entry barrier raised ``go``, raising the owner's counter of (chunk,
    source) from ``partial``; all-reduce: it then waits for the owner's broadcast counter of
    the chunk (from ``broadcast``) before the kernel ends. This rank's own chunks wait for
    every source's counter, reduce, and raise the broadcast counters."""
    m_loc = m // world
    template = schedule.partition_all_reduce if all_reduce else schedule.full_mesh_reduce_scatter
    sched = template(world, m_loc, split, backend="sm", align=cfg.block_m)
    schedule.check(sched)
    slot_of = {c.id: i for i, c in enumerate(sched.row_order)}
    segments = []
    for chunk, _ in schedule.chunk_order(sched, rank):
        o, cid = chunk.owner, slot_of[chunk.id]
        tiles = tiles_of(chunk.rows, n, cfg)
        common = dict(row0=chunk.lo, rows=chunk.rows, owner=o, out_row0=chunk.lo - o * m_loc)
        if o != rank:
            src = (rank - o - 1) % world  # the owner numbers its sources from o + 1
            segments.append(
                Segment(
                    kind="push", notify=partial + cid * (world - 1) + src,
                    final_slot=broadcast + cid, final_expected=tiles if all_reduce else 0,
                    wait_first=go, wait_count=1, wait_expected=1, **common,
                )
            )  # fmt: skip
        else:
            segments.append(
                Segment(
                    kind="reduce", wait_first=partial + cid * (world - 1),
                    wait_count=world - 1, wait_expected=tiles, notify=broadcast + cid, **common,
                )
            )  # fmt: skip
    return segments


class Fused:
    """Mixed into the GEMM+RS / GEMM+AR context (:class:`.base.ScatterGemm`)."""

    def _fused_plan(self, m: int, n: int) -> FusedPlan:
        """The GEMM's tiles (:func:`fused_segments`): counters one per (chunk, source) on
        the owner, one broadcast counter per chunk on every rank (all-reduce)."""
        if (found := self._known_plan((m, n))) is not None:
            return found
        cfg = self._cfg(m, n, self.k)
        segments = fused_segments(
            self.world_size, self.rank, m, n, cfg, self._split_of("fused"),
            all_reduce=self.BROADCAST, partial=self.pad.offset("partial"),
            broadcast=self.pad.offset("broadcast"), go=self.pad.offset("go"),
        )  # fmt: skip
        tiles = segment_gemm.plan_tiles(
            segments, m, n, cfg, self.group.device, self.group.backend, single=True
        )
        return self._keep_plan((m, n), FusedPlan(tiles))

    def _fused(self, a, b, bias, c):
        """One GEMM launch: its program 0 runs the entry barrier, and it clears its
        counters as it ends."""
        m, n = a.shape[0], b.shape[1]
        plan = self._fused_plan(m, n)
        run = plan.launchers.get(bias is not None)
        if run is None:
            peers = segment_gemm.PeerStores(
                push=True, broadcast=self.BROADCAST, recv=self.recv.local,
                recv_table=self.recv.ptrs, recv_rows=self.max_m // self.world_size,
                out_table=getattr(self, "result", self.recv).ptrs,
            )  # fmt: skip
            run = plan.launchers[bias is not None] = segment_gemm.launcher(
                m, n, self.k, plan.tiles, dtype=self.dtype, device=self.group.device,
                has_bias=bias is not None, signals=self._signals(), peers=peers,
            )  # fmt: skip
        run(a, b, c, bias)
