"""The custom ops of ``interlace.ops.library`` (``torch.ops.interlace.*``) and their
autograd: forward and every input gradient against float32 references built on every rank
from shared seeds (ragged shapes, bias, growing row counts on one cached context, the
weight as a transposed view), ``torch.library.opcheck`` on each op, a
``torch.compile(fullgraph=True)`` trace through forward and backward, bad inputs raising
on every rank, and the transposed-weight cache."""

from __future__ import annotations

import pytest
import torch

from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.ops import autograd as eager_ops
from interlace.ops import library
from tests.nn._models import TOL, leaf, rel, seeded, worlds
from tests.ops._helpers import expect_error

ops = torch.ops.interlace


def _dense_body(group, strategy, route="custom"):
    """ag_gemm / gemm_rs / gemm_ar forward and gradients, two calls of growing size, through
    the custom ops or (``route="eager"``) the eager entry points the layers call."""
    ops = torch.ops.interlace if route == "custom" else eager_ops
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    assert library.register_group(group) == h
    # the handle carries the world size: graphs compiled for other world sizes hold
    # another constant, so they never share a compile-cache entry with these
    assert h % library.HANDLE_STRIDE == w and library.group_of(h) is group
    n, k = 33, 20
    sizes = (3, 5) if w == 2 else (4,)  # rows per rank; the second call outgrows the first
    for call, m in enumerate(sizes):
        s = 100 * call
        # --- AG+GEMM: a shard per rank, a column shard of the weight per rank
        a = [seeded(s + q, m, k, device=dev) for q in range(w)]
        wt = [seeded(s + 10 + q, n, k, scale=0.2, device=dev) for q in range(w)]
        bias = [seeded(s + 20 + q, n, device=dev) for q in range(w)]
        dc = [seeded(s + 30 + q, w * m, n, device=dev) for q in range(w)]
        x, weight, b = leaf(a[r]), leaf(wt[r]), leaf(bias[r])
        c = ops.ag_gemm(x, weight.t(), b, h, strategy)
        a_full = torch.cat(a).float()
        assert rel(c, a_full @ wt[r].float().t() + bias[r].float()) < TOL
        c.backward(dc[r])
        da_full = sum(dc[q].float() @ wt[q].float() for q in range(w))
        assert rel(x.grad, da_full[r * m : (r + 1) * m]) < TOL
        assert rel(weight.grad, dc[r].float().t() @ a_full) < TOL
        assert weight.grad.stride() == weight.stride()  # made in the weight's layout
        assert rel(b.grad, dc[r].float().sum(0)) < TOL
        # --- GEMM+RS / GEMM+AR: rank-specific a and weight columns, one bias
        a = [seeded(s + 40 + q, w * m, k, device=dev) for q in range(w)]
        wt = [seeded(s + 50 + q, n, k, scale=0.2, device=dev) for q in range(w)]
        b_all = seeded(s + 60, n, device=dev)
        total = sum(a[q].float() @ wt[q].float().t() for q in range(w)) + b_all.float()
        dy = [seeded(s + 70 + q, m, n, device=dev) for q in range(w)]
        x, weight, b = leaf(a[r]), leaf(wt[r]), leaf(b_all)
        y = ops.gemm_rs(x, weight.t(), b, h, strategy)
        assert rel(y, total[r * m : (r + 1) * m]) < TOL
        y.backward(dy[r])
        dy_full = torch.cat(dy).float()
        assert rel(x.grad, dy_full @ wt[r].float()) < TOL
        assert rel(weight.grad, dy_full.t() @ a[r].float()) < TOL
        assert rel(b.grad, dy_full.sum(0)) < TOL
        ar_strategy = strategy if strategy != "sm_pull" else "auto"
        dz = seeded(s + 80, w * m, n, device=dev)  # the same on every rank
        x, weight, b = leaf(a[r]), leaf(wt[r]), leaf(b_all)
        z = ops.gemm_ar(x, weight.t(), b, h, ar_strategy)
        assert rel(z, total) < TOL
        z.backward(dz)
        assert rel(x.grad, dz.float() @ wt[r].float()) < TOL
        assert rel(weight.grad, dz.float().t() @ a[r].float()) < TOL
        assert rel(b.grad, dz.float().sum(0)) < TOL
    ag = [c for key, c in library.contexts().items() if key[:2] == ("ag_gemm", h)]
    assert ag and all(c.max_m >= w * sizes[-1] for c in ag)
    return True


@pytest.mark.parametrize("world", worlds(), indirect=True)
@pytest.mark.parametrize("strategy", ["none", "fused"])
def test_dense_ops_and_gradients(world, strategy):
    world.run(_dense_body, strategy)


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_dense_eager_entry_points_and_gradients(world):
    world.run(_dense_body, "fused", "eager")


def _collectives_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    x = [seeded(q, 5, 3, 2, dtype=torch.float32, device=dev) for q in range(w)]
    dy = [seeded(10 + q, w * 5, 3, 2, dtype=torch.float32, device=dev) for q in range(w)]
    t = leaf(x[r])
    out = ops.all_gather(t, h, "default")
    assert rel(out, torch.cat(x)) < 1e-6
    out.backward(dy[r])  # the gathered output fed rank-specific work: summed gradients
    assert rel(t.grad, sum(dy)[r * 5 : (r + 1) * 5]) < 1e-6
    x = [seeded(20 + q, w * 4, 7, device=dev) for q in range(w)]
    dy = [seeded(30 + q, 4, 7, device=dev) for q in range(w)]
    t = leaf(x[r])
    out = ops.reduce_scatter(t, h, "default")
    assert rel(out, sum(v.float() for v in x)[r * 4 : (r + 1) * 4]) < TOL
    out.backward(dy[r])
    assert rel(t.grad, torch.cat(dy)) < 1e-6
    t = leaf(x[r])
    out = ops.all_reduce(t, h, "one_shot")
    assert rel(out, sum(v.float() for v in x)) < TOL
    out.backward(dy[0].repeat(w, 1))  # replicated output, the same gradient: identity
    assert rel(t.grad, dy[0].repeat(w, 1)) < 1e-6
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_collective_ops_and_gradients(world):
    world.run(_collectives_body)


def _opcheck_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    a = leaf(seeded(r, 4, 24, device=dev))
    b = leaf(seeded(9, 24, 40, scale=0.2, device=dev))
    bias = leaf(seeded(8, 40, device=dev))
    bt = seeded(7, 40, 24, scale=0.2, device=dev)
    a_rs = leaf(seeded(r, w * 4, 24, device=dev))
    x = leaf(seeded(r, 6, 5, dtype=torch.float32, device=dev))
    x_rs = leaf(seeded(r, w * 6, 5, dtype=torch.float32, device=dev))
    dc, dy = seeded(5, w * 4, 40, device=dev), seeded(6, 4, 40, device=dev)
    cases = [
        (ops.ag_gemm.default, (a, b, bias, h, "fused")),
        (ops.ag_gemm.default, (a, b, None, h, "none")),
        (ops.gemm_rs.default, (a_rs, b, bias, h, "fused")),
        (ops.gemm_ar.default, (a_rs, b, None, h, "none")),
        (ops.all_gather.default, (x, h, "default")),
        (ops.reduce_scatter.default, (x_rs, h, "default")),
        (ops.all_reduce.default, (x, h, "default")),
        (ops.ag_gemm_backward.default, (dc, a.detach(), b.detach(), h, "none", True, True)),
        (ops.gemm_rs_backward.default, (dy, a_rs.detach(), b.detach(), h, "none", True, False)),
        # a transposed weight view: db comes out in its layout, as the fake one does
        (ops.ag_gemm_backward.default, (dc, a.detach(), bt.t(), h, "fused", True, True)),
        (ops.gemm_rs_backward.default, (dy, a_rs.detach(), bt.t(), h, "none", False, True)),
    ]  # fmt: skip
    for op, args in cases:
        torch.library.opcheck(op, args)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_opcheck(world):
    world.run(_opcheck_body)


def _tp_mlp(x, w1, w2, h, strategy):
    """A sequence-parallel MLP on the custom ops: all_gather(x) @ w1.T, SiLU, then
    reduce_scatter(. @ w2.T)."""
    hidden = torch.nn.functional.silu(ops.ag_gemm(x, w1.t(), None, h, strategy))
    return ops.gemm_rs(hidden, w2.t(), None, h, strategy)


def _compile_body(group, backend):
    r, dev = group.rank, group.device
    h = library.register_group(group)
    x0 = seeded(r, 6, 24, device=dev)
    w1 = seeded(10 + r, 40, 24, scale=0.2, device=dev)
    w2 = seeded(20 + r, 24, 40, scale=0.2, device=dev)
    dy = seeded(30 + r, 6, 24, device=dev)
    torch._dynamo.reset()
    compiled = torch.compile(_tp_mlp, fullgraph=True, backend=backend)
    results = []
    for fn in (_tp_mlp, compiled):
        x, a, b = leaf(x0), leaf(w1), leaf(w2)
        y = fn(x, a, b, h, "fused")
        y.backward(dy)
        results.append((y, x.grad, a.grad, b.grad))
    for eager, traced in zip(*results):
        assert rel(traced, eager) < TOL
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_compile_fullgraph(world):
    """fullgraph=True fails on any graph break: the ops and their autograd trace whole.
    (The CPU emulation compiles with ``aot_eager``; GPUs with inductor.)"""
    world.run(_compile_body, "aot_eager" if world.backend == "cpu" else "inductor")


def _bad_inputs_body(group):
    dev = group.device
    h = library.register_group(group)
    a = seeded(0, 4, 24, device=dev)
    b = seeded(1, 24, 40, device=dev)
    expect_error(InterlaceValueError, "strategy", ops.ag_gemm, a, b, None, h, "bogus")
    expect_error(InterlaceValueError, "no interlace group", ops.ag_gemm, a, b, None, 999, "auto")
    expect_error(InterlaceValueError, "2-D", ops.gemm_rs, a.view(-1), b, None, h, "auto")
    expect_error(InterlaceValueError, "inner dimensions", ops.gemm_ar, a, b[:20], None, h, "auto")
    expect_error(InterlaceTypeError, "dtype", ops.ag_gemm, a.float(), b.float(), None, h, "auto")
    expect_error(InterlaceTypeError, "Group", library.register_group, "not a group")
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_bad_inputs_raise_on_every_rank(world):
    assert world.run(_bad_inputs_body) == [True] * world.world_size


def test_transposed_weight_cache():
    weight = torch.randn(6, 4)
    first = library.contiguous_b(weight.t())
    assert first.is_contiguous() and torch.equal(first, weight.t())
    assert library.contiguous_b(weight.t()) is first  # one copy per weight version
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step
    second = library.contiguous_b(weight.t())
    assert second is not first and torch.equal(second, weight.t())
    plain = torch.randn(4, 6)
    assert library.contiguous_b(plain) is plain
    other = torch.randn(6, 4)
    assert torch.equal(library.contiguous_b(other.t()), other.t())
