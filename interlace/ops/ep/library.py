"""The expert-parallel ops as torch custom ops, so that ``torch.compile(fullgraph=True)``
traces a model that calls them without graph breaks. Every output's shape follows from
the inputs and the sizes the op's context is built with (``max_tokens``, ``capacity``):
the receive side is sized by the worst case, as the contexts size it, so nothing waits
on the host for a count.

* ``torch.ops.interlace.ep_moe(x, topk_idx, topk_weights, weight, group, strategy,
  max_tokens, capacity=0) -> y``: :class:`~interlace.ops.ep.EPMoE` on this rank's tokens.
  ``x [n, H]`` (``n <= max_tokens``; ``n`` may differ by rank), ``topk_idx [n, k]``
  (int32 / int64 global expert ids, -1 = none), ``topk_weights [n, k]`` (float32 or
  ``x``'s dtype), ``weight [E/W, H, H]`` this rank's experts (``x``'s dtype; ``E = W *
  weight.shape[0]``). ``y [n, H]``: ``y[t] = sum_k topk_weights[t, k] * x[t] @
  W[topk_idx[t, k]]`` over every rank's experts. ``strategy``: ``EPMoE.STRATEGIES`` or
  ``auto`` (= ``fused``, the overlapped path); ``capacity``: received rows per rank, 0
  for the bound that cannot overflow (``W * max_tokens * k``).
* ``torch.ops.interlace.ep_moe_backward(dy, x, topk_idx, topk_weights, weight, group,
  max_tokens, need_x, need_weights, need_weight) -> (dx, dweights, dweight)``: its
  gradients, each typed and shaped as its input (an unneeded one empty; ``topk_idx``
  has none). EPMoE has no backward of its own: this op gathers every rank's tokens, output
  gradients and routing (padded to ``max_tokens`` rows per rank) with interlace's
  all-gather, takes the gradients of this rank's experts by the chain rule written out in
  float32 (a custom op's implementation runs below autograd, so it cannot differentiate
  torch ops inside itself), and reduce-scatters ``dx`` / ``dweights`` back to their
  ranks; ``dweight`` stays with this rank's experts. It moves ``W * max_tokens`` rows of
  ``2 H`` values to every rank, more than the forward's all-to-all: a training step pays
  a dense gather where the forward paid a sparse exchange.
* ``torch.ops.interlace.ep_dispatch(x, topk_idx, topk_weights, group, experts,
  max_tokens, capacity=0) -> (recv_x, expert_counts, expert_offsets)``: the
  :meth:`EPAllToAll.dispatch` handle's tensors. ``recv_x [C, H]`` with ``C = capacity``
  (0: ``W * max_tokens * k``): the received rows grouped by local expert (see
  :class:`~interlace.ops.ep.EPHandle`), rows past ``expert_offsets[-1]`` zero;
  ``expert_counts`` / ``expert_offsets`` int32 ``[E/W]`` (counts and inclusive prefix
  sums, the ``offs`` of ``torch._grouped_mm``).
* ``torch.ops.interlace.ep_combine(expert_out, expert_counts, topk_idx, group,
  max_tokens) -> y``: :meth:`EPAllToAll.combine` of the latest ``ep_dispatch`` with the
  same sizes on this group. ``expert_out [C, H]`` one row per row of ``recv_x``;
  ``expert_counts`` and ``topk_idx`` are the dispatch's (the counts tie the combine to
  its dispatch in a traced graph; ``topk_idx [n, k]`` names the tokens and top-k; the
  routing weights and row layout are those the dispatch left on the device). ``y [n,
  H]``: ``sum_k topk_weights[t, k] * expert_out[row of (t, k)]``, float32 sums.
* ``torch.ops.interlace.ep_low_latency_dispatch(x, topk_idx, topk_weights, group,
  experts, max_tokens, protocol) -> (recv_x, expert_counts)`` and
  ``torch.ops.interlace.ep_low_latency_combine(expert_out, expert_counts, topk_idx,
  group, protocol) -> y``: the same for :class:`~interlace.ops.ep.EPLowLatency`
  (``max_tokens <= 256``, bfloat16 / float16): ``recv_x [E/W, W * max_tokens, H]``,
  expert ``e``'s rows ``recv_x[e, :expert_counts[e]]`` and the rest zero; ``expert_out``
  laid out as ``recv_x``. ``protocol``: ``auto`` or one of ``low_latency.PROTOCOLS``.

Dispatch and combine are inference ops (their backward raises); the dispatch outputs are
copies of the context's buffers (a custom op's outputs are its own), one pass over ``C *
H`` values (the FP8 dispatch modes are not offered as ops). A dispatch and its combine run
on one context: calls of one size alternate dispatch, combine (a graph keeps that order
where each dispatch's tokens depend on the previous combine's output).

``group`` is the integer handle of :func:`interlace.ops.library.register_group`. The
contexts are kept in :mod:`interlace.ops.library`'s cache, keyed by (op name, handle,
dtype, strategy / protocol / ``""``, hidden, experts, top-k, max_tokens, the capacity as
given / the received rows ``C`` / 0, for ``ep_moe`` / ``ep_dispatch`` / low latency):
built at the first call of those sizes (every size is an argument, the same on every
rank, so every rank builds at the same call; a context never grows), rebuilt after a
failed call, freed by
``interlace.ops.library.clear_cache`` or :func:`close_contexts` and checked by
``interlace.ops.library.check``. Every call is collective::

    h = interlace.ops.library.register_group(group)
    y = torch.ops.interlace.ep_moe(x, idx, w, weight, h, "fused", 4096)
    recv, counts, offs = torch.ops.interlace.ep_dispatch(x, idx, w, h, 256, 4096)
    y = torch.ops.interlace.ep_combine(torch._grouped_mm(recv, weight, offs=offs), counts,
                                       idx, h, 4096)
"""

from __future__ import annotations

import torch

from ...errors import InterlaceValueError
from .._context import ContextSet
from ..library import _cached, _contexts, collective_op, group_of
from ..token_grads import gather_tokens
from .dispatch import EPAllToAll
from .ep_moe import EPMoE
from .layout import EPHandle
from .low_latency import DEFAULT_PROTOCOL, PROTOCOLS, EPLowLatency, EPLowLatencyHandle

Tensor = torch.Tensor
#: the strategies ``ep_moe`` takes: EPMoE's, and ``auto`` (= ``fused``)
OP_STRATEGIES = ("auto", *EPMoE.STRATEGIES)
#: the cache keys' first fields (the contexts' op names)
MOE, DISPATCH, LOW_LATENCY = EPMoE.op_name, EPAllToAll.op_name, EPLowLatency.op_name


class MoEEntry(ContextSet):
    """An :class:`EPMoE` as the cache holds it: closed or failed when its all-to-all
    context is (what :mod:`interlace.ops.library`'s cache reads)."""

    op_name = MOE

    def __init__(self, moe: EPMoE):
        super().__init__(moe.a2a)
        self.moe = moe

    @property
    def _closed(self) -> bool:
        return self.moe.a2a._closed


# ---------------------------------------------------------------------------- checks
def _strategy(strategy: str) -> str:
    if strategy not in OP_STRATEGIES:
        raise InterlaceValueError(
            f"ep_moe: strategy must be one of {OP_STRATEGIES}, got {strategy!r}"
        )
    return "fused" if strategy == "auto" else strategy


def _protocol(op: str, protocol: str) -> str:
    if protocol != "auto" and protocol not in PROTOCOLS:
        raise InterlaceValueError(
            f"{op}: protocol must be 'auto' or one of {PROTOCOLS}, got {protocol!r}"
        )
    return DEFAULT_PROTOCOL if protocol == "auto" else protocol


def _check_routing(op: str, x, topk_idx, topk_weights) -> None:
    """The ranks and the shapes that tie a call's tokens and routing together (the
    contexts check the rest: dtypes, devices, sizes against their own)."""
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.dim() != 2:
            raise InterlaceValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if topk_idx.shape != topk_weights.shape or topk_idx.shape[0] != x.shape[0]:
        raise InterlaceValueError(
            f"{op}: topk_idx {tuple(topk_idx.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [{x.shape[0]}, topk] for x "
            f"{tuple(x.shape)}"
        )


def _check_sizes(op: str, world: int, experts: int, max_tokens: int, capacity: int) -> None:
    if max_tokens < 1:
        raise InterlaceValueError(f"{op}: max_tokens must be positive, got {max_tokens}")
    if experts < 1 or experts % world:
        raise InterlaceValueError(
            f"{op}: experts = {experts} must be a positive multiple of the world size {world}"
        )
    if capacity < 0:
        raise InterlaceValueError(f"{op}: capacity must be 0 (the bound) or positive")


def _check_weight(x, weight) -> None:
    if weight.dim() != 3 or tuple(weight.shape[1:]) != (x.shape[1], x.shape[1]):
        raise InterlaceValueError(
            f"ep_moe: weight must be [local experts, {x.shape[1]}, {x.shape[1]}] for x "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )


def _rows(world: int, max_tokens: int, topk: int, capacity: int):
    """The received rows of an ``ep_dispatch``: ``capacity``, or the bound when 0."""
    return capacity if capacity > 0 else world * max_tokens * topk


# ---------------------------------------------------------------------------- context cache
def _context(key: tuple, build):
    """The cached context under ``key``; built by ``build()`` when there is none, and
    rebuilt after a failure (``library._cached``). Every size is in the key, so a context
    never grows."""
    ctx = _cached(key)
    if ctx is None or ctx._closed:
        ctx = _contexts[key] = build()
    return ctx


def _moe_context(handle: int, strategy: str, x, topk: int, weight, max_tokens: int,
                 capacity: int) -> EPMoE:  # fmt: skip
    g = group_of(handle)
    experts = g.world_size * weight.shape[0]
    _check_sizes(MOE, g.world_size, experts, max_tokens, capacity)
    hidden = x.shape[1]
    key = (MOE, handle, x.dtype, strategy, hidden, experts, topk, max_tokens, capacity)
    entry = _context(key, lambda: MoEEntry(EPMoE(
        g, max_tokens, hidden, experts, topk, x.dtype, strategy=strategy,
        capacity=capacity or None,
    )))  # fmt: skip
    return entry.moe


def _dispatch_key(handle, dtype, hidden, experts, topk, max_tokens, rows) -> tuple:
    """``rows``: the received rows (the capacity, resolved), which combine reads off its
    ``expert_out``."""
    return (DISPATCH, handle, dtype, "", hidden, experts, topk, max_tokens, rows)


def _ll_key(handle, dtype, protocol, hidden, experts, topk, max_tokens) -> tuple:
    return (LOW_LATENCY, handle, dtype, protocol, hidden, experts, topk, max_tokens, 0)


def _dispatched(op: str, key: tuple, n: int):
    """The cached context under ``key`` whose latest dispatch had ``n`` tokens on this
    rank (what a combine runs on); raises where there is none."""
    ctx = _cached(key)
    if ctx is None or ctx._closed or ctx._dispatched is None:
        raise InterlaceValueError(
            f"{op}: no dispatch of these sizes ran on this group before (dtype {key[2]}, "
            f"hidden {key[4]}, experts {key[5]}, topk {key[6]}, max_tokens {key[7]}): "
            "call the dispatch op first, with the same sizes"
        )
    if ctx._dispatched[1] != n:
        raise InterlaceValueError(
            f"{op}: topk_idx has {n} rows but the latest dispatch of these sizes had "
            f"{ctx._dispatched[1]} tokens on this rank"
        )
    return ctx


def close_contexts(group: int) -> None:
    """Close and forget the cached expert-parallel contexts of the group with handle
    ``group`` (collective: call on every rank; a later call builds new ones)."""
    for key in [k for k in _contexts if k[0] in (MOE, DISPATCH, LOW_LATENCY) and k[1] == group]:
        _contexts.pop(key).close()


# ---------------------------------------------------------------------------- implementations
def _received(recv_x: Tensor, valid: Tensor) -> Tensor:
    """A copy of the context's ``recv_x`` with the rows ``valid`` does not mark zero (the
    op's output is deterministic, and its own tensor)."""
    return torch.where(valid[..., None], recv_x, recv_x.new_zeros(()))


def _ep_moe(x, topk_idx, topk_weights, weight, group: int, strategy: str, max_tokens: int,
            capacity: int) -> Tensor:  # fmt: skip
    _check_routing(MOE, x, topk_idx, topk_weights)
    _check_weight(x, weight)
    strategy = _strategy(strategy)
    moe = _moe_context(group, strategy, x, topk_idx.shape[1], weight, int(max_tokens),
                       int(capacity))  # fmt: skip
    return moe(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(),
               weight.contiguous())  # fmt: skip


def _ep_moe_backward(dy, x, topk_idx, topk_weights, weight, group: int, max_tokens: int,
                     need_x: bool, need_weights: bool, need_weight: bool
                     ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of :func:`_ep_moe` in float32 from every rank's gathered tokens (see
    the module docstring); an unneeded one is empty."""
    _check_routing(MOE, x, topk_idx, topk_weights)
    _check_weight(x, weight)
    g = group_of(group)
    w, (n, hidden) = g.world_size, x.shape
    e_loc, t = weight.shape[0], int(max_tokens)
    if n > t:
        raise InterlaceValueError(f"ep_moe: {n} tokens, more than max_tokens = {t}")

    def empty():  # (a fresh one each: a custom op's outputs may not alias each other)
        return dy.new_empty(0)

    tg = gather_tokens(x, dy, topk_weights, topk_idx, group, w, t)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    for e in range(e_loc):
        token, slot = torch.where(tg.ids == g.rank * e_loc + e)
        if token.numel() == 0:
            continue
        a, d, we = tg.x[token], tg.dy[token], weight[e].float()
        wv = tg.weights[token, slot][:, None]
        if need_weights:  # d(weight of (t, slot)) = <x[t] @ W[e], dy[t]>
            tg.grads[token, hidden + slot] = ((a @ we) * d).sum(1)
        if need_x:  # dx[t] += weight * dy[t] @ W[e].T
            tg.grads[:, :hidden].index_add_(0, token, (wv * d) @ we.t())
        if need_weight:  # dW[e] = sum of weight * x[t].T dy[t]
            dw[e] = a.t() @ (wv * d)
    dx, dweights = tg.scatter_home(x.dtype, topk_weights.dtype, need_x, need_weights, empty)
    dweight = dw.to(weight.dtype) if need_weight else empty()
    return dx, dweights, dweight


def _ep_dispatch(x, topk_idx, topk_weights, group: int, experts: int, max_tokens: int,
                 capacity: int) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    _check_routing(DISPATCH, x, topk_idx, topk_weights)
    g = group_of(group)
    experts, max_tokens, capacity = int(experts), int(max_tokens), int(capacity)
    _check_sizes(DISPATCH, g.world_size, experts, max_tokens, capacity)
    topk, hidden = topk_idx.shape[1], x.shape[1]
    rows = _rows(g.world_size, max_tokens, topk, capacity)
    key = _dispatch_key(group, x.dtype, hidden, experts, topk, max_tokens, rows)
    ctx = _context(key, lambda: EPAllToAll(
        g, max_tokens, hidden, experts, topk, x.dtype, capacity=rows,
    ))  # fmt: skip
    h = ctx.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous())
    rows = torch.arange(h.recv_x.shape[0], device=x.device)
    recv_x = _received(h.recv_x, rows < h.expert_offsets[-1])
    return recv_x, h.expert_counts.clone(), h.expert_offsets.clone()


def _combine_handle(ctx, n: int):
    """The handle of ``ctx``'s latest dispatch (what its ``combine`` checks and reads)."""
    fields = dict(recv_x=ctx.recv_x, recv_scale=ctx.recv_scale, expert_counts=ctx.expert_counts,
                  num_tokens=n, call=ctx._dispatched[0])  # fmt: skip
    if isinstance(ctx, EPLowLatency):
        return EPLowLatencyHandle(layout=ctx.layout, src_info=ctx.recv_src, **fields)
    return EPHandle(expert_offsets=ctx.expert_offsets, **fields)


def _check_combine(op: str, expert_out, expert_counts, topk_idx, dims: int) -> None:
    if expert_out.dim() != dims or expert_counts.dim() != 1 or topk_idx.dim() != 2:
        raise InterlaceValueError(
            f"{op}: expert_out must be {dims}-D, expert_counts 1-D and topk_idx 2-D, got "
            f"{tuple(expert_out.shape)}, {tuple(expert_counts.shape)}, {tuple(topk_idx.shape)}"
        )


def _ep_combine(expert_out, expert_counts, topk_idx, group: int, max_tokens: int) -> Tensor:
    op = "ep_combine"
    _check_combine(op, expert_out, expert_counts, topk_idx, 2)
    g = group_of(group)
    capacity, hidden = expert_out.shape
    experts, topk = g.world_size * expert_counts.shape[0], topk_idx.shape[1]
    key = _dispatch_key(group, expert_out.dtype, hidden, experts, topk, int(max_tokens),
                        capacity)  # fmt: skip
    ctx = _dispatched(op, key, topk_idx.shape[0])
    return ctx.combine(expert_out.contiguous(), _combine_handle(ctx, topk_idx.shape[0]))


def _ep_low_latency_dispatch(x, topk_idx, topk_weights, group: int, experts: int,
                             max_tokens: int, protocol: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    op = "ep_low_latency_dispatch"
    _check_routing(op, x, topk_idx, topk_weights)
    protocol = _protocol(op, protocol)
    g = group_of(group)
    experts, max_tokens = int(experts), int(max_tokens)
    _check_sizes(op, g.world_size, experts, max_tokens, 0)
    topk, hidden = topk_idx.shape[1], x.shape[1]
    key = _ll_key(group, x.dtype, protocol, hidden, experts, topk, max_tokens)
    ctx = _context(key, lambda: EPLowLatency(
        g, max_tokens, hidden, experts, topk, x.dtype, protocol=protocol,
    ))  # fmt: skip
    h = ctx.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous())
    rows = torch.arange(h.recv_x.shape[1], device=x.device)
    recv_x = _received(h.recv_x, rows[None, :] < h.expert_counts[:, None])
    return recv_x, h.expert_counts.clone()


def _ep_low_latency_combine(expert_out, expert_counts, topk_idx, group: int,
                            protocol: str) -> Tensor:  # fmt: skip
    op = "ep_low_latency_combine"
    _check_combine(op, expert_out, expert_counts, topk_idx, 3)
    protocol = _protocol(op, protocol)
    g = group_of(group)
    e_loc, rows, hidden = expert_out.shape
    if e_loc != expert_counts.shape[0] or rows % g.world_size:
        raise InterlaceValueError(
            f"{op}: expert_out {tuple(expert_out.shape)} must be laid out as the dispatch's "
            f"recv_x [local experts = {expert_counts.shape[0]}, W * max_tokens, hidden]"
        )
    key = _ll_key(group, expert_out.dtype, protocol, hidden, g.world_size * e_loc,
                  topk_idx.shape[1], rows // g.world_size)  # fmt: skip
    ctx = _dispatched(op, key, topk_idx.shape[0])
    return ctx.combine(expert_out.contiguous(), _combine_handle(ctx, topk_idx.shape[0]))


# ---------------------------------------------------------------------------- registration
@collective_op("interlace::ep_moe")
def ep_moe(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, weight: Tensor, group: int,
           strategy: str, max_tokens: int, capacity: int = 0) -> Tensor:  # fmt: skip
    """The expert-parallel MoE layer (:class:`EPMoE`) on this rank's tokens (see the module
    docstring)."""
    return _ep_moe(x, topk_idx, topk_weights, weight, group, strategy, max_tokens, capacity)


@collective_op("interlace::ep_moe_backward")
def ep_moe_backward(
    dy: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, weight: Tensor, group: int,
    max_tokens: int, need_x: bool, need_weights: bool, need_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx, dweights, dweight)`` of :func:`ep_moe` from ``dy`` (an unneeded one is
    empty)."""
    return _ep_moe_backward(dy, x, topk_idx, topk_weights, weight, group, max_tokens, need_x,
                            need_weights, need_weight)  # fmt: skip


@collective_op("interlace::ep_dispatch")
def ep_dispatch(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, group: int, experts: int,
                max_tokens: int, capacity: int = 0) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(recv_x, expert_counts, expert_offsets)`` of :meth:`EPAllToAll.dispatch` (see the
    module docstring). Inference only."""
    return _ep_dispatch(x, topk_idx, topk_weights, group, experts, max_tokens, capacity)


@collective_op("interlace::ep_combine")
def ep_combine(expert_out: Tensor, expert_counts: Tensor, topk_idx: Tensor, group: int,
               max_tokens: int) -> Tensor:  # fmt: skip
    """:meth:`EPAllToAll.combine` of the latest ``ep_dispatch`` of these sizes (see the
    module docstring). Inference only."""
    return _ep_combine(expert_out, expert_counts, topk_idx, group, max_tokens)


@collective_op("interlace::ep_low_latency_dispatch")
def ep_low_latency_dispatch(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, group: int,
                            experts: int, max_tokens: int, protocol: str
                            ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(recv_x, expert_counts)`` of :meth:`EPLowLatency.dispatch` (see the module
    docstring). Inference only."""
    return _ep_low_latency_dispatch(x, topk_idx, topk_weights, group, experts, max_tokens,
                                    protocol)  # fmt: skip


@collective_op("interlace::ep_low_latency_combine")
def ep_low_latency_combine(expert_out: Tensor, expert_counts: Tensor, topk_idx: Tensor,
                           group: int, protocol: str) -> Tensor:  # fmt: skip
    """:meth:`EPLowLatency.combine` of the latest ``ep_low_latency_dispatch`` of these
    sizes (see the module docstring). Inference only."""
    return _ep_low_latency_combine(expert_out, expert_counts, topk_idx, group, protocol)


# ---------------------------------------------------------------------------- fake impls
def _world(group: int) -> int:
    return group_of(group).world_size


@ep_moe.register_fake
def _(x, topk_idx, topk_weights, weight, group, strategy, max_tokens, capacity=0):
    _check_routing(MOE, x, topk_idx, topk_weights)
    _check_weight(x, weight)
    _strategy(strategy)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@ep_moe_backward.register_fake
def _(dy, x, topk_idx, topk_weights, weight, group, max_tokens, need_x, need_weights,
      need_weight):  # fmt: skip
    _check_routing(MOE, x, topk_idx, topk_weights)
    _check_weight(x, weight)
    needs = (need_x, need_weights, need_weight)
    return tuple(
        t.new_empty(t.shape) if need else dy.new_empty(0)
        for t, need in zip((x, topk_weights, weight), needs)
    )


@ep_dispatch.register_fake
def _(x, topk_idx, topk_weights, group, experts, max_tokens, capacity=0):
    _check_routing(DISPATCH, x, topk_idx, topk_weights)
    w = _world(group)
    _check_sizes(DISPATCH, w, experts, max_tokens, capacity)
    rows = _rows(w, max_tokens, topk_idx.shape[1], capacity)
    counts = x.new_empty(experts // w, dtype=torch.int32)
    return x.new_empty(rows, x.shape[1]), counts, torch.empty_like(counts)


@ep_combine.register_fake
def _(expert_out, expert_counts, topk_idx, group, max_tokens):
    _check_combine("ep_combine", expert_out, expert_counts, topk_idx, 2)
    return expert_out.new_empty(topk_idx.shape[0], expert_out.shape[1])


@ep_low_latency_dispatch.register_fake
def _(x, topk_idx, topk_weights, group, experts, max_tokens, protocol):
    op = "ep_low_latency_dispatch"
    _check_routing(op, x, topk_idx, topk_weights)
    _protocol(op, protocol)
    w = _world(group)
    _check_sizes(op, w, experts, max_tokens, 0)
    recv = x.new_empty(experts // w, w * max_tokens, x.shape[1])
    return recv, x.new_empty(experts // w, dtype=torch.int32)


@ep_low_latency_combine.register_fake
def _(expert_out, expert_counts, topk_idx, group, protocol):
    op = "ep_low_latency_combine"
    _check_combine(op, expert_out, expert_counts, topk_idx, 3)
    _protocol(op, protocol)
    return expert_out.new_empty(topk_idx.shape[0], expert_out.shape[2])


# ---------------------------------------------------------------------------- autograd
def _setup_moe(ctx, inputs, output):
    x, topk_idx, topk_weights, weight, group, strategy, max_tokens, *_ = inputs
    ctx.save_for_backward(x, topk_idx, topk_weights, weight)
    ctx.group, ctx.max_tokens = group, max_tokens


def _moe_grads(ctx, dy):
    x, topk_idx, topk_weights, weight = ctx.saved_tensors
    nx, _, nw, nweight = ctx.needs_input_grad[:4]
    rest = (None,) * 4  # group, strategy, max_tokens, capacity
    if not (nx or nw or nweight):
        return (None,) * 4 + rest
    dx, dw, dweight = torch.ops.interlace.ep_moe_backward(
        dy, x, topk_idx, topk_weights, weight, ctx.group, ctx.max_tokens, nx, nw, nweight
    )
    return (dx if nx else None), None, (dw if nw else None), (dweight if nweight else None), *rest


torch.library.register_autograd("interlace::ep_moe", _moe_grads, setup_context=_setup_moe)


def _inference_only(name: str):
    def backward(ctx, *grads):
        raise InterlaceValueError(
            f"{name} is an inference op and has no backward: call it on tensors that do not "
            "require grad (under torch.no_grad() or torch.inference_mode()), or use ep_moe, "
            "which has one"
        )

    return backward


for _name in ("ep_dispatch", "ep_combine", "ep_low_latency_dispatch", "ep_low_latency_combine"):
    torch.library.register_autograd(f"interlace::{_name}", _inference_only(_name))


__all__ = [
    "OP_STRATEGIES",
    "MoEEntry",
    "close_contexts",
    "ep_combine",
    "ep_dispatch",
    "ep_low_latency_combine",
    "ep_low_latency_dispatch",
    "ep_moe",
    "ep_moe_backward",
]
