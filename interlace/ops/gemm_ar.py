"""GEMM+AR: ``all_reduce(a @ b) (+ bias)``, overlapped.

Strategies (``strategy=``; ``auto`` and ``none``: :mod:`interlace.ops.overlapped`): those
of GEMM+RS (:mod:`interlace.ops.gemm_rs`) but ``ring``, on the same context, each with the
all-gather half added:

* ``fused``: the owner's epilogue writes each reduced tile into every rank's output (the
  all-gather spread over the whole GEMM);
* ``ce_fused``: own chunks reduced in rounds, a round after the peers computed them, their
  sums sent to every rank by the epilogue (``gather="epilogue"``, the default) or the copy
  engine (``gather="copy"``). ``gather="copy"`` with split 2 / 4 / 8 measured 1.55 / 1.93
  / 2.52 time / bound on LLaMA-7B, M 8192, 4 x H200, against 1.30 / 1.54 with the epilogue
  (``benchmarks/results/history/2026-11-22-h200-w4-02.json``, ``-03.json``): each chunk's
  wait and copies cost the comm stream ~10 µs beyond the copy, and the gather doubles the
  copies;
* ``ce_scatter``: the reduce-scatter of GEMM+RS, then the copy engine gathers each rank's
  reduced rows to every peer;
* ``signal_reorder``: through :class:`~interlace.SignalReorderGemmAR`.

Results: a view of the context's symmetric output buffer, valid until the next call (pass
``out=`` to keep it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InterlaceValueError
from ..runtime import symm_empty
from .gemm_rs.base import ScatterGemm


class GemmAR(ScatterGemm):
    """``all_reduce(a @ b) (+ bias)``: ``a [M, k]``, ``b [k, n]``; result ``[M, n]`` on
    every rank (a view of the context's buffer unless ``out=`` is given)."""

    op_name = "gemm_ar"
    BROADCAST = True
    STRATEGIES = ("auto", "fused", "ce_fused", "ce_scatter", "signal_reorder", "none")
    #: how ``ce_fused`` moves the reduced rows to the peers: ``"copy"`` (the copy engine,
    #: chunk by chunk) or ``"epilogue"`` (the owner's epilogue stores each reduced tile
    #: into every rank's result, as ``fused``)
    GATHERS = ("copy", "epilogue")

    def __init__(
        self, group, max_m, n, k, dtype=torch.bfloat16, strategy="auto", gather="epilogue",
        **kw,
    ):  # fmt: skip
        if gather not in self.GATHERS:
            raise InterlaceValueError(
                f"{self.op_name}: gather must be one of {self.GATHERS}, got {gather!r}"
            )
        self.gather = gather
        super().__init__(group, max_m, n, k, dtype, strategy, **kw)
        if strategy != "none":
            self.result = self._track(symm_empty((self.max_m, self.n), dtype, group))
        self._result_views: dict[tuple[int, int], torch.Tensor] = {}

    def _result_view(self, m: int, n: int) -> torch.Tensor:
        """The ``[m, n]`` view of the symmetric result buffer (made once per shape)."""
        view = self._result_views.get((m, n))
        if view is None:
            view = self._result_views[(m, n)] = self.result.local.view(-1)[: m * n].view(m, n)
        return view

    def _overlapped_call(self, strategy, a, b, bias, out):
        """The strategies that reduce into this context's symmetric result: that buffer's
        view, or ``out`` holding a copy of it."""
        result = self._result_view(a.shape[0], b.shape[1])
        run = {"ce_scatter": self._ce_all_reduce, "ce_fused": self._ce_fused}
        run = run.get(strategy, self._fused)

        def enqueue():
            run(a, b, bias, result)
            if out is not None:
                out.copy_(result)

        self._enqueue(strategy, enqueue, a, b, bias, out)
        return result if out is None else out

    def __call__(self, a, b, bias=None, out=None):
        # (a call like an earlier one replays its graph at once)
        key, result = self._replayed(a, b, bias, None, out)
        if result is not None:
            return result
        self._check_call(a, b, bias, self.max_m)
        self._rows_check(a)
        m, n = a.shape[0], b.shape[1]
        out = self._check_out(out, (m, n))
        strategy = self._resolve(m, n, self.k)
        self._begin_gemm_call(m, n, strategy, bias)
        if strategy == "none":
            result = torch.matmul(a, b, out=out) if out is not None else torch.matmul(a, b)
            dist.all_reduce(result, group=self._pg)
            if bias is not None:
                result += bias
        elif strategy == "signal_reorder":
            result = self._signal_reorder(a, b, bias=bias, out=out)
        else:
            result = self._overlapped_call(strategy, a, b, bias, out)
        self.last_strategy = strategy
        self._end()
        self._arm_call(key, strategy, None if out is not None else result)
        return result


__all__ = ["GemmAR"]
