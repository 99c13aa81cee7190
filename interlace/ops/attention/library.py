"""The attention ops as torch custom ops, so that ``torch.compile(fullgraph=True)``
traces a model that calls them without graph breaks:

* ``torch.ops.interlace.sp_attention(q, k, v, group, strategy, causal, sm_scale,
  cu_seqlens=None) -> (out, lse)``: this rank's attention output (as
  :class:`~interlace.ops.attention.SPAttention` returns it) and ``lse``, the natural-log
  log-sum-exp of every query row's scaled logits over the whole sequence, float32
  ``[batch, heads, S_loc]`` (not differentiable). Strategy ``none`` keeps no softmax
  statistics: its ``lse`` is empty (``[0]``) and its backward recomputes the forward.
* ``torch.ops.interlace.sp_attention_backward(dout, q, k, v, out, lse, group, strategy,
  causal, sm_scale, cu_seqlens=None) -> (dq, dk, dv)``: the gradients of this rank's
  tokens, by the strategy's own backward (``fused``: the overlapped dK/dV, dQ and
  reduction kernels; ``ring``: the ring backward; ``none``: its softmax statistics
  recomputed by the ring forward, then the ring backward: the same gradients, from torch
  ops, since a custom op cannot differentiate SDPA inside itself).
* ``torch.ops.interlace.flash_decode(q, k, v, kv_lens, group, strategy, sm_scale) ->
  out``: distributed flash-decode (:class:`~interlace.ops.attention.FlashDecode`, every
  rank getting the output); inference only (its backward raises). Described at the
  end.

The sequence-parallel ops' arguments are those of ``SPAttention.__call__``: ``q [batch,
heads, S_loc, d]``, ``k, v [batch, kv_heads, S_loc, d]`` in the token layout of
:mod:`.sp_attention` (zigzag when ``causal``), ``cu_seqlens`` the packed documents'
global boundaries (a tensor every rank holds alike; it is read on the host, so it may
live on the CPU). ``group`` is the integer handle of
:func:`interlace.ops.library.register_group`; ``strategy`` one of
``SPAttention.STRATEGIES`` or ``auto`` (= ``fused``).

The op's :class:`SPAttention` context is kept in :mod:`interlace.ops.library`'s cache,
keyed by (``"sp_attention"``, handle, dtype, strategy, heads, kv_heads, head_dim): built
for the next power of two of ``batch * S_loc`` on the first call and rebuilt at least
twice as large when a call needs more, rebuilt after a failed call, freed by
``interlace.ops.library.clear_cache`` and checked by ``interlace.ops.library.check``.
Every call is collective: every rank calls with the same shapes (checked on every call
where the group is not NCCL, as :class:`~interlace.nn.ContextParallelAttention` does).

:func:`attention` is the entry point a layer calls: the custom op while ``torch.compile``
traces, else the cached context's own call (its autograd Function, no dispatcher), as
:mod:`interlace.ops.autograd` routes the dense ops::

    h = interlace.ops.library.register_group(group)
    out = attention(q, k, v, h, "fused", causal=True)            # differentiable
    out, lse = torch.ops.interlace.sp_attention(q, k, v, h, "fused", True, d**-0.5)

``flash_decode``'s arguments are those of ``FlashDecode.__call__`` (``q [batch, heads,
d]`` the same on every rank, ``k, v [batch, kv_heads, kv_len, d]`` this rank's shard of
the KV cache, read in place where its last dimension has unit stride; ``kv_lens [batch]``
int32 on the group's device or None), the group handle, a strategy of
``FlashDecode.STRATEGIES`` (``auto`` = ``fused``) and the scale. Its context is cached
alike, keyed by (``"flash_decode"``, handle, dtype, strategy, heads, kv_heads, head_dim):
built for the next power of two of the batch and rebuilt at least twice as large when a
call's batch is larger. :func:`decode` is its entry point (the custom op while
``torch.compile`` traces or an input requires grad, else the context's own call)::

    with torch.no_grad():
        out = decode(q, k_shard, v_shard, h, kv_lens=lens)         # [batch, heads, d]
"""

from __future__ import annotations

import math

import torch

from ...errors import InterlaceValueError
from ...runtime import Group
from ..library import _cached_or_grown, collective_op, group_of
from .flash_decode import FlashDecode
from .sp_attention import STRATEGIES, SPAttention

Tensor = torch.Tensor
#: the strategies the ops take: SPAttention's, and ``auto`` (its default, ``fused``)
OP_STRATEGIES = ("auto", *STRATEGIES)


def _strategy(strategy: str) -> str:
    if strategy not in OP_STRATEGIES:
        raise InterlaceValueError(
            f"sp_attention: strategy must be one of {OP_STRATEGIES}, got {strategy!r}"
        )
    return "fused" if strategy == "auto" else strategy


def _check_4d(**tensors) -> None:
    for name, t in tensors.items():
        if t.dim() != 4:
            raise InterlaceValueError(
                f"sp_attention: {name} must be 4-D [batch, heads, S_loc, d], got shape "
                f"{tuple(t.shape)}"
            )


# ---------------------------------------------------------------------------- context cache
def _attention_context(
    group: Group, handle: int, strategy: str, q: Tensor, k: Tensor
) -> SPAttention:
    """The cached context able to run a call on ``q`` / ``k``: built for the next power of
    two of ``batch * S_loc`` tokens, rebuilt at least twice as large when a call needs
    more, and rebuilt (as large) after a failure (``library._cached``)."""
    _check_4d(q=q, k=k)
    b, heads, s_loc, d = q.shape
    kv_heads, tokens = k.shape[1], b * s_loc
    key = (SPAttention.op_name, handle, q.dtype, strategy, heads, kv_heads, d)
    # the per-call shape agreement (a host all-reduce, a synchronisation on NCCL) runs
    # where the group is not NCCL; on NCCL the call fingerprints catch a mismatch
    return _cached_or_grown(
        key, tokens, lambda c: c.max_tokens,
        lambda cap: SPAttention(group, heads, kv_heads, d, max_tokens=cap, dtype=q.dtype,
                                strategy=strategy, validate=not group.nccl),
    )  # fmt: skip


def _context_of(q: Tensor, k: Tensor, group: int, strategy: str) -> SPAttention:
    return _attention_context(group_of(group), group, _strategy(strategy), q, k)


# ---------------------------------------------------------------------------- implementations
def _fresh(t: Tensor) -> Tensor:
    """``t`` laid out as the fake implementations say: contiguous from the start of its
    storage (a strategy may return a view into a larger tensor, e.g. one rank's slice)."""
    if t.is_contiguous() and t.storage_offset() == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _sp_attention(q, k, v, group: int, strategy: str, causal: bool, sm_scale: float, cu=None):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ctx = _context_of(q, k, group, strategy)
    out, lse = ctx.forward_with_lse(q, k, v, bool(causal), cu, float(sm_scale))
    return _fresh(out), _fresh(lse)


def _sp_attention_backward(dout, q, k, v, out, lse, group: int, strategy: str, causal: bool,
                           sm_scale: float, cu=None):  # fmt: skip
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ctx = _context_of(q, k, group, strategy)
    grads = ctx.backward_with_lse(dout, q, k, v, out, lse, bool(causal), cu, float(sm_scale))
    return tuple(_fresh(g) for g in grads)


# ---------------------------------------------------------------------------- registration
@collective_op("interlace::sp_attention")
def sp_attention(
    q: Tensor, k: Tensor, v: Tensor, group: int, strategy: str, causal: bool,
    sm_scale: float, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Sequence-parallel attention of this rank's queries over the whole sequence:
    ``(out, lse)`` (see the module docstring)."""
    return _sp_attention(q, k, v, group, strategy, causal, sm_scale, cu_seqlens)


@collective_op("interlace::sp_attention_backward")
def sp_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, group: int,
    strategy: str, causal: bool, sm_scale: float, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of :func:`sp_attention` from ``dout`` and its ``(out, lse)``."""
    return _sp_attention_backward(
        dout, q, k, v, out, lse, group, strategy, causal, sm_scale, cu_seqlens
    )


def _fake_lse(q, strategy):
    if _strategy(strategy) == "none":
        return q.new_empty(0, dtype=torch.float32)
    b, h, s_loc, _ = q.shape
    return q.new_empty((b, h, s_loc), dtype=torch.float32)


@sp_attention.register_fake
def _(q, k, v, group, strategy, causal, sm_scale, cu_seqlens=None):
    _check_4d(q=q, k=k, v=v)
    return torch.empty_like(q, memory_format=torch.contiguous_format), _fake_lse(q, strategy)


@sp_attention_backward.register_fake
def _(dout, q, k, v, out, lse, group, strategy, causal, sm_scale, cu_seqlens=None):
    _check_4d(q=q, k=k, v=v)
    _strategy(strategy)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, group, strategy, causal, sm_scale, *cu = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu[0] if cu else None)
    ctx.group, ctx.strategy, ctx.causal, ctx.sm_scale = group, strategy, causal, sm_scale
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, dlse):
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = torch.ops.interlace.sp_attention_backward(
        dout, q, k, v, out, lse, ctx.group, ctx.strategy, ctx.causal, ctx.sm_scale, cu
    )
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("interlace::sp_attention", _grads, setup_context=_setup)


# ---------------------------------------------------------------------------- entry point
_is_compiling = torch.compiler.is_compiling


def attention(q, k, v, group: int, strategy: str = "auto", causal: bool = False,
              sm_scale: float | None = None, cu_seqlens=None) -> Tensor:  # fmt: skip
    """This rank's attention output (differentiable): ``torch.ops.interlace.sp_attention``
    while ``torch.compile`` traces, else the cached context's own call."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if _is_compiling():
        out, _ = torch.ops.interlace.sp_attention(
            q, k, v, group, strategy, causal, scale, cu_seqlens
        )
        return out
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ctx = _context_of(q, k, group, strategy)
    return ctx(q, k, v, causal=causal, cu_seqlens=cu_seqlens, sm_scale=scale)


# ---------------------------------------------------------------------------- flash-decode
#: the strategies ``flash_decode`` takes: FlashDecode's (``auto`` = ``fused``)
DECODE_STRATEGIES = FlashDecode.STRATEGIES


def _decode_strategy(strategy: str) -> str:
    if strategy not in DECODE_STRATEGIES:
        raise InterlaceValueError(
            f"flash_decode: strategy must be one of {DECODE_STRATEGIES}, got {strategy!r}"
        )
    return "fused" if strategy == "auto" else strategy


def _check_decode_dims(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 3:
        raise InterlaceValueError(
            f"flash_decode: q must be 3-D [batch, heads, d], got shape {tuple(q.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise InterlaceValueError(
                f"flash_decode: {name} must be 4-D [batch, kv_heads, kv_len, d], got shape "
                f"{tuple(t.shape)}"
            )


def _decode_context(group: Group, handle: int, strategy: str, q: Tensor, k: Tensor
                    ) -> FlashDecode:  # fmt: skip
    """The cached context able to run a call on ``q`` / ``k``: built for the next power of
    two of the batch, rebuilt at least twice as large when a call's batch is larger, and
    rebuilt (as large) after a failure (``library._cached``). Every rank gets the output
    (no owner). The softmax scale is an argument of each call."""
    b, heads, d = q.shape
    key = (FlashDecode.op_name, handle, q.dtype, strategy, heads, k.shape[1], d)
    return _cached_or_grown(
        key, b, lambda c: c.max_batch,
        lambda cap: FlashDecode(group, cap, heads, k.shape[1], d, dtype=q.dtype,
                                strategy=strategy),
    )  # fmt: skip


def _unit_last(t: Tensor) -> Tensor:
    """``t`` with unit stride along its last dimension (a strided KV cache slice is read
    in place; only a tensor strided along ``d`` is copied)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_decode(q, k, v, kv_lens, group: int, strategy: str, sm_scale: float) -> Tensor:
    _check_decode_dims(q, k, v)
    strategy = _decode_strategy(strategy)
    g = group_of(group)
    q, k, v = q.contiguous(), _unit_last(k), _unit_last(v)
    ctx = _decode_context(g, group, strategy, q, k)
    return ctx(q, k, v, kv_lens=kv_lens, sm_scale=float(sm_scale))


@collective_op("interlace::flash_decode")
def flash_decode(q: Tensor, k: Tensor, v: Tensor, kv_lens: Tensor | None, group: int,
                 strategy: str, sm_scale: float) -> Tensor:  # fmt: skip
    """Distributed flash-decode (:class:`~interlace.ops.attention.FlashDecode`): attention
    of ``q [batch, heads, d]`` (the same on every rank) over the KV cache whose sequence
    is split over the ranks (``k, v [batch, kv_heads, kv_len, d]``, this rank's shard;
    ``kv_lens [batch]`` int32 on the group's device: each sequence's valid rows in the
    shard). Every rank gets ``out [batch, heads, d]``. Inference only: no backward."""
    return _flash_decode(q, k, v, kv_lens, group, strategy, sm_scale)


@flash_decode.register_fake
def _(q, k, v, kv_lens, group, strategy, sm_scale):
    _check_decode_dims(q, k, v)
    _decode_strategy(strategy)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _no_decode_grad(ctx, grad):
    raise InterlaceValueError(
        "flash_decode is an inference op and has no backward: call it on tensors that do "
        "not require grad (under torch.no_grad() or torch.inference_mode())"
    )


torch.library.register_autograd("interlace::flash_decode", _no_decode_grad)


def _wants_grad(*tensors: Tensor) -> bool:
    """An input requires grad: the call takes the custom op, whose backward raises (the
    context's own call would return an output silently cut off from autograd)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def decode(q, k, v, group: int, strategy: str = "auto", kv_lens=None,
           sm_scale: float | None = None) -> Tensor:  # fmt: skip
    """Every rank's flash-decode output ``[batch, heads, d]`` (see :func:`flash_decode`;
    ``sm_scale`` defaults to ``1/sqrt(d)``): ``torch.ops.interlace.flash_decode`` while
    ``torch.compile`` traces or an input requires grad, else the cached context's own
    call."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if _is_compiling() or _wants_grad(q, k, v):
        return torch.ops.interlace.flash_decode(q, k, v, kv_lens, group, strategy, scale)
    return _flash_decode(q, k, v, kv_lens, group, strategy, scale)


__all__ = [
    "DECODE_STRATEGIES",
    "OP_STRATEGIES",
    "attention",
    "decode",
    "flash_decode",
    "sp_attention",
    "sp_attention_backward",
]
