"""Distributed flash-decode: attention of one query token per sequence over a KV cache
split along the sequence over the ranks of a group.

Every rank holds the same query ``q [B, HQ, D]`` and its own shard of the cache, ``k, v
[B, HKV, L_r, D]`` (``L_r`` may differ from rank to rank; optional ``kv_lens [B]`` give
each sequence's valid length in the shard). Per call, on the caller's stream:

1. ``split_decode_kernel``: split-KV attention on the local shard (grouped-query: one
   program reads a K/V block once for the ``HQ / HKV`` query heads that share it), the
   splits combined by log-sum-exp on the device, and the rank's partial ``(o, lse)``
   stored straight into the symmetric buffers of the ranks that merge (all ranks, or one
   ``owner``), then their arrival flags raised to this call's epoch.
2. ``merge_kernel`` (on every merging rank): waits per source rank for its flag, merges
   the ``W`` partials by log-sum-exp into ``out [B, HQ, D]``.

Two launches, no copies, no host synchronisation and no per-call flag resets (epoch
flags, see :mod:`interlace.kernels.decode`), so a decode step captures into a CUDA graph
as it is, and graph replays and eager calls can be mixed on one context. Inside
``interlace.trace.record`` both launches are traced (``TRACE`` on; not while captured).

Strategies (``strategy=``): ``"fused"`` is the path above (``"auto"`` resolves to it);
``"none"`` is the baseline written with torch alone, one step after another:

1. the rank's partial ``(o, lse)`` over its shard (natural-log log-sum-exp): on a GPU
   without ``kv_lens``, torch's flash-attention kernel with the ``HQ / HKV`` query heads
   of a KV head taken as that many query rows (no K/V copy for grouped-query heads);
   otherwise scores, log-sum-exp and weighted values in float32 with torch ops;
2. ``(o, lse)`` of every rank gathered with the process group: ``all_gather_into_tensor``
   (``gather`` to ``owner`` in the one-owner mode) over NCCL; ``all_gather`` / ``gather``
   of host tensors where the group is gloo (the ``cpu`` backend, or ranks sharing one GPU);
3. the ``W`` partials merged by log-sum-exp in float32 with torch ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from ...errors import InterlaceTypeError, InterlaceValueError
from ...kernels.decode import merge_kernel, split_decode_kernel
from ...runtime import symm_zeros
from .. import _trace
from .._context import OpContext, cdiv, sm_count
from .._launch import PreparedLaunch, install_scratch_allocator

LOG2E = 1.4426950408889634
STRATEGIES = ("auto", "fused", "none")
#: Most splits of one sequence's shard: bounds the local scratch.
MAX_SPLITS = 128
#: the kernels' names in traces (``interlace.trace``)
SPLIT_DECODE = "split_decode"
DECODE_MERGE = "decode_merge"


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices of the split-KV decode kernel.

    ``block_n``: KV rows per loop step; ``num_warps`` / ``num_stages``: Triton's;
    ``programs_per_sm``: the split count aims at this many programs per SM over all
    ``(sequence, kv head)`` groups; ``min_split``: fewest KV rows a split may have (fewer
    splits for short shards, whose split combine would cost more than it spreads).

    ``programs_per_sm`` 2: on one H200 (graph replays, records ``flash_decode_variant``
    of benchmarks/results/2026-11-28-h200-w1.json) it ran batch 1 with 32k / 131k / 262k
    rows per shard at 0.92 / 1.03 / 1.02 x torch SDPA's decode bandwidth against 0.75 /
    0.90 / 0.86 with 4 (whose splits were too short to pipeline), batch 8 with 16k at 0.90
    against 0.87, batch 64 with 8k at 1.38 against 1.52; the other configurations timed
    there (block 32 or 128, 4 stages, 8 programs per SM) won no shape by as much. On one
    H100 the 4-per-SM defaults ran at 1.03-1.70 x
    (benchmarks/results/2026-11-25-h100-80gb-hbm3-w1.json).

    ``min_split`` 512: batch 1 with 8k rows per shard (16 splits instead of 32) ran at
    0.86-0.92 x SDPA against 0.83 with 256 (one H200, two runs:
    benchmarks/results/history/2026-11-28-h200-w1-decode-min-split-256.log and
    ``-512.log``); longer shards split alike either way."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2
    min_split: int = 512


#: The CPU emulation runs programs one after another: few, small ones, but several splits
#: so the split combine is exercised.
CPU_CONFIG = DecodeConfig(block_n=16, num_warps=1, num_stages=1, programs_per_sm=4, min_split=16)


@dataclass
class DecodePlan:
    """The launches of one call shape (batch, shard length, strides)."""

    n_splits: int
    split_len: int
    decode: PreparedLaunch
    merge: PreparedLaunch | None


class FlashDecode(OpContext):
    """``softmax(q k^T * scale) v`` for one query token per sequence, with the KV cache's
    sequence split over the group's ranks; see the module docstring.

    ``ctx(q, k_shard, v_shard, kv_lens=None, out=None)`` returns ``out [B, heads, d]`` on
    every rank (``owner=None``) or on rank ``owner`` only (the others get ``None``). ``q``
    must be the same on every rank and ``B`` must agree across ranks.

    ``strategy``: ``"fused"`` (the Triton kernels; ``"auto"`` resolves to it) or
    ``"none"`` (torch attention per shard, a process-group gather, a torch merge: the
    baseline). ``last_strategy`` names the strategy the last call ran."""

    op_name = "flash_decode"
    STRATEGIES = STRATEGIES

    def __init__(
        self, group, max_batch: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
        dtype=torch.bfloat16, owner: int | None = None, sm_scale: float | None = None,
        config: DecodeConfig | None = None, max_spins=None, strategy: str = "auto",
    ):  # fmt: skip
        name = self.op_name
        if strategy not in STRATEGIES:
            raise InterlaceValueError(
                f"{name}: strategy must be one of {STRATEGIES}, got {strategy!r}"
            )
        max_batch, heads, kv_heads, head_dim = (
            int(x) for x in (max_batch, heads, kv_heads, head_dim)
        )
        if min(max_batch, heads, kv_heads) <= 0:
            raise InterlaceValueError(
                f"{name}: max_batch, heads and kv_heads must be positive, got "
                f"{max_batch}, {heads}, {kv_heads}"
            )
        if heads % kv_heads:
            raise InterlaceValueError(
                f"{name}: heads = {heads} is not a multiple of kv_heads = {kv_heads}"
            )
        if head_dim not in (16, 32, 64, 128, 256):
            raise InterlaceValueError(
                f"{name}: head_dim must be a power of two from 16 to 256, got {head_dim}"
            )
        if dtype not in (torch.bfloat16, torch.float16):
            raise InterlaceTypeError(f"{name}: dtype must be bfloat16 or float16, got {dtype}")
        w = group.world_size
        if owner is not None and not 0 <= int(owner) < w:
            raise InterlaceValueError(f"{name}: owner must be a rank in [0, {w}), got {owner}")
        self.max_batch, self.heads = max_batch, heads
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.owner = None if owner is None else int(owner)
        self.sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.strategy = strategy
        self.last_strategy: str | None = None
        n_groups = max_batch * kv_heads
        regions = {
            "count": n_groups + 2,  # split counters per group, the launch's, the merge's
            "epoch": 1,
            "arrive": w,
            "ack": 1,
        }
        super().__init__(group, dtype, max_batch * heads * head_dim, regions, max_spins)
        cuda = group.backend == "cuda"
        self.config = config or (DecodeConfig() if cuda else CPU_CONFIG)
        self._target = (sm_count(group.device.index) if cuda else 1) * self.config.programs_per_sm
        self._plans: dict[tuple, DecodePlan] = {}
        if self._resolve() == "fused":  # (the baseline needs none of the kernels' buffers)
            rows = max_batch * heads
            self.push_o = self._track(symm_zeros((2, w, rows, head_dim), torch.float32, group))
            self.push_lse = self._track(symm_zeros((2, w, rows), torch.float32, group))
            scratch_rows = max(b * heads * self._max_splits(b) for b in range(1, max_batch + 1))
            dev = group.device
            self.part_o = torch.empty(scratch_rows * head_dim, dtype=torch.float32, device=dev)
            self.part_lse = torch.empty(scratch_rows, dtype=torch.float32, device=dev)
            self._no_lens = torch.zeros(1, dtype=torch.int32, device=dev)

    def _resolve(self) -> str:
        return "fused" if self.strategy == "auto" else self.strategy

    # ------------------------------------------------------------------ planning
    def _max_splits(self, batch: int) -> int:
        return max(1, min(cdiv(self._target, batch * self.kv_heads), MAX_SPLITS))

    def splits(self, batch: int, kv_cap: int) -> tuple[int, int]:
        """``(n_splits, split_len)`` for ``batch`` sequences of ``kv_cap`` cached rows:
        enough programs to fill the GPU, splits of at least ``min_split`` rows, each a
        multiple of ``block_n``."""
        cfg = self.config
        n = min(self._max_splits(batch), max(1, cdiv(kv_cap, cfg.min_split)))
        split_len = cdiv(cdiv(max(kv_cap, 1), n), cfg.block_n) * cfg.block_n
        return max(1, cdiv(kv_cap, split_len)), split_len

    def _plan(self, q, k, v, has_lens, out, scale: float) -> DecodePlan:
        key = (q.shape[0], k.shape[2], q.stride(), k.stride(), v.stride(), out.stride(), has_lens,
               scale)  # fmt: skip
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        batch, kv_cap = q.shape[0], k.shape[2]
        n_splits, split_len = self.splits(batch, kv_cap)
        g = self.heads // self.kv_heads
        pad, cfg = self.pad, self.config
        owner = -1 if self.owner is None else self.owner
        args = (  # (the operands' places are filled by each call)
            None, None, None, None, self.part_o, self.part_lse, self.push_o.local,
            self.push_lse.local, self.push_o.ptrs, self.push_lse.ptrs, pad.ptrs,
            self.error.address, self.rank, self.world_size, owner, self.max_spins,
            pad.offset("count"), pad.offset("epoch"), pad.offset("arrive"), pad.offset("ack"),
            batch * self.kv_heads, kv_cap, split_len, n_splits, self.max_batch * self.heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), scale * LOG2E,
        )  # fmt: skip
        kwargs = dict(
            HKV=self.kv_heads, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=self.head_dim,
            BLOCK_N=cfg.block_n, HAS_LENS=has_lens, ONE_SPLIT=n_splits == 1,
            OWNER_ONLY=self.owner is not None, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        decode = PreparedLaunch(
            split_decode_kernel, batch * self.kv_heads * n_splits, args, kwargs,
            ("q", "k", "v", "lens"),
        )  # fmt: skip
        merge = None
        if self.owner is None or self.owner == self.rank:
            n_rows = batch * self.heads
            block_r = 4 if n_rows <= 1024 else 16
            margs = (
                self.push_o.local, self.push_lse.local, None, pad.ptrs, self.error.address,
                self.rank, self.world_size, self.max_spins, pad.offset("epoch"),
                pad.offset("arrive"), pad.offset("ack"), pad.offset("count") + self.max_batch
                * self.kv_heads + 1, n_rows, self.max_batch * self.heads, out.stride(0),
                out.stride(1),
            )  # fmt: skip
            mkw = dict(
                HQ=self.heads, D=self.head_dim, BLOCK_R=block_r, ACK=self.owner is not None,
                num_warps=4 if block_r == 16 else 2,
            )  # fmt: skip
            merge = PreparedLaunch(merge_kernel, cdiv(n_rows, block_r), margs, mkw, ("out",))
        plan = self._plans[key] = DecodePlan(n_splits, split_len, decode, merge)
        return plan

    # ------------------------------------------------------------------ checks
    def _check_call(self, q, k, v, kv_lens, out):
        name = self.op_name
        for label, t in (("q", q), ("k", k), ("v", v)):
            self._check_placed(label, t)
        if q.dim() != 3 or q.shape[1] != self.heads or q.shape[2] != self.head_dim:
            raise InterlaceValueError(
                f"{name}: q must be [batch, {self.heads}, {self.head_dim}], got {tuple(q.shape)}"
            )
        batch = q.shape[0]
        if not 1 <= batch <= self.max_batch:
            raise InterlaceValueError(
                f"{name}: batch = {batch} is outside [1, max_batch = {self.max_batch}]"
            )
        if q.stride(2) != 1:
            raise InterlaceValueError(f"{name}: q must have unit stride along head_dim")
        for label, t in (("k", k), ("v", v)):
            if (
                t.dim() != 4
                or tuple(t.shape[:2]) != (batch, self.kv_heads)
                or t.shape[3] != self.head_dim
            ):
                raise InterlaceValueError(
                    f"{name}: {label} must be [{batch}, {self.kv_heads}, kv_len, "
                    f"{self.head_dim}], got {tuple(t.shape)}"
                )
            if t.stride(3) != 1:
                raise InterlaceValueError(f"{name}: {label} must have unit stride along head_dim")
        if k.shape != v.shape:
            raise InterlaceValueError(
                f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape"
            )
        if kv_lens is not None:
            if not isinstance(kv_lens, torch.Tensor) or kv_lens.dtype != torch.int32:
                raise InterlaceTypeError(f"{name}: kv_lens must be an int32 tensor")
            if tuple(kv_lens.shape) != (batch,) or kv_lens.device != self.group.device:
                raise InterlaceValueError(
                    f"{name}: kv_lens must be [{batch}] on {self.group.device}, got "
                    f"{tuple(kv_lens.shape)} on {kv_lens.device}"
                )
        if out is not None:
            self._check_placed("out", out)
            if tuple(out.shape) != tuple(q.shape) or out.stride(2) != 1:
                raise InterlaceValueError(
                    f"{name}: out must be {tuple(q.shape)} with unit stride along head_dim, "
                    f"got {tuple(out.shape)}"
                )

    # ------------------------------------------------------------------ call
    def __call__(self, q, k, v, kv_lens=None, out=None, sm_scale: float | None = None):
        """``sm_scale``: this call's softmax scale (default: the context's)."""
        self._begin()
        self._check_call(q, k, v, kv_lens, out)
        strategy = self._resolve()
        # (the shard length and kv_lens differ by rank: not part of the fingerprint)
        self._begin_call(batch=q.shape[0], strategy=strategy)
        merges = self.owner is None or self.owner == self.rank
        if out is None and merges:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        scale = self.sm_scale if sm_scale is None else float(sm_scale)
        if strategy == "none":
            self._none(q, k, v, kv_lens, out, scale)
        else:
            self._fused(q, k, v, kv_lens, out, merges, scale)
        self.last_strategy = strategy
        self._end()
        return out if merges else None

    def _fused(self, q, k, v, kv_lens, out, merges, scale: float) -> None:
        plan = self._plan(q, k, v, kv_lens is not None, out if merges else q, scale)
        lens = self._no_lens if kv_lens is None else kv_lens
        if _trace.ACTIVE and self._traced(plan, q, k, v, lens, out):
            return
        plan.decode(q, k, v, lens)
        if plan.merge is not None:
            plan.merge(out)

    def _traced(self, plan: DecodePlan, q, k, v, lens, out) -> bool:
        """Both launches of ``plan`` with ``TRACE`` on, into buffers of the recorder in force
        (``interlace.trace.record``); False where none is (nothing launched). The decode
        kernel's program ``p`` of ``P`` fills tiles ``p`` (its split), ``p + P`` (the
        combine) and ``p + 2 P`` (the push); the merge's, ``p + i P`` per source rank ``i``
        (``kernels.decode``)."""
        grid, n_groups = plan.decode.grid, q.shape[0] * self.kv_heads
        info = dict(
            kernel=SPLIT_DECODE, layout="tiles", slots="split_decode", rank=self.rank,
            world=self.world_size, owner=self.owner, kv_heads=self.kv_heads,
            group_heads=self.heads // self.kv_heads, head_dim=self.head_dim,
            n_splits=plan.n_splits, split_len=plan.split_len, kv_len=k.shape[2],
            n_tiles=grid + n_groups * (1 if plan.n_splits == 1 else 2),
        )  # fmt: skip
        if not _traced_launch(plan.decode, (q, k, v, lens), 3, info):
            return False
        if plan.merge is not None:
            grid, block_r = plan.merge.grid, plan.merge.kwargs["BLOCK_R"]
            info = dict(
                kernel=DECODE_MERGE, layout="tiles", slots="merge", rank=self.rank,
                world=self.world_size, rows=q.shape[0] * self.heads, block_r=block_r,
                n_tiles=grid * self.world_size,
            )  # fmt: skip
            if not _traced_launch(plan.merge, (out,), self.world_size, info):
                plan.merge(out)
        return True

    # ------------------------------------------------------------------ none
    def _none(self, q, k, v, kv_lens, out, scale: float) -> None:
        """The baseline (see the module docstring): writes ``out`` on the merging ranks."""
        d = self.head_dim
        o, lse = local_partial(q, k, v, kv_lens, scale)
        part = torch.cat([o, lse[..., None]], dim=-1)  # [B, HQ, d + 1] float32
        parts = self._gather_partials(part)  # [W, B, HQ, d + 1]
        if parts is not None:
            out.copy_(merge_partials(parts[..., :d], parts[..., d]))

    def _gather_partials(self, part: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``part``, stacked in rank order, on the merging ranks (None on the
        others): NCCL on the CUDA tensors, else gloo on host copies."""
        group, w = self.group, self.world_size
        pg = group.process_group
        on_host = not group.nccl
        src = part.cpu() if on_host else part
        if self.owner is None:
            if on_host:
                parts = [torch.empty_like(src) for _ in range(w)]
                dist.all_gather(parts, src, group=pg)
                gathered = torch.stack(parts)
            else:
                gathered = torch.empty((w, *src.shape), dtype=src.dtype, device=src.device)
                dist.all_gather_into_tensor(gathered, src, group=pg)
        else:
            mine = self.rank == self.owner
            parts = [torch.empty_like(src) for _ in range(w)] if mine else None
            dist.gather(src, parts, dst=dist.get_global_rank(pg, self.owner), group=pg)
            if not mine:
                return None
            gathered = torch.stack(parts)
        return gathered.to(part.device)


def _traced_launch(prepared: PreparedLaunch, operands, tiles_per_program: int, info) -> bool:
    """``prepared`` on ``operands`` with ``TRACE`` on, its events going into a buffer of
    the recorder in force (``tiles_per_program`` tile slots per program; ``info``: how the
    trace decodes it); False (nothing launched) where no recorder is in force."""
    tbuf = _trace.buffer(prepared.grid, tiles_per_program, dict(info, grid=prepared.grid))
    if tbuf is None:
        return False
    args = list(prepared.args)
    for i, t in zip(prepared._where, operands):
        args[i] = t
    install_scratch_allocator()
    prepared.kernel[(prepared.grid,)](*args, **prepared.kwargs, TRACE=True, tbuf=tbuf)
    return True


def local_partial(q, k, v, kv_lens, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, HQ, d]`` over one shard ``k, v [B, HKV, L, d]`` (the first
    ``kv_lens[b]`` rows of sequence ``b`` where given) as ``(o [B, HQ, d], lse [B, HQ])``
    in float32, ``lse`` the natural-log log-sum-exp of the scaled scores (``-inf`` and
    ``o = 0`` where no row is valid). The ``HQ / HKV`` query heads that share a KV head
    are that head's query rows, so grouped-query heads read K/V once."""
    batch, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = q.reshape(batch, hkv, hq // hkv, d)
    if q.is_cuda and kv_lens is None and n > 0:
        res = torch.ops.aten._scaled_dot_product_flash_attention(qg, k, v, scale=scale)
        return res[0].float().reshape(batch, hq, d), res[1].reshape(batch, hq)
    s = (qg.float() @ k.float().transpose(-1, -2)) * scale  # [B, HKV, G, L]
    if kv_lens is not None:
        valid = torch.arange(n, device=k.device)[None, :] < kv_lens[:, None]  # [B, L]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    o = p @ v.float()
    return o.reshape(batch, hq, d), lse.reshape(batch, hq)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``o [W, ..., d]`` and ``lse [W, ...]`` (float32) merged by log-sum-exp over the
    first dimension (0 where every partial is empty)."""
    total = torch.logsumexp(lse, dim=0)
    weight = torch.exp(lse - torch.where(torch.isfinite(total), total, 0.0))
    return (o * weight[..., None]).sum(dim=0)
