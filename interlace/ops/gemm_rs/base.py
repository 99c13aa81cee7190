"""What GEMM+RS (:class:`~interlace.GemmRS`) and GEMM+AR (:class:`~interlace.GemmAR`)
share: the context with its buffers, signal regions, tile config and the strategy mixins
(one module per strategy in this package)."""

from __future__ import annotations

import torch

from ...errors import InterlaceValueError
from ...runtime import symm_empty
from .. import segment_gemm
from .._context import BUFFER_SETS, AlternatingSets
from ..overlapped import OverlappedGemm
from ..segment_gemm import MAX_SPLIT, GemmConfig
from .ce_fused import CeFused
from .ce_scatter import CeScatter
from .copies import ChunkShipping
from .fused import Fused
from .ring import RING_MAX_PROGRAMS, Ring


class ScatterGemm(AlternatingSets, Fused, CeFused, CeScatter, Ring, ChunkShipping, OverlappedGemm):
    """Shared by GEMM+RS and GEMM+AR: the row chunks in rank-rotated order, partial tiles
    pushed to their owner from the epilogue, the owner's tiles reduced in theirs."""

    STRATEGIES = ("auto", "fused", "signal_reorder", "none")
    BROADCAST = False
    gather = None  # GEMM+AR only

    def __init__(self, group, max_m, n, k, dtype=torch.bfloat16, strategy="auto", **kw):
        super().__init__(group, max_m, n, k, dtype, strategy, **kw)
        w = self.world_size
        if self.max_m % w:
            raise InterlaceValueError(
                f"{self.op_name}: max_m = {self.max_m} must be a multiple of the world size {w}"
            )
        self._signal_reorder = None
        self._chunk_waits: dict = {}  # (counter slot, tiles) -> prepared wait (ce_*)
        if strategy == "signal_reorder":
            from ..signal_reorder import SignalReorderGemmAR, SignalReorderGemmRS

            cls = SignalReorderGemmAR if self.BROADCAST else SignalReorderGemmRS
            self._signal_reorder = cls(
                group, self.max_m, self.n, self.k, dtype, config=self.config,
                max_spins=self.max_spins, eager_graphs=kw.get("eager_graphs"),
            )  # fmt: skip
        elif strategy == "ce_fused" or self._auto_ce_fused():
            # a receive buffer per buffer set (AlternatingSets); ``fused`` uses the first
            shape = (BUFFER_SETS, w, self.max_m // w, self.n)
            self.recv = self._track(symm_empty(shape, dtype, group))
        elif strategy != "none":
            self.recv = self._track(symm_empty((w, self.max_m // w, self.n), dtype, group))
        if strategy in ("ce_scatter", "ring", "ce_fused") or self._auto_ce_fused():
            self.partials = torch.empty(self.max_m * self.n, dtype=dtype, device=group.device)
        if strategy == "ring" and not 1 <= self._ring_programs() <= RING_MAX_PROGRAMS:
            raise InterlaceValueError(
                f"{self.op_name}: comm_sms must be in 1..{RING_MAX_PROGRAMS} for the ring, "
                f"got {self.comm_sms}"
            )

    def _auto_ce_fused(self) -> bool:
        return self.strategy == "auto" and self.policy.ce_fused_min_gemm_us is not None

    def _overlapped(self, t_gemm_us: float) -> str:
        if self._auto_ce_fused() and t_gemm_us >= self.policy.ce_fused_min_gemm_us:
            return "ce_fused"
        return "fused"

    def _begin_gemm_call(self, m: int, n: int, strategy: str, bias) -> None:
        """``_begin_call`` of a GEMM+RS / GEMM+AR call (graphed where the strategy's device
        work is one ``_enqueue``), then the barrier of a strategy switch."""
        self._begin_call(
            graphed=strategy not in ("none", "signal_reorder"), M=m, N=n, K=self.k,
            strategy=strategy, bias=bias is not None,
        )  # fmt: skip
        self._switch_barrier(strategy)

    def _switch_barrier(self, strategy: str) -> None:
        """``fused`` and ``ce_fused`` share receive buffers and signal slots, and neither
        waits for the other's last call: when ``auto`` switches between them, a device
        barrier first (every rank's previous call has finished)."""
        if strategy in ("fused", "ce_fused"):
            if self._last_overlapped not in (None, strategy):
                self._barrier()
            self._last_overlapped = strategy

    _last_overlapped: str | None = None

    def _switches(self, strategy: str) -> bool:
        return strategy in ("fused", "ce_fused") and self._last_overlapped not in (None, strategy)

    @staticmethod
    def _regions(world):
        return {
            "partial": world * MAX_SPLIT * (world - 1), "broadcast": world * MAX_SPLIT,
            # ce_scatter: per (source, piece) arrivals and the reduction's finished-program
            # counter (its last slot); per chunk finished-tile counts
            "arrival": world * MAX_SPLIT + 1, "chunk_done": world * MAX_SPLIT,
            # ring: per (step, program) arrivals from the left neighbour
            "ring": world * RING_MAX_PROGRAMS,
            # GEMM+AR ce_scatter: a peer's reduced rows have landed
            "gathered": world,
            # "go" and "done": the GEMM's entry barrier and exit clearing (kernels.gemm)
            "go": 1, "done": 1,
            # ce_fused: per chunk its finished staged (all-reduce: or reduced) tiles; per
            # buffer set the arrival flags, "go" and "done" (``_cef_set_slots``); all-reduce:
            # per peer its last gathered chunk
            "ce_done": world * MAX_SPLIT,
            "ce_sets": BUFFER_SETS * CeFused.cef_set_size(world), "ce_gathered": world,
        }  # fmt: skip

    def _signals(self) -> segment_gemm.Signals:
        """The ``fused`` GEMM's signal arguments: program 0 runs the entry barrier; every
        slot after the barrier's is the op's, and the launch leaves them zero as it ends
        (so no call clears them first)."""
        start, size = self.pad.regions["barrier"]
        first = start + size
        return segment_gemm.Signals(
            sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
            max_spins=self.max_spins, world=self.world_size, sig_table=self.pad.ptrs,
            bar_slot=self.pad.offset("barrier"), go_slot=self.pad.offset("go"),
            clear=(first, self.pad.size - first),
        )  # fmt: skip

    def _comm_bytes(self, m_total, n):
        """The reduce-scatter traffic (for all-reduce too: its floor accounts for the rest)."""
        return m_total * n * self.dtype.itemsize * (self.world_size - 1) // self.world_size

    def _cfg(self, m: int, n: int, k: int) -> GemmConfig:
        cfg = super()._cfg(m, n, k)
        if self.group.backend != "cuda":
            return cfg
        return segment_gemm.scatter_config(cfg, n, widen=self.config is None)

    def close(self) -> None:
        if self._signal_reorder is not None:
            self._signal_reorder.close()
        super().close()

    def _rows_check(self, a):
        if a.shape[0] % self.world_size:
            raise InterlaceValueError(
                f"{self.op_name}: a has {a.shape[0]} rows, not a multiple of the world size "
                f"{self.world_size} (each rank gets an equal share of the rows)"
            )
