"""The public dense ops as torch custom ops (``torch.ops.interlace.*``), so that
``torch.compile(fullgraph=True)`` traces a model that calls them without graph breaks.

Every op takes plain tensors, ints and strings: the process group is an integer handle from
:func:`register_group`, and the op's context (its symmetric buffers, signals and plans) is
looked up in a module-level cache keyed by (op, handle, dtype, strategy, n, k): built on
the first call and rebuilt with twice the rows when a call needs more. Every call is
collective, so every rank builds and rebuilds the same contexts in the same order.

A cached context that failed (a ``CrossRankError`` in one of its calls, after which it
refuses calls) or was closed is closed and rebuilt at its next call, so one failed step
does not poison the process. The decision rests on the context's own failed state, which
a cross-rank fault sets on every rank at the same call on the ``cpu`` backend (every rank
raises at the end of the failing call). On a GPU each rank raises at its next call on the
context or at ``check()``, which need not be the same call on every rank: after catching
such an error, call :func:`check` on every rank before the next step, so that every rank
marks the same contexts failed and rebuilds them at the same call::

    h = interlace.ops.library.register_group(group)
    c = torch.ops.interlace.ag_gemm(a_shard, b, None, h, "auto")   # all_gather(a) @ b
    y = torch.ops.interlace.gemm_rs(a, b, None, h, "auto")         # reduce_scatter(a @ b)

A custom op pays the dispatcher on every call; :mod:`interlace.ops.autograd` has the same
ops as plain functions (``interlace.ops.autograd.ag_gemm(...)``, same arguments) that go
straight to the implementations below in eager mode and through these custom ops only
while ``torch.compile`` traces: what :mod:`interlace.nn` calls.

Ops (``b`` is ``[k, n]``, read contiguous by the fused GEMMs: store a weight that way; a
transposed view of a contiguous ``[n, k]`` weight is accepted, its contiguous copy made
once per weight version and kept while the weight lives, see :func:`contiguous_b`):

* ``ag_gemm(a, b, bias, group, strategy)``: ``all_gather(a) @ b + bias``.
* ``gemm_rs(a, b, bias, group, strategy)``: ``reduce_scatter(a @ b) + bias`` (rows).
* ``gemm_ar(a, b, bias, group, strategy)``: ``all_reduce(a @ b) + bias``.
* ``all_gather(x, group, method)``, ``reduce_scatter(x, group, method)``,
  ``all_reduce(x, group, method)``: along dim 0, as :class:`~interlace.AllGather` etc.
  (``method`` ``"default"`` is the context's default method).
* ``ag_gemm_backward`` / ``gemm_rs_backward``: the fused GEMMs' backward passes, each one
  op so its communication overlaps its GEMMs inside. ``db`` comes out laid out as ``b``.

Every op's autograd formula is registered at the end of this module
(``torch.library.register_autograd``); :mod:`interlace.ops.autograd` describes them.

A one-rank group runs the local math (``torch.matmul``, copies): there is nothing to
communicate. Results are always new tensors (a context's own buffers are copied out).
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..errors import InterlaceError, InterlaceTypeError, InterlaceValueError
from ..runtime import Group, fork, join, use_stream
from ._context import grown_capacity
from .ag_gemm import AGGemm
from .collectives import AllGather, AllReduce, ReduceScatter
from .gemm_ar import GemmAR
from .gemm_rs import GemmRS

# ---------------------------------------------------------------------------- group handles
_lock = threading.Lock()
_groups: dict[int, Group] = {}  # handle -> group
_handles: dict[str, int] = {}  # Group.uid -> handle


#: a handle is ``serial * HANDLE_STRIDE + world size``: the fake impls' output shapes
#: depend on the world size, and a compiled graph holds the handle as a constant, so graphs
#: compiled for worlds of different sizes never share an entry of inductor's on-disk cache
#: (with the serial alone, two processes' first groups of 2 and 4 ranks would both be 1)
HANDLE_STRIDE = 1 << 16


def register_group(group: Group) -> int:
    """The integer handle that names ``group`` in a custom op's arguments (the same handle
    for the same group on every later call; see :data:`HANDLE_STRIDE`)."""
    if not isinstance(group, Group):
        raise InterlaceTypeError(f"register_group: expected an interlace Group, got {type(group)}")
    handle = _handles.get(group.uid)  # registered already: no lock (per-call path, traceable)
    if handle is not None:
        return handle
    with _lock:
        handle = _handles.get(group.uid)
        if handle is None:
            handle = (len(_groups) + 1) * HANDLE_STRIDE + group.world_size
            _handles[group.uid] = handle
            _groups[handle] = group
        return handle


def group_of(handle: int) -> Group:
    """The group registered under ``handle``."""
    group = _groups.get(int(handle))
    if group is None:
        raise InterlaceValueError(f"no interlace group is registered under handle {handle}")
    return group


# ---------------------------------------------------------------------------- context cache
#: (op, handle, dtype, strategy, n, k) -> context; module-level cache, keyed explicitly
_contexts: dict[tuple, object] = {}


def _unusable(ctx) -> bool:
    """``ctx`` refuses calls: closed, or failed in an earlier call (itself, or the
    ``signal_reorder`` context a GEMM+RS / GEMM+AR runs through)."""
    inner = getattr(ctx, "_signal_reorder", None)
    return any(c is not None and (c._closed or c.failed) for c in (ctx, inner))


def _cached(key: tuple):
    """The cached context under ``key``, or None. A failed or closed one is closed and
    dropped from the cache, and returned closed: the caller builds a fresh one of (at
    least) its capacity (see the module docstring)."""
    ctx = _contexts.get(key)
    if ctx is not None and _unusable(ctx):
        del _contexts[key]
        ctx.close()
    return ctx


def _cached_or_grown(key: tuple, need: int, capacity_of, build, multiple: int = 1):
    """The cached context under ``key`` when it can take ``need`` (``capacity_of(ctx)``);
    else ``build(capacity)``, cached under ``key``: for a new key, or after a failure, of
    at least the old capacity; when the cached one is too small, of at least twice its
    capacity (the old one closed first: collective, every rank outgrows it on the same
    call). Capacities are ``grown_capacity(need, multiple)`` or more."""
    ctx = _cached(key)
    if ctx is not None and not ctx._closed and capacity_of(ctx) >= need:
        return ctx
    if ctx is None or ctx._closed:  # new, or rebuilt after a failure: as large as it was
        cap = max(grown_capacity(need, multiple), capacity_of(ctx) if ctx is not None else 0)
    else:
        cap = max(grown_capacity(need, multiple), 2 * capacity_of(ctx))
        ctx.close()
    ctx = _contexts[key] = build(cap)
    return ctx


def _gemm_context(cls, group: Group, handle: int, strategy: str, rows: int, n: int, k: int, dtype):
    """The cached ``cls`` context (AGGemm: ``rows`` gathered rows; GemmRS / GemmAR: ``rows``
    input rows) able to run a call of this size; rebuilt larger when it is not, and rebuilt
    (as large) when it failed."""
    return _cached_or_grown(
        (cls.op_name, handle, dtype, strategy, n, k), rows, lambda c: c.max_m,
        lambda cap: cls(group, max_m=cap, n=n, k=k, dtype=dtype, strategy=strategy),
        group.world_size,
    )  # fmt: skip


def _collective_context(cls, group: Group, handle: int, method: str, numel: int, dtype):
    """The cached collective context of capacity ``numel`` (per-rank input for all-gather
    and all-reduce, per-rank output for reduce-scatter), rebuilt larger when needed."""
    kw = {} if method == "default" else {"method": method}
    return _cached_or_grown(
        (cls.op_name, handle, dtype, method, 0, 0), numel, lambda c: c.max_numel,
        lambda cap: cls(group, max_numel=cap, dtype=dtype, **kw),
    )  # fmt: skip


def contexts() -> dict[tuple, object]:
    """The cached contexts (a copy of the cache), for inspection."""
    return dict(_contexts)


def check(group: Group | None = None) -> None:
    """Wait for the device and for every rank (collective: call on every rank), then
    ``check()`` every cached context (of ``group``, or all): a context that a fault touched
    is marked failed on every rank alike (after the host barrier every rank's kernels have
    finished, so every rank reads the same fault record) and is rebuilt at its next call.
    Raises the first such context's error, after checking all of them."""
    handle = None if group is None else _handles.get(group.uid)
    cached = [(k, c) for k, c in _contexts.items() if handle is None or k[1] == handle]
    groups = {k[1]: _groups[k[1]] for k, _ in cached}
    for g in groups.values():
        if g.backend == "cuda":
            torch.cuda.synchronize(g.device)
        g.host_barrier()
    first = None
    for _, ctx in cached:
        if _unusable(ctx):
            continue
        try:
            ctx.check()
            inner = getattr(ctx, "_signal_reorder", None)
            if inner is not None:
                inner.check()
        except InterlaceError as e:
            first = first or e
    if first is not None:
        raise first


def clear_cache(group: Group | None = None) -> None:
    """Close and forget the cached contexts (of ``group``, or all): collective, call on
    every rank."""
    handle = None if group is None else _handles.get(group.uid)
    for key in [k for k in _contexts if handle is None or k[1] == handle]:
        _contexts.pop(key).close()
    _transposed.clear()


# ---------------------------------------------------------------------------- operand layout
#: id(base tensor) -> (weakref to it, version, view geometry, contiguous copy)
_transposed: dict[int, tuple] = {}


def contiguous_b(b: torch.Tensor) -> torch.Tensor:
    """``b`` as the contiguous ``[k, n]`` tensor the fused GEMMs read. A transposed view of
    a contiguous tensor (``linear.weight.t()``) is copied once per version of that tensor:
    the copy is kept while the tensor lives and is made again after it changes in place
    (an optimizer step), so inference and gradient-accumulation steps copy a weight once."""
    if b.is_contiguous():
        return b
    base = b._base if b._base is not None else b
    geometry = (tuple(b.shape), tuple(b.stride()), b.storage_offset(), b.dtype, b.device)
    found = _transposed.get(id(base))
    if found is not None:
        ref, version, geo, copy = found
        if ref() is base and version == b._version and geo == geometry:
            return copy
    copy = b.contiguous()
    key = id(base)
    try:
        ref = weakref.ref(base, lambda _r, key=key: _transposed.pop(key, None))
    except TypeError:  # not weak-referenceable: no caching
        return copy
    _transposed[key] = (ref, b._version, geometry, copy)
    return copy


def _check_2d(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.dim() != 2:
            raise InterlaceValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")


def _local_linear(a, b, bias):
    return torch.matmul(a, b) if bias is None else torch.addmm(bias, a, b)


# ---------------------------------------------------------------------------- implementations
def _fused_gemm(cls, a, b, bias, group: int, strategy: str):
    """AG+GEMM or GEMM+RS (``cls``) by its cached context; a local matmul on one rank."""
    g = group_of(group)
    _check_2d(cls.op_name, a=a, b=b)
    if g.world_size == 1:
        return _local_linear(a, b, bias)
    a, b = a.contiguous(), contiguous_b(b)
    rows = a.shape[0] * (g.world_size if cls is AGGemm else 1)  # (AGGemm: gathered rows)
    ctx = _gemm_context(cls, g, group, strategy, rows, b.shape[1], b.shape[0], a.dtype)
    return ctx(a, b, bias=bias)


def _ag_gemm(a, b, bias, group: int, strategy: str):
    return _fused_gemm(AGGemm, a, b, bias, group, strategy)


def _gemm_rs(a, b, bias, group: int, strategy: str):
    return _fused_gemm(GemmRS, a, b, bias, group, strategy)


def _gemm_ar(a, b, bias, group: int, strategy: str):
    g = group_of(group)
    _check_2d("gemm_ar", a=a, b=b)
    if g.world_size == 1:
        return _local_linear(a, b, bias)
    a, b = a.contiguous(), contiguous_b(b)
    m = a.shape[0]
    pad = -m % g.world_size  # GemmAR splits the rows over the ranks: pad them to a multiple
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    ctx = _gemm_context(GemmAR, g, group, strategy, a.shape[0], b.shape[1], b.shape[0], a.dtype)
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    ctx(a, b, bias=bias, out=out)  # (without out=: a view of the context's buffer)
    return out[:m] if pad else out


def _all_gather(x, group: int, method: str):
    g = group_of(group)
    if g.world_size == 1:
        return x.clone()
    x = x.contiguous()
    ctx = _collective_context(AllGather, g, group, method, x.numel(), x.dtype)
    out = x.new_empty((g.world_size * x.shape[0], *x.shape[1:]))
    return ctx(x, out=out)


def _reduce_scatter(x, group: int, method: str):
    g = group_of(group)
    if g.world_size == 1:
        return x.clone()
    x = x.contiguous()
    ctx = _collective_context(ReduceScatter, g, group, method, x.numel() // g.world_size, x.dtype)
    return ctx(x)


def _all_reduce(x, group: int, method: str):
    g = group_of(group)
    if g.world_size == 1:
        return x.clone()
    x = x.contiguous()
    ctx = _collective_context(AllReduce, g, group, method, x.numel(), x.dtype)
    return ctx(x)


def _dual(cls, strategy: str) -> str:
    """The strategy a backward pass runs ``cls`` with: the forward's when ``cls`` has it
    (``none`` stays the baseline), else ``auto``."""
    return strategy if strategy in cls.STRATEGIES else "auto"


def _side_gather(g: Group, handle: int, x: torch.Tensor):
    """``all_gather(x)`` on a side stream (forked from the current one), so the GEMM the
    caller enqueues next overlaps it; returns ``(gathered, stream)`` for :func:`_join`."""
    stream = fork(g, _BACKWARD_STREAM)
    with use_stream(stream):
        gathered = _all_gather(x, handle, "default")
    if stream is not None:
        x.record_stream(stream)
    return gathered, stream


def _join(g: Group, gathered: torch.Tensor, stream) -> None:
    join(g, stream, _BACKWARD_STREAM)
    if stream is not None:
        gathered.record_stream(torch.cuda.current_stream(g.device))


#: the comm-stream index of the backward passes' side gathers (``runtime.comm_stream``)
_BACKWARD_STREAM = 2


def _column_major(b: torch.Tensor) -> bool:
    """True when ``b`` ``[k, n]`` is stored column-major (a transposed view of a contiguous
    ``[n, k]`` tensor, ``linear.weight.t()``): its gradient is then made in that layout,
    so autograd accumulates it into the ``[n, k]`` parameter without a transposing copy."""
    return not b.is_contiguous() and b.t().is_contiguous()


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x.T @ dy`` (the gradient of ``b`` in ``x @ b``), laid out as ``b`` is."""
    return torch.matmul(dy.t(), x).t() if _column_major(b) else torch.matmul(x.t(), dy)


def _b_transposed(b: torch.Tensor) -> torch.Tensor:
    """``b.T`` as the contiguous ``[n, k]`` operand a backward GEMM reads: a view when
    ``b`` is column-major, else a copy used for this call only (not cached: a cached copy
    would hold a second copy of every weight for the whole of training)."""
    return b.t().contiguous()


def _fused_backward(
    grad, a, b, group: int, strategy: str, need_a: bool, need_b: bool, gathers_a: bool
):
    """``(da, db)`` of a fused GEMM ``y = op(a @ b)`` from ``grad = dy``: ``da`` by the dual
    fused GEMM of ``grad @ b.T`` while the operand ``db`` needs whole is all-gathered on a
    side stream, then ``db`` laid out as ``b``. ``gathers_a`` (``ag_gemm``): the dual is
    GEMM+RS and ``db = all_gather(a).T @ grad``; else (``gemm_rs``) the dual is AG+GEMM and
    ``db = a.T @ all_gather(grad)``. An unneeded gradient is empty."""
    g = group_of(group)
    grad = grad.contiguous()
    empty = grad.new_empty(0)
    if g.world_size == 1:
        da = torch.matmul(grad, b.t()) if need_a else empty
        db = _weight_grad(a, grad, b) if need_b else empty
        return da, db
    gathered = stream = None
    if need_b:
        gathered, stream = _side_gather(g, group, a if gathers_a else grad)
    da = empty
    if need_a:
        dual, cls = (_gemm_rs, GemmRS) if gathers_a else (_ag_gemm, AGGemm)
        da = dual(grad, _b_transposed(b), None, group, _dual(cls, strategy))
    db = empty
    if need_b:
        _join(g, gathered, stream)
        db = _weight_grad(gathered, grad, b) if gathers_a else _weight_grad(a, gathered, b)
    return da, db


def _ag_gemm_backward(dc, a, b, group: int, strategy: str, need_a: bool, need_b: bool):
    """Gradients of ``c = all_gather(a) @ b``: ``da = reduce_scatter(dc @ b.T)`` by the
    fused GEMM+RS while ``a`` is gathered again on a side stream; then
    ``db = all_gather(a).T @ dc`` (laid out as ``b``). Returns ``(da, db)``; an unneeded
    one is empty."""
    return _fused_backward(dc, a, b, group, strategy, need_a, need_b, gathers_a=True)


def _gemm_rs_backward(dy, a, b, group: int, strategy: str, need_a: bool, need_b: bool):
    """Gradients of ``y = reduce_scatter(a @ b)``: ``da = all_gather(dy) @ b.T`` by the
    fused AG+GEMM while ``dy`` is gathered on a side stream for ``db = a.T @
    all_gather(dy)`` (laid out as ``b``). Returns ``(da, db)``; an unneeded one is empty."""
    return _fused_backward(dy, a, b, group, strategy, need_a, need_b, gathers_a=False)


# ---------------------------------------------------------------------------- registration
Tensor = torch.Tensor


def collective_op(name: str):
    """``torch.library.custom_op(name, mutates_args=())`` for an op every rank of the group
    must call, marked side-effectful (``torch.fx.node.has_side_effect``): a compiler may
    not drop it. Without the mark, inductor drops a call whose outputs have no elements
    and whose result nobody reads (a rank with no tokens: its ``ep_moe`` output is
    ``[0, H]``), and that rank then never joins the collective its peers wait in."""

    def register(fn):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        torch.fx.node.has_side_effect(getattr(torch.ops.interlace, name.split("::")[1]).default)
        return op

    return register


@collective_op("interlace::ag_gemm")
def ag_gemm(a: Tensor, b: Tensor, bias: Tensor | None, group: int, strategy: str) -> Tensor:
    """``all_gather(a) @ b (+ bias)`` over the group ``group`` (a handle)."""
    return _ag_gemm(a, b, bias, group, strategy)


@collective_op("interlace::gemm_rs")
def gemm_rs(a: Tensor, b: Tensor, bias: Tensor | None, group: int, strategy: str) -> Tensor:
    """``reduce_scatter(a @ b) (+ bias)`` along rows."""
    return _gemm_rs(a, b, bias, group, strategy)


@collective_op("interlace::gemm_ar")
def gemm_ar(a: Tensor, b: Tensor, bias: Tensor | None, group: int, strategy: str) -> Tensor:
    """``all_reduce(a @ b) (+ bias)``."""
    return _gemm_ar(a, b, bias, group, strategy)


@collective_op("interlace::all_gather")
def all_gather(x: Tensor, group: int, method: str) -> Tensor:
    """All-gather along dim 0."""
    return _all_gather(x, group, method)


@collective_op("interlace::reduce_scatter")
def reduce_scatter(x: Tensor, group: int, method: str) -> Tensor:
    """Reduce-scatter (sum) along dim 0."""
    return _reduce_scatter(x, group, method)


@collective_op("interlace::all_reduce")
def all_reduce(x: Tensor, group: int, method: str) -> Tensor:
    """All-reduce (sum)."""
    return _all_reduce(x, group, method)


@collective_op("interlace::ag_gemm_backward")
def ag_gemm_backward(
    dc: Tensor, a: Tensor, b: Tensor, group: int, strategy: str, need_a: bool, need_b: bool
) -> tuple[Tensor, Tensor]:
    """``(da, db)`` of ``ag_gemm`` (overlapped; see :func:`_ag_gemm_backward`)."""
    return _ag_gemm_backward(dc, a, b, group, strategy, need_a, need_b)


@collective_op("interlace::gemm_rs_backward")
def gemm_rs_backward(
    dy: Tensor, a: Tensor, b: Tensor, group: int, strategy: str, need_a: bool, need_b: bool
) -> tuple[Tensor, Tensor]:
    """``(da, db)`` of ``gemm_rs`` (overlapped; see :func:`_gemm_rs_backward`)."""
    return _gemm_rs_backward(dy, a, b, group, strategy, need_a, need_b)


# ---------------------------------------------------------------------------- fake impls
def _world(group: int) -> int:
    return group_of(group).world_size


def _fake_gemm_checks(op: str, a, b, bias) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise InterlaceValueError(
            f"{op}: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply"
        )
    if bias is not None and tuple(bias.shape) != (b.shape[1],):
        raise InterlaceValueError(f"{op}: bias must have shape ({b.shape[1]},)")


@ag_gemm.register_fake
def _(a, b, bias, group, strategy):
    _fake_gemm_checks("ag_gemm", a, b, bias)
    return a.new_empty(_world(group) * a.shape[0], b.shape[1])


@gemm_rs.register_fake
def _(a, b, bias, group, strategy):
    _fake_gemm_checks("gemm_rs", a, b, bias)
    return a.new_empty(a.shape[0] // _world(group), b.shape[1])


@gemm_ar.register_fake
def _(a, b, bias, group, strategy):
    _fake_gemm_checks("gemm_ar", a, b, bias)
    return a.new_empty(a.shape[0], b.shape[1])


@all_gather.register_fake
def _(x, group, method):
    return x.new_empty((_world(group) * x.shape[0], *x.shape[1:]))


@reduce_scatter.register_fake
def _(x, group, method):
    return x.new_empty((x.shape[0] // _world(group), *x.shape[1:]))


@all_reduce.register_fake
def _(x, group, method):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_grad_like(b):
    """An empty gradient of ``b`` in the layout :func:`_weight_grad` gives it."""
    return b.new_empty(b.shape[::-1]).t() if _column_major(b) else b.new_empty(b.shape)


def _fake_backward(grad, a, b, group, strategy, need_a, need_b):
    """``(da, db)`` of either fused GEMM's backward: ``da`` as ``a``, ``db`` as
    :func:`_weight_grad` lays it out; an unneeded one empty."""
    da = a.new_empty(a.shape) if need_a else grad.new_empty(0)
    db = _fake_grad_like(b) if need_b else grad.new_empty(0)
    return da, db


ag_gemm_backward.register_fake(_fake_backward)
gemm_rs_backward.register_fake(_fake_backward)


# ---------------------------------------------------------------------------- autograd
# The backward formulas (see interlace.ops.autograd's docstring), written once for both
# routes: ``via`` holds the callees, the custom ops here (a traced graph) or the
# implementations (interlace.ops.autograd's eager Functions).
def _fused_gemm_grads(ctx, grad, backward):
    """``(da, db)`` of a fused GEMM by its backward op ``backward``; None where not needed."""
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    if not (need_a or need_b):
        return None, None
    da, db = backward(grad, a, b, ctx.group, ctx.strategy, need_a, need_b)
    return (da if need_a else None), (db if need_b else None)


def _ag_gemm_grads(ctx, dc, via):
    da, db = _fused_gemm_grads(ctx, dc, via.ag_gemm_backward)
    dbias = dc.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return da, db, dbias, None, None


def _gemm_rs_grads(ctx, dy, via):
    da, db = _fused_gemm_grads(ctx, dy, via.gemm_rs_backward)
    dbias = None
    if ctx.has_bias and ctx.needs_input_grad[2]:  # every rank's rows got the bias: sum all
        dbias = dy.sum(0)
        if group_of(ctx.group).world_size > 1:
            dbias = via.all_reduce(dbias, ctx.group, "default")
    return da, db, dbias, None, None


def _gemm_ar_grads(ctx, dy, via=None):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = torch.matmul(dy, b.t()) if need_a else None
    db = _weight_grad(a, dy, b) if need_b else None
    dbias = dy.sum(0) if ctx.has_bias and need_bias else None
    return da, db, dbias, None, None


def _all_gather_grads(ctx, dy, via):
    return via.reduce_scatter(dy.contiguous(), ctx.group, "default"), None, None


def _reduce_scatter_grads(ctx, dy, via):
    return via.all_gather(dy.contiguous(), ctx.group, "default"), None, None


def _all_reduce_grads(ctx, dy, via=None):
    return dy, None, None


def _setup_gemm(ctx, inputs, output):
    a, b, bias, group, strategy = inputs
    ctx.save_for_backward(a, b)
    ctx.group, ctx.strategy, ctx.has_bias = group, strategy, bias is not None


def _setup_collective(ctx, inputs, output):
    ctx.group = inputs[1]


def _custom(formula):
    def backward(ctx, grad):
        return formula(ctx, grad, torch.ops.interlace)

    return backward


for _name, _formula, _setup in (
    ("ag_gemm", _ag_gemm_grads, _setup_gemm),
    ("gemm_rs", _gemm_rs_grads, _setup_gemm),
    ("gemm_ar", _gemm_ar_grads, _setup_gemm),
    ("all_gather", _all_gather_grads, _setup_collective),
    ("reduce_scatter", _reduce_scatter_grads, _setup_collective),
    ("all_reduce", _all_reduce_grads, _setup_collective),
):
    torch.library.register_autograd(f"interlace::{_name}", _custom(_formula), setup_context=_setup)


__all__ = [
    "ag_gemm",
    "ag_gemm_backward",
    "all_gather",
    "all_reduce",
    "check",
    "clear_cache",
    "contexts",
    "contiguous_b",
    "gemm_ar",
    "gemm_rs",
    "gemm_rs_backward",
    "group_of",
    "reduce_scatter",
    "register_group",
]
