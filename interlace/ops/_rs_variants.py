"""The copy-engine scatter (``ce_scatter``: GEMM+RS, and GEMM+AR with a copy-engine
gather after it) and the ring (``ring``, GEMM+RS): the methods they add to the GEMM+RS /
GEMM+AR context (``ops.gemm._ScatterGemm``, which mixes this class in). Both run the
segment GEMM with plain stores of every partial tile into a local buffer
(``self.partials``) and per-chunk finished-tile counters; they differ in what moves the
chunks: the copy engine plus one reduction kernel, or a ring of a few SMs."""

from __future__ import annotations

import torch

from .. import schedule
from ..kernels.collective import reduce_arrivals_kernel
from ..kernels.ring import MAX_PROGRAMS, ring_reduce_scatter_kernel
from ..language.primitives import wait_kernel
from ..runtime import copy_and_signal, fork, join, use_stream
from . import _gemm
from ._context import cdiv, persistent_grid
from ._gemm import Segment, tiles_of
from ._launch import launch
from .collectives import REDUCE_BLOCK

RING_MAX_PROGRAMS = MAX_PROGRAMS.value
#: Reduction programs per SM: the reduction spins on arrivals while the comm stream's
#: one-program waits still need a place on some SM (four per SM could fill one).
REDUCE_PER_SM = 1


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
            w, m_loc, self.split, backend="ce", align=cfg.block_m
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
                (
                    dst.view(hi - lo, n), t.lo, t.hi, self.pad.buffer.peers[o].view(torch.uint32),
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
            self._ship(copies, partials)
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
        for *_, done, tiles in copies:
            wait_kernel.warmup(
                self.pad.buffer.local, done, 1, tiles, self.error.address, self.rank,
                self.max_spins, RESET=True, grid=(1,),
            )  # fmt: skip
        return True

    def _ship(self, copies, partials) -> None:
        """Per chunk: wait (bounded, one program) until the GEMM has finished its tiles, then
        copy it to its owner and raise the owner's flag."""
        for dst, lo, hi, signal, slot, done, tiles in copies:
            launch(
                wait_kernel, 1, self.pad.buffer.local, done, 1, tiles, self.error.address,
                self.rank, self.max_spins, RESET=True,
            )  # fmt: skip
            copy_and_signal(dst, partials[lo:hi], signal, slot)
