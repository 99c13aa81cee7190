"""p2p_ring (CommFuse) ops against torch.distributed references: all-gather GEMM,
GEMM + reduce-scatter, query-split attention, fused Ulysses all-to-all, and the autograd of
the two GEMMs, on both schedules and transports, with uneven sub-slices, repeated calls on
one context, poisoned outputs and buffers, and bad inputs that must raise on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.ops.p2p_ring import (
    FuseAGLinear,
    FuseRSLinear,
    P2PRing,
    chunk_bounds,
    fuse_ag,
    fuse_rs,
    partner,
)
from interlace.ops.p2p_ring.plans import all_to_all_plan, gather_plan, reduce_plan
from tests.ops._helpers import gathered, nans, rand, reduced_rows, rel_err

TRANSPORTS = ("p2p", "symm")

# The ring runs torch.distributed P2P and collectives on CUDA tensors (NCCL).
pytestmark = pytest.mark.own_gpu


# ----------------------------------------------------------------------------- helpers
def _dtype(group):
    return torch.float32 if group.backend == "cpu" else torch.bfloat16


def _tol(group):
    return 1e-5 if group.backend == "cpu" else 1e-2


def _schedules(group):
    return ["ring", "pairwise"] if group.world_size % 2 == 0 else ["ring"]


def _rand(gen, group, *shape, requires_grad=False):
    t = rand(gen, *shape, dtype=_dtype(group), device=group.device)
    return t.requires_grad_(requires_grad)


def _nan(group, *shape):
    return nans(*shape, dtype=_dtype(group), device=group.device)


def _check(group, what, y, ref):
    assert y.shape == ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(y).any(), f"{what}: unwritten (NaN) output"
    err = rel_err(y, ref)
    assert err <= _tol(group), f"{what}: relative error {err:.2e} on rank {group.rank}"


def _poison(ring):
    if ring._symm is not None:  # stale data in the receive buffer must not pass
        ring._symm.local.fill_(float("nan"))


# ----------------------------------------------------------------------------- plans (no ranks)
@pytest.mark.parametrize("world", range(1, 9))
def test_plans_are_consistent(world):
    """Every message a plan sends is the one its receiver expects in that slot, and every
    rank ends with every slice (gather) or the sum over all ranks (reduce)."""
    schedules = ["ring"] + (["pairwise"] if world % 2 == 0 else [])
    for sched in schedules:
        if sched == "pairwise":
            for t in range(world - 1):
                met = [partner(r, t, world) for r in range(world)]
                assert all(met[met[r]] == r != met[r] for r in range(world))
            assert all(
                sorted(partner(r, t, world) for t in range(world - 1))
                == [p for p in range(world) if p != r]
                for r in range(world)
            )
        gp = [gather_plan(sched, r, world) for r in range(world)]
        for r, p in enumerate(gp):
            assert sorted(p.order) == list(range(world)) and p.order[0] == r
            for i in range(world - 1):
                sent = p.order[i] if sched == "ring" else r
                receiver = gp[p.dest[i]]
                assert receiver.src[i] == r and receiver.order[i + 1] == sent
        rp = [reduce_plan(sched, r, world) for r in range(world)]
        # symbolic run: the set of ranks whose partial a message carries
        msgs = {}
        for r, p in enumerate(rp):
            assert sorted(p.order) == list(range(world)) and p.order[-1] == r
        for i in range(world):
            for r, p in enumerate(rp):
                have = {r}
                for k in p.acc[i]:
                    slice_, ranks = msgs[(r, k)]
                    assert slice_ == p.order[i], (sched, world, r, i)
                    have |= ranks
                if i < world - 1:
                    assert rp[p.dest[i]].src[i] == r
                    msgs[(p.dest[i], i)] = (p.order[i], have)
                else:
                    assert have == set(range(world)), (sched, world, r)
        ap = [all_to_all_plan(sched, r, world) for r in range(world)]
        for r, p in enumerate(ap):
            assert sorted(p.order) == list(range(world)) and p.order[-1] == r
            for i in range(world - 1):
                assert p.dest[i] == p.order[i] and ap[p.dest[i]].src[i] == r


def test_chunk_bounds():
    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(2, 5) == [(0, 1), (1, 2)]
    assert chunk_bounds(7, 1) == [(0, 7)]


# ----------------------------------------------------------------------------- GEMMs
def _gemm_body(group, transport, seed):
    gen = torch.Generator().manual_seed(seed + 101 * group.rank)
    W, R, K, N = group.world_size, 10, 24, 16
    rings = {
        s: P2PRing(group, _dtype(group), schedule=s, transport=transport) for s in _schedules(group)
    }
    try:
        for (sched, ring), chunks in itertools.product(rings.items(), (1, 3)):
            tag = f"{transport}/{sched}/chunks={chunks}"
            for call in range(2):  # repeated calls on one context
                x, w = _rand(gen, group, R, K), _rand(gen, group, K, N)
                _poison(ring)
                out = _nan(group, W * R, N)
                y = ring.ag_gemm(x, w, out=out, chunks=chunks)
                assert y.data_ptr() == out.data_ptr()
                _check(
                    group, f"ag_gemm {tag} call {call}", y, gathered(x, group).float() @ w.float()
                )
                _poison(ring)
                y, g = ring.ag_gemm(x, w, return_gathered=True, chunks=chunks)
                assert torch.equal(g, gathered(x, group)), f"ag_gemm gathered {tag}"
                _check(group, f"ag_gemm (no out) {tag}", y, gathered(x, group).float() @ w.float())
                _poison(ring)
                _, g = ring.ag_gemm(x, None, return_gathered=True, chunks=chunks)
                assert torch.equal(g, gathered(x, group)), f"gather only {tag}"

                xs = _rand(gen, group, W * R, K)
                _poison(ring)
                out = _nan(group, R, N)
                y = ring.gemm_rs(xs, w, out=out, chunks=chunks)
                assert y.data_ptr() == out.data_ptr()
                _check(
                    group,
                    f"gemm_rs {tag} call {call}",
                    y,
                    reduced_rows(xs.float() @ w.float(), group),
                )
        for sched, ring in rings.items():
            for mode in ("both", "weights", "inputs"):
                _autograd_check(group, gen, ring, f"{transport}/{sched}/{mode}", mode)
        _layers_check(group, gen, next(iter(rings.values())), transport)
    finally:
        for ring in rings.values():
            ring.close()
    return True


def _autograd_check(group, gen, ring, tag, mode):
    """MLP-like chain ``fuse_rs(fuse_ag(x, w1), w2)`` and its gradients against the dual
    computation with torch.distributed collectives."""
    R, K, N = 6, 16, 20
    x = _rand(gen, group, R, K, requires_grad=mode != "weights")
    w1 = _rand(gen, group, K, N, requires_grad=mode != "inputs")
    w2 = _rand(gen, group, N, K, requires_grad=mode != "inputs")
    gy = _rand(gen, group, R, K)
    _poison(ring)
    h = fuse_ag(x, w1, ring)
    if mode == "weights":
        h = h.detach()  # fuse_rs then needs its weight's gradient only
    y = fuse_rs(h, w2, ring)
    y.backward(gy)

    xg = gathered(x.detach(), group).float()
    h_ref = xg @ w1.detach().float()
    _check(group, f"fuse_ag fwd {tag}", h, h_ref)
    _check(group, f"fuse_rs fwd {tag}", y, reduced_rows(h_ref @ w2.detach().float(), group))
    gyg = gathered(gy, group).float()
    gh = gyg @ w2.detach().float().t()
    if mode != "inputs":
        _check(group, f"grad w2 {tag}", w2.grad, h_ref.t() @ gyg)
    if mode == "both":
        _check(group, f"grad w1 {tag}", w1.grad, xg.t() @ gh)
    if mode != "weights":
        _check(group, f"grad x {tag}", x.grad, reduced_rows(gh @ w1.detach().float().t(), group))


def _layers_check(group, gen, ring, transport):
    R, D, F_ = 8, 16, 24
    up, down = FuseAGLinear(ring, D, F_), FuseRSLinear(ring, F_, D)
    x = _rand(gen, group, R, D, requires_grad=True)
    y = down(up(x))
    gy = _rand(gen, group, R, D)
    y.backward(gy)
    xg = gathered(x.detach(), group).float()
    h = xg @ up.weight.detach().float().t()
    _check(
        group,
        f"layers fwd {transport}",
        y,
        reduced_rows(h @ down.weight.detach().float().t(), group),
    )
    gh = gathered(gy, group).float() @ down.weight.detach().float()
    _check(
        group,
        f"layers grad down {transport}",
        down.weight.grad,
        (h.t() @ gathered(gy, group).float()).t(),
    )
    _check(group, f"layers grad up {transport}", up.weight.grad, (xg.t() @ gh).t())
    _check(
        group,
        f"layers grad x {transport}",
        x.grad,
        reduced_rows(gh @ up.weight.detach().float(), group),
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gemms_and_autograd(world, transport):
    world.run(_gemm_body, transport, 7)


# ----------------------------------------------------------------------------- attention
def _attention_body(group, transport, seed):
    gen = torch.Generator().manual_seed(seed + 101 * group.rank)
    W, r = group.world_size, group.rank
    B, h, L, d, H = 2, 2, 5, 8, 12
    S = W * L
    rings = {
        s: P2PRing(group, _dtype(group), schedule=s, transport=transport) for s in _schedules(group)
    }
    try:
        for (sched, ring), chunks, causal in itertools.product(
            rings.items(), (1, 2), (False, True)
        ):
            tag = f"{transport}/{sched}/chunks={chunks}/causal={causal}"
            q, k, v = (_rand(gen, group, B, h, S, d) for _ in range(3))
            w_o = _rand(gen, group, h * d, H)
            o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            o = o.permute(2, 0, 1, 3)  # [S, B, h, d]

            _poison(ring)
            out = _nan(group, L, B, H)
            y = ring.attn_rs(q, k, v, w_o, causal=causal, out=out, chunks=chunks)
            assert y.data_ptr() == out.data_ptr()
            ref = reduced_rows(o.reshape(S * B, h * d) @ w_o.float(), group).view(L, B, H)
            _check(group, f"attn_rs {tag}", y, ref)

            _poison(ring)
            out = _nan(group, L, B, W * h, d)
            y = ring.attn_a2a(q, k, v, causal=causal, out=out)
            parts = [torch.empty_like(o) for _ in range(W)]
            dist.all_gather(parts, o.contiguous())
            ref = torch.cat([p[r * L : (r + 1) * L] for p in parts], dim=2)
            _check(group, f"attn_a2a {tag}", y, ref)
    finally:
        for ring in rings.values():
            ring.close()
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_attention(world, transport):
    world.run(_attention_body, transport, 11)


# ----------------------------------------------------------------------------- bad inputs
def _raises(exc, fn, what):
    try:
        fn()
    except exc as e:
        return str(e)
    raise AssertionError(f"{what}: no {exc.__name__} raised")


def _errors_body(group):
    W, dt = group.world_size, _dtype(group)
    gen = torch.Generator().manual_seed(5 + group.rank)
    ring = P2PRing(group, dt, transport="p2p")
    try:
        x = _rand(gen, group, W * 4 + 1, 8)  # ragged: not divisible by the world size
        w = _rand(gen, group, 8, 6)
        msg = _raises(InterlaceValueError, lambda: ring.gemm_rs(x, w), "ragged gemm_rs")
        assert "multiple of the world size" in msg, msg
        q = _rand(gen, group, 1, 2, W * 3 + 1, 4)
        _raises(
            InterlaceValueError,
            lambda: ring.attn_rs(q, q, q, _rand(gen, group, 8, 4)),
            "ragged attn_rs",
        )
        _raises(InterlaceValueError, lambda: ring.attn_a2a(q, q, q), "ragged attn_a2a")
        _raises(InterlaceValueError, lambda: P2PRing(group, dt, schedule="star"), "bad schedule")
        _raises(InterlaceValueError, lambda: P2PRing(group, dt, transport="smoke"), "bad transport")
        _raises(InterlaceValueError, lambda: P2PRing(group, dt, chunks=0), "chunks=0")
        _raises(InterlaceValueError, lambda: ring.ag_gemm(x, _rand(gen, group, 9, 6)), "w rows")
        _raises(InterlaceTypeError, lambda: ring.ag_gemm(x.double(), w), "dtype")
        if W % 2:
            msg = _raises(
                InterlaceValueError, lambda: P2PRing(group, dt, schedule="pairwise"), "odd"
            )
            assert "even world size" in msg, msg
            _raises(
                InterlaceValueError, lambda: ring.ag_gemm(x, w, schedule="pairwise"), "odd call"
            )
        # nothing was sent by the failed calls: the context still works
        x = _rand(gen, group, W * 4, 8)
        _check(
            group, "after errors", ring.gemm_rs(x, w), reduced_rows(x.float() @ w.float(), group)
        )
        # compute_only (benchmark use) moves nothing and returns the right shapes
        with P2PRing(group, dt, transport="compute_only") as dry:
            assert dry.gemm_rs(x, w).shape == (4, 6)
            assert dry.ag_gemm(x, w).shape == (W * W * 4, 6)
    finally:
        ring.close()
    return True


def test_errors(world):
    world.run(_errors_body)
