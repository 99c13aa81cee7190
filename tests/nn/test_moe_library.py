"""The tensor-parallel MoE experts as custom ops (``torch.ops.interlace.moe_experts`` /
``moe_experts_backward``, ``interlace.ops.moe.library``): output and the gradients of the
tokens, routing weights and both weight shards against a float32 MoE of the whole sequence
built on every rank from shared seeds (a ragged token count, an expert no token picks, a
second larger call that grows the cached contexts, a call without the weights' gradient),
for every strategy; ``torch.library.opcheck`` on both ops; a
``torch.compile(fullgraph=True)`` trace of :class:`interlace.nn.MoEBlock` through forward
and backward against the same block run eagerly and against float32, ``auto`` picking the
same path compiled as eagerly; bad arguments raising on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import interlace.nn as inn
from interlace.errors import InterlaceValueError
from interlace.ops import library
from interlace.ops.moe import moe_rs
from tests.nn._models import TOL, leaf, rel, seeded, worlds
from tests.ops._helpers import expect_error, recording

ops = torch.ops.interlace
#: experts, hidden, intermediate columns per rank, top-k
E, H, I_LOC, K = 4, 16, 8, 2
#: CPU ranks (and 3 for the op's math), and two ranks sharing one GPU or on two
WORLDS = worlds(cpu=(2,), gpu=(2,))


def _full_weights(seed: int, world: int):
    """Full expert weights, the same on every rank: ``gate_up [E, 2I, H]`` (gate rows
    first) and ``down [E, H, I]``, bfloat16 values held in float32."""
    i = I_LOC * world
    gate_up = seeded(seed, E, 2 * i, H, scale=0.3).float()
    down = seeded(seed + 1, E, H, i, scale=0.3).float()
    return gate_up, down


def _shards(gate_up, down, rank: int, world: int):
    """This rank's ``gate_up [E, H, 2 I/W]`` and ``down [E, I/W, H]`` (MoEBlock's layout)."""
    i = I_LOC * world
    gu = inn.shard(gate_up, rank, world, 1, [i, i]).transpose(1, 2).contiguous()
    dn = inn.shard(down, rank, world, 2).transpose(1, 2).contiguous()
    return gu, dn


def _routing(seed: int, tokens: int, skip_last: bool):
    """Top-k routing of ``tokens`` tokens: distinct experts per token (none picks the last
    expert when ``skip_last``), positive float32 weights."""
    g = torch.Generator().manual_seed(seed)
    choices = E - 1 if skip_last else E
    index = torch.stack([torch.randperm(choices, generator=g)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=g) + 0.1
    return weights, index


def _reference(x, weights, index, gate_up, down):
    """float32 MoE of all tokens ``x [T, H]`` with full weights."""
    i = down.shape[2]
    gu = gate_up[index]  # [T, K, 2I, H]
    h = torch.einsum("tkoh,th->tko", gu, x)
    s = F.silu(h[..., :i]) * h[..., i:]
    y = torch.einsum("tkhi,tki->tkh", down[index], s)
    return (y * weights[..., None]).sum(1)


def _op_body(group, strategy):
    """Two calls on the custom op: 5 tokens per rank (expert E-1 unused), then 11 (the
    cached contexts grow; the weights take no gradient). Every gradient against float32."""
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    gate_up, down = _full_weights(1, w)
    gu_shard, dn_shard = (t.to(torch.bfloat16).to(dev) for t in _shards(gate_up, down, r, w))
    for call, (m, skip, want_w) in enumerate([(5, True, True), (11, False, False)]):
        x_all = seeded(10 + call, w * m, H)
        dy_all = seeded(20 + call, w * m, H)
        weights_all, index_all = _routing(30 + call, w * m, skip)
        rows = slice(r * m, (r + 1) * m)
        x = leaf(x_all[rows].to(dev))
        weights = weights_all[rows].to(dev).requires_grad_(want_w)
        gu, dn = leaf(gu_shard), leaf(dn_shard)
        y = ops.moe_experts(x, weights, index_all[rows].to(dev), gu, dn, h, strategy)
        y.backward(dy_all[rows].to(dev))
        ref_leaves = [leaf(t) for t in (x_all.float(), weights_all, gate_up, down)]
        ref = _reference(ref_leaves[0], ref_leaves[1], index_all, *ref_leaves[2:])
        (ref * dy_all.float()).sum().backward()
        gu_ref, dn_ref = _shards(ref_leaves[2].grad, ref_leaves[3].grad, r, w)
        what = f"{strategy} call {call} (m = {m})"
        assert y.shape == (m, H) and y.dtype == torch.bfloat16, what
        checks = [("y", y, ref[rows]), ("dx", x.grad, ref_leaves[0].grad[rows]),
                  ("dgate_up", gu.grad, gu_ref), ("ddown", dn.grad, dn_ref)]  # fmt: skip
        if want_w:
            checks.append(("dweights", weights.grad, ref_leaves[1].grad[rows]))
        else:
            assert weights.grad is None, what
        for name, out, expect in checks:
            assert torch.isfinite(out.float()).all(), f"{what}: {name} not finite"
            err = rel(out, expect)
            assert err < TOL, f"{what}: {name} rel err {err:.2e}"
        if skip:  # the unused expert's weights get exactly zero gradient
            assert not gu.grad[E - 1].any() and not dn.grad[E - 1].any(), what
    key = ("moe_experts", h, torch.bfloat16, strategy, H, I_LOC, E, K)
    cached = [c for k, c in library.contexts().items() if k[0] == "moe_experts"]
    assert len(cached) == 1 and library.contexts()[key].max_m >= 11  # grown by call 1
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2, 3), gpu=(2,)), indirect=True)
@pytest.mark.parametrize(
    "strategy",
    # (``none`` runs torch.distributed's collectives on the group's tensors: on GPUs it needs
    # a GPU per rank)
    ["fused", pytest.param("none", marks=pytest.mark.own_gpu)],
)
def test_op_matches_float32(world, strategy):
    world.run(_op_body, strategy)


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_op_auto(world):
    world.run(_op_body, "auto")


def _opcheck_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    m = 3
    gate_up, down = _full_weights(2, w)
    gu, dn = (leaf(t.to(torch.bfloat16).to(dev)) for t in _shards(gate_up, down, r, w))
    x = leaf(seeded(40 + r, m, H, device=dev))
    weights_all, index_all = _routing(41, w * m, False)
    weights = leaf(weights_all[r * m : (r + 1) * m].to(dev))
    index = index_all[r * m : (r + 1) * m].to(dev)
    dy = seeded(42 + r, m, H, device=dev)
    torch.library.opcheck(ops.moe_experts.default, (x, weights, index, gu, dn, h, "fused"))
    saved = tuple(t.detach() for t in (x, weights, index, gu, dn))
    for needs in ((True, True, True, True), (True, False, False, True)):
        torch.library.opcheck(ops.moe_experts_backward.default, (dy, *saved, h, *needs))
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_opcheck(world):
    world.run(_opcheck_body)


def _expected_path(group, strategy: str) -> str:
    """What an eager MoEBlock of bfloat16 weights with ``strategy`` runs."""
    if strategy == "auto":
        fused = group.backend != "cuda" or moe_rs.AUTO_FUSED_ON_GPU
        return "fused" if fused else "none"
    return strategy


def _compile_body(group, strategy, backend):
    """A sequence-parallel MoEBlock, eager then compiled twice: output, input gradient and
    every parameter gradient against the eager run and float32; the compiled block runs
    the path the eager one does. The fused path is traced with ``fullgraph=True``; the
    ``none`` path (``auto`` on GPUs) has data-dependent shapes (its per-expert loop), which
    break the graph, so it is compiled without ``fullgraph``."""
    w, r, dev = group.world_size, group.rank, group.device
    m = 5  # tokens per rank
    router = seeded(3, E, H, scale=0.5).float()
    gate_up, down = _full_weights(4, w)
    block = inn.MoEBlock.from_weights(router, gate_up, down, K, group, strategy=strategy,
                                      dtype=torch.bfloat16)  # fmt: skip
    x_all, g_all = seeded(50, w * m, H), seeded(51, w * m, H)
    rows = slice(r * m, (r + 1) * m)
    expected = _expected_path(group, strategy)
    fused = expected == "fused"
    graphs: list = []
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=fused, backend=recording(backend, graphs))
    results, paths = [], []
    for fn in (block, compiled, compiled):  # eager, then the compiled graph twice
        block.last_strategy = None
        xl = leaf(x_all[rows][None].to(dev))
        y = fn(xl)
        y.backward(g_all[rows][None].to(dev))
        paths.append(block.last_strategy)
        results.append([y[0], xl.grad[0], *(p.grad.clone() for p in block.parameters())])
        block.zero_grad(set_to_none=True)
    assert paths == [expected] * 3, f"{strategy}: ran {paths}, expected {expected}"
    holds_op = [any("interlace.moe_experts" in t for t in g) for g in graphs]
    if fused:  # (fullgraph: one graph, or it raised)
        assert holds_op == [True], graphs
    else:
        assert graphs and not any(holds_op), graphs
    # float32 reference of the whole sequence with the block's own routing rule
    ref_leaves = [leaf(t) for t in (x_all.float(), router, gate_up, down)]
    xr, rr = ref_leaves[:2]
    probs = torch.softmax(xr @ rr.t(), -1)
    weights, index = torch.topk(probs, K, -1)
    ref = _reference(xr, weights / weights.sum(-1, keepdim=True), index, *ref_leaves[2:])
    (ref * g_all.float()).sum().backward()
    gu_ref, dn_ref = _shards(ref_leaves[2].grad, ref_leaves[3].grad, r, w)
    refs = [ref[rows], xr.grad[rows], rr.grad, gu_ref, dn_ref]
    names = ["out", "dx", "router", "gate_up", "down"]
    for run, res in enumerate(results):
        for name, out, expect, eager in zip(names, res, refs, results[0]):
            what = f"{strategy} run {run}: {name}"
            assert torch.isfinite(out.float()).all(), f"{what} not finite"
            err = rel(out, expect)
            assert err < TOL, f"{what} vs float32 rel err {err:.2e}"
            if run:  # (aot_eager runs the eager kernels; inductor generates its own)
                err = rel(out, eager)
                tol = TOL / 4 if backend == "aot_eager" else TOL
                assert err < tol, f"{what} compiled vs eager rel err {err:.2e}"
    block.close()
    assert not [k for k in library.contexts() if k[0] == "moe_experts"]
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("strategy", ["auto", "fused"])
def test_compile_moe_block(world, strategy):
    """``fused`` (and ``auto`` where it runs fused) under fullgraph=True, which fails on
    any graph break; the graph holds the custom op (``aot_eager`` on the CPU emulation,
    inductor on GPUs)."""
    world.run(_compile_body, strategy, "aot_eager" if world.backend == "cpu" else "inductor")


def _bad_body(group):
    dev, w = group.device, group.world_size
    h = library.register_group(group)
    gu, dn = (t.to(torch.bfloat16).to(dev) for t in _shards(*_full_weights(5, w), 0, w))
    x = seeded(60, 4, H, device=dev)
    weights, index = (t.to(dev) for t in _routing(61, 4, False))
    op = ops.moe_experts
    expect_error(InterlaceValueError, "strategy", op, x, weights, index, gu, dn, h, "ring")
    expect_error(InterlaceValueError, "no interlace group", op, x, weights, index, gu, dn, 999,
                 "fused")  # fmt: skip
    expect_error(InterlaceValueError, "2-D", op, x[0], weights, index, gu, dn, h, "fused")
    expect_error(InterlaceValueError, "top_k", op, x, weights[:3], index, gu, dn, h, "fused")
    expect_error(InterlaceValueError, "gate_up", op, x, weights, index, gu[:, :, :-2], dn, h,
                 "fused")  # fmt: skip
    y = op(x, weights, index, gu, dn, h, "fused")  # still usable
    assert torch.isfinite(y.float()).all() and y.shape == x.shape
    expect_error(InterlaceValueError, "SiLU", inn.MoEBlock, H, I_LOC * w, E, K, group,
                 act=F.gelu, strategy="fused", dtype=torch.bfloat16)  # fmt: skip
    block = inn.MoEBlock(H, I_LOC * w, E, K, group, act=F.gelu, dtype=torch.bfloat16)
    block(x[None])
    assert block.last_strategy == "none"  # auto: the fused ops apply SiLU only
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_bad_inputs_raise_on_every_rank(world):
    assert world.run(_bad_body) == [True] * world.world_size


def test_silu_probe():
    """MoEBlock recognises SiLU however it is spelled, and nothing else."""
    from interlace.nn.moe import _computes_silu

    assert _computes_silu(F.silu) and _computes_silu(torch.nn.SiLU())
    assert not _computes_silu(F.gelu) and not _computes_silu(torch.relu)
