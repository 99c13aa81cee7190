"""Tensor-parallel linear layers over the fused ops, and the sequence-parallel region
helpers between them.

* :class:`ColumnParallelLinear`: the weight's output rows split over ranks. With sequence
  parallelism (the default) the input is each rank's share of the rows and the layer runs
  AG+GEMM (``all_gather(x) @ w.T``); without it the input is the same on every rank and the
  layer is a local GEMM (its input gradient all-reduced).
* :class:`RowParallelLinear`: the weight's input columns split over ranks; GEMM+RS (each
  rank gets its share of the output rows, sequence parallelism) or GEMM+AR (every rank the
  whole output).

Both are built from a plain ``nn.Linear`` with :meth:`from_linear` (the full weights,
sharded on construction: each rank keeps its slice) or with random weights.

Weight layout. Over several ranks each layer stores its shard as the ``[k, n]`` (``[in,
out]``) operand the fused GEMMs read, the transpose of ``nn.Linear``'s ``[out, in]``:
``from_linear`` / ``from_weights`` / :meth:`shard` transpose once, at construction, so a
forward pass copies no weight and the weight gradient is made in the parameter's layout.
(The backward GEMM that reads ``weight.T`` makes that operand per call, not kept.) Over
one rank the layer is ``nn.Linear``: ``[out, in]``, ``F.linear``, the same aten ops. So
``state_dict()`` holds each rank's shard in its layer's layout: it loads into the same
layers at the same world size; to load ``nn.Linear``-layout weights (a full checkpoint)
use ``from_linear`` / ``from_weights``, or copy :meth:`shard` of the full tensor into
``weight``. :attr:`linear_weight` is the shard in ``[out, in]`` layout (a view).

Eager calls go straight to the implementations (``interlace.ops.autograd``); only a graph
being traced by ``torch.compile`` goes through the ``torch.ops.interlace`` custom ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InterlaceTypeError, InterlaceValueError
from ..ops import AGGemm, GemmAR, GemmRS
from ..ops import autograd as _ops
from ..ops import library as _library
from ..runtime import Group


# ---------------------------------------------------------------------------- sharding
def shard(t: torch.Tensor, rank: int, world: int, dim: int = 0, parts=None) -> torch.Tensor:
    """Rank ``rank``'s slice of ``t`` along ``dim`` (a contiguous copy). ``parts``: sizes
    of consecutive blocks along ``dim`` that are each split over the ranks, the rank's
    slices concatenated in block order (a fused QKV or gate/up weight)."""
    parts = [t.shape[dim]] if parts is None else list(parts)
    if sum(parts) != t.shape[dim]:
        raise InterlaceValueError(f"shard: parts {parts} do not add up to {t.shape[dim]}")
    pieces, start = [], 0
    for size in parts:
        if size % world:
            raise InterlaceValueError(
                f"shard: a block of {size} along dim {dim} does not split over {world} ranks"
            )
        step = size // world
        pieces.append(t.narrow(dim, start + rank * step, step))
        start += size
    return torch.cat(pieces, dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


def _check_group(name: str, group) -> Group:
    if not isinstance(group, Group):
        raise InterlaceTypeError(f"{name}: group must be an interlace Group, got {type(group)}")
    return group


def _check_strategy(name: str, strategy: str, cls) -> None:
    if strategy not in cls.STRATEGIES:
        raise InterlaceValueError(
            f"{name}: strategy must be one of {cls.STRATEGIES}, got {strategy!r}"
        )


# ---------------------------------------------------------------------------- region helpers
class _CopyToParallel(torch.autograd.Function):
    """Forward identity; backward all-reduce (a replicated input feeding rank-specific
    computation: each rank holds a partial gradient)."""

    @staticmethod
    def forward(ctx, x, handle):
        ctx.handle = handle
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _ops.all_reduce(dy.contiguous(), ctx.handle), None


class _ScatterToSequence(torch.autograd.Function):
    """Forward: this rank's slice along ``dim``; backward: all-gather of the slices'
    gradients along ``dim``."""

    @staticmethod
    def forward(ctx, x, handle, rank, world, dim):
        ctx.handle, ctx.world, ctx.dim = handle, world, dim
        step = x.shape[dim] // world
        return x.narrow(dim, rank * step, step).contiguous()

    @staticmethod
    def backward(ctx, dy):
        return _gather_along(dy, ctx.handle, ctx.world, ctx.dim), None, None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: this rank's slice of the gradient (the
    gathered tensor feeds replicated computation, whose gradient every rank holds whole)."""

    @staticmethod
    def forward(ctx, x, handle, rank, world, dim):
        ctx.rank, ctx.world, ctx.dim = rank, world, dim
        return _gather_along(x, handle, world, dim)

    @staticmethod
    def backward(ctx, dy):
        step = dy.shape[ctx.dim] // ctx.world
        return dy.narrow(ctx.dim, ctx.rank * step, step).contiguous(), None, None, None, None


def _gather_along(x: torch.Tensor, handle: int, world: int, dim: int) -> torch.Tensor:
    out = _ops.all_gather(x.contiguous(), handle)  # rank-major along dim 0
    if dim == 0:
        return out
    out = out.view(world, *x.shape).movedim(0, dim)
    return out.reshape(*x.shape[:dim], world * x.shape[dim], *x.shape[dim + 1 :])


def copy_to_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x`` (the same on every rank) entering rank-specific computation: identity forward,
    all-reduced gradient."""
    if group.world_size == 1:
        return x
    return _CopyToParallel.apply(x, _library.register_group(group))


def scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """This rank's share of ``x`` along ``dim`` (padded with zeros to a multiple of the
    world size first); the gradient is all-gathered."""
    w = group.world_size
    if w == 1:
        return x
    pad = -x.shape[dim] % w
    if pad:
        widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
        x = F.pad(x, widths)
    return _ScatterToSequence.apply(x, _library.register_group(group), group.rank, w, dim)


def gather_from_sequence(x: torch.Tensor, group: Group, dim: int = 1, length=None):
    """Every rank's share of ``x`` along ``dim``, concatenated in rank order (trimmed to
    ``length``); the gradient of the result, the same on every rank, is sliced back."""
    w = group.world_size
    if w == 1:
        return x
    out = _GatherFromSequence.apply(x, _library.register_group(group), group.rank, w, dim)
    if length is not None and length < out.shape[dim]:
        out = out.narrow(dim, 0, length)
    return out


def sync_sequence_parallel_grads(params, group: Group) -> int:
    """Register on each parameter (replicated weights applied to each rank's share of the
    tokens, like a norm's) a hook that all-reduces each gradient it receives before it is
    accumulated, so every rank holds the whole gradient (gradient accumulation over
    several backward passes included). Returns the number of parameters hooked (a
    parameter already hooked is skipped)."""
    if group.world_size == 1:
        return 0
    handle = _library.register_group(group)
    count = 0
    for p in params:
        if not p.requires_grad or getattr(p, "_interlace_grad_sync", None) is not None:
            continue

        def hook(grad, handle=handle):
            return _ops.all_reduce(grad.contiguous(), handle)

        p.register_hook(hook)
        p._interlace_grad_sync = handle
        count += 1
    return count


# ---------------------------------------------------------------------------- layers
class _LinearParts(torch.autograd.Function):
    """``F.linear`` of ``x`` with each block of the weight's output rows as its own GEMM,
    returning one tensor per block: what a plain model computes with separate
    projections (the same GEMM shapes, contiguous outputs). Its backward adds the input
    gradients inside the GEMMs (``addmm_``) and writes each block's weight (and bias)
    gradient into its rows of one gradient tensor (autograd's slice backward would make a
    zero-filled full-size gradient per block and add them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, parts):
        ctx.save_for_backward(x, weight)
        ctx.parts, ctx.has_bias = parts, bias is not None
        biases = bias.split(parts) if bias is not None else [None] * len(parts)
        return tuple(F.linear(x, w, b) for w, b in zip(weight.split(parts), biases))

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        parts = ctx.parts
        x2 = x.reshape(-1, x.shape[-1])
        gs = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            for g, w in zip(gs, weight.split(parts)):
                if g is not None:
                    dx = torch.mm(g, w) if dx is None else dx.addmm_(g, w)
            dx = torch.zeros_like(x) if dx is None else dx.view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = torch.empty_like(weight)
            for g, d in zip(gs, dw.split(parts)):
                torch.mm(g.t(), x2, out=d) if g is not None else d.zero_()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = torch.empty(sum(parts), dtype=weight.dtype, device=weight.device)
            for g, d in zip(gs, db.split(parts)):
                torch.sum(g, 0, out=d) if g is not None else d.zero_()
        return dx, dw, db, None


def _linear_parts(x, weight, bias, parts) -> tuple:
    """One rank's ``[out, in]`` weight applied block by block (see :class:`_LinearParts`);
    under ``torch.compile`` or autocast, plain ``F.linear`` of each block's view."""
    plain = torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type)
    if plain or not torch.is_grad_enabled():
        biases = bias.split(parts) if bias is not None else [None] * len(parts)
        return tuple(F.linear(x, w, b) for w, b in zip(weight.split(parts), biases))
    return _LinearParts.apply(x, weight, bias, list(parts))


class _ParallelLinear(nn.Module):
    """The shared parts: ``weight`` holds this rank's ``[out_local, in_local]`` shard,
    stored transposed (``[in_local, out_local]``, ``kn``) over several ranks."""

    def __init__(self, in_features, out_features, group, bias, strategy, sequence_parallel,
                 dtype, device, local_shape, bias_features):  # fmt: skip
        super().__init__()
        self.group = _check_group(type(self).__name__, group)
        self.handle = _library.register_group(group)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.strategy, self.sequence_parallel = strategy, bool(sequence_parallel)
        #: the weight is stored [in_local, out_local] (the fused GEMMs' b); False over one
        #: rank, where the layer is nn.Linear ([out, in], F.linear)
        self.kn = group.world_size > 1
        kw = dict(dtype=dtype, device=group.device if device is None else device)
        shape = tuple(reversed(local_shape)) if self.kn else tuple(local_shape)
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        self.bias = nn.Parameter(torch.empty(bias_features, **kw)) if bias else None
        # as torch.nn.Linear: uniform in +-1/sqrt(fan-in), the whole layer's fan-in
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)
        # every rank's gradient of these is already whole (a shard's, or the row-parallel
        # bias's, summed over ranks by its backward): no sequence-parallel gradient sync
        for p in self.parameters():
            p._interlace_tp = True

    @property
    def linear_weight(self) -> torch.Tensor:
        """This rank's weight shard in ``nn.Linear``'s ``[out, in]`` layout (a view)."""
        return self.weight.t() if self.kn else self.weight

    def _layout(self, piece: torch.Tensor) -> torch.Tensor:
        """A ``[out, in]`` weight shard (or a 1-D one) in the parameter's layout."""
        return piece.t().contiguous() if self.kn and piece.dim() == 2 else piece

    def extra_repr(self) -> str:
        stored = "[in, out]" if self.kn else "[out, in]"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"local={tuple(self.linear_weight.shape)}, stored={stored}, "
            f"bias={self.bias is not None}, strategy={self.strategy!r}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T + bias`` with the output features split over ranks: each rank holds
    rows ``[r * out / W, (r + 1) * out / W)`` of ``W`` (and of the bias) and returns those
    output features. Over several ranks ``weight`` is that shard transposed, ``[in, out /
    W]`` (see the module docstring); over one, ``[out, in]`` as ``nn.Linear``'s.

    ``sequence_parallel=True``: ``x`` is this rank's share of the rows (dim 0); the result
    has every rank's rows, in rank order (AG+GEMM, ``strategy`` as :class:`~interlace.AGGemm`).
    ``False``: ``x`` is the same on every rank, the result has its rows."""

    def __init__(self, in_features, out_features, group: Group, bias: bool = True, *,
                 strategy: str = "auto", sequence_parallel: bool = True, dtype=None,
                 device=None, parts=None):  # fmt: skip
        name = type(self).__name__
        _check_strategy(name, strategy, AGGemm)
        w = _check_group(name, group).world_size
        self.parts = [int(out_features)] if parts is None else [int(p) for p in parts]
        if sum(self.parts) != int(out_features) or any(p % w for p in self.parts):
            raise InterlaceValueError(
                f"{name}: out_features {out_features} (blocks {self.parts}) must split "
                f"evenly over {w} ranks"
            )
        local = int(out_features) // w
        super().__init__(in_features, out_features, group, bias, strategy, sequence_parallel,
                         dtype, device, (local, int(in_features)), local)  # fmt: skip

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``nn.Linear``-layout tensor: an ``[out, in]`` weight
        or its gradient (returned in ``weight``'s layout), or an ``[out]`` bias."""
        return self._layout(shard(full, self.group.rank, self.group.world_size, 0, self.parts))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kw):
        """The column-parallel layer holding this rank's slice of ``linear``'s weights."""
        return cls.from_weights(linear.weight, linear.bias, group, **kw)

    @classmethod
    def from_weights(cls, weight, bias, group: Group, **kw):
        """From a full ``[out, in]`` weight (and ``[out]`` bias or None); ``parts`` in
        ``kw`` names blocks of output rows that are each split (fused projections)."""
        kw.setdefault("dtype", weight.dtype)
        layer = cls(weight.shape[1], weight.shape[0], group, bias is not None, **kw)
        with torch.no_grad():
            layer.weight.copy_(layer.shard(weight.detach()))
            if bias is not None:
                layer.bias.copy_(layer.shard(bias.detach()))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kn:  # one rank: nn.Linear
            return F.linear(x, self.weight, self.bias)
        if not self.sequence_parallel:
            return F.linear(copy_to_parallel(x, self.group), self.weight.t(), self.bias)
        lead = x.shape[:-1]
        y = _ops.ag_gemm(x.reshape(-1, x.shape[-1]), self.weight, self.bias, self.handle,
                         self.strategy)  # fmt: skip
        return y.view(self.group.world_size * lead[0], *lead[1:], y.shape[-1])

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``forward(x)`` cut into one tensor per block of ``parts`` (this rank's features
        of each). Over one rank each block is its own GEMM with a contiguous output, the
        ops of a plain model's separate projections; over several, views of the one
        fused GEMM's output."""
        if not self.kn:
            return _linear_parts(x, self.weight, self.bias, self.parts)
        w = self.group.world_size
        return self(x).split([p // w for p in self.parts], dim=-1)


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T + bias`` with the input features split over ranks: each rank holds
    columns ``[r * in / W, (r + 1) * in / W)`` of ``W`` and gets ``x``'s matching
    features; the bias is whole, added once after the reduction. Over several ranks
    ``weight`` is that shard transposed, ``[in / W, out]`` (see the module docstring);
    over one, ``[out, in]`` as ``nn.Linear``'s.

    ``sequence_parallel=True``: GEMM+RS, each rank returns its share of the rows (dim 0,
    which must split evenly); ``False``: GEMM+AR, every rank the whole result. ``strategy``
    as :class:`~interlace.GemmRS` / :class:`~interlace.GemmAR`."""

    def __init__(self, in_features, out_features, group: Group, bias: bool = True, *,
                 strategy: str = "auto", sequence_parallel: bool = True, dtype=None,
                 device=None):  # fmt: skip
        name = type(self).__name__
        _check_strategy(name, strategy, GemmRS if sequence_parallel else GemmAR)
        w = _check_group(name, group).world_size
        if int(in_features) % w:
            raise InterlaceValueError(
                f"{name}: in_features {in_features} must split evenly over {w} ranks"
            )
        local = (int(out_features), int(in_features) // w)
        super().__init__(in_features, out_features, group, bias, strategy, sequence_parallel,
                         dtype, device, local, int(out_features))  # fmt: skip

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``[out, in]`` weight or its gradient, in ``weight``'s
        layout (the bias is whole)."""
        return self._layout(shard(full, self.group.rank, self.group.world_size, 1))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kw):
        """The row-parallel layer holding this rank's slice of ``linear``'s weights."""
        return cls.from_weights(linear.weight, linear.bias, group, **kw)

    @classmethod
    def from_weights(cls, weight, bias, group: Group, **kw):
        """From a full ``[out, in]`` weight (and ``[out]`` bias or None)."""
        kw.setdefault("dtype", weight.dtype)
        layer = cls(weight.shape[1], weight.shape[0], group, bias is not None, **kw)
        with torch.no_grad():
            layer.weight.copy_(layer.shard(weight.detach()))
            if bias is not None:
                layer.bias.copy_(bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kn:  # one rank: nn.Linear
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if not self.sequence_parallel:
            y = _ops.gemm_ar(x2, self.weight, self.bias, self.handle, self.strategy)
            return y.view(*lead, y.shape[-1])
        w = self.group.world_size
        if lead[0] % w:
            raise InterlaceValueError(
                f"{type(self).__name__}: {lead[0]} rows do not split over {w} ranks"
            )
        y = _ops.gemm_rs(x2, self.weight, self.bias, self.handle, self.strategy)
        return y.view(lead[0] // w, *lead[1:], y.shape[-1])


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_parallel",
    "gather_from_sequence",
    "scatter_to_sequence",
    "shard",
    "sync_sequence_parallel_grads",
]
