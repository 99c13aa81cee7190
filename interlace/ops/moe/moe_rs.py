"""The second half of a tensor-parallel MoE layer: the down-projection grouped GEMM + the
top-k weighted sum + reduce-scatter, overlapped.

::

    rs = interlace.MoERS(group, max_tokens=8192, hidden=2048, inter=384, experts=32, topk=2)
    y_shard = rs(h, routing, w_down)      # [m, H]: this rank's tokens, summed over ranks

``h [routing.rows, inter]`` and ``routing``: what :class:`~interlace.AGMoE` returned (or
any activations in that row order); ``w_down [E, inter, H]``: this rank's shard. The
result is, for each of this rank's tokens, the sum over its ``k`` slots and over all
ranks of ``weight * h_row @ w_down[expert]``, accumulated in float32.

Strategies:

* ``fused``: one persistent grouped GEMM whose epilogue multiplies each row by its routing
  weight and adds it (GPU-scope float32 atomics) into this rank's local accumulator of
  every token, so the top-k sum needs no permuted copy of the rows; when all its tiles are
  done a rank raises every owner's counter, and each owner, once all ranks have counted,
  sums its tokens' rows of every rank's accumulator (peer reads: the reduce-scatter, in
  float32), converts them to the output type and zeroes what it read
  (``moe_finish_kernel``). The accumulators take ``3 * max_tokens * hidden`` float32 per
  rank (two eager buffer sets and one for CUDA graphs). Needs the padded routing of
  ``AGMoE``'s ``fused`` strategy.
* ``none``: ``torch._grouped_mm``, weights, ``index_add`` (float32), NCCL reduce-scatter.
* ``auto``: ``fused`` for a padded routing in the CPU emulation, ``none`` on GPUs (below)
  and for the ``none`` strategy's routing.

On GPUs ``fused`` is refused (``InterlaceValueError``): at the benchmark's shapes (8192
tokens, H 2048-4096, E 8-32) its result was off by a relative error of 0.26-0.43 on one
H100 while the small GPU tests passed
(``benchmarks/results/history/2026-11-25-h100-moe2-bench.log``); the cause is not found.
``INTERLACE_EXPERIMENTAL_MOE_RS=1`` lets it run, to debug it.
"""

from __future__ import annotations

import os

import torch

from ...errors import InterlaceValueError
from ...runtime import symm_zeros
from .._context import BUFFER_SETS, GRAPH_SET
from . import _checks
from ._gemm import MoeGemmConfig, launch_finish, launch_gemm, programs
from .ag_moe import _MoeContext
from .baseline import moe_rs_none
from .routing import MoeRouting

#: lets the fused strategy run on GPUs (see the module docstring)
EXPERIMENTAL = "INTERLACE_EXPERIMENTAL_MOE_RS"


class MoERS(_MoeContext):
    """Grouped GEMM + top-k reduce + reduce-scatter; see the module docstring."""

    op_name = "moe_rs"
    _mode = "reduce"
    #: per buffer set: the GEMM's finished-program counter, the owners' contribution
    #: counter and the finish kernel's finished-program counter
    _set_size = 3

    def __init__(
        self, group, max_tokens: int, hidden: int, inter: int, experts: int, topk: int,
        dtype: torch.dtype = torch.bfloat16, strategy: str = "auto",
        config: MoeGemmConfig | None = None, validate: bool = True, max_spins=None,
    ):  # fmt: skip
        super().__init__(
            group, max_tokens, hidden, inter, experts, topk, dtype, strategy, config,
            validate, max_spins, {"moe": BUFFER_SETS * self._set_size},
        )  # fmt: skip
        if strategy != "none":
            # every token's rows (the owners' reads of each set are zeroed by the owner)
            shape = (BUFFER_SETS, self.max_tokens, self.hidden)
            self.acc = self._track(symm_zeros(shape, torch.float32, group))

    def _check(self, h, routing, w) -> None:
        op, dev = self.op_name, self.group.device
        err = None
        if not isinstance(routing, MoeRouting):
            err = _checks.ArgError(
                InterlaceValueError,
                f"{op}: routing must be the MoeRouting that AGMoE returned, got "
                f"{type(routing).__name__}",
            )
        err = (
            err
            or _checks.tensor_error(op, "h", h, dtype=self.dtype, dims=2, device=dev)
            or _checks.tensor_error(op, "w_down", w, dtype=self.dtype, dims=3, device=dev)
        )
        fields = (-1, -1)
        if err is None:
            fields = (routing.m_loc, routing.topk)
            err = _checks.shape_error(op, "h", h, (routing.rows, self.inter)) or (
                _checks.shape_error(op, "w_down", w, (self.experts, self.inter, self.hidden))
            )
            if err is None and (
                routing.topk != self.topk or routing.experts != self.experts
                or routing.world != self.world_size or not 1 <= routing.m_loc <= self.max_m
            ):  # fmt: skip
                err = _checks.ArgError(
                    InterlaceValueError,
                    f"{op}: the routing is for {routing.m_loc} tokens per rank, top-{routing.topk} "
                    f"of {routing.experts} experts over {routing.world} ranks; this context "
                    f"takes up to {self.max_m} tokens per rank, top-{self.topk} of "
                    f"{self.experts} over {self.world_size}",
                )
            if err is None and self.strategy == "fused" and routing.layout != "padded":
                err = _checks.ArgError(
                    InterlaceValueError,
                    f"{op}: strategy 'fused' needs the padded routing of AGMoE's 'fused' "
                    "strategy (this one comes from 'none')",
                )
            if (
                err is None
                and routing.layout == "padded"
                and (routing.block_m != self.config.block_m)
            ):
                err = _checks.ArgError(
                    InterlaceValueError,
                    f"{op}: the routing pads experts to {routing.block_m} rows, this "
                    f"context's tiles are {self.config.block_m} rows high (give both halves "
                    "the same config.block_m)",
                )
        _checks.agree(self, err, fields, self.validate and not self._capturing())

    def __call__(self, h, routing: MoeRouting, w_down) -> torch.Tensor:
        if self.strategy == "fused" and self._fused_refused():  # the same on every rank
            raise InterlaceValueError(
                f"{self.op_name}: strategy 'fused' gives wrong results on GPUs at large shapes "
                "(a known defect, see interlace/ops/moe/moe_rs.py); use 'none' or 'auto', or "
                "set INTERLACE_EXPERIMENTAL_MOE_RS=1 to run it anyway"
            )
        self._begin()
        self._check(h, routing, w_down)
        strategy = self.strategy
        if strategy == "auto":
            padded = routing.layout == "padded"
            strategy = "fused" if padded and not self._fused_refused() else "none"
        self._begin_call(m=routing.m_loc, strategy=strategy)
        if strategy == "none":
            y = moe_rs_none(self.group, h, routing, w_down, self.dtype)
        else:
            y = self._fused(h, routing, w_down)
        self.last_strategy = strategy
        self._end()
        return y

    def _fused_refused(self) -> bool:
        """The fused kernel is refused on GPUs unless INTERLACE_EXPERIMENTAL_MOE_RS=1."""
        return self.group.backend == "cuda" and os.environ.get(EXPERIMENTAL) != "1"

    def _fused(self, h, routing: MoeRouting, w):
        dev, m = self.group.device, routing.m_loc
        s = self._buffer_set()
        if s == GRAPH_SET:
            self._barrier()
        base = self._set_base(s)
        y = torch.empty(m, self.hidden, dtype=self.dtype, device=dev)
        sig, err = self.pad.buffer.local, self.error.address
        cfg = self.config
        launch_gemm(
            a=h, x_own=None, w=w, out=None, routing=routing, n=self.hidden, up=0, cfg=cfg,
            grid=programs(routing, self.hidden, cfg, dev, self.group.backend), gather=False,
            swiglu=False, reduce=True, acc_out=self.acc.local[s], sig=sig,
            sig_table=self.pad.ptrs, err=err, rank=self.rank, max_spins=self.max_spins,
            done_slot=base, contrib_slot=base + 1, world=self.world_size,
        )  # fmt: skip
        launch_finish(
            self.acc.ptrs, s * self.max_tokens * self.hidden, y, m, sig, base + 1, base + 2,
            err, self.rank, self.max_spins, self.world_size, dev, self.group.backend,
        )  # fmt: skip
        return y


__all__ = ["MoERS"]
