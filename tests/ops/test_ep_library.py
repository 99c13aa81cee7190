"""The expert-parallel custom ops (``interlace.ops.ep.library``): ``ep_moe`` and its
gradients, ``ep_dispatch`` / ``ep_combine`` and the low-latency pair, each against the
context called directly and against a float32 MoE of every rank's tokens rebuilt on every
rank from shared seeds (ragged token counts, a rank with no tokens, a -1 slot, a token
naming one expert twice, expert outputs poisoned with NaN past the received rows, a
capacity below the bound); ``torch.library.opcheck`` on every op; a
``torch.compile(fullgraph=True)`` of functions calling them against eager; the inference
ops' backward raising; bad arguments raising on every rank; the cache and
``close_contexts``."""

from __future__ import annotations

import shutil

import pytest
import torch

from interlace.errors import InterlaceValueError
from interlace.ops import library
from interlace.ops.ep import EPAllToAll, EPLowLatency, EPMoE
from interlace.ops.ep import library as ep_library
from tests.nn._models import TOL, leaf, rel, seeded, worlds
from tests.ops._helpers import expect_error, recording

ops = torch.ops.interlace
#: hidden, local experts per rank, top-k, max_tokens per rank
H, E_LOC, K, T = 16, 2, 2, 6
#: two CPU ranks, and two ranks sharing one GPU or on two
WORLDS = worlds(cpu=(2,), gpu=(2,))
#: tokens per rank of each call: ragged, then a rank without tokens (rank 1)
COUNTS = ((6, 5, 4), (3, 0, 6))


def _n(call: int, rank: int) -> int:
    return COUNTS[call % 2][rank % 3]


def _inputs(call: int, rank: int, world: int):
    """Rank ``rank``'s tokens ``x [n, H]`` (bfloat16), expert ids ``[n, K]`` (int64:
    distinct experts, but token 0's last slot -1 and token 1 naming one expert twice) and
    float32 weights of call ``call``; every rank can rebuild every rank's."""
    n, e = _n(call, rank), E_LOC * world
    x = seeded(100 * call + rank, n, H)
    g = torch.Generator().manual_seed(200 * call + rank)
    idx = torch.zeros(n, K, dtype=torch.int64)
    for t in range(n):
        idx[t] = torch.randperm(e, generator=g)[:K]
    if n > 0:
        idx[0, -1] = -1
    if n > 1:
        idx[1, 1] = idx[1, 0]
    weights = torch.rand(n, K, generator=g) + 0.1
    return x, idx, weights


def _weight(rank: int, seed: int = 300):
    """Rank ``rank``'s experts ``[E_LOC, H, H]`` (bfloat16)."""
    return seeded(seed + rank, E_LOC, H, H, scale=0.3)


def _moe_reference(xs, idxs, ws, full_w):
    """float32 ``y[t] = sum_k w[t, k] * x[t] @ W[idx[t, k]]`` of the tokens ``xs [N, H]``
    with every expert ``full_w [E, H, H]`` (a -1 slot adds nothing)."""
    valid = idxs >= 0
    rows = torch.einsum("th,tkhj->tkj", xs, full_w[idxs.clamp_min(0)])
    return (rows * (ws * valid)[..., None]).sum(1)


def _everyone(call: int, world: int):
    """Every rank's inputs of ``call``, concatenated in rank order (float32), with each
    rank's row range."""
    parts = [_inputs(call, r, world) for r in range(world)]
    starts = [0]
    for x, _, _ in parts:
        starts.append(starts[-1] + x.shape[0])
    xs, idxs, ws = (torch.cat([p[i] for p in parts]) for i in range(3))
    spans = [slice(starts[r], starts[r + 1]) for r in range(world)]
    return xs.float(), idxs, ws, spans


def _same(out, expect, group, what: str) -> None:
    """``out`` equals ``expect`` (bit for bit on the CPU; on a GPU float atomics in the
    ``none`` path's sums may reorder additions)."""
    if group.backend == "cpu":
        assert torch.equal(out.cpu(), expect.cpu()), what
    else:
        assert rel(out, expect) < 2e-3, what


def _expected_rows(group, call: int):
    """This rank's received rows of ``call`` in EPAllToAll's order (local expert, source
    rank, token, slot) and the per-expert counts, from every rank's inputs."""
    rows, counts = [], []
    for e in range(E_LOC):
        n = 0
        for s in range(group.world_size):
            x, idx, _ = _inputs(call, s, group.world_size)
            tok, _ = (idx == group.rank * E_LOC + e).nonzero(as_tuple=True)
            rows.append(x[tok])
            n += tok.numel()
        counts.append(n)
    return torch.cat(rows), counts


# ---------------------------------------------------------------------------- ep_moe
def _moe_body(group, strategy):
    """Two calls of ``ep_moe`` (ragged tokens, then a rank without any; the second takes
    no gradient of the routing weights): output against EPMoE called directly and against
    float32, every gradient against float32; one cached context, gone after
    ``close_contexts``."""
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    full_w = torch.cat([_weight(s) for s in range(w)]).float()
    weight = _weight(r).to(dev)
    direct = EPMoE(group, T, H, E_LOC * w, K, torch.bfloat16,
                   strategy="fused" if strategy == "auto" else strategy)  # fmt: skip
    for call in range(2):
        want_w = call == 0
        x, idx, ws = (t.to(dev) for t in _inputs(call, r, w))
        xl, wl, wt = leaf(x), ws.clone().requires_grad_(want_w), leaf(weight)
        y = ops.ep_moe(xl, idx, wl, wt, h, strategy, T)
        what = f"{strategy} call {call} (n = {x.shape[0]})"
        assert y.shape == x.shape and y.dtype == torch.bfloat16, what
        _same(y, direct(x, idx, ws, weight), group, f"{what}: vs EPMoE")
        xs, idxs, wss, spans = _everyone(call, w)
        dys = seeded(400 + call, xs.shape[0], H)
        y.backward(dys[spans[r]].to(dev))
        ref_leaves = [leaf(t) for t in (xs, wss, full_w)]
        ref = _moe_reference(ref_leaves[0], idxs, ref_leaves[1], ref_leaves[2])
        (ref * dys.float()).sum().backward()
        mine = slice(r * E_LOC, (r + 1) * E_LOC)  # this rank's experts
        checks = [("y", y, ref[spans[r]]), ("dx", xl.grad, ref_leaves[0].grad[spans[r]]),
                  ("dweight", wt.grad, ref_leaves[2].grad[mine])]  # fmt: skip
        if want_w:
            checks.append(("dweights", wl.grad, ref_leaves[1].grad[spans[r]]))
        else:
            assert wl.grad is None, what
        for name, out, expect in checks:
            assert out.shape == expect.shape, f"{what}: {name} shape"
            assert torch.isfinite(out.float()).all(), f"{what}: {name} not finite"
            if expect.numel():
                err = rel(out, expect)
                assert err < TOL, f"{what}: {name} rel err {err:.2e}"
    direct.close()
    library.check(group)  # the cached context passes the library's check
    keys = [k for k in library.contexts() if k[0] == "ep_moe"]
    resolved = "fused" if strategy == "auto" else strategy
    assert keys == [("ep_moe", h, torch.bfloat16, resolved, H, E_LOC * w, K, T, 0)], keys
    ep_library.close_contexts(h)
    assert not [k for k in library.contexts() if k[0] == "ep_moe"]
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2, 3), gpu=(2,)), indirect=True)
@pytest.mark.parametrize(
    "strategy",
    # (``none`` runs torch.distributed's all-to-all on the group's tensors: on GPUs it needs
    # a GPU per rank)
    ["fused", "serial", pytest.param("none", marks=pytest.mark.own_gpu)],
)
def test_ep_moe_matches_context_and_float32(world, strategy):
    world.run(_moe_body, strategy)


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_ep_moe_auto(world):
    world.run(_moe_body, "auto")


# ---------------------------------------------------------------------------- dispatch / combine
def _nan_past(t, valid):
    """``t`` with the rows ``valid`` does not mark set to NaN (a combine must not read
    them)."""
    return torch.where(valid[..., None], t, torch.full_like(t, float("nan")))


def _dispatch_body(group):
    """Three dispatch + combine calls (ragged tokens; a rank without tokens; a capacity
    below the bound): received rows, counts and offsets against every rank's inputs and
    against EPAllToAll called directly (first call), rows past the received ones zero;
    combine of a per-expert linear map (NaN past the received rows) against EPAllToAll's
    combine and float32."""
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    full_w = torch.cat([_weight(s) for s in range(w)]).float()
    weight = _weight(r).to(dev)
    direct = EPAllToAll(group, T, H, E_LOC * w, K)
    for call, capacity in enumerate((0, 0, 20)):
        x, idx, ws = (t.to(dev) for t in _inputs(call, r, w))
        with torch.no_grad():
            recv, counts, offs = ops.ep_dispatch(x, idx, ws, h, E_LOC * w, T, capacity)
        what = f"call {call}"
        rows = capacity or w * T * K
        assert recv.shape == (rows, H) and recv.dtype == torch.bfloat16, what
        assert counts.dtype == offs.dtype == torch.int32 and counts.shape == (E_LOC,), what
        exp_rows, exp_counts = _expected_rows(group, call)
        total = sum(exp_counts)
        assert counts.cpu().tolist() == exp_counts, f"{what}: counts"
        assert offs.cpu().tolist() == torch.tensor(exp_counts).cumsum(0).tolist(), what
        assert torch.equal(recv[:total].cpu(), exp_rows), f"{what}: rows"
        assert not recv[total:].any(), f"{what}: rows past the received ones"
        got = torch.cat([recv[offs[e] - counts[e] : offs[e]].float() @ weight[e].float()
                         for e in range(E_LOC)])  # fmt: skip
        eo = torch.full((rows, H), float("nan"), dtype=torch.bfloat16, device=dev)
        eo[:total] = got.to(torch.bfloat16)
        with torch.no_grad():
            y = ops.ep_combine(eo, counts, idx, h, T)
        assert y.shape == x.shape and torch.isfinite(y.float()).all(), what
        if call == 0:  # the op equals the context's own calls
            hd = direct.dispatch(x, idx, ws)
            assert torch.equal(hd.recv_x[:total], recv[:total]), f"{what}: vs EPAllToAll"
            assert torch.equal(hd.expert_offsets, offs), what
            eo_direct = torch.zeros(direct.capacity, H, dtype=torch.bfloat16, device=dev)
            eo_direct[:total] = eo[:total]
            _same(y, direct.combine(eo_direct, hd), group, f"{what}: combine vs EPAllToAll")
        _check_combined(y, call, w, r, full_w, what)
    direct.close()
    library.check(group)
    keys = sorted(k[-1] for k in library.contexts() if k[0] == "ep_dispatch")
    assert keys == sorted([20, w * T * K]), keys  # one context per capacity
    ep_library.close_contexts(h)
    assert not [k for k in library.contexts() if k[0] == "ep_dispatch"]
    library.clear_cache(group)
    return True


def _check_combined(y, call, w, r, full_w, what) -> None:
    """``y`` (this rank's combined tokens of call ``call``) against the float32 MoE of
    every rank's inputs."""
    xs, idxs, wss, spans = _everyone(call, w)
    ref = _moe_reference(xs, idxs, wss, full_w)[spans[r]]
    if ref.numel():
        err = rel(y, ref)
        assert err < TOL, f"{what}: combine rel err {err:.2e}"


@pytest.mark.parametrize("world", worlds(cpu=(2, 3), gpu=(2,)), indirect=True)
def test_dispatch_combine_ops(world):
    world.run(_dispatch_body)


def _ll_body(group, protocol):
    """Two low-latency dispatch + combine calls: rows per local expert (each token that
    names the expert once, by source rank then token), the rest zero, against every rank's
    inputs and EPLowLatency called directly; combine of a per-expert linear map (NaN past
    each expert's rows) against EPLowLatency's combine and float32."""
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    full_w = torch.cat([_weight(s) for s in range(w)]).float()
    weight = _weight(r).to(dev)
    direct = EPLowLatency(group, T, H, E_LOC * w, K, protocol=protocol)
    for call in range(2):
        x, idx, ws = (t.to(dev) for t in _inputs(call, r, w))
        with torch.no_grad():
            recv, counts = ops.ep_low_latency_dispatch(x, idx, ws, h, E_LOC * w, T, protocol)
        what = f"{protocol} call {call}"
        assert recv.shape == (E_LOC, w * T, H) and counts.shape == (E_LOC,), what
        for e in range(E_LOC):
            parts = [_inputs(call, s, w) for s in range(w)]
            exp = torch.cat([p[0][(p[1] == r * E_LOC + e).any(1)] for p in parts])
            c = int(counts[e])
            assert c == exp.shape[0], f"{what}: expert {e} count {c} != {exp.shape[0]}"
            assert torch.equal(recv[e, :c].cpu(), exp), f"{what}: expert {e} rows"
            assert not recv[e, c:].any(), f"{what}: expert {e} rows past its count"
        valid = torch.arange(w * T, device=dev)[None, :] < counts[:, None]
        eo = _nan_past(torch.bmm(recv.float(), weight.float()).to(torch.bfloat16), valid)
        with torch.no_grad():
            y = ops.ep_low_latency_combine(eo, counts, idx, h, protocol)
        assert y.shape == x.shape and torch.isfinite(y.float()).all(), what
        hd = direct.dispatch(x, idx, ws)
        assert torch.equal(hd.expert_counts, counts), f"{what}: vs EPLowLatency"
        _same(y, direct.combine(eo.clone(), hd), group, f"{what}: combine vs EPLowLatency")
        _check_combined(y, call, w, r, full_w, what)
    direct.close()
    assert [k for k in library.contexts() if k[0] == "ep_low_latency"]
    ep_library.close_contexts(h)
    assert not [k for k in library.contexts() if k[0] == "ep_low_latency"]
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("protocol", ["auto", "flag_in_data"])
def test_low_latency_ops(world, protocol):
    world.run(_ll_body, protocol)


# ---------------------------------------------------------------------------- opcheck
def _opcheck_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    x, idx, ws = (t.to(dev) for t in _inputs(0, r, w))
    weight = _weight(r).to(dev)
    dy = seeded(500 + r, x.shape[0], H, device=dev)
    e = E_LOC * w
    torch.library.opcheck(ops.ep_moe.default,
                          (leaf(x), idx, leaf(ws), leaf(weight), h, "fused", T))  # fmt: skip
    for needs in ((True, True, True), (False, True, False)):
        torch.library.opcheck(ops.ep_moe_backward.default, (dy, x, idx, ws, weight, h, T, *needs))
    torch.library.opcheck(ops.ep_dispatch.default, (x, idx, ws, h, e, T, 0))
    recv, counts, offs = ops.ep_dispatch(x, idx, ws, h, e, T, 0)
    torch.library.opcheck(ops.ep_combine.default, (recv, counts, idx, h, T))
    torch.library.opcheck(ops.ep_low_latency_dispatch.default, (x, idx, ws, h, e, T, "auto"))
    recv, counts = ops.ep_low_latency_dispatch(x, idx, ws, h, e, T, "auto")
    torch.library.opcheck(ops.ep_low_latency_combine.default, (recv, counts, idx, h, "auto"))
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_opcheck(world):
    world.run(_opcheck_body)


# ---------------------------------------------------------------------------- torch.compile
def _inference_step(x, idx, ws, weight, h: int, experts: int):
    """Dispatch, a grouped linear map, combine; then ``ep_moe`` of the result and a
    low-latency dispatch / linear map / combine of that."""
    recv, counts, offs = ops.ep_dispatch(x, idx, ws, h, experts, T)
    y = ops.ep_combine(torch._grouped_mm(recv, weight, offs=offs), counts, idx, h, T)
    y = ops.ep_moe(y, idx, ws, weight, h, "fused", T)
    recv, counts = ops.ep_low_latency_dispatch(y, idx, ws, h, experts, T, "auto")
    return ops.ep_low_latency_combine(torch.bmm(recv, weight), counts, idx, h, "auto")


def _training_step(x, idx, ws, weight, h: int):
    return ops.ep_moe(x * 2, idx, ws, weight, h, "fused", T).float().square().sum()


def _compile_body(group, backend):
    """The two steps compiled with ``fullgraph=True`` (which raises on any graph break)
    against eager, on two calls (ragged tokens, then a rank without any): the inference
    step's output, the training step's loss and gradients; each graph holds the ops."""
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    weight = _weight(r, 600).to(dev)
    full_w = torch.cat([_weight(s, 600) for s in range(w)]).float()
    graphs: list = []
    torch._dynamo.reset()
    rec = recording(backend, graphs)
    infer = torch.compile(_inference_step, fullgraph=True, backend=rec)
    train = torch.compile(_training_step, fullgraph=True, backend=rec)
    tol = 1e-6 if backend == "aot_eager" else TOL  # (aot_eager runs the eager kernels)
    for call in range(2):
        x, idx, ws = (t.to(dev) for t in _inputs(call, r, w))
        what = f"call {call}"
        with torch.no_grad():
            eager = _inference_step(x, idx, ws, weight, h, E_LOC * w)
            traced = infer(x, idx, ws, weight, h, E_LOC * w)
        assert traced.shape == x.shape and torch.isfinite(traced.float()).all(), what
        if x.shape[0]:
            assert rel(traced, eager) <= tol, f"{what}: inference compiled vs eager"
        grads = []
        for fn in (_training_step, train):
            leaves = [leaf(x), leaf(ws), leaf(weight)]
            loss = fn(leaves[0], idx, leaves[1], leaves[2], h)
            loss.backward()
            grads.append([loss.detach(), *(t.grad for t in leaves)])
        xs, idxs, wss, spans = _everyone(call, w)
        ref = _moe_reference(2 * xs.to(torch.bfloat16).float(), idxs, wss, full_w)
        ref_loss = ref[spans[r]].square().sum()
        for name, got, expect in zip(("loss", "dx", "dweights", "dweight"), *grads):
            assert torch.isfinite(got.float()).all(), f"{what}: {name} not finite"
            if expect.numel() and expect.abs().sum():
                err = rel(got, expect)
                assert err <= max(tol, 1e-3), f"{what}: {name} compiled vs eager: {err:.2e}"
        if x.shape[0]:
            assert rel(grads[1][0], ref_loss) < TOL, f"{what}: loss vs float32"
    targets = [t for g in graphs for t in g]
    for op in ("ep_dispatch", "ep_combine", "ep_moe", "ep_low_latency_dispatch",
               "ep_low_latency_combine"):  # fmt: skip
        assert f"interlace.{op}" in targets, (op, graphs)
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_compile_fullgraph(world):
    """Inductor (on the CPU emulation where a C++ compiler is found, else ``aot_eager``).
    Call 1 gives rank 1 no tokens: inductor drops a call whose output has no elements
    unless the op is marked side-effectful, and the peers then wait for it in vain."""
    cpu_inductor = shutil.which("g++") or shutil.which("c++")
    on_cpu = world.backend == "cpu"
    world.run(_compile_body, "aot_eager" if on_cpu and not cpu_inductor else "inductor")


# ---------------------------------------------------------------------------- errors
def _bad_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    x, idx, ws = (t.to(dev) for t in _inputs(0, 0, w))  # 6 tokens on every rank
    weight = _weight(r).to(dev)
    e = E_LOC * w
    moe, disp = ops.ep_moe, ops.ep_dispatch
    expect_error(InterlaceValueError, "strategy", moe, x, idx, ws, weight, h, "ring", T)
    expect_error(InterlaceValueError, "no interlace group", moe, x, idx, ws, weight, 999,
                 "fused", T)  # fmt: skip
    expect_error(InterlaceValueError, "2-D", moe, x[0], idx, ws, weight, h, "fused", T)
    expect_error(InterlaceValueError, "topk_weights", moe, x, idx, ws[:3], weight, h, "fused", T)
    expect_error(InterlaceValueError, "weight must be", moe, x, idx, ws, weight[:, :8], h,
                 "fused", T)  # fmt: skip
    expect_error(InterlaceValueError, "max_tokens", moe, x, idx, ws, weight, h, "fused", 4)
    expect_error(InterlaceValueError, "multiple", disp, x, idx, ws, h, e + 1, T)
    expect_error(InterlaceValueError, "max_tokens", disp, x, idx, ws, h, e, 0)
    expect_error(InterlaceValueError, "protocol", ops.ep_low_latency_dispatch, x, idx, ws, h,
                 e, T, "smoke")  # fmt: skip
    # a combine needs the dispatch of its sizes, with as many tokens
    eo = torch.zeros(w * T * K, H, dtype=torch.bfloat16, device=dev)
    counts = torch.zeros(E_LOC, dtype=torch.int32, device=dev)
    expect_error(InterlaceValueError, "no dispatch", ops.ep_combine, eo, counts, idx, h, T)
    recv, counts, _ = disp(x, idx, ws, h, e, T)
    expect_error(InterlaceValueError, "tokens on this rank", ops.ep_combine, eo, counts,
                 idx[:2], h, T)  # fmt: skip
    expect_error(InterlaceValueError, "no dispatch", ops.ep_combine, eo[:, :8], counts, idx,
                 h, T)  # fmt: skip
    y = ops.ep_combine(eo, counts, idx, h, T)  # still usable
    assert y.shape == x.shape and not y.any()
    eo_ll = torch.zeros(E_LOC, w * T + 1, H, dtype=torch.bfloat16, device=dev)
    expect_error(InterlaceValueError, "laid out", ops.ep_low_latency_combine, eo_ll, counts,
                 idx, h, "auto")  # fmt: skip
    # the inference ops' backward raises (dispatch, and combine of a grad-requiring input)
    recv, counts, _ = disp(leaf(x), idx, ws, h, e, T)
    expect_error(InterlaceValueError, "inference op", recv.float().sum().backward)
    y = ops.ep_combine(leaf(eo), counts, idx, h, T)
    expect_error(InterlaceValueError, "inference op", y.float().sum().backward)
    recv, counts = ops.ep_low_latency_dispatch(leaf(x), idx, ws, h, e, T, "auto")
    expect_error(InterlaceValueError, "inference op", recv.float().sum().backward)
    y = moe(x, idx, ws, weight, h, "fused", T)  # still usable
    assert torch.isfinite(y.float()).all() and y.shape == x.shape
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_bad_inputs_raise_on_every_rank(world):
    assert world.run(_bad_body) == [True] * world.world_size
