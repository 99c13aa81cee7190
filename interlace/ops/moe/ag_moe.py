"""The first half of a tensor-parallel MoE layer: all-gather of the tokens + routing + a
grouped GEMM (gate/up, fused SwiGLU), overlapped.

::

    ag = interlace.AGMoE(group, max_tokens=8192, hidden=2048, inter=384, experts=32, topk=2)
    h, routing = ag(x_shard, topk_ids, topk_weights, w_gate_up)

``x_shard [m, H]``: this rank's tokens (``m <= max_tokens / W``, the same ``m`` on every
rank); ``topk_ids [m, k]`` (int32 or int64) and ``topk_weights [m, k]``: their routing;
``w_gate_up [E, H, 2 * inter]``: this rank's shard of the expert weights, gate columns
``[0, inter)`` then up columns ``[inter, 2 * inter)`` (``activation=None``: ``[E, H, inter]``
and no activation). Returns ``h [routing.rows, inter]``: one row per (token, slot) in
expert-sorted order (``routing.entry_ids`` says which (token, slot) each row is; rows past
``routing.offsets[E]`` hold nothing), and the :class:`MoeRouting` that
:class:`~interlace.MoERS` takes.

Strategies:

* ``fused``: the ranks' routing (ids and weights, packed) and then their token shards
  reach every peer by the copy engine, peer by peer in rank-rotated order, each copy
  raising the peer's arrival flag from the stream. The routing build waits only for the
  routing, build the tile table on the device, and the persistent grouped GEMM runs tiles
  in arrival order, each waiting for the shards its rows read and gathering those rows
  itself (this rank's tokens read in place): no permuted copy of the tokens exists.
* ``none``: NCCL all-gather, torch sort, index, ``torch._grouped_mm``, SwiGLU.
* ``auto``: ``fused``.

Eager calls alternate two buffer sets (no barrier); a call captured in a CUDA graph uses
a third, behind a device barrier, and can be replayed with new tokens and routing. With
``eager_graphs`` (the default where the driver allows) an eager ``fused`` call is replayed
from a CUDA graph the context captured on the second call of its kind
(``OpContext._enqueue``): one launch from the host instead of the packing, the copies and
their flags, the routing build and the GEMM.
"""

from __future__ import annotations

import torch

from ...errors import InterlaceTypeError, InterlaceValueError
from ...runtime import fork, join, symm_empty
from .. import _trace
from .._context import BUFFER_SETS, GRAPH_SET, AlternatingSets, OpContext
from . import _checks
from ._gemm import MoeGemmConfig, config_for, launch_gemm, programs
from .baseline import ag_moe_none
from .routing import (
    BARRIER_SLOTS,
    MoeRouting,
    _no_err,
    alloc_routing,
    launch_routing,
    pack_meta,
)

ACTIVATIONS = ("swiglu", None)
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _MoeContext(AlternatingSets, OpContext):
    """What both halves share: capacity, strategy and the host checks."""

    STRATEGIES = ("auto", "fused", "none")

    def __init__(
        self, group, max_tokens, hidden, inter, experts, topk, dtype, strategy, config,
        validate, max_spins, regions, eager_graphs,
    ):  # fmt: skip
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"{self.op_name}: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        if dtype not in (torch.bfloat16, torch.float16):
            raise InterlaceTypeError(
                f"{self.op_name}: dtype must be bfloat16 or float16, got {dtype}"
            )
        for name, v in (("max_tokens", max_tokens), ("hidden", hidden), ("inter", inter),
                        ("experts", experts), ("topk", topk)):  # fmt: skip
            if int(v) <= 0:
                raise InterlaceValueError(f"{self.op_name}: {name} must be positive, got {v}")
        if int(topk) > int(experts):
            raise InterlaceValueError(
                f"{self.op_name}: topk = {topk} exceeds the number of experts {experts}"
            )
        w = group.world_size
        if int(max_tokens) % w:
            raise InterlaceValueError(
                f"{self.op_name}: max_tokens = {max_tokens} (gathered tokens) must be a "
                f"multiple of the world size {w}"
            )
        super().__init__(group, dtype, int(max_tokens) * int(hidden), regions, max_spins)
        self.max_tokens, self.hidden, self.inter = int(max_tokens), int(hidden), int(inter)
        self.experts, self.topk = int(experts), int(topk)
        self.max_m = self.max_tokens // w
        self.strategy, self.validate = strategy, bool(validate)
        self.config = config or config_for(self._mode, group.backend)
        self.last_strategy: str | None = None
        self._init_eager_graphs(eager_graphs)

    _mode = "gather"

    def _resolve(self) -> str:
        return "fused" if self.strategy == "auto" else self.strategy

    def _none_capturable(self) -> bool:
        """``none`` may run now: not in a CUDA-graph capture, or on an NCCL group (a graph
        captures NCCL's collectives, not gloo's: ranks that share a GPU)."""
        return not self._capturing() or self.group.nccl

    def _check_capturable(self, strategy: str) -> None:
        if strategy == "none" and not self._none_capturable():
            raise InterlaceValueError(
                f"{self.op_name}: strategy 'none' runs the process group's collectives, "
                "which a CUDA graph captures only on an NCCL group; capture 'fused' (or "
                "'auto') on this group"
            )

    def _set_base(self, s: int) -> int:
        return self.pad.offset("moe") + s * self._set_size

    def _u32(self, peer: int) -> torch.Tensor:
        return self.pad.buffer.peers[peer].view(torch.uint32)


class AGMoE(_MoeContext):
    """All-gather + routing + grouped GEMM (+ SwiGLU); see the module docstring.
    ``inter``: this rank's intermediate columns (the TP shard of I)."""

    op_name = "ag_moe"

    def __init__(
        self, group, max_tokens: int, hidden: int, inter: int, experts: int, topk: int,
        dtype: torch.dtype = torch.bfloat16, activation: str | None = "swiglu",
        strategy: str = "auto", config: MoeGemmConfig | None = None, validate: bool = True,
        max_spins=None, eager_graphs: bool | None = None,
    ):  # fmt: skip
        if activation not in ACTIVATIONS:
            raise InterlaceValueError(
                f"ag_moe: activation must be one of {ACTIVATIONS}, got {activation!r}"
            )
        w = group.world_size
        # per buffer set: meta flags, token flags (one per arrival position), "done", the
        # routing build's grid barrier
        self._set_size = 2 * w + 1 + BARRIER_SLOTS
        super().__init__(
            group, max_tokens, hidden, inter, experts, topk, dtype, strategy, config,
            validate, max_spins, {"moe": BUFFER_SETS * self._set_size}, eager_graphs,
        )  # fmt: skip
        self.activation = activation
        self.w_cols = 2 * self.inter if activation == "swiglu" else self.inter
        self._meta_stride = 2 * self.max_m * self.topk
        if strategy != "none":
            self.gathered = self._track(
                symm_empty((BUFFER_SETS, self.max_tokens, self.hidden), dtype, group)
            )
            self.meta = self._track(
                symm_empty((BUFFER_SETS, w, self._meta_stride), torch.int32, group)
            )

    # ------------------------------------------------------------------ checks
    def _check(self, x, ids, weights, w) -> None:
        op, dev = self.op_name, self.group.device
        err = (
            _checks.tensor_error(op, "x_shard", x, dtype=self.dtype, dims=2, device=dev)
            or _checks.tensor_error(op, "topk_ids", ids, dtypes=ID_DTYPES, dims=2, device=dev)
            or _checks.tensor_error(
                op, "topk_weights", weights, dtypes=WEIGHT_DTYPES, dims=2, device=dev
            )
            or _checks.tensor_error(op, "w", w, dtype=self.dtype, dims=3, device=dev)
        )
        fields = (-1, -1)
        if err is None:
            m = x.shape[0]
            fields = (m, ids.shape[1])
            err = (
                _checks.shape_error(op, "x_shard", x, (None, self.hidden))
                or _checks.shape_error(op, "topk_ids", ids, (m, self.topk))
                or _checks.shape_error(op, "topk_weights", weights, (m, self.topk))
                or _checks.shape_error(op, "w", w, (self.experts, self.hidden, self.w_cols))
            )
            if err is None and not 1 <= m <= self.max_m:
                err = _checks.ArgError(
                    InterlaceValueError,
                    f"{op}: x_shard has {m} rows; this context takes 1 to {self.max_m} "
                    f"(max_tokens / world = {self.max_tokens} / {self.world_size})",
                )
            exchange = self.validate and not self._capturing()
            if err is None and exchange:
                err = _checks.ids_error(op, ids, self.experts)
        else:
            exchange = self.validate and not self._capturing()
        _checks.agree(self, err, fields, exchange)

    # ------------------------------------------------------------------ call
    def __call__(self, x_shard, topk_ids, topk_weights, w) -> tuple[torch.Tensor, MoeRouting]:
        self._begin()
        self._check(x_shard, topk_ids, topk_weights, w)
        strategy = self._resolve()
        self._check_capturable(strategy)
        self._begin_call(graphed=strategy != "none", m=x_shard.shape[0], strategy=strategy)
        if strategy == "none":
            h, routing = ag_moe_none(
                self.group, x_shard, topk_ids, topk_weights, w, self.experts, self.activation
            )
        else:
            h, routing = self._fused(x_shard, topk_ids, topk_weights, w)
        self.last_strategy = strategy
        self._end()
        return h, routing

    def _fused(self, x, ids, weights, w):
        wsz, r, dev = self.world_size, self.rank, self.group.device
        m, k = x.shape[0], self.topk
        mk = m * k
        cfg = self.config
        # the call's own tensors, allocated here (a graph-replayed call re-points them)
        work = alloc_routing(m, k, self.experts, wsz, cfg.block_m, dev)
        h = torch.empty(work.routing.rows, self.inter, dtype=self.dtype, device=dev)

        def run():
            s = self._buffer_set()
            if s == GRAPH_SET:
                self._barrier()  # every rank's previous replay is done with this set
            base = self._set_base(s)
            meta_flags, tok_flags, done = base, base + wsz, base + 2 * wsz
            meta = self.meta.local[s]
            pack_meta(meta[r], ids, weights)
            stream = fork(self.group)
            # producers: every peer's routing first (small: the tables need all of it),
            # then the token shards; peer (r - i) gets this rank's data as its arrival
            # position i
            x_flat = x.reshape(-1)
            for i in range(1, wsz):
                peer = (r - i) % wsz
                dst = self.meta.peers[peer][s, r, : 2 * mk]
                _trace.copy_and_signal(
                    dst, meta[r, : 2 * mk], self._u32(peer), meta_flags + i, stream=stream,
                    what="routing",
                )  # fmt: skip
            for i in range(1, wsz):
                peer = (r - i) % wsz
                dst = self.gathered.peers[peer][s].view(-1)[
                    r * m * self.hidden : (r + 1) * m * self.hidden
                ]
                _trace.copy_and_signal(
                    dst, x_flat, self._u32(peer), tok_flags + i, stream=stream, what="tokens"
                )
            sig, err = self.pad.buffer.local, self.error.address
            routing = launch_routing(
                work, meta, self._meta_stride, rank=r, sig=sig, flag0=meta_flags, err=err,
                max_spins=self.max_spins, wait=wsz > 1, bar_slot=done + 1,
            )  # fmt: skip
            grid = programs(routing, self.inter, cfg, dev, self.group.backend)
            launch_gemm(
                a=self.gathered.local[s], x_own=x, w=w, out=h, routing=routing, n=self.inter,
                up=self.inter, cfg=cfg, grid=grid, gather=True,
                swiglu=self.activation == "swiglu", reduce=False, sig=sig, flag0=tok_flags,
                err=err or _no_err(x), rank=r, max_spins=self.max_spins, done_slot=done,
                clear=(base, self._set_size), wait=wsz > 1, world=wsz,
            )  # fmt: skip
            join(self.group, stream)

        # what besides the operands' shapes a replayed call must share with the captured
        # one: the packing's kernels depend on the routing's dtypes and layouts
        kind = ("fused", ids.dtype, weights.dtype, ids.stride(), weights.stride())
        self._enqueue(kind, run, x, ids, weights, w, h, work.routing.storage)
        return h, work.routing


__all__ = ["AGMoE"]
