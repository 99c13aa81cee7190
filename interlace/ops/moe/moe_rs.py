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
  weight and stores the tile (in ``rows_dtype``, below) in ``h``'s expert-sorted row
  order into this rank's local row buffer (whole tiles, as a plain GEMM stores; no
  atomics), and records each (token, slot) entry's row in this rank's entry -> row map;
  when all its tiles are done a rank raises every owner's counter, and each owner, once
  all ranks have counted, sums the ``k`` rows of each of its tokens in every rank's row
  buffer, found through that rank's map (peer reads: the top-k sum and the reduce-scatter
  in one pass), and converts them to the output type (``moe_finish_kernel``). The row
  buffers take ``3 * rows * hidden`` elements of ``rows_dtype`` per rank, ``rows`` the
  padded routing's worst case (``max_tokens * topk`` plus up to ``block_m - 1`` per
  expert; two eager buffer sets and one for CUDA graphs: 0.47 GiB in bf16 at 8192
  tokens, top-2, 32 experts, hidden 4096). Every call rewrites every entry's row and map
  word, so nothing is cleared between calls; an entry whose expert id is out of range
  (the host checks refuse those, except in a call being captured) has no row, and the
  finish would read that entry's row of an earlier call. Needs the padded routing of
  ``AGMoE``'s ``fused`` strategy.
* ``none``: ``torch._grouped_mm``, weights, ``index_add`` (float32), NCCL reduce-scatter.
* ``auto``: ``fused`` for a padded routing (:data:`AUTO_FUSED_ON_GPU` on GPUs), ``none``
  for the ``none`` strategy's routing.

With ``eager_graphs`` (the default where the driver allows) an eager ``fused`` call is
replayed from a CUDA graph captured on the second call of its kind (``OpContext._enqueue``).

Inside ``interlace.trace.record`` the ``fused`` strategy's two launches are traced
(``TRACE`` on): the grouped GEMM (per tile, and the raise of the owners' counters) and the
finish kernel (per program its wait for the contributions, per tile its end).

``rows_dtype``: the type of the weighted rows between the GEMM and the owner's float32
sum. The default is the op's type, as in torch's path (``torch._grouped_mm``'s output is
in the op's type): one rounding per row before the sum, and half the bytes of float32 to
write, read and, on several GPUs, carry over the links. ``torch.float32`` keeps each row
unrounded until the sum, which is then rounded once. On one H200 at TileLink's shapes
(TP 4, rank 0 with its waits met): relative error against float32 2.4e-3 with bf16 rows,
1.7e-3 with float32 rows, and the GEMM + finish 1.24-1.43 x faster with bf16 rows
(``bench moe``'s records, which hold both: ``t_ms`` and ``t_f32_rows_ms`` in
benchmarks/results/2026-11-29-h200-w1.json).
"""

from __future__ import annotations

import torch

from ...errors import InterlaceTypeError, InterlaceValueError
from ...runtime import symm_zeros
from .._context import BUFFER_SETS, GRAPH_SET
from . import _checks
from ._gemm import MoeGemmConfig, launch_finish, launch_gemm, programs
from .ag_moe import _MoeContext
from .baseline import moe_rs_none
from .routing import MoeRouting, padded_rows

#: ``auto`` picks ``fused`` on GPUs: on four H200s (one rank each, TileLink's 12 MoE
#: cases) the eager ``fused`` call ran 1.24-2.12 x faster than ``none`` and the whole layer
#: replayed from graphs 1.6-2.3 x (``benchmarks/results/2026-11-28-h200-w4.json``).
AUTO_FUSED_ON_GPU = True


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
        eager_graphs: bool | None = None, rows_dtype: torch.dtype | None = None,
    ):  # fmt: skip
        rows_dtype = dtype if rows_dtype is None else rows_dtype
        if rows_dtype not in (dtype, torch.float32):
            raise InterlaceTypeError(
                f"{self.op_name}: rows_dtype must be the op's type {dtype} or float32, got "
                f"{rows_dtype}"
            )
        self.rows_dtype = rows_dtype
        super().__init__(
            group, max_tokens, hidden, inter, experts, topk, dtype, strategy, config,
            validate, max_spins, {"moe": BUFFER_SETS * self._set_size}, eager_graphs,
        )  # fmt: skip
        if strategy != "none":
            # per buffer set: the weighted rows in the routing's (padded, expert-sorted)
            # order, and each (token, slot) entry's row (symmetric allocations start on 16
            # bytes on every rank: the finish's aligned loads)
            bm = self.config.block_m
            self.row_cap = padded_rows(self.max_tokens, self.topk, self.experts, bm)
            shape = (BUFFER_SETS, self.row_cap, self.hidden)
            self.row_buf = self._track(symm_zeros(shape, self.rows_dtype, group))
            entries = (BUFFER_SETS, self.max_tokens * self.topk)
            self.row_map = self._track(symm_zeros(entries, torch.int32, group))

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
        self._begin()
        self._check(h, routing, w_down)
        strategy = self.strategy
        if strategy == "auto":
            padded = routing.layout == "padded"
            gpu = self.group.backend == "cuda"
            # (a captured call on a group whose collectives a graph cannot hold: fused)
            fused = AUTO_FUSED_ON_GPU or not gpu or not self._none_capturable()
            strategy = "fused" if padded and fused else "none"
        self._check_capturable(strategy)
        self._begin_call(graphed=strategy != "none", m=routing.m_loc, strategy=strategy)
        if strategy == "none":
            y = moe_rs_none(self.group, h, routing, w_down, self.dtype)
        else:
            y = self._fused(h, routing, w_down)
        self.last_strategy = strategy
        self._end()
        return y

    def _fused(self, h, routing: MoeRouting, w):
        dev, m = self.group.device, routing.m_loc
        y = torch.empty(m, self.hidden, dtype=self.dtype, device=dev)
        cfg = self.config

        def run():
            s = self._buffer_set()
            if s == GRAPH_SET:
                self._barrier()
            base = self._set_base(s)
            sig, err = self.pad.buffer.local, self.error.address
            launch_gemm(
                a=h, x_own=None, w=w, out=None, routing=routing, n=self.hidden, up=0,
                cfg=cfg,
                grid=programs(routing, self.hidden, cfg, dev, self.group.backend, reduce=True),
                gather=False, swiglu=False, reduce=True, rows_out=self.row_buf.local[s],
                row_of=self.row_map.local[s], sig=sig, sig_table=self.pad.ptrs, err=err,
                rank=self.rank, max_spins=self.max_spins, done_slot=base,
                contrib_slot=base + 1, world=self.world_size,
            )  # fmt: skip
            launch_finish(
                self.row_buf.ptrs, s * self.row_cap * self.hidden, self.row_map.ptrs,
                s * self.max_tokens * self.topk, y, m, self.topk, sig, base + 1, base + 2, err,
                self.rank, self.max_spins, self.world_size, dev, self.group.backend,
                rows_f32=self.rows_dtype == torch.float32, aligned=True,
            )  # fmt: skip

        # the routing's tensors: views of one allocation (the operand), of which the
        # kernels read some; a routing made elsewhere lists them (a view no kernel reads
        # makes the call run eagerly: nothing is replayed with a stale routing)
        tables = [routing.storage]
        if routing.storage is None:
            tables = [routing.entry_ids, routing.weights, routing.tiles, routing.tile_count]
        self._enqueue("fused", run, h, *tables, w, y)
        return y


__all__ = ["MoERS"]
