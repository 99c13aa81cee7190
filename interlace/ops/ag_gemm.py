"""AG+GEMM: ``all_gather(a_shard) @ b (+ bias)``, overlapped.

Strategies (``strategy=``; ``auto`` and ``none``: :mod:`.overlapped`):

* ``fused`` (the overlapped design): every rank's copy engine pushes its shard to the
  peers, peer by peer in rank-rotated order, raising the peer's arrival flag per chunk from
  the stream; the persistent GEMM starts on its own shard (read in place, no copy) and then
  takes the chunks in arrival order, waiting per chunk. ``schedule=`` picks the order of
  the chunks (``full_mesh`` or ``swizzled``, :mod:`interlace.schedule`).
* ``sm_pull``: ``comm_sms`` SMs pull the peers' shards with loads while the GEMM runs on
  the other SMs.

Results: a new tensor ``[world * m, n]`` (or ``out``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import schedule
from ..errors import InterlaceValueError
from ..kernels.collective import pull_chunks_kernel
from ..runtime import (
    fork,
    fork_from_mark,
    fork_mark,
    join,
    symm_empty,
    use_stream,
)
from . import _trace, segment_gemm
from ._context import BUFFER_SETS, AlternatingSets
from .overlapped import OverlappedGemm
from .segment_gemm import MAX_SPLIT, Segment

AG_TEMPLATES = {
    "full_mesh": schedule.full_mesh_all_gather,
    "swizzled": schedule.swizzled_all_gather,
}


def ag_layout(
    world: int, rank: int, m_loc: int, cfg: segment_gemm.GemmConfig, split: int, *,
    pull: bool = False, arrival: int = 0, expected: int = 1, template: str = "full_mesh",
) -> tuple[schedule.Schedule, list[Segment]]:  # fmt: skip
    """The checked schedule and the consumer GEMM's segments for ``rank``, in arrival order
    (no buffers: ``interlace.testing.emulated`` builds the same kernel layout on one
    device). The own rows are read in place from the caller's shard (``store_own``); a
    peer's chunk waits until flag ``arrival + its slot`` reaches ``expected`` (1 per copy,
    or one per pulling program)."""
    sched = AG_TEMPLATES[template](
        world, m_loc, split, mode="pull" if pull else "push", backend="sm" if pull else "ce",
        align=cfg.block_m,
    )  # fmt: skip
    schedule.check(sched)
    segments = []
    for chunk, slot in schedule.chunk_order(sched, rank):
        if slot is None:  # own rows: read in place from the caller's shard
            segments.append(
                Segment(
                    row0=chunk.lo, rows=chunk.rows, kind="store_own", owner=rank,
                    out_row0=chunk.lo - rank * m_loc,
                )
            )  # fmt: skip
        else:
            segments.append(
                Segment(
                    row0=chunk.lo, rows=chunk.rows, kind="store", owner=chunk.owner,
                    wait_first=arrival + slot, wait_count=1, wait_expected=expected,
                )
            )  # fmt: skip
    return sched, segments


@dataclass(frozen=True)
class ShardCopy:
    """One copy of ``fused``: rows ``lo:hi`` of this rank's shard into ``dst`` (a peer's
    gather buffer), raising ``signal[slot]`` on that peer."""

    dst: torch.Tensor
    lo: int
    hi: int
    signal: torch.Tensor
    slot: int


@dataclass
class AgPlan:
    """One (shape, strategy, buffer set)'s plan: the GEMM's tiles in arrival order; the
    copies this rank issues (``fused``) or the pull kernel's chunk table (``sm_pull``);
    the buffer set and its gather buffer; the prepared GEMM launches per bias / no bias."""

    tiles: segment_gemm.Tiles
    copies: list[ShardCopy]
    pulls: torch.Tensor | None
    set: int
    gathered: torch.Tensor
    launchers: dict = field(default_factory=dict)


class AGGemm(AlternatingSets, OverlappedGemm):
    """``all_gather(a_shard) @ b (+ bias)``: ``a_shard [m, k]`` on each rank, ``b [k, n]``
    (the rank's column shard of the weight); result ``[world * m, n]``."""

    op_name = "ag_gemm"
    STRATEGIES = ("auto", "fused", "sm_pull", "none")

    def __init__(
        self, group, max_m, n, k, dtype=torch.bfloat16, strategy="auto", schedule="full_mesh",
        **kw,
    ):  # fmt: skip
        if schedule not in AG_TEMPLATES:
            raise InterlaceValueError(
                f"{self.op_name}: schedule must be one of {tuple(AG_TEMPLATES)}, got {schedule!r}"
            )
        self.schedule = schedule
        super().__init__(group, max_m, n, k, dtype, strategy, **kw)
        if self.max_m % self.world_size:
            raise InterlaceValueError(
                f"{self.op_name}: max_m = {self.max_m} (gathered rows) must be a multiple of "
                f"the world size {self.world_size}"
            )
        if strategy != "none":
            # fused (and auto): the alternating buffer sets (``AlternatingSets``)
            sets = 1 if strategy == "sm_pull" else BUFFER_SETS
            self.gathered = self._track(symm_empty((sets, self.max_m, self.k), dtype, group))

    @staticmethod
    def _regions(world):
        # per buffer set: the arrival flags, then the GEMM's "go" and "done" slots
        return {"arrival": BUFFER_SETS * (world * MAX_SPLIT + 2)}

    def _set_slots(self) -> tuple[int, int]:
        """(first, count): the signal slots of one buffer set (see ``_regions``)."""
        count = self.world_size * MAX_SPLIT + 2
        return self.pad.offset("arrival"), count

    def _signals(self, s: int = 0) -> segment_gemm.Signals:
        """The GEMM's signal arguments for buffer set ``s``: it clears that set's slots as
        it ends, and only those (a peer may already be filling the other eager set)."""
        first, count = self._set_slots()
        first += s * count
        return segment_gemm.Signals(
            sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
            max_spins=self.max_spins, world=self.world_size, go_slot=first + count - 2,
            clear=(first, count),
        )  # fmt: skip

    def _comm_bytes(self, m_total, n):
        return m_total * self.k * self.dtype.itemsize * (self.world_size - 1) // self.world_size

    def __call__(self, a_shard, b, bias=None, out=None):
        w = self.world_size
        # (a call like an earlier one replays its graph at once)
        key, result = self._replayed(a_shard, b, bias, (w, 1), out)
        if result is not None:
            return result
        self._check_call(a_shard, b, bias, self.max_m // w)
        m_loc, n = a_shard.shape[0], b.shape[1]
        if out is None:
            out = torch.empty(w * m_loc, n, dtype=self.dtype, device=self.group.device)
        else:
            self._check_out(out, (w * m_loc, n))
            segment_gemm.check_tma_aligned(self.op_name, out, names=("out",))
        strategy = self._resolve(w * m_loc, n, self.k)
        self._begin_call(
            graphed=strategy == "fused",
            M=w * m_loc,
            N=n,
            K=self.k,
            strategy=strategy,
            bias=bias is not None,
        )
        if strategy == "none":
            self._baseline(a_shard, b, bias, out)
        elif strategy == "fused":
            run = lambda: self._fused(a_shard, b, bias, out)  # noqa: E731
            self._enqueue(strategy, run, a_shard, b, bias, out)
        else:
            self._sm_pull(a_shard, b, bias, out)
        self.last_strategy = strategy
        self._end()
        self._arm_call(key, strategy)
        return out

    def _baseline(self, a_shard, b, bias, out):
        gathered = torch.empty(
            self.world_size * a_shard.shape[0], self.k, dtype=self.dtype, device=a_shard.device
        )
        dist.all_gather_into_tensor(gathered, a_shard, group=self._pg)
        if bias is None:
            torch.matmul(gathered, b, out=out)
        else:
            torch.addmm(bias, gathered, b, out=out)

    def _plan(self, m_loc: int, n: int, pull: bool, s: int = 0):
        """Segments in arrival order, and the transfers this rank issues (push) or the
        chunk table of the pull kernel, for buffer set ``s``; lowered from a checked
        schedule, once per shape and set."""
        key = (m_loc, n, pull, s)
        if (found := self._known_plan(key)) is not None:
            return found
        w, r = self.world_size, self.rank
        cfg = self._cfg(w * m_loc, n, self.k)
        first, count = self._set_slots()
        arrival = first + s * count
        sched, segments = ag_layout(
            w, r, m_loc, cfg, self._split_of("sm_pull" if pull else "fused"), pull=pull,
            arrival=arrival, expected=self._pull_programs() if pull else 1,
            template=self.schedule,
        )  # fmt: skip
        one_loop = segment_gemm.one_loop_tables(
            segments, w * m_loc, n, self.k, cfg, self.dtype, self.group.device
        )
        tiles = segment_gemm.plan_tiles(
            segments, w * m_loc, n, cfg, self.group.device, self.group.backend,
            comm_sms=self.comm_sms if pull else 1,  # fused: one SM for the barrier
            one_loop=one_loop,
        )  # fmt: skip
        moves = schedule.transfers(sched, r)
        if pull:
            rows = [[t.lo, t.hi - t.lo, arrival + t.signal, t.src] for t in moves]
            pulls = segment_gemm.to_device(torch.tensor(rows, dtype=torch.int32), self.group.device)
            copies = []
        else:
            pulls, copies = None, []
            for t in moves:  # issue order: peer by peer, rank-rotated
                signal = self.pad.buffer.peers[t.dst].view(torch.uint32)
                copies.append(
                    ShardCopy(
                        self.gathered.peers[t.dst][s, t.lo : t.hi], t.lo - r * m_loc,
                        t.hi - r * m_loc, signal, arrival + t.signal,
                    )
                )  # fmt: skip
        plan = AgPlan(tiles, copies, pulls, s, self.gathered.local[s])
        return self._keep_plan(key, plan)

    def _pull_programs(self) -> int:
        return self.comm_sms if self.group.backend == "cuda" else 2

    def _gemm(self, plan: AgPlan, a_shard, b, bias, out, m_loc):
        run = plan.launchers.get(bias is not None)
        if run is None:
            run = plan.launchers[bias is not None] = segment_gemm.launcher(
                self.world_size * m_loc, b.shape[1], self.k, plan.tiles, dtype=self.dtype,
                device=self.group.device, has_bias=bias is not None, own_rows=m_loc,
                signals=self._signals(plan.set),
            )  # fmt: skip
        run(plan.gathered, b, out, bias, a_shard)

    def _fused(self, a_shard, b, bias, out):
        """A device barrier that checks the call fingerprints, then the consumer GEMM on
        the caller's stream, and on the comm stream the copies of this rank's shard into
        its peers' buffers of this call's buffer set (``AlternatingSets``). On a GPU the
        GEMM is launched before the copies: it
        starts on its own shard at once, so the host time before its launch is all an
        eager call exposes (a profiled eager call on 2 x H200, copies first: the GEMM began
        165 us after the call, 80 us after the copy), and it waits per chunk for the peers'
        copies. The comm stream's fork point is recorded before the GEMM (or the copies
        would wait for it) and its wait enqueued after the launch. The interpreter runs a
        launch to completion, so there the copies come first. The GEMM zeroes its set's
        flags as it ends and leaves an SM free for a captured call's barrier."""
        m_loc = a_shard.shape[0]
        s = self._buffer_set()
        plan = self._plan(m_loc, b.shape[1], pull=False, s=s)
        whole = a_shard.shape[0]
        consumer_first = self.group.backend == "cuda"
        # Every peer is in this same call (the barrier carries the call fingerprint: a
        # peer that called with other shapes is reported at once) and done with its
        # previous call (a captured call's set is rewritten by every replay). On the
        # caller's stream, before the GEMM: on the comm stream, beside a persistent GEMM
        # that holds the SMs and waits for the copies, the one-program barrier may never
        # be scheduled.
        self._barrier()
        fork_mark(self.group)  # the copies may start once the inputs are ready
        if consumer_first:
            self._gemm(plan, a_shard, b, bias, out, m_loc)
        stream = fork_from_mark(self.group)
        for c in plan.copies:
            src = a_shard if c.hi - c.lo == whole else a_shard[c.lo : c.hi]
            _trace.copy_and_signal(c.dst, src, c.signal, c.slot, stream=stream)
        if not consumer_first:
            self._gemm(plan, a_shard, b, bias, out, m_loc)
        join(self.group, stream)

    def _sm_pull(self, a_shard, b, bias, out):
        r, m_loc = self.rank, a_shard.shape[0]
        plan = self._plan(m_loc, b.shape[1], pull=True)
        first, count = self._set_slots()  # set 0: one set, barriers around each call
        gathered = self.gathered.local[0]
        gathered[r * m_loc : (r + 1) * m_loc].copy_(a_shard)
        self._barrier(first, count)  # every shard is staged; my flags are zero
        stream = fork(self.group)
        with use_stream(stream):
            pull_chunks_kernel[(self._pull_programs(),)](
                gathered, self.gathered.ptrs, plan.pulls, plan.pulls.shape[0], self.k,
                self.pad.buffer.local, BLOCK_M=32, BLOCK_K=256,
            )  # fmt: skip
        self._gemm(plan, a_shard, b, bias, out, m_loc)
        join(self.group, stream)
        self._barrier()  # nobody still pulls from my staged shard


__all__ = ["AGGemm"]
