"""Context-parallel (sequence-parallel) attention block: every rank holds the whole q / k /
v / o projections and its share of the sequence; attention over the whole sequence runs
through :class:`~interlace.ops.attention.SPAttention` (K/V shards passed peer to peer,
hidden behind the attention kernel).

Token layout (what ``hidden_states`` of one rank holds; :func:`shard_sequence` /
:func:`unshard_sequence` convert a whole batch):

* non-causal: rank ``r`` holds positions ``[r * s, (r + 1) * s)``, ``s = S / W``;
* causal: the zigzag layout: the sequence cut into ``2W`` chunks of ``s / 2``, rank ``r``
  holds chunks ``r`` and ``2W - 1 - r`` (in that order), so that every rank does the same
  causal work. ``S`` must split into ``2W`` equal chunks.

Eager calls run the block's own ``SPAttention`` context; while ``torch.compile`` traces,
the block calls the custom op ``torch.ops.interlace.sp_attention``
(:mod:`interlace.ops.attention.library`), so a ``fullgraph=True`` trace holds attention
forward and backward whole. The compiled route's context lives in
:mod:`interlace.ops.library`'s cache (shared by every block of one group, shape and
strategy), freed by ``interlace.ops.library.clear_cache(group)``, not by :meth:`close`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InterlaceTypeError, InterlaceValueError
from ..ops import library as _library
from ..ops._context import KeptContext
from ..ops.attention.layout import positions, zigzag_shard, zigzag_unshard
from ..ops.attention.library import attention as _traced_attention
from ..ops.attention.sp_attention import DTYPES, HEAD_DIMS, SPAttention
from ..runtime import Group
from .attention import apply_rotary
from .linear import _check_group, gather_from_sequence, scatter_to_sequence
from .linear import sync_sequence_parallel_grads as _sync_grads


# ---------------------------------------------------------------------------- layout
def _chunks_per_sequence(world: int, causal: bool) -> int:
    return 2 * world if causal else world


def shard_sequence(x: torch.Tensor, group: Group, causal: bool, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole sequence ``x`` (the same on every rank) along ``dim``,
    in :class:`ContextParallelAttention`'s layout (zigzag when ``causal``). Differentiable:
    the gradient of ``x`` is every rank's gradient gathered back into sequence order (as
    :func:`~interlace.nn.scatter_to_sequence`'s). Also cuts rotary ``cos`` / ``sin``
    ``[1, S, d]`` to this rank's positions."""
    _check_group("shard_sequence", group)
    w = group.world_size
    n = _chunks_per_sequence(w, causal)
    if x.shape[dim] % n:
        layout = f"{n} chunks (2W, zigzag: causal)" if causal else f"{n} ranks"
        raise InterlaceValueError(
            f"shard_sequence: a sequence of {x.shape[dim]} along dim {dim} does not split "
            f"into {layout} of equal length"
        )
    if causal and w > 1:  # every rank's zigzag tokens contiguous, in rank order
        x = torch.cat([zigzag_shard(x, w, r, dim) for r in range(w)], dim=dim)
    return scatter_to_sequence(x, group, dim=dim)


def unshard_sequence(parts_or_local, group: Group, causal: bool, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's tokens (the layout of :func:`shard_sequence`).
    ``parts_or_local``: a list of every rank's tensor in rank order (put back in sequence
    order, no communication), or this rank's tensor (bfloat16, float16 or float32;
    all-gathered, collective: every rank calls; the gradient of the result, the same on
    every rank, is cut back to this rank's tokens)."""
    _check_group("unshard_sequence", group)
    w = group.world_size
    if isinstance(parts_or_local, (list, tuple)):
        parts = list(parts_or_local)
        if len(parts) != w:
            raise InterlaceValueError(
                f"unshard_sequence: {len(parts)} parts given, the group has {w} ranks"
            )
    else:
        full = gather_from_sequence(parts_or_local, group, dim=dim)
        parts = list(full.chunk(w, dim=dim)) if w > 1 else [full]
    if causal:
        if any(p.shape[dim] % 2 for p in parts):
            raise InterlaceValueError(
                "unshard_sequence: causal (zigzag) parts hold two equal chunks each; got "
                f"lengths {[p.shape[dim] for p in parts]} along dim {dim}"
            )
        return zigzag_unshard(parts, dim=dim)
    return torch.cat(parts, dim=dim)


def sequence_positions(group: Group, s_local: int, causal: bool, device=None) -> torch.Tensor:
    """Global positions (int64 ``[s_local]``) of this rank's tokens in the layout of
    :func:`shard_sequence`: the ``position_ids`` to feed a rotary module."""
    _check_group("sequence_positions", group)
    if causal and s_local % 2:
        raise InterlaceValueError(
            f"sequence_positions: causal (zigzag) shards hold two equal chunks; s_local = "
            f"{s_local} is odd"
        )
    return positions(group.rank, group.world_size, int(s_local), bool(causal), device)


# ---------------------------------------------------------------------------- block
class ContextParallelAttention(nn.Module):
    """Multi-head (grouped-query) attention with the sequence split over ``group``
    (context parallelism, for sequences too long for one device's activations).

    Every rank holds the whole projections ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
    (plain ``nn.Linear``, the same on every rank) and runs them on its own tokens;
    attention of its queries over the whole sequence runs through
    :class:`~interlace.ops.attention.SPAttention` (``strategy``: ``auto`` = ``fused``,
    the overlapped kernel; ``none``: all-gather + SDPA; ``ring``).

    ``forward(hidden_states, position_embeddings=None, cu_seqlens=None)``:
    ``hidden_states [B, s, H]`` is this rank's ``s = S / W`` tokens of every sequence, in
    the layout of :func:`shard_sequence` (``causal``: zigzag, rank ``r`` holds chunks
    ``r`` and ``2W - 1 - r`` of ``2W``, so ``s`` must be even); the result, ``(output
    [B, s, H], None)`` as transformers' attention modules return, is in the same layout.
    ``position_embeddings``: rotary ``(cos, sin)`` ``[B or 1, s, head_dim]`` of this
    rank's own positions (``shard_sequence(cos, group, causal)`` of the whole sequence's,
    or a rotary module applied to :func:`sequence_positions`), applied as
    :func:`~interlace.nn.attention.apply_rotary`. ``cu_seqlens``: packed documents, as
    ``SPAttention`` takes them. Every rank calls with the same shapes. No KV cache and no
    attention mask besides ``causal`` / ``cu_seqlens``; no attention dropout.

    Weight gradients: each rank's come from its own tokens, so every parameter carries a
    hook (:func:`~interlace.nn.sync_sequence_parallel_grads`) that all-reduces its
    gradient over ``group`` before it is accumulated: after ``backward`` every rank holds
    the whole gradient, the same everywhere. ``sync_grads=False`` leaves them per rank
    (to sum them yourself, e.g. with a data-parallel reduction over the same ranks).

    bfloat16 / float16 weights, ``head_dim`` 64 or 128 (the kernels'). The block builds
    its ``SPAttention`` context on its first call, sized to the next power of two of
    ``B * s``, and rebuilds it when a call has more tokens, when the weights' dtype
    changed, and after a failed call; :meth:`close` frees it (collective).

    ``interlace.nn.parallelize`` does not use this block: it puts the head-parallel
    :class:`~interlace.nn.ParallelAttention` in a model."""

    STRATEGIES = ("auto", "fused", "none", "ring")

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 group: Group, *, causal: bool = True, qkv_bias: bool = False,
                 o_bias: bool = False, strategy: str = "auto", scaling: float | None = None,
                 sync_grads: bool = True, dtype=torch.bfloat16, device=None):  # fmt: skip
        super().__init__()
        name = type(self).__name__
        self.group = _check_group(name, group)
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"{name}: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise InterlaceValueError(
                f"{name}: num_heads = {num_heads} must be a positive multiple of "
                f"num_kv_heads = {num_kv_heads} (grouped-query attention)"
            )
        if int(head_dim) not in HEAD_DIMS:
            raise InterlaceValueError(
                f"{name}: head_dim must be one of {HEAD_DIMS} (the attention kernels'), "
                f"got {head_dim}"
            )
        self._check_dtype(dtype)
        self.hidden_size, self.head_dim = int(hidden_size), int(head_dim)
        self.num_heads, self.num_kv_heads = int(num_heads), int(num_kv_heads)
        self.causal, self.strategy = bool(causal), strategy
        self.scaling = self.head_dim**-0.5 if scaling is None else float(scaling)
        kw = dict(dtype=dtype, device=group.device if device is None else device)
        h, d = self.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias, **kw)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias, **kw)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias, **kw)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias, **kw)
        self._ctx = KeptContext(self._build_context)  # the SPAttention context
        self.handle = _library.register_group(group)  # names the group in the custom op
        if sync_grads:
            _sync_grads(self.parameters(), group)

    @classmethod
    def _check_dtype(cls, dtype) -> None:
        if dtype not in DTYPES:
            raise InterlaceTypeError(
                f"{cls.__name__}: weights must be one of {DTYPES} (the attention kernels' "
                f"dtypes), got {dtype}"
            )

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear,
                     head_dim: int, group: Group, **kw):  # fmt: skip
        """From a model's ``q``, ``k``, ``v`` and ``o`` projections (their weights copied,
        in ``q``'s dtype unless ``dtype`` is given); every rank passes the same ones."""
        kw.setdefault("dtype", q.weight.dtype)
        if q.out_features % head_dim or k.out_features % head_dim:
            raise InterlaceValueError(
                f"{cls.__name__}.from_linears: q ({q.out_features}) and k ({k.out_features}) "
                f"output features must be multiples of head_dim = {head_dim}"
            )
        attn = cls(q.in_features, q.out_features // head_dim, k.out_features // head_dim,
                   head_dim, group, qkv_bias=q.bias is not None, o_bias=o.bias is not None,
                   **kw)  # fmt: skip
        with torch.no_grad():
            for mine, theirs in zip(
                (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj), (q, k, v, o)
            ):
                if mine.weight.shape != theirs.weight.shape:
                    raise InterlaceValueError(
                        f"{cls.__name__}.from_linears: a weight of shape "
                        f"{tuple(theirs.weight.shape)} where {tuple(mine.weight.shape)} is "
                        "expected"
                    )
                mine.weight.copy_(theirs.weight)
                if theirs.bias is not None:
                    mine.bias.copy_(theirs.bias)
        return attn

    @classmethod
    def from_module(cls, attn: nn.Module, group: Group, **kw):
        """From a transformers-style attention module (``q_proj``, ``k_proj``, ``v_proj``,
        ``o_proj``, ``head_dim``, ``scaling``; no attention dropout)."""
        head_dim = getattr(attn, "head_dim", None)
        if head_dim is None:
            raise InterlaceValueError(f"{cls.__name__}.from_module: the module has no head_dim")
        if float(getattr(attn, "attention_dropout", 0.0) or 0.0) > 0:
            raise InterlaceValueError(
                f"{cls.__name__}.from_module: attention dropout is not supported"
            )
        kw.setdefault("scaling", getattr(attn, "scaling", None))
        return cls.from_linears(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, head_dim,
                                group, **kw)  # fmt: skip

    # ------------------------------------------------------------------ context
    def close(self) -> None:
        """Free the ``SPAttention`` context (collective: call on every rank). Idempotent;
        a later call builds a new one."""
        self._ctx.close()

    def _build_context(self, cap: int, dtype: torch.dtype) -> SPAttention:
        """The context for up to ``cap`` tokens (``B * s``) per rank; kept and rebuilt as
        :class:`KeptContext` says (every rank calls with the same shapes)."""
        strategy = "fused" if self.strategy == "auto" else self.strategy
        # The per-call shape agreement check is a cross-rank all-reduce (a host
        # synchronisation on NCCL); the layer's inputs have one shape on every rank by
        # contract, so it runs only in the CPU emulation; the call fingerprints still
        # catch a mismatch at the kernels' waits.
        validate = not self.group.nccl
        return SPAttention(
            self.group, self.num_heads, self.num_kv_heads, self.head_dim, max_tokens=cap,
            dtype=dtype, strategy=strategy, validate=validate,
        )  # fmt: skip

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                cu_seqlens=None, **kwargs):  # fmt: skip
        name = type(self).__name__
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None:
            raise InterlaceValueError(
                f"{name} runs prefill and training only: no KV cache (pass use_cache=False)"
            )
        if attention_mask is not None:
            raise InterlaceValueError(
                f"{name}: no attention_mask; masking is causal={self.causal} (set at "
                "construction) and packed documents come as cu_seqlens"
            )
        x = hidden_states
        dtype = self.q_proj.weight.dtype
        self._check_dtype(dtype)
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise InterlaceValueError(
                f"{name}: hidden_states must be [batch, S / W, {self.hidden_size}], got "
                f"shape {tuple(x.shape)}"
            )
        if x.dtype != dtype:
            raise InterlaceTypeError(f"{name}: hidden_states are {x.dtype}, the weights {dtype}")
        b, s, _ = x.shape
        if self.causal and s % 2:
            raise InterlaceValueError(
                f"{name}: causal attention uses the zigzag layout (each rank holds two equal "
                f"chunks of the sequence): this rank's length S / W = {s} must be even"
            )
        d, hq, hk = self.head_dim, self.num_heads, self.num_kv_heads
        q = self.q_proj(x).view(b, s, hq, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, hk, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, hk, d).transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            if cos.shape[-2:] != (s, d) or sin.shape != cos.shape:
                raise InterlaceValueError(
                    f"{name}: position_embeddings (cos, sin) must be [B or 1, {s}, {d}] for "
                    f"this rank's {s} positions (shard_sequence of the whole sequence's), "
                    f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
                )
            q, k = apply_rotary(q, k, cos.to(q.dtype), sin.to(q.dtype))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if torch.compiler.is_compiling():  # the graph holds the custom op (module docstring)
            strategy = "fused" if self.strategy == "auto" else self.strategy
            out = _traced_attention(q, k, v, self.handle, strategy, self.causal, self.scaling,
                                    cu_seqlens)  # fmt: skip
        else:
            ctx = self._ctx.get(b * s, dtype)
            out = ctx(q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, sm_scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, hq * d)), None

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}, strategy={self.strategy!r}, "
            f"world_size={self.group.world_size}"
        )


__all__ = [
    "ContextParallelAttention",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
