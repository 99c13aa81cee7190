"""The eager entry points of the ops of :mod:`interlace.ops.library` (what the layers call:
:func:`ag_gemm`, :func:`gemm_rs`, :func:`gemm_ar`, :func:`all_gather`,
:func:`reduce_scatter`, :func:`all_reduce`; the arguments of ``torch.ops.interlace.*``),
and the autograd formulas both routes share.

Two routes to one implementation and one set of backward formulas:

* Eager calls go straight to the implementation: through a ``torch.autograd.Function``
  when a gradient is needed, else a plain call. A torch custom op costs a trip through
  the dispatcher and its autograd wrapper on every call, host time a layer would pay
  per projection, forward and backward.
* While ``torch.compile`` traces (``torch.compiler.is_compiling()``) the entry points call
  the custom ops ``torch.ops.interlace.*``, whose autograd :mod:`~interlace.ops.library`
  registers with ``torch.library.register_autograd`` (the same formulas), so the graph
  holds them whole (fullgraph) and ``torch.library.opcheck`` checks them.

The fused GEMMs' backward passes are each other's duals, overlapped:

* ``ag_gemm`` (``c = all_gather(a) @ b``): ``da = reduce_scatter(dc @ b.T)`` by the fused
  GEMM+RS, while ``a`` is all-gathered again on a side stream (it is not kept from the
  forward: that would hold ``world`` times the activation); then ``db = gathered.T @ dc``.
* ``gemm_rs`` (``y = reduce_scatter(a @ b)``): ``da = all_gather(dy) @ b.T`` by the fused
  AG+GEMM, while ``dy`` is all-gathered on a side stream for ``db = a.T @ gathered``. The
  bias, added once after the reduction to each rank's rows, gets the sum over all ranks'
  rows (an all-reduce of the per-rank sums).
* ``gemm_ar`` (``y = all_reduce(a @ b)``): local, ``da = dy @ b.T``, ``db = a.T @ dy``.

``db`` is laid out as ``b`` is (column-major for ``weight.t()``), so autograd accumulates
it into the parameter without a transposing copy.

The formulas follow Megatron-LM's tensor-parallel conventions: a tensor that is the same on
every rank (the output of ``all_reduce`` or ``gemm_ar``) carries the gradient of one loss,
the same on every rank, so those backward passes are local; the output of ``all_gather``
feeds rank-specific computation (a column shard), whose partial gradients its backward
sums with ``reduce_scatter``; ``reduce_scatter``'s backward is ``all_gather``.
(:mod:`interlace.nn` has the other gather, whose output feeds replicated computation.)
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .library import (
    _ag_gemm,
    _ag_gemm_backward,
    _ag_gemm_grads,
    _all_gather,
    _all_gather_grads,
    _all_reduce,
    _all_reduce_grads,
    _gemm_ar,
    _gemm_ar_grads,
    _gemm_rs,
    _gemm_rs_backward,
    _gemm_rs_grads,
    _reduce_scatter,
    _reduce_scatter_grads,
)

_is_compiling = torch.compiler.is_compiling
_CUSTOM = torch.ops.interlace
#: the backward formulas' callees in eager mode: the implementations
_EAGER = SimpleNamespace(
    ag_gemm_backward=_ag_gemm_backward,
    gemm_rs_backward=_gemm_rs_backward,
    all_reduce=_all_reduce,
    reduce_scatter=_reduce_scatter,
    all_gather=_all_gather,
)


# ---------------------------------------------------------------------------- eager
def _gemm_function(name: str, impl, formula) -> type:
    """An eager fused GEMM with autograd: forward ``impl``, backward ``formula`` (the custom
    op's), its callees the implementations."""

    def forward(ctx, a, b, bias, group, strategy):
        ctx.save_for_backward(a, b)
        ctx.group, ctx.strategy, ctx.has_bias = group, strategy, bias is not None
        return impl(a, b, bias, group, strategy)

    def backward(ctx, grad):
        return formula(ctx, grad, _EAGER)

    body = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), body)


def _collective_function(name: str, impl, formula) -> type:
    """An eager collective with autograd (as :func:`_gemm_function`)."""

    def forward(ctx, x, group, method):
        ctx.group = group
        return impl(x, group, method)

    def backward(ctx, grad):
        return formula(ctx, grad, _EAGER)

    body = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), body)


_AGGemmFunction = _gemm_function("_AGGemmFunction", _ag_gemm, _ag_gemm_grads)
_GemmRSFunction = _gemm_function("_GemmRSFunction", _gemm_rs, _gemm_rs_grads)
_GemmARFunction = _gemm_function("_GemmARFunction", _gemm_ar, _gemm_ar_grads)
_AllGatherFunction = _collective_function("_AllGatherFunction", _all_gather, _all_gather_grads)
_ReduceScatterFunction = _collective_function(
    "_ReduceScatterFunction", _reduce_scatter, _reduce_scatter_grads
)
_AllReduceFunction = _collective_function("_AllReduceFunction", _all_reduce, _all_reduce_grads)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def ag_gemm(a, b, bias, group: int, strategy: str):
    """``all_gather(a) @ b (+ bias)``: ``torch.ops.interlace.ag_gemm`` while compiling,
    else straight to the implementation (with autograd when a gradient is needed)."""
    if _is_compiling():
        return _CUSTOM.ag_gemm(a, b, bias, group, strategy)
    if _needs_grad(a, b, bias):
        return _AGGemmFunction.apply(a, b, bias, group, strategy)
    return _ag_gemm(a, b, bias, group, strategy)


def gemm_rs(a, b, bias, group: int, strategy: str):
    """``reduce_scatter(a @ b) (+ bias)``, routed as :func:`ag_gemm`."""
    if _is_compiling():
        return _CUSTOM.gemm_rs(a, b, bias, group, strategy)
    if _needs_grad(a, b, bias):
        return _GemmRSFunction.apply(a, b, bias, group, strategy)
    return _gemm_rs(a, b, bias, group, strategy)


def gemm_ar(a, b, bias, group: int, strategy: str):
    """``all_reduce(a @ b) (+ bias)``, routed as :func:`ag_gemm`."""
    if _is_compiling():
        return _CUSTOM.gemm_ar(a, b, bias, group, strategy)
    if _needs_grad(a, b, bias):
        return _GemmARFunction.apply(a, b, bias, group, strategy)
    return _gemm_ar(a, b, bias, group, strategy)


def all_gather(x, group: int, method: str = "default"):
    """All-gather along dim 0, routed as :func:`ag_gemm`."""
    if _is_compiling():
        return _CUSTOM.all_gather(x, group, method)
    if _needs_grad(x):
        return _AllGatherFunction.apply(x, group, method)
    return _all_gather(x, group, method)


def reduce_scatter(x, group: int, method: str = "default"):
    """Reduce-scatter (sum) along dim 0, routed as :func:`ag_gemm`."""
    if _is_compiling():
        return _CUSTOM.reduce_scatter(x, group, method)
    if _needs_grad(x):
        return _ReduceScatterFunction.apply(x, group, method)
    return _reduce_scatter(x, group, method)


def all_reduce(x, group: int, method: str = "default"):
    """All-reduce (sum), routed as :func:`ag_gemm`."""
    if _is_compiling():
        return _CUSTOM.all_reduce(x, group, method)
    if _needs_grad(x):
        return _AllReduceFunction.apply(x, group, method)
    return _all_reduce(x, group, method)


__all__ = ["ag_gemm", "all_gather", "all_reduce", "gemm_ar", "gemm_rs", "reduce_scatter"]
