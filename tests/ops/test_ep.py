"""Expert-parallel dispatch / combine (``EPAllToAll``), its ``none`` baseline and ``EPMoE``
against float32 references built from every rank's gathered inputs: random, skewed and
adversarial routing (a rank that receives nothing, every token to one expert, -1 slots,
repeated experts), top-k from 1 to 8, ragged token counts, repeated calls on one context,
FP8 dispatch against a quantise-dequantise reference, capacity overflow and bad expert
ids raised on every rank, bad arguments raised before launch, and (on GPUs) CUDA-graph
replay with new routing. The low-latency mode (``EPLowLatency``, both arrival protocols,
bf16 and FP8 dispatch) against the same references, and ``EPMoE``'s overlapped ``fused``
and ``serial`` strategies against an fp32 MoE reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import interlace
from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.ops.ep import EPAllToAll, EPCapacityError, EPMoE
from interlace.ops.ep.baseline import a2a_combine, a2a_dispatch
from tests.ops._helpers import (
    capture,
    counting,
    expect_error,
    nans,
    rand,
    rel_err,
    replay,
    run_on_gpus,
    sync,
)

TOL = 1e-2


def _gather_padded(t, max_tokens, group):
    """Every rank's ``t`` (first dim <= max_tokens) as a list, through a padded all-gather."""
    n = torch.tensor([t.shape[0]], device=t.device)
    ns = [torch.empty_like(n) for _ in range(group.world_size)]
    dist.all_gather(ns, n)
    pad = t.new_zeros((max_tokens, *t.shape[1:]))
    pad[: t.shape[0]] = t
    parts = [torch.empty_like(pad) for _ in range(group.world_size)]
    dist.all_gather(parts, pad)
    return [p[: int(m)] for p, m in zip(parts, ns)]


def _routing(gen, kind, n, topk, experts, world):
    """Expert ids ``[n, topk]`` (int64) and fp32 weights for a routing ``kind``."""
    if n == 0:
        idx = torch.zeros(0, topk, dtype=torch.int64)
    elif kind == "random":
        idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(n)])
    elif kind == "skewed":  # most pairs on the first experts (and so on rank 0)
        probs = torch.tensor([4.0 ** -(e // 2) for e in range(experts)])
        idx = torch.stack([torch.multinomial(probs, topk, generator=gen) for _ in range(n)])
    elif kind == "not_rank0":  # rank 0 receives nothing
        e_loc = experts // world
        pool = torch.arange(e_loc, experts)
        idx = pool[torch.randint(len(pool), (n, topk), generator=gen)]  # repeats allowed
    elif kind == "one_expert":  # every token to expert 1, the other slots -1 or repeated
        idx = torch.full((n, topk), -1, dtype=torch.int64)
        idx[:, 0] = 1
        if topk > 2:
            idx[:, 2] = 1  # the same expert twice: two rows, both weighted
    else:
        raise ValueError(kind)
    w = torch.rand(n, topk, generator=gen) + 0.1
    return idx.to(torch.int64), w.float()


def _expected_rows(group, xs, idxs, e_loc):
    """This rank's expanded rows (local expert, source, token, k) and per-expert counts."""
    r = group.rank
    rows, counts = [], []
    for e in range(e_loc):
        g = r * e_loc + e
        n = 0
        for x, idx in zip(xs, idxs):
            tok, _ = (idx == g).nonzero(as_tuple=True)
            rows.append(x[tok])
            n += tok.numel()
        counts.append(n)
    return torch.cat(rows) if rows else None, counts


def _scale_of(ids):
    return 1.0 + 0.05 * ids.float()


def _check_call(group, ctx, gen, kind, n, calls_tol=TOL, poison_out=True, offset=0):
    """One dispatch + combine against the reference. ``poison_out``: combine into a given
    NaN-filled ``out`` (else it allocates its own); ``offset``: ``x`` that many bytes past
    a 16-byte boundary (a Triton kernel specialised otherwise must not run on it)."""
    dev, w, r = group.device, group.world_size, group.rank
    x = rand(gen, n, ctx.hidden, dtype=ctx.dtype, device="cpu")
    idx, wts = _routing(gen, kind, n, ctx.topk, ctx.experts, w)
    h = ctx.dispatch(_on_device(x, dev, offset), idx.to(dev), wts.to(dev))
    sync(group)
    xs = _gather_padded(x.to(dev), ctx.max_tokens, group)
    idxs = _gather_padded(idx.to(dev), ctx.max_tokens, group)
    exp_rows, exp_counts = _expected_rows(group, [a.cpu() for a in xs], [a.cpu() for a in idxs],
                                          ctx.e_loc)  # fmt: skip
    counts = h.expert_counts.cpu().tolist()
    assert counts == exp_counts, f"{kind}: counts {counts} != {exp_counts}"
    total = sum(counts)
    assert h.expert_offsets.cpu().tolist() == torch.tensor(counts).cumsum(0).tolist()
    got = h.recv_x[:total].cpu()
    if ctx.fp8:
        got = _dequant(got, h.recv_scale[:total].cpu())
        exp_rows = _dequant(*_quant(exp_rows.float()))
    if total:
        err = rel_err(got, exp_rows)
        # fp8: codes may differ by one step where a value sits on a rounding boundary
        assert err < (1e-2 if ctx.fp8 else 1e-3), f"{kind}: rows differ, rel err {err:.2e}"
    # expert e scales its rows by 1 + 0.05 * (global id): the combine reference is exact
    ids = torch.repeat_interleave(torch.arange(ctx.e_loc) + r * ctx.e_loc, torch.tensor(counts))
    eo = nans(ctx.capacity, ctx.hidden, dtype=ctx.dtype, device="cpu")
    if total:
        eo[:total] = (got.float() * _scale_of(ids)[:, None]).to(ctx.dtype)
    out = nans(n, ctx.hidden, dtype=ctx.dtype, device=dev) if poison_out else None
    out = ctx.combine(eo.to(dev), h, out=out)
    sync(group)
    xq = x.float() if not ctx.fp8 else _dequant(*_quant(x.float()))
    xq = xq.to(ctx.dtype).float() if not ctx.fp8 else xq
    valid = idx >= 0
    sc = _scale_of(idx.clamp_min(0)) * wts * valid
    ref = (sc[:, :, None] * xq[:, None, :]).sum(1)
    if n:
        err = rel_err(out.cpu(), ref)
        assert err < calls_tol, f"{kind}: combine rel err {err:.2e}"
        assert not out.isnan().any()
    return True


def _on_device(x, dev, offset=0):
    """``x`` copied to ``dev``, starting ``offset`` bytes past a 16-byte boundary."""
    if not offset:
        return x.to(dev)
    skip = offset // x.element_size()
    out = torch.empty(x.numel() + skip, dtype=x.dtype, device=dev)[skip:].view(x.shape)
    out.copy_(x)
    assert out.data_ptr() % 16 == offset
    return out


def _quant(x):
    """e4m3 codes and fp32 scales (one per 128 values of the last dim) of fp32 ``x``."""
    g = x.unflatten(-1, (-1, 128))
    s = g.abs().amax(-1).clamp_min(1e-12) / 448.0
    q = (g / s[..., None]).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def _dequant(q, s):
    return (q.float().unflatten(-1, (-1, 128)) * s[..., None]).flatten(-2)


def _dispatch_body(group, topk, e_loc, hidden, kinds, fp8=False, max_tokens=13):
    gen = torch.Generator().manual_seed(17 + group.rank)
    w = group.world_size
    ctx = EPAllToAll(group, max_tokens, hidden, w * e_loc, topk, fp8=fp8)
    try:
        for i, kind in enumerate(kinds):
            n = max_tokens if i % 2 == 0 else max(0, max_tokens - 5 - 3 * group.rank)
            _check_call(group, ctx, gen, kind, n)
        ctx.check()
    finally:
        ctx.close()
    return True


@pytest.mark.parametrize(
    "topk, e_loc, hidden, kinds",
    [
        (1, 1, 40, ("random", "one_expert", "random")),
        (3, 2, 72, ("skewed", "not_rank0", "one_expert")),
        (8, 4, 24, ("random", "skewed")),
    ],
)
def test_dispatch_combine(world, topk, e_loc, hidden, kinds):
    if topk > world.world_size * e_loc:
        pytest.skip("topk larger than the expert count")
    world.run(_dispatch_body, topk, e_loc, hidden, kinds)


def test_dispatch_fp8(world):
    if world.world_size == 4 and world.backend == "cpu":
        pytest.skip("fp8 covered at W = 2, 3 on the CPU")
    world.run(_dispatch_body, 2, 2, 256, ("random", "skewed"), fp8=True, max_tokens=6)


def _baseline_body(group):
    """``none`` gives the same expanded rows (same order) and combine as EPAllToAll, and
    EPMoE ``fused`` matches ``none``."""
    gen = torch.Generator().manual_seed(5 + group.rank)
    w, dev, hidden, topk, e_loc = group.world_size, group.device, 32, 3, 2
    with EPAllToAll(group, 9, hidden, w * e_loc, topk) as ctx:
        x = rand(gen, 9 - group.rank, hidden, dtype=torch.bfloat16, device=dev)
        idx, wts = _routing(gen, "random", x.shape[0], topk, w * e_loc, w)
        idx, wts = idx.to(dev), wts.to(dev)
        h = ctx.dispatch(x, idx, wts)
        rows, counts, offs, state = a2a_dispatch(group, x, idx, wts, w * e_loc)
        sync(group)
        assert torch.equal(h.expert_counts.cpu(), counts.cpu())
        assert torch.equal(h.recv_x[: rows.shape[0]].cpu(), rows.cpu())
        eo = torch.zeros(ctx.capacity, hidden, dtype=torch.bfloat16, device=dev)
        eo[: rows.shape[0]] = rand(gen, rows.shape[0], hidden, dtype=torch.bfloat16, device=dev)
        y = ctx.combine(eo, h)
        y_ref = a2a_combine(group, eo[: rows.shape[0]], state)
        sync(group)
        assert rel_err(y, y_ref) < TOL
    weight = rand(torch.Generator().manual_seed(3 + group.rank), e_loc, hidden, hidden,
                  dtype=torch.bfloat16, device=dev, scale=0.2)  # fmt: skip
    outs = []
    for strategy in EPMoE.STRATEGIES:
        with EPMoE(group, 9, hidden, w * e_loc, topk, strategy=strategy) as moe:
            outs.append(moe(x, idx, wts, weight))
            outs.append(moe(x, idx, wts, weight))  # repeated call
            sync(group)
    ref = _moe_reference(x, idx, wts, weight, group, e_loc)
    for o in outs:
        assert rel_err(o, ref) < 2 * TOL
    return True


def _moe_reference(x, idx, wts, weight, group, e_loc):
    """fp32 top-k weighted sum of each token's experts' linear maps (weights gathered)."""
    ws = [torch.empty_like(weight) for _ in range(group.world_size)]
    dist.all_gather(ws, weight)
    allw = torch.cat(ws).float()  # [E, H, H]
    ref = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(idx.shape[1]):
        ok = idx[:, j] >= 0
        y = torch.bmm(x.float()[:, None, :], allw[idx[:, j].clamp_min(0)])[:, 0]
        ref += (wts[:, j] * ok)[:, None] * y
    return ref


@pytest.mark.own_gpu  # all_to_all_single on CUDA tensors: NCCL, not the shared-GPU gloo group
def test_baseline_and_moe(world):
    world.run(_baseline_body)


def _dispatch_checked(ctx, *args):
    ctx.dispatch(*args)
    ctx.check()


def _errors_body(group):
    """Capacity overflow and an out-of-range expert id raise on every rank and move no
    rows; the context works afterwards. Bad arguments raise before any launch."""
    gen = torch.Generator().manual_seed(3 + group.rank)
    w, dev, hidden = group.world_size, group.device, 16
    ctx = EPAllToAll(group, 8, hidden, 2 * w, 2, capacity=10)
    try:
        x = rand(gen, 8, hidden, dtype=torch.bfloat16, device=dev)
        wts = torch.rand(8, 2, device=dev)
        every = torch.tensor([[0, 1]] * 8, device=dev)  # all to rank 0: 16 * w rows > 10
        try:
            ctx.dispatch(x, every, wts)
            ctx.check()
        except EPCapacityError as e:
            assert "rank 0" in str(e) and "capacity of 10" in str(e), str(e)
        else:
            raise AssertionError("no EPCapacityError")
        bad = torch.tensor([[0, 2 * w + group.rank]] * 8, device=dev)
        expect_error(InterlaceValueError, "expert id", _dispatch_checked, ctx, x, bad, wts)
        _check_call(group, ctx, gen, "random", 2)  # still usable
        expect_error(InterlaceValueError, "max_tokens", ctx.dispatch, x.repeat(2, 1), every, wts)
        expect_error(InterlaceTypeError, "dtype", ctx.dispatch, x.float(), every, wts)
        expect_error(InterlaceValueError, "topk_idx", ctx.dispatch, x, every[:, :1], wts)
        expect_error(InterlaceTypeError, "topk_idx", ctx.dispatch, x, every.float(), wts)
        expect_error(InterlaceValueError, "x must be", ctx.dispatch, x[:, :8], every, wts)
        h = ctx.dispatch(x[:1], every[:1] + 2, wts[:1])
        expect_error(InterlaceValueError, "expert_out", ctx.combine, x, h)
        eo = torch.zeros(ctx.capacity, hidden, dtype=torch.bfloat16, device=dev)
        ctx.combine(eo, h)
        h2 = ctx.dispatch(x[:1], every[:1] + 2, wts[:1])
        expect_error(InterlaceValueError, "latest dispatch", ctx.combine, eo, h)
        ctx.combine(eo, h2)
        ctx.check()
    finally:
        ctx.close()
    expect_error(InterlaceValueError, "multiple", EPAllToAll, group, 8, 16, 2 * w + 1, 2)
    expect_error(InterlaceValueError, "fp8", EPAllToAll, group, 8, 100, 2 * w, 2, fp8=True)
    return True


def test_errors(world):
    world.run(_errors_body)


def _graph_replays(group, ctx, gen, eo, kinds):
    """Capture dispatch + combine of ``ctx`` (``eo``: the expert outputs it combines, a
    copy of the rows received, dequantised with FP8 dispatch) in a CUDA graph, replay it
    with new tokens and routing of each of ``kinds`` written into the captured inputs:
    every replay matches the reference."""
    dev, w, n = group.device, group.world_size, ctx.max_tokens
    x = torch.empty(n, ctx.hidden, dtype=torch.bfloat16, device=dev)
    idx = torch.empty(n, ctx.topk, dtype=torch.int64, device=dev)
    wts = torch.empty(n, ctx.topk, dtype=torch.float32, device=dev)

    def fill(kind):
        x.copy_(rand(gen, n, ctx.hidden, dtype=torch.bfloat16, device=dev))
        i, ww = _routing(gen, kind, n, ctx.topk, ctx.experts, w)
        idx.copy_(i)
        wts.copy_(ww)

    def step():
        h = ctx.dispatch(x, idx, wts)
        eo.copy_(_dequant(h.recv_x, h.recv_scale) if ctx.fp8 else h.recv_x)
        return ctx.combine(eo, h)

    fill("random")
    graph, y = capture(step)
    for kind in kinds:
        fill(kind)
        replay(graph, y)
        xr = _dequant(*_quant(x.float())) if ctx.fp8 else x.float()
        ref = (wts * (idx >= 0))[:, :, None].float() * xr[:, None, :]
        assert rel_err(y, ref.sum(1)) < TOL, kind
    ctx.check()


def _graph_body(group):
    """Capture dispatch + combine in a CUDA graph, replay with new routing and tokens
    written into the captured inputs; every replay matches the reference."""
    gen = torch.Generator().manual_seed(11 + group.rank)
    w, dev, hidden, topk, e_loc, n = group.world_size, group.device, 7168, 8, 4, 64
    ctx = EPAllToAll(group, n, hidden, w * e_loc, topk)
    try:
        eo = torch.empty(ctx.capacity, hidden, dtype=torch.bfloat16, device=dev)
        _graph_replays(group, ctx, gen, eo, ("random", "skewed", "not_rank0", "random"))
        for _ in range(3):  # eager calls (replayed from eager graphs) after the capture
            _check_call(group, ctx, gen, "skewed", n)
    finally:
        ctx.close()
    return True


@pytest.mark.gpu
def test_graph_replay(world):
    run_on_gpus(world, _graph_body, why="CUDA graphs need a GPU")


def _big_body(group):
    """Hidden 7168, top-8, 256 experts over the ranks, ragged token counts, fp8 too."""
    for fp8 in (False, True):
        _dispatch_body(group, 8, 256 // group.world_size, 7168, ("random", "skewed", "one_expert"),
                       fp8=fp8, max_tokens=300)  # fmt: skip
    return True


@pytest.mark.gpu
def test_large_hidden(world):
    run_on_gpus(world, _big_body, why="GPU sizes")


def test_the_routing_fast_path_agrees_with_the_full_checks(monkeypatch):
    """``routing_args_fit`` (one expression, what an eager call pays for) accepts exactly
    what the full checks accept, over valid inputs and each kind of bad one."""
    from types import SimpleNamespace

    from interlace.ops.ep import layout

    cpu = torch.device("cpu")
    ctx = SimpleNamespace(group=SimpleNamespace(device=cpu), dtype=torch.bfloat16, hidden=8,
                          max_tokens=4, topk=2)  # fmt: skip
    # (a fake context: the full checks' ``_check_placed``, as the contexts have it)
    ctx._check_placed = lambda name, t: interlace.ops._context.OpContext._check_placed(ctx, name, t)
    ctx.op_name = "ep_dispatch"

    bf, i64, z = torch.bfloat16, torch.int64, torch.zeros

    def args(**change):
        a = dict(x=z(3, 8, dtype=bf), idx=z(3, 2, dtype=i64), w=z(3, 2))
        a.update(change)
        return a["x"], a["idx"], a["w"]

    cases = [
        args(), args(idx=z(3, 2, dtype=torch.int32)), args(w=z(3, 2, dtype=bf)),
        args(x=z(0, 8, dtype=bf), idx=z(0, 2, dtype=i64), w=z(0, 2)),
        # bad ones: x's dtype, width, token count, dims, layout, type; then the routing's
        args(x=z(3, 8)), args(x=z(3, 9, dtype=bf)), args(x=z(5, 8, dtype=bf)),
        args(x=z(8, dtype=bf)), args(x=z(8, 3, dtype=bf).t()), args(x=[[0.0] * 8] * 3),
        args(idx=z(3, 2, dtype=torch.int16)), args(idx=z(3, 3, dtype=i64)),
        args(idx=z(2, 3, dtype=i64).t()), args(idx=None),
        args(w=z(3, 2, dtype=torch.float16)), args(w=z(4, 2)), args(w=z(2, 3).t()),
        args(w=z(3, 2, dtype=torch.float64)),
    ]  # fmt: skip
    fits = [layout.routing_args_fit(ctx, *c) for c in cases]
    monkeypatch.setattr(layout, "routing_args_fit", lambda *a: False)  # the full checks alone
    accepted = []
    for c in cases:
        try:
            layout.check_routing_args("ep_dispatch", *c, ctx)
            accepted.append(True)
        except (InterlaceTypeError, InterlaceValueError):
            accepted.append(False)
    assert fits == accepted, list(zip(fits, accepted))
    assert fits[:4] == [True] * 4 and not any(fits[4:])


def test_replay_keys_differ_wherever_the_checks_could():
    """``replay_key`` (what an eager call that replays its graph directly is matched by):
    equal for operands alike in dtype, shape, strides, device and 16-byte alignment, and
    different when any of those differs or the call's own fields do; no key for an operand
    that is not a tensor."""
    from interlace.ops._context import replay_key

    z, bf = torch.zeros, torch.bfloat16
    x, i = z(4, 8, dtype=bf), z(4, 2, dtype=torch.int64)
    key, ptrs = replay_key("dispatch", (x, i))
    assert ptrs == (x.data_ptr(), i.data_ptr())
    assert replay_key("dispatch", (z(4, 8, dtype=bf), z(4, 2, dtype=torch.int64)))[0] == key
    buf = z(33, dtype=bf)
    others = [
        ("combine", (x, i)), ("dispatch", (x.float(), i)), ("dispatch", (z(5, 8, dtype=bf), i)),
        ("dispatch", (z(8, 4, dtype=bf).t(), i)), ("dispatch", (buf[1:].view(4, 8), i)),
        ("dispatch", (x, i.int())), ("dispatch", (x, z(4, 3, dtype=torch.int64))),
    ]  # fmt: skip
    assert len({replay_key(*o)[0] for o in others} | {key}) == len(others) + 1
    assert replay_key("dispatch", (x, None)) == (None, None)
    assert replay_key("dispatch", ([[0.0]], i)) == (None, None)


class _StandInGraph:
    """Stands in for an armed ``EagerGraph`` on the CPU backend: records each launch's
    operands and addresses (nothing runs)."""

    next_set = None

    def __init__(self):
        self.launches = []

    def launch(self, operands, ptrs):
        self.launches.append((operands, ptrs))


def _short_path_body(group):
    """The short path's Python on the CPU backend (no graphs there: a stand-in armed by
    hand for this call's key): a dispatch like the armed one launches it with its operands
    and their addresses and returns the handle of this call; a combine without ``out``
    launches with a fresh output of the tokens' shape, and one with ``out=`` into that
    ``out`` where its key (with ``out``'s) was armed; a call of another dtype, an ``out``
    of another alignment, one after the context failed or closed, and one while a fault is
    pending go the whole way (each raising as that way does)."""
    from interlace.errors import ContextClosedError, ContextFailedError
    from interlace.ops._context import Armed, replay_key
    from interlace.ops.ep import EPLowLatency

    dev, w = group.device, group.world_size
    gen = torch.Generator().manual_seed(group.rank)
    ctx = EPLowLatency(group, 4, 16, 2 * w, 2)
    x = rand(gen, 4, 16, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
    wts = torch.ones(4, 2, device=dev)
    h = ctx.dispatch(x, idx, wts)  # the whole way (the call slot holds its fields)
    eo = torch.zeros(h.recv_x.shape, dtype=torch.bfloat16, device=dev)
    ctx.combine(eo, h)
    graph = _StandInGraph()
    armed = Armed(graph, None, ctx._kind_now, ctx.call_flag, ctx.pad.call_names)
    ctx._replays = {
        replay_key("dispatch", (x, idx, wts))[0]: armed,
        replay_key(("combine", 4), (eo,))[0]: armed,
    }
    x2, idx2, wts2 = x.clone(), idx.clone(), wts.clone()
    calls = ctx._calls
    h2 = ctx.dispatch(x2, idx2, wts2)
    ((ops, ptrs),) = graph.launches
    assert ops == (x2, idx2, wts2) and ptrs == (x2.data_ptr(), idx2.data_ptr(), wts2.data_ptr())
    assert h2.num_tokens == 4 and h2.call == calls + 1 == ctx._dispatched[0]
    y = ctx.combine(eo, h2)
    ops, ptrs = graph.launches[-1]
    assert ops[0] is eo and ops[1] is y and ptrs == (eo.data_ptr(), y.data_ptr())
    assert y.shape == (4, 16) and y.dtype == torch.bfloat16
    expect_error(InterlaceTypeError, "dtype", ctx.dispatch, x.float(), idx, wts)
    out = torch.empty(4, 16, dtype=torch.bfloat16, device=dev)
    assert ctx.combine(eo, ctx.dispatch(x, idx, wts), out=out) is out  # (not armed: whole way)
    assert len(graph.launches) == 3  # that dispatch was replayed; its combine was not
    ctx._replays[replay_key(("combine", 4), (eo, out))[0]] = armed
    out2 = torch.empty_like(out)
    assert ctx.combine(eo, ctx.dispatch(x, idx, wts), out=out2) is out2
    assert graph.launches[-1] == ((eo, out2), (eo.data_ptr(), out2.data_ptr()))
    assert len(graph.launches) == 5
    odd = torch.empty(4 * 16 + 2, dtype=torch.bfloat16, device=dev)[2:].view(4, 16)
    assert ctx.combine(eo, ctx.dispatch(x, idx, wts), out=odd) is odd  # another alignment
    assert len(graph.launches) == 6 and graph.launches[-1][0][0] is x  # (its dispatch)
    key = replay_key("dispatch", (x, idx, wts))[0]
    assert ctx._armed(key) is armed
    ctx.error.words[0] = 1  # a fault pending: the whole way, which raises it
    assert ctx._armed(key) is None
    ctx.error.words[0] = 0
    ctx._failed = RuntimeError("a fault")
    expect_error(ContextFailedError, "", ctx.dispatch, x, idx, wts)
    ctx._failed = None
    ctx.close()
    expect_error(ContextClosedError, "closed", ctx.dispatch, x, idx, wts)
    assert len(graph.launches) == 6
    return True


def test_short_path_on_a_stand_in_graph(world):
    if world.world_size != 2 or world.backend != "cpu":
        pytest.skip("the Python of the short path: one CPU world")
    world.run(_short_path_body)


def test_exports():
    from interlace.ops.ep import EPLowLatency
    from interlace.ops.ep.low_latency import EPLowLatency as cls

    assert interlace.ops.ep.EPAllToAll is EPAllToAll
    assert EPLowLatency is cls


# ---------------------------------------------------------------------- low latency


def _ll_rows(group, ctx, x, idx):
    """Low latency's rows per local expert of this rank: every rank's tokens that name it,
    each once, in (source rank, token) order, from every rank's ``x`` and ``idx``."""
    dev = group.device
    xs = [a.cpu() for a in _gather_padded(x.to(dev), ctx.max_tokens, group)]
    idxs = [a.cpu() for a in _gather_padded(idx.to(dev), ctx.max_tokens, group)]
    first = group.rank * ctx.e_loc
    return [
        torch.cat([xx[(ii == first + e).any(1)] for xx, ii in zip(xs, idxs)])
        for e in range(ctx.e_loc)
    ]


def _ll_check_call(group, ctx, gen, kind, n, poison_out=True, offset=0):
    """One low-latency dispatch + combine against references from every rank's inputs:
    rows per expert in (source, token) order, each (token, expert) once; combine of rows
    scaled per expert equals the top-k weighted sum of the scaled token (``poison_out``,
    ``offset``: as for ``_check_call``)."""
    dev, w, r = group.device, group.world_size, group.rank
    x = rand(gen, n, ctx.hidden, dtype=ctx.dtype, device="cpu")
    idx, wts = _routing(gen, kind, n, ctx.topk, ctx.experts, w)
    ctx.recv_x.fill_(float("nan"))
    h = ctx.dispatch(_on_device(x, dev, offset), idx.to(dev), wts.to(dev))
    sync(group)
    counts = h.expert_counts.cpu().tolist()
    eo = nans(*h.recv_x.shape, dtype=ctx.dtype, device="cpu")
    for e, exp in enumerate(_ll_rows(group, ctx, x, idx)):
        g = r * ctx.e_loc + e
        assert counts[e] == exp.shape[0], f"{kind}: expert {e}: {counts[e]} != {exp.shape[0]}"
        got = h.recv_x[e, : counts[e]].cpu()
        assert torch.equal(got, exp), f"{kind}: expert {e} rows differ"
        eo[e, : counts[e]] = (got.float() * _scale_of(torch.tensor(g))).to(ctx.dtype)
    _check_combine(group, ctx, h, eo, idx, wts, x.float(), kind, poison_out)
    return True


def _check_combine(group, ctx, h, eo, idx, wts, x_ref, kind, poison_out=True):
    """Combine of the expert rows ``eo`` (each scaled per expert) equals the top-k
    weighted sum of each token's scaled ``x_ref``; no output row is left unwritten
    (``poison_out``: into a NaN-filled ``out``, else into the one combine allocates)."""
    n = idx.shape[0]
    dev = group.device
    out = nans(n, ctx.hidden, dtype=ctx.dtype, device=dev) if poison_out else None
    out = ctx.combine(eo.to(dev), h, out=out)
    sync(group)
    sc = _scale_of(idx.clamp_min(0)) * wts * (idx >= 0)
    ref = (sc[:, :, None] * x_ref[:, None, :]).sum(1)
    if n:
        assert not out.isnan().any(), kind
        err = rel_err(out.cpu(), ref)
        assert err < TOL, f"{kind}: combine rel err {err:.2e}"


def _ll_body(group, protocol, topk, e_loc, hidden, kinds, max_tokens=7):
    from interlace.ops.ep import EPLowLatency

    gen = torch.Generator().manual_seed(23 + group.rank)
    w = group.world_size
    with EPLowLatency(group, max_tokens, hidden, w * e_loc, topk, protocol=protocol) as ctx:
        for i, kind in enumerate(kinds):
            n = max_tokens if i % 2 == 0 else max(0, max_tokens - 3 - 2 * group.rank)
            _ll_check_call(group, ctx, gen, kind, n)
        ctx.check()
    return True


@pytest.mark.parametrize("protocol", ["flag_in_data", "token_flag"])
def test_low_latency(world, protocol):
    if world.world_size == 4 and world.backend == "cpu":
        pytest.skip("low latency covered at W = 2, 3 on the CPU")
    kinds = ("random", "one_expert", "not_rank0", "skewed")
    world.run(_ll_body, protocol, 3, 2, 20, kinds)


def _ll_fp8_check_call(group, ctx, gen, kind, n):
    """One FP8 low-latency dispatch + combine: each expert's rows (same order as bf16)
    carry the e4m3 codes and the scales of the quantised tokens of every rank (scales
    exact; codes may differ by one step where a value sits on a rounding boundary, which
    the dequantised error bounds); combine of the dequantised rows scaled per expert equals
    the top-k weighted sum of the scaled quantise-dequantised token."""
    dev, w, r = group.device, group.world_size, group.rank
    x = rand(gen, n, ctx.hidden, dtype=ctx.dtype, device="cpu")
    idx, wts = _routing(gen, kind, n, ctx.topk, ctx.experts, w)
    ctx.recv_x.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    ctx.recv_scale.fill_(float("nan"))
    h = ctx.dispatch(x.to(dev), idx.to(dev), wts.to(dev))
    sync(group)
    assert h.recv_x.dtype == torch.float8_e4m3fn and h.recv_scale is ctx.recv_scale
    counts = h.expert_counts.cpu().tolist()
    eo = nans(*h.recv_x.shape, dtype=ctx.dtype, device="cpu")
    for e, exp in enumerate(_ll_rows(group, ctx, x, idx)):
        g = r * ctx.e_loc + e
        exp = exp.float()
        assert counts[e] == exp.shape[0], f"{kind}: expert {e}: {counts[e]} != {exp.shape[0]}"
        q, sc = h.recv_x[e, : counts[e]].cpu(), h.recv_scale[e, : counts[e]].cpu()
        eq, es = _quant(exp)
        assert torch.equal(sc, es), f"{kind}: expert {e} scales differ"
        got = _dequant(q, sc)
        if exp.numel():
            off = (q.view(torch.uint8) != eq.view(torch.uint8)).float().mean().item()
            assert off <= 0.01, f"{kind}: expert {e}: {off:.2%} of the codes differ"
            err = rel_err(got, _dequant(eq, es))
            assert err < 1e-2, f"{kind}: expert {e} rows differ, rel err {err:.2e}"
        eo[e, : counts[e]] = (got * _scale_of(torch.tensor(g))).to(ctx.dtype)
    _check_combine(group, ctx, h, eo, idx, wts, _dequant(*_quant(x.float())), kind)
    return True


def _ll_fp8_body(group, protocol, topk, e_loc, hidden, kinds, max_tokens=7):
    from interlace.ops.ep import EPLowLatency

    gen = torch.Generator().manual_seed(29 + group.rank)
    w = group.world_size
    with EPLowLatency(group, max_tokens, hidden, w * e_loc, topk, protocol=protocol,
                      fp8=True) as ctx:  # fmt: skip
        assert tuple(ctx.recv_scale.shape) == (e_loc, w * max_tokens, hidden // 128)
        for i, kind in enumerate(kinds):  # repeated calls, ragged token counts
            n = max_tokens if i % 2 == 0 else max(0, max_tokens - 3 - 2 * group.rank)
            _ll_fp8_check_call(group, ctx, gen, kind, n)
        ctx.check()
    return True


@pytest.mark.parametrize(
    "protocol, topk, e_loc, hidden",
    [
        ("token_flag", 1, 1, 128),
        ("flag_in_data", 3, 2, 384),  # a ragged last chunk of 256 values in the interpreter
        ("token_flag", 8, 4, 384),
        ("flag_in_data", 8, 4, 256),
    ],
)
def test_low_latency_fp8(world, protocol, topk, e_loc, hidden):
    if world.world_size == 4 and world.backend == "cpu":
        pytest.skip("low latency covered at W = 2, 3 on the CPU")
    kinds = ("random", "skewed", "one_expert", "random")
    world.run(_ll_fp8_body, protocol, topk, e_loc, hidden, kinds)


def _ll_fp8_errors_body(group):
    """FP8 low latency: hidden not a multiple of 128 raises at construction (on every
    rank); combine refuses the e4m3 rows themselves (it takes ``dtype`` rows)."""
    from interlace.ops.ep import EPLowLatency

    w, dev = group.world_size, group.device
    for protocol in ("token_flag", "flag_in_data"):
        expect_error(InterlaceValueError, "multiple of 128", EPLowLatency, group, 8, 200, 2 * w,
                     2, protocol=protocol, fp8=True)  # fmt: skip
    with EPLowLatency(group, 2, 128, w, 1, fp8=True) as ctx:
        x = rand(
            torch.Generator().manual_seed(group.rank), 2, 128, dtype=torch.bfloat16, device=dev
        )
        idx = torch.zeros(2, 1, dtype=torch.int64, device=dev)
        h = ctx.dispatch(x, idx, torch.ones(2, 1, device=dev))
        expect_error(InterlaceTypeError, "dtype", ctx.combine, h.recv_x.clone(), h)
        ctx.combine(torch.zeros(h.recv_x.shape, dtype=torch.bfloat16, device=dev), h)
        ctx.check()
    return True


def test_low_latency_fp8_errors(world):
    if world.world_size == 4 and world.backend == "cpu":
        pytest.skip("covered at W = 2, 3 on the CPU")
    world.run(_ll_fp8_errors_body)


def _ll_errors_body(group):
    """Low latency: an out-of-range expert id raises on every rank and the context works
    afterwards; bad arguments raise before launch."""
    from interlace.ops.ep import EPLowLatency

    gen = torch.Generator().manual_seed(7 + group.rank)
    w, dev = group.world_size, group.device
    with EPLowLatency(group, 4, 16, 2 * w, 2) as ctx:
        x = rand(gen, 4, 16, dtype=torch.bfloat16, device=dev)
        wts = torch.rand(4, 2, device=dev)
        bad = torch.tensor([[0, 2 * w + group.rank]] * 4, device=dev)
        expect_error(InterlaceValueError, "expert id", _dispatch_checked, ctx, x, bad, wts)
        _ll_check_call(group, ctx, gen, "random", 4)  # still usable
        idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
        expect_error(InterlaceValueError, "max_tokens", ctx.dispatch, x.repeat(2, 1), idx, wts)
        expect_error(InterlaceTypeError, "dtype", ctx.dispatch, x.float(), idx, wts)
        odd = _on_device(x.cpu(), dev, 2)  # (2 bytes past a 16-byte boundary)
        expect_error(InterlaceValueError, "4-byte boundary", ctx.dispatch, odd, idx, wts)
        expect_error(InterlaceValueError, "topk_idx", ctx.dispatch, x, idx[:, :1], wts)
        h = ctx.dispatch(x, idx, wts)
        expect_error(InterlaceValueError, "expert_out", ctx.combine, x, h)
        h2 = ctx.dispatch(x, idx, wts)
        expect_error(InterlaceValueError, "latest dispatch", ctx.combine, h2.recv_x, h)
        ctx.combine(h2.recv_x.clone(), h2)
        ctx.check()
    expect_error(InterlaceValueError, "max_tokens", EPLowLatency, group, 257, 16, 2 * w, 2)
    expect_error(InterlaceValueError, "even", EPLowLatency, group, 8, 15, 2 * w, 2)
    expect_error(InterlaceValueError, "protocol", EPLowLatency, group, 8, 16, 2 * w, 2,
                 protocol="x")  # fmt: skip
    return True


def test_low_latency_errors(world):
    if world.world_size == 4 and world.backend == "cpu":
        pytest.skip("covered at W = 2, 3 on the CPU")
    world.run(_ll_errors_body)


def _moe_body(group, kinds):
    """EPMoE ``fused`` (per-source grouped GEMM overlapped with the dispatch) and
    ``serial`` against the fp32 reference, repeated calls, a rank with no tokens."""
    gen = torch.Generator().manual_seed(9 + group.rank)
    w, dev, hidden, topk, e_loc, t = group.world_size, group.device, 40, 3, 2, 7
    weight = rand(gen, e_loc, hidden, hidden, dtype=torch.bfloat16, device=dev, scale=0.2)
    for strategy in ("fused", "serial"):
        with EPMoE(group, t, hidden, w * e_loc, topk, strategy=strategy) as moe:
            for i, kind in enumerate(kinds):
                n = t if i % 2 == 0 else (0 if group.rank == 1 else t - 2)
                x = rand(gen, n, hidden, dtype=torch.bfloat16, device=dev)
                idx, wts = _routing(gen, kind, n, topk, w * e_loc, w)
                y = moe(x, idx.to(dev), wts.to(dev), weight)
                sync(group)
                ref = _moe_reference(x, idx.to(dev), wts.to(dev), weight, group, e_loc)
                if n:
                    err = rel_err(y, ref)
                    assert err < 2 * TOL, f"{strategy} {kind}: rel err {err:.2e}"
            moe.check()
    return True


def test_moe_overlap(world):
    if world.world_size == 4 and world.backend == "cpu":
        pytest.skip("covered at W = 2, 3 on the CPU")
    world.run(_moe_body, ("random", "skewed", "not_rank0"))


def _ll_graph_body(group, protocol, fp8):
    """Low latency under CUDA-graph capture at GPU sizes (hidden 7168, top-8, 128 tokens):
    eager calls, replays with new tokens and routing written into the captured inputs
    (epochs advance on the device; FP8: the graph dequantises the received rows for
    combine), then an eager call with fewer tokens."""
    from interlace.ops.ep import EPLowLatency

    gen = torch.Generator().manual_seed(31 + group.rank)
    w, hidden, topk, e_loc, n = group.world_size, 7168, 8, 8, 128
    ctx = EPLowLatency(group, n, hidden, w * e_loc, topk, protocol=protocol, fp8=fp8)
    check = _ll_fp8_check_call if fp8 else _ll_check_call
    try:
        for kind in ("random", "skewed", "one_expert"):  # eager (replayed from eager graphs)
            check(group, ctx, gen, kind, n)
        eo = torch.empty(ctx.recv_x.shape, dtype=torch.bfloat16, device=group.device)
        _graph_replays(group, ctx, gen, eo, ("random", "skewed", "not_rank0", "one_expert"))
        check(group, ctx, gen, "random", n - 5)
    finally:
        ctx.close()
    return True


def _replayed_body(group, low_latency):
    """Eager calls that replay their graph directly (``OpContext._armed``): a loop of
    dispatch + combine (combine allocating its output) with fresh tokens and routing,
    each against the reference, the third call on taking the short path; then calls that
    must leave it, each still right: another token count, ``x`` 4 bytes past a 16-byte
    boundary, 2 bytes past (low latency: raised before launch, its kernels move 4-byte
    words), a wrong dtype (raised before launch on every rank), an out-of-range expert
    id (replayed, found on the device, raised on every rank by the next call), a call
    captured in a user's CUDA graph; and the short path again after each. Combines into a
    fresh NaN-filled ``out=`` each call take it too (each replay re-points the graph)."""
    from interlace.ops.ep import EPLowLatency

    gen = torch.Generator().manual_seed(41 + group.rank)
    w, dev, n, hidden, topk, e_loc = group.world_size, group.device, 16, 256, 4, 2
    cls = EPLowLatency if low_latency else EPAllToAll
    check = _ll_check_call if low_latency else _check_call
    ctx = cls(group, n, hidden, w * e_loc, topk)
    with ctx, counting(ctx, "_replay") as replayed:

        def calls(count, m=n, poison_out=False, **kw):
            before = len(replayed)
            for i in range(count):
                check(group, ctx, gen, ("random", "skewed")[i % 2], m, poison_out=poison_out, **kw)
            return len(replayed) - before

        # calls 1 and 2 of a kind go the whole way (run, then capture): then dispatch and
        # combine both replay directly
        assert calls(5) == 2 * 3
        # combine with out=: its first call goes the whole way (replaying the same graph,
        # it arms a key that holds out's), the next ones replay directly into their out
        assert calls(4, poison_out=True) == 4 + 3
        assert calls(3, n - 3 - group.rank) == 2 * 1  # another token count: a new kind
        # another alignment: a new kind of dispatch (its combine replays throughout)
        assert calls(3, offset=4) == 1 + 3
        x = rand(gen, n, hidden, dtype=torch.bfloat16, device="cpu")
        idx, wts = (t.to(dev) for t in _routing(gen, "random", n, topk, w * e_loc, w))
        if low_latency:
            odd = _on_device(x, dev, 2)
            expect_error(InterlaceValueError, "4-byte boundary", ctx.dispatch, odd, idx, wts)
            h = ctx.dispatch(x.to(dev), idx, wts)
            eo = _on_device(torch.zeros(h.recv_x.shape, dtype=torch.bfloat16), dev, 2)
            expect_error(InterlaceValueError, "4-byte boundary", ctx.combine, eo, h)
            ctx.combine(eo.clone(), h)
        else:
            # the 4-byte offset's graph serves it (Triton specialises on 16 bytes): its
            # first call goes the whole way, then it replays directly
            assert calls(3, offset=2) == 2 + 3
        x = x.to(dev)
        assert calls(2) == 2 * 2  # the first kind again
        expect_error(InterlaceTypeError, "dtype", ctx.dispatch, x.float(), idx, wts)
        before = len(replayed)
        bad = idx.clone()
        bad[0, 0] = w * e_loc + group.rank
        expect_error(InterlaceValueError, "expert id", _dispatch_checked, ctx, x, bad, wts)
        assert len(replayed) == before + 1  # (the bad call itself replayed)
        assert calls(2) == 2 * 2
        h = ctx.dispatch(x, idx, wts)  # a user's graph of a combine, then eager calls
        eo = torch.zeros(h.recv_x.shape, dtype=torch.bfloat16, device=dev)
        graph, _ = capture(lambda: ctx.combine(eo, ctx.dispatch(x, idx, wts)))
        replay(graph)
        # the capture left the call slot's fields to the graph: the first dispatch after
        # it rewrites them (the whole way), every call after that replays directly
        assert calls(3) == 2 + 3
        ctx.check()
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
def test_replayed_calls(world, low_latency):
    run_on_gpus(world, _replayed_body, low_latency, why="eager graphs need a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("protocol", ["flag_in_data", "token_flag"])
def test_low_latency_graph(world, protocol, fp8):
    run_on_gpus(world, _ll_graph_body, protocol, fp8, why="CUDA graphs need a GPU")
