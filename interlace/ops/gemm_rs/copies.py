"""What the copy-engine strategies of GEMM+RS / GEMM+AR share (``ce_scatter``,
``ce_fused``; the GEMM that stores partials also serves ``ring``): the prepared GEMM that
stores partial tiles locally and counts each chunk's finished tiles, and the chunk
shipments of the comm stream (wait for a chunk's tiles, copy it to its owner, raise the
owner's flag)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...language.primitives import wait_kernel
from .. import _trace, segment_gemm
from .._launch import PreparedLaunch


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


class ChunkShipping:
    """Mixed into the GEMM+RS / GEMM+AR context (:class:`.base.ScatterGemm`).

    Launch order: the partials GEMM never waits on anything, so it is enqueued first (on
    every backend), before the kernels that spin waiting for its chunks. The other order
    deadlocked on 2 x H200 until the waits timed out: the first launch of a kernel (here
    the GEMM, at each new specialisation) blocked the host for as long as a kernel was
    spinning on the device (benchmarks/NOTES.md, "A launch-order deadlock"). The GEMM's
    grid leaves ``comm_sms`` SMs free for the spinning kernels."""

    def _partials_gemm(self, launchers, m, n, tiles, a, b, bias):
        """The plan's GEMM that stores partials and counts finished tiles per chunk
        (prepared once per bias / no bias). Compiled when prepared on a GPU, so that no
        first compile (seconds) falls between kernels that wait on each other."""
        run = launchers.get(bias is not None)
        if run is None:
            signals = segment_gemm.Signals(
                sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
                max_spins=self.max_spins, world=self.world_size, notify_stores=True,
            )  # fmt: skip
            run = launchers[bias is not None] = segment_gemm.launcher(
                m, n, self.k, tiles, dtype=self.dtype, device=self.group.device,
                has_bias=bias is not None, signals=signals,
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
