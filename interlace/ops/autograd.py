"""Autograd for the custom ops of :mod:`interlace.ops.library` (registered with
``torch.library.register_autograd``, so eager autograd and ``torch.compile`` both use them).

The fused GEMMs' backward passes are each other's duals, overlapped:

* ``ag_gemm`` (``c = all_gather(a) @ b``): ``da = reduce_scatter(dc @ b.T)`` by the fused
  GEMM+RS, while ``a`` is all-gathered again on a side stream (it is not kept from the
  forward: that would hold ``world`` times the activation); then ``db = gathered.T @ dc``.
* ``gemm_rs`` (``y = reduce_scatter(a @ b)``): ``da = all_gather(dy) @ b.T`` by the fused
  AG+GEMM, while ``dy`` is all-gathered on a side stream for ``db = a.T @ gathered``. The
  bias, added once after the reduction to each rank's rows, gets the sum over all ranks'
  rows (an all-reduce of the per-rank sums).
* ``gemm_ar`` (``y = all_reduce(a @ b)``): local, ``da = dy @ b.T``, ``db = a.T @ dy``.

The formulas follow Megatron-LM's tensor-parallel conventions: a tensor that is the same on
every rank (the output of ``all_reduce`` or ``gemm_ar``) carries the gradient of one loss,
the same on every rank, so those backward passes are local; the output of ``all_gather``
feeds rank-specific computation (a column shard), whose partial gradients its backward
sums with ``reduce_scatter``; ``reduce_scatter``'s backward is ``all_gather``.
(:mod:`interlace.nn` has the other gather, whose output feeds replicated computation.)
"""

from __future__ import annotations

import torch

# Imported by ``library`` once it has defined the ops (importing ``library`` from here
# would make the two a cycle): import ``interlace.ops.library``, not this module.
ops = torch.ops.interlace


def _none_if_empty(t, needed: bool):
    return t if needed else None


# ---------------------------------------------------------------------------- AG + GEMM
def _setup_gemm(ctx, inputs, output):
    a, b, bias, group, strategy = inputs
    ctx.save_for_backward(a, b)
    ctx.group, ctx.strategy, ctx.has_bias = group, strategy, bias is not None


def _ag_gemm_bwd(ctx, dc):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = db = None
    if need_a or need_b:
        da, db = ops.ag_gemm_backward(dc, a, b, ctx.group, ctx.strategy, need_a, need_b)
    dbias = dc.sum(0) if ctx.has_bias and need_bias else None
    return _none_if_empty(da, need_a), _none_if_empty(db, need_b), dbias, None, None


def _gemm_rs_bwd(ctx, dy):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = db = None
    if need_a or need_b:
        da, db = ops.gemm_rs_backward(dy, a, b, ctx.group, ctx.strategy, need_a, need_b)
    dbias = None
    if ctx.has_bias and need_bias:  # every rank's rows got the bias: sum over all of them
        dbias = ops.all_reduce(dy.sum(0), ctx.group, "default")
    return _none_if_empty(da, need_a), _none_if_empty(db, need_b), dbias, None, None


def _gemm_ar_bwd(ctx, dy):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = torch.matmul(dy, b.t()) if need_a else None
    db = torch.matmul(a.t(), dy) if need_b else None
    dbias = dy.sum(0) if ctx.has_bias and need_bias else None
    return da, db, dbias, None, None


# ---------------------------------------------------------------------------- collectives
def _setup_collective(ctx, inputs, output):
    ctx.group = inputs[1]


def _all_gather_bwd(ctx, dy):
    return ops.reduce_scatter(dy.contiguous(), ctx.group, "default"), None, None


def _reduce_scatter_bwd(ctx, dy):
    return ops.all_gather(dy.contiguous(), ctx.group, "default"), None, None


def _all_reduce_bwd(ctx, dy):
    return dy, None, None


torch.library.register_autograd("interlace::ag_gemm", _ag_gemm_bwd, setup_context=_setup_gemm)
torch.library.register_autograd("interlace::gemm_rs", _gemm_rs_bwd, setup_context=_setup_gemm)
torch.library.register_autograd("interlace::gemm_ar", _gemm_ar_bwd, setup_context=_setup_gemm)
torch.library.register_autograd(
    "interlace::all_gather", _all_gather_bwd, setup_context=_setup_collective
)
torch.library.register_autograd(
    "interlace::reduce_scatter", _reduce_scatter_bwd, setup_context=_setup_collective
)
torch.library.register_autograd(
    "interlace::all_reduce", _all_reduce_bwd, setup_context=_setup_collective
)

__all__: list[str] = []
