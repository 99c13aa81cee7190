"""Tensor-parallel attention block: QKV column-parallel (one fused AG+GEMM), attention on
this rank's heads over the whole sequence (torch SDPA), the output projection
row-parallel (GEMM+RS back to this rank's share of the sequence, or GEMM+AR)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InterlaceValueError
from ..runtime import Group
from .linear import ColumnParallelLinear, RowParallelLinear


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q, k, cos, sin):
    """Rotary position embedding in the rotate-half convention of Llama / Qwen2 / Mixtral:
    ``q``, ``k`` ``[B, heads, S, d]``; ``cos``, ``sin`` ``[B or 1, S, d]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class ParallelAttention(nn.Module):
    """Multi-head (grouped-query) attention over ``group``: each rank runs
    ``num_heads / W`` query heads and ``num_kv_heads / W`` key/value heads.

    Sequence parallel (the default): ``hidden_states`` is this rank's share of every
    sequence, ``[B, s, H]`` with ``s = ceil(S / W)`` (the sequence zero-padded to ``W * s``,
    rank ``r`` holding positions ``[r * s, (r + 1) * s)``), and so is the result. The QKV
    AG+GEMM gathers the whole sequence; padding positions are dropped before attention and
    restored (as zeros) before the output GEMM+RS. Without it: ``[B, S, H]`` on every rank.

    ``forward`` takes the transformers attention arguments (``position_embeddings`` =
    ``(cos, sin)`` of the whole sequence, ``attention_mask``: None for causal, or a mask
    SDPA accepts) and returns ``(output, None)``. No KV cache (prefill and training)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 group: Group, *, qkv_bias: bool = False, o_bias: bool = False,
                 strategy: str = "auto", o_strategy: str | None = None,
                 sequence_parallel: bool = True, scaling: float | None = None,
                 dropout: float = 0.0, dtype=None, device=None):  # fmt: skip
        super().__init__()
        w = group.world_size
        if num_heads % w or num_kv_heads % w or num_heads % num_kv_heads:
            raise InterlaceValueError(
                f"ParallelAttention: {num_heads} query and {num_kv_heads} key/value heads "
                f"must each split evenly over {w} ranks (and query heads over kv heads)"
            )
        self.group, self.head_dim = group, int(head_dim)
        self.num_heads, self.num_kv_heads = int(num_heads), int(num_kv_heads)
        self.local_heads, self.local_kv_heads = self.num_heads // w, self.num_kv_heads // w
        self.scaling = head_dim**-0.5 if scaling is None else float(scaling)
        self.dropout, self.sequence_parallel = float(dropout), bool(sequence_parallel)
        d = self.head_dim
        parts = [num_heads * d, num_kv_heads * d, num_kv_heads * d]
        self.qkv = ColumnParallelLinear(
            hidden_size, sum(parts), group, qkv_bias, strategy=strategy, parts=parts,
            sequence_parallel=sequence_parallel, dtype=dtype, device=device,
        )  # fmt: skip
        self.o = RowParallelLinear(
            num_heads * d, hidden_size, group, o_bias, strategy=o_strategy or strategy,
            sequence_parallel=sequence_parallel, dtype=dtype, device=device,
        )  # fmt: skip

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear,
                     head_dim: int, group: Group, **kw):  # fmt: skip
        """From the full ``q``, ``k``, ``v`` and ``o`` projections (sharded here)."""
        kw.setdefault("dtype", q.weight.dtype)
        attn = cls(q.in_features, q.out_features // head_dim, k.out_features // head_dim,
                   head_dim, group, qkv_bias=q.bias is not None, o_bias=o.bias is not None,
                   **kw)  # fmt: skip
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.shard(torch.cat([q.weight, k.weight, v.weight])))
            attn.o.weight.copy_(attn.o.shard(o.weight))
            if q.bias is not None:
                attn.qkv.bias.copy_(attn.qkv.shard(torch.cat([q.bias, k.bias, v.bias])))
            if o.bias is not None:
                attn.o.bias.copy_(o.bias)
        return attn

    @classmethod
    def from_module(cls, attn: nn.Module, group: Group, **kw):
        """From a transformers-style attention module (``q_proj``, ``k_proj``, ``v_proj``,
        ``o_proj``, ``head_dim``, ``scaling``)."""
        head_dim = getattr(attn, "head_dim", None)
        if head_dim is None:
            raise InterlaceValueError("ParallelAttention.from_module: the module has no head_dim")
        kw.setdefault("scaling", getattr(attn, "scaling", None))
        kw.setdefault("dropout", float(getattr(attn, "attention_dropout", 0.0) or 0.0))
        return cls.from_linears(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, head_dim,
                                group, **kw)  # fmt: skip

    def _attend(self, q, k, v, position_embeddings, attention_mask):
        """``q [B, S, local q features]``, ``k`` and ``v`` ``[B, S, local kv features]`` ->
        ``[B, S, local q features]``."""
        b, s, _ = q.shape
        d, hq, hk = self.head_dim, self.local_heads, self.local_kv_heads
        q = q.reshape(b, s, hq, d).transpose(1, 2)
        k = k.reshape(b, s, hk, d).transpose(1, 2)
        v = v.reshape(b, s, hk, d).transpose(1, 2)
        if position_embeddings is not None:
            q, k = apply_rotary(q, k, *position_embeddings)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None and s > 1,
            scale=self.scaling, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=hq != hk,
        )  # fmt: skip
        return out.transpose(1, 2).reshape(b, s, hq * d)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            raise InterlaceValueError(
                "ParallelAttention runs prefill and training only: no KV cache (pass "
                "use_cache=False)"
            )
        w = self.group.world_size
        if not self.sequence_parallel or w == 1:  # (one rank: the plain block's ops)
            q, k, v = self.qkv.forward_parts(hidden_states)
            out = self._attend(q, k, v, position_embeddings, attention_mask)
            return self.o(out), None
        b, s, h = hidden_states.shape
        qkv = self.qkv(hidden_states.reshape(b * s, h))  # [W * b * s, n], rank-major
        n = qkv.shape[-1]
        full = w * s
        length = full if position_embeddings is None else position_embeddings[0].shape[-2]
        if b == 1:
            qkv = qkv.view(1, full, n)
        else:
            qkv = qkv.view(w, b, s, n).transpose(0, 1).reshape(b, full, n)
        d = self.head_dim
        q, k, v = qkv[:, :length].split(
            [self.local_heads * d, self.local_kv_heads * d, self.local_kv_heads * d], dim=-1
        )
        out = self._attend(q, k, v, position_embeddings, attention_mask)
        if length < full:
            out = F.pad(out, (0, 0, 0, full - length))
        m = out.shape[-1]
        if b == 1:
            out = out.view(full, m)
        else:
            out = out.view(b, w, s, m).transpose(0, 1).reshape(w * b * s, m)
        return self.o(out).view(b, s, -1), None


__all__ = ["ParallelAttention", "apply_rotary", "rotate_half"]
