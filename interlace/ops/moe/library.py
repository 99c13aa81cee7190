"""The tensor-parallel MoE experts as torch custom ops, so that ``torch.compile(fullgraph=True)``
traces a model that runs them without graph breaks:

* ``torch.ops.interlace.moe_experts(x, weights, index, gate_up, down, group, strategy) ->
  y``: the experts of a sequence-parallel MoE layer on this rank's tokens, by
  :class:`~interlace.ops.moe.AGMoE` (all-gather of the tokens and routing overlapped with
  the gate/up grouped GEMM and SwiGLU) then :class:`~interlace.ops.moe.MoERS` (down grouped
  GEMM, top-k weighted sum and reduce-scatter overlapped). ``x [m, H]``: this rank's
  tokens (the same ``m`` on every rank); ``weights [m, k]`` (float32, bfloat16 or float16)
  and ``index [m, k]`` (int32 or int64): their routing; ``gate_up [E, H, 2 * I / W]``
  (this rank's gate columns, then its up columns) and ``down [E, I / W, H]``: this rank's
  slices of every expert. ``y [m, H]``: for each of this rank's tokens, the sum over its
  ``k`` slots and over all ranks' slices of ``weight * (silu(x @ gate) * (x @ up)) @
  down``. ``strategy``: the two contexts' (``auto``, ``fused`` or ``none``).
* ``torch.ops.interlace.moe_experts_backward(dy, x, weights, index, gate_up, down, group,
  need_x, need_weights, need_gate_up, need_down) -> (dx, dweights, dgate_up, ddown)``: its
  gradients, each laid out and typed as its input (an unneeded one is empty). The fused
  ops have no backward of their own: this op recomputes the ``none`` path (all-gather of
  the tokens, routing and ``dy``; a per-expert loop of torch matmuls in float32) and takes
  its gradients by the chain rule written out (a custom op's implementation runs below
  autograd, so it cannot differentiate torch ops inside itself); ``dx`` and ``dweights``
  are reduce-scattered back to their ranks (one float32 reduce-scatter),
  ``dgate_up`` / ``ddown`` stay with this rank's slices. This costs a second forward (its
  all-gathers included) in the backward pass.

``group`` is the integer handle of :func:`interlace.ops.library.register_group`. The pair
of contexts is kept in :mod:`interlace.ops.library`'s cache, keyed by (``"moe_experts"``,
handle, dtype, strategy, hidden, this rank's intermediate columns, experts, top-k): built
for the next power of two of the tokens per rank on the first call, rebuilt at least twice
as large when a call has more, rebuilt after a failed call, freed by
``interlace.ops.library.clear_cache`` (or :func:`close_contexts`) and checked by
``interlace.ops.library.check``. Every call is collective: every rank calls with the same
shapes (checked on every call where the group is not NCCL)::

    h = interlace.ops.library.register_group(group)
    y = torch.ops.interlace.moe_experts(x, weights, index, gate_up, down, h, "fused")

The fused ops take bfloat16 / float16 tokens and expert weights only.
"""

from __future__ import annotations

import torch

from ...errors import InterlaceValueError
from ...runtime import Group
from .._context import ContextSet
from ..library import _cached_or_grown, _contexts, collective_op, group_of
from ..token_grads import gather_tokens
from .ag_moe import AGMoE
from .moe_rs import MoERS

Tensor = torch.Tensor
#: the strategies the op takes: those of AGMoE / MoERS
OP_STRATEGIES = AGMoE.STRATEGIES
#: the cache key's first field
OP_NAME = "moe_experts"


class ExpertContexts(ContextSet):
    """The :class:`AGMoE` / :class:`MoERS` pair one cache entry holds: closed or failed
    when either is (what :mod:`interlace.ops.library`'s cache reads)."""

    op_name = OP_NAME

    def __init__(self, ag: AGMoE, rs: MoERS):
        super().__init__(ag, rs)
        self.ag, self.rs = ag, rs

    @property
    def _closed(self) -> bool:
        return self.ag._closed or self.rs._closed

    @property
    def max_m(self) -> int:
        """Tokens per rank a call may have."""
        return self.ag.max_m


def _strategy(strategy: str) -> str:
    if strategy not in OP_STRATEGIES:
        raise InterlaceValueError(
            f"moe_experts: strategy must be one of {OP_STRATEGIES}, got {strategy!r}"
        )
    return strategy


def _check_dims(x, weights, index, gate_up, down) -> None:
    """The ranks and the shapes that tie the arguments together (the contexts check the
    rest: dtypes, devices, capacity)."""
    for name, t, dims in (("x", x, 2), ("weights", weights, 2), ("index", index, 2),
                          ("gate_up", gate_up, 3), ("down", down, 3)):  # fmt: skip
        if t.dim() != dims:
            raise InterlaceValueError(
                f"moe_experts: {name} must be {dims}-D, got shape {tuple(t.shape)}"
            )
    m, hidden = x.shape
    e, inter = down.shape[0], down.shape[1]
    if weights.shape != index.shape or weights.shape[0] != m:
        raise InterlaceValueError(
            f"moe_experts: weights {tuple(weights.shape)} and index {tuple(index.shape)} "
            f"must both be [{m}, top_k] for x {tuple(x.shape)}"
        )
    if tuple(gate_up.shape) != (e, hidden, 2 * inter) or down.shape[2] != hidden:
        raise InterlaceValueError(
            f"moe_experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} must "
            f"be [E, {hidden}, 2 * I] and [E, I, {hidden}]"
        )


# ---------------------------------------------------------------------------- context cache
def _experts_context(group: Group, handle: int, strategy: str, m: int, topk: int,
                     gate_up: Tensor) -> ExpertContexts:  # fmt: skip
    """The cached pair able to run a call of ``m`` tokens per rank: built for the next
    power of two of ``m``, rebuilt at least twice as large when a call has more, and
    rebuilt (as large) after a failure (``library._cached``)."""
    e, hidden, cols = gate_up.shape
    key = (OP_NAME, handle, gate_up.dtype, strategy, hidden, cols // 2, e, topk)

    def build(cap: int) -> ExpertContexts:
        # The ops' per-call checks (an expert-id read-back and a cross-rank all-reduce: two
        # host synchronisations per call on NCCL) run only where the group is not NCCL:
        # the router's top-k ids are in range and the sequence-parallel shards have the
        # same rows on every rank by construction; a mismatch still shows in the call
        # fingerprints.
        sizes = dict(
            max_tokens=cap * group.world_size, hidden=hidden, inter=cols // 2, experts=e,
            topk=topk, dtype=gate_up.dtype, strategy=strategy, validate=not group.nccl,
        )  # fmt: skip
        ag = AGMoE(group, **sizes)
        try:
            rs = MoERS(group, **sizes)
        except BaseException:
            ag.close()
            raise
        return ExpertContexts(ag, rs)

    return _cached_or_grown(key, m, lambda c: c.max_m, build)


def close_contexts(group: int) -> None:
    """Close and forget the cached ``moe_experts`` contexts of the group with handle
    ``group`` (collective: call on every rank; a later call builds new ones)."""
    for key in [k for k in _contexts if k[0] == OP_NAME and k[1] == group]:
        _contexts.pop(key).close()


# ---------------------------------------------------------------------------- implementations
def _moe_experts(x, weights, index, gate_up, down, group: int, strategy: str) -> Tensor:
    _check_dims(x, weights, index, gate_up, down)
    strategy = _strategy(strategy)
    g = group_of(group)
    if x.shape[0] == 0:  # no tokens on any rank (the same m everywhere): nothing to run
        return x.new_zeros(x.shape)
    ctx = _experts_context(g, group, strategy, x.shape[0], index.shape[1], gate_up)
    h, routing = ctx.ag(x.contiguous(), index.contiguous(), weights.contiguous(),
                        gate_up.contiguous())  # fmt: skip
    return ctx.rs(h, routing, down.contiguous())


def _moe_experts_backward(dy, x, weights, index, gate_up, down, group: int, need_x: bool,
                          need_weights: bool, need_gate_up: bool, need_down: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of :func:`_moe_experts`, from the ``none`` path recomputed in float32
    (see the module docstring); an unneeded one is empty."""
    _check_dims(x, weights, index, gate_up, down)
    g = group_of(group)
    w, (m, hidden) = g.world_size, x.shape
    e, inter = down.shape[0], down.shape[1]

    def empty():  # (a fresh one each: a custom op's outputs may not alias each other)
        return dy.new_empty(0)

    if m == 0:  # no tokens on any rank (the forward ran nothing): zero gradients
        needs = (need_x, need_weights, need_gate_up, need_down)
        return tuple(
            torch.zeros_like(t, memory_format=torch.contiguous_format) if need else empty()
            for t, need in zip((x, weights, gate_up, down), needs)
        )
    t = gather_tokens(x, dy, weights, index, group, w, m)
    dgu = torch.zeros(gate_up.shape, dtype=torch.float32, device=x.device)
    dd = torch.zeros(down.shape, dtype=torch.float32, device=x.device)
    for ex in range(e):
        token, slot = torch.where(t.ids == ex)
        if token.numel() == 0:
            continue
        a, gu, dn = t.x[token], gate_up[ex].float(), down[ex].float()
        gate, up = (a @ gu).split(inter, dim=1)
        sig = torch.sigmoid(gate)
        act = gate * sig  # silu(gate)
        s = act * up  # [n, I/W]: the SwiGLU rows
        dyr = t.dy[token]
        if need_weights:  # d(weight) = <s @ down, dy> of each (token, slot)
            t.grads[token, hidden + slot] = ((s @ dn) * dyr).sum(1)
        dz = dyr * t.weights[token, slot][:, None]  # gradient of s @ down
        if need_down:
            dd[ex] = s.t() @ dz
        if need_x or need_gate_up:
            ds = dz @ dn.t()
            d_gate = ds * up * (sig * (1 + gate * (1 - sig)))  # silu'(g) = s(g)(1 + g(1 - s(g)))
            dh = torch.cat([d_gate, ds * act], 1)
            if need_gate_up:
                dgu[ex] = a.t() @ dh
            if need_x:
                t.grads[:, :hidden].index_add_(0, token, dh @ gu.t())
    dx, dweights = t.scatter_home(x.dtype, weights.dtype, need_x, need_weights, empty)
    dgate_up = dgu.to(gate_up.dtype) if need_gate_up else empty()
    ddown = dd.to(down.dtype) if need_down else empty()
    return dx, dweights, dgate_up, ddown


# ---------------------------------------------------------------------------- registration
@collective_op("interlace::moe_experts")
def moe_experts(x: Tensor, weights: Tensor, index: Tensor, gate_up: Tensor, down: Tensor,
                group: int, strategy: str) -> Tensor:  # fmt: skip
    """The experts of a sequence-parallel MoE layer on this rank's tokens (AGMoE + MoERS;
    see the module docstring)."""
    return _moe_experts(x, weights, index, gate_up, down, group, strategy)


@collective_op("interlace::moe_experts_backward")
def moe_experts_backward(
    dy: Tensor, x: Tensor, weights: Tensor, index: Tensor, gate_up: Tensor, down: Tensor,
    group: int, need_x: bool, need_weights: bool, need_gate_up: bool, need_down: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx, dweights, dgate_up, ddown)`` of :func:`moe_experts` from ``dy`` (the ``none``
    path's gradients; an unneeded one is empty)."""
    return _moe_experts_backward(dy, x, weights, index, gate_up, down, group, need_x,
                                 need_weights, need_gate_up, need_down)  # fmt: skip


@moe_experts.register_fake
def _(x, weights, index, gate_up, down, group, strategy):
    _check_dims(x, weights, index, gate_up, down)
    _strategy(strategy)
    return x.new_empty(x.shape)


@moe_experts_backward.register_fake
def _(dy, x, weights, index, gate_up, down, group, need_x, need_weights, need_gate_up,
      need_down):  # fmt: skip
    _check_dims(x, weights, index, gate_up, down)
    needs = (need_x, need_weights, need_gate_up, need_down)
    return tuple(
        t.new_empty(t.shape) if need else dy.new_empty(0)
        for t, need in zip((x, weights, gate_up, down), needs)
    )


def _setup(ctx, inputs, output):
    x, weights, index, gate_up, down, group, strategy = inputs
    ctx.save_for_backward(x, weights, index, gate_up, down)
    ctx.group = group


def _grads(ctx, dy):
    x, weights, index, gate_up, down = ctx.saved_tensors
    nx, nw, _, ngu, nd = ctx.needs_input_grad[:5]
    if not (nx or nw or ngu or nd):
        return None, None, None, None, None, None, None
    dx, dw, dgu, dd = torch.ops.interlace.moe_experts_backward(
        dy, x, weights, index, gate_up, down, ctx.group, nx, nw, ngu, nd
    )
    pick = [t if need else None for t, need in ((dx, nx), (dw, nw), (dgu, ngu), (dd, nd))]
    return pick[0], pick[1], None, pick[2], pick[3], None, None


torch.library.register_autograd("interlace::moe_experts", _grads, setup_context=_setup)


__all__ = ["OP_STRATEGIES", "ExpertContexts", "close_contexts", "moe_experts",
           "moe_experts_backward"]  # fmt: skip
