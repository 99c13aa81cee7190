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

from . import library as _library
from .library import (
    _ag_gemm_backward,
    _all_gather,
    _all_reduce,
    _gemm_rs_backward,
    _reduce_scatter,
    _setup_collective,
    _setup_gemm,
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
def _function(name: str, impl, formula, setup) -> type:
    """An eager op with autograd: forward ``impl`` after ``setup`` (the custom op's
    ``setup_context``) saved what the backward needs, backward ``formula`` (the custom
    op's), its callees the implementations."""

    def forward(ctx, *args):
        setup(ctx, args, None)
        return impl(*args)

    def backward(ctx, grad):
        return formula(ctx, grad, _EAGER)

    body = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), body)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _named(entry, name: str, doc: str):
    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = doc
    return entry


def _parts(name: str, setup):
    """The custom op ``name``, its implementation ``library._<name>`` and that with the
    autograd formula ``library._<name>_grads`` (an autograd Function)."""
    impl, formula = getattr(_library, f"_{name}"), getattr(_library, f"_{name}_grads")
    return getattr(_CUSTOM, name), impl, _function(f"_{name}_function", impl, formula, setup)


def _gemm_entry(name: str, doc: str):
    """The entry point of the fused GEMM op ``name``: ``torch.ops.interlace.<name>`` while
    compiling, else straight to the implementation (through an autograd Function when a
    gradient is needed)."""
    custom, impl, function = _parts(name, _setup_gemm)

    def entry(a, b, bias, group: int, strategy: str):
        if _is_compiling():
            return custom(a, b, bias, group, strategy)
        if _needs_grad(a, b, bias):
            return function.apply(a, b, bias, group, strategy)
        return impl(a, b, bias, group, strategy)

    return _named(entry, name, doc)


def _collective_entry(name: str, doc: str):
    """The entry point of the collective ``name``, routed as :func:`_gemm_entry`'s."""
    custom, impl, function = _parts(name, _setup_collective)

    def entry(x, group: int, method: str = "default"):
        if _is_compiling():
            return custom(x, group, method)
        if _needs_grad(x):
            return function.apply(x, group, method)
        return impl(x, group, method)

    return _named(entry, name, doc)


ag_gemm = _gemm_entry(
    "ag_gemm",
    """``all_gather(a) @ b (+ bias)``: ``torch.ops.interlace.ag_gemm`` while compiling,
    else straight to the implementation (with autograd when a gradient is needed).""",
)
gemm_rs = _gemm_entry("gemm_rs", "``reduce_scatter(a @ b) (+ bias)``, routed as :func:`ag_gemm`.")
gemm_ar = _gemm_entry("gemm_ar", "``all_reduce(a @ b) (+ bias)``, routed as :func:`ag_gemm`.")
all_gather = _collective_entry("all_gather", "All-gather along dim 0, routed as :func:`ag_gemm`.")
reduce_scatter = _collective_entry(
    "reduce_scatter", "Reduce-scatter (sum) along dim 0, routed as :func:`ag_gemm`."
)
all_reduce = _collective_entry("all_reduce", "All-reduce (sum), routed as :func:`ag_gemm`.")


__all__ = ["ag_gemm", "all_gather", "all_reduce", "gemm_ar", "gemm_rs", "reduce_scatter"]
