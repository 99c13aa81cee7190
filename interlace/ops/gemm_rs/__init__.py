"""GEMM+RS: ``reduce_scatter(a @ b) (+ bias)`` along rows, overlapped.

Strategies (``strategy=``; ``auto`` and ``none``: :mod:`interlace.ops.overlapped`), one
module each:

* ``fused`` (:mod:`.fused`): partial tiles pushed to their owner from the GEMM's epilogue,
  the owner's own tiles reduced in theirs;
* ``ce_fused`` (:mod:`.ce_fused`): partial tiles staged locally and shipped by the copy
  engine chunk by chunk, reduced in the owner's epilogue;
* ``ce_scatter`` (:mod:`.ce_scatter`): the copy engine ships the chunks and a reduction
  kernel adds them;
* ``ring`` (:mod:`.ring`): TileLink's ring of a few SMs beside the GEMM;
* ``signal_reorder``: FlashOverlap, through :class:`~interlace.SignalReorderGemmRS`
  (:mod:`interlace.ops.signal_reorder`): tiles land wave group by wave group in a
  reordered buffer and a stock ``torch.distributed`` collective runs per group. No
  symmetric memory: it works wherever the process group does.

The shared context is :class:`.base.ScatterGemm`; GEMM+AR (:mod:`interlace.ops.gemm_ar`)
builds on it too.

Results: a new tensor ``[M / world, n]`` (or ``out``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import segment_gemm
from .base import ScatterGemm
from .ce_fused import CeFusedPlan, cef_layout, gather_order


class GemmRS(ScatterGemm):
    """``reduce_scatter(a @ b) (+ bias)`` along rows: ``a [M, k]`` (the rank's column
    shard of the activations), ``b [k, n]``; rank ``r`` gets rows ``[r*M/W, (r+1)*M/W)``
    of the sum over ranks, ``[M / world, n]``."""

    op_name = "gemm_rs"
    STRATEGIES = ("auto", "fused", "ce_fused", "ce_scatter", "ring", "signal_reorder", "none")

    def __call__(self, a, b, bias=None, out=None):
        w = self.world_size
        # (a call like an earlier one replays its graph at once)
        key, result = self._replayed(a, b, bias, (1, w), out)
        if result is not None:
            return result
        self._check_call(a, b, bias, self.max_m)
        self._rows_check(a)
        m, n = a.shape[0], b.shape[1]
        if out is None:
            out = torch.empty(m // w, n, dtype=self.dtype, device=self.group.device)
        else:
            self._check_out(out, (m // w, n))
            segment_gemm.check_tma_aligned(self.op_name, out, names=("out",))
        strategy = self._resolve(m, n, self.k)
        self._begin_gemm_call(m, n, strategy, bias)
        if strategy == "none":
            c = torch.matmul(a, b)
            dist.reduce_scatter_tensor(out, c, group=self._pg)
            if bias is not None:
                out += bias
        elif strategy == "signal_reorder":
            out = self._signal_reorder(a, b, bias=bias, out=out)
        else:
            run = {"ce_scatter": self._ce_scatter, "ce_fused": self._ce_fused, "ring": self._ring}
            run = run.get(strategy, self._fused)
            self._enqueue(strategy, lambda: run(a, b, bias, out), a, b, bias, out)
        self.last_strategy = strategy
        self._end()
        self._arm_call(key, strategy)
        return out


__all__ = ["CeFusedPlan", "GemmRS", "ScatterGemm", "cef_layout", "gather_order"]
