"""What the layers run in eager mode. Over one rank every layer is ``nn.Linear``: its
forward and backward issue the very aten ops ``nn.Linear`` does (recorded with a
``TorchDispatchMode``), with bitwise equal outputs and gradients, and the weight gradient
in the parameter's own layout (no transposing copy when autograd accumulates it); the
parallelized decoder issues no interlace op, and no copy, concatenation or addition the
plain one does not, and as many GEMMs (``forward_parts``: a fused QKV or gate/up weight
runs one GEMM per projection); the SiLU-gated product's gradient over several ranks is
made without a concatenation. Over two
ranks the layers' eager calls (forward, backward, the sequence scatter/gather and the
gradient-sync hooks) never enter the ``torch.ops.interlace`` custom ops, and a
``torch.compile(fullgraph=True)`` trace of the same layers holds them (the graph's ops
recorded by the backend) and matches eager, gradients included. The weight layout:
``[in, out]`` shards over several ranks, ``state_dict`` round trip, ``linear_weight``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import interlace.nn as inn
from interlace.nn.mlp import gated
from tests.nn._models import TOL, leaf, rel, seeded


class _Record(TorchDispatchMode):
    """The names of the ops dispatched inside the ``with`` block, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _linear(seed, n_in, n_out, bias):
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(seeded(seed, n_out, n_in, scale=0.2, dtype=torch.float32))
        if bias:
            lin.bias.copy_(seeded(seed + 1, n_out, dtype=torch.float32))
    return lin


def _ops_and_grads(module, x, g):
    x = leaf(x)
    with _Record() as rec:
        y = module(x)
        y.backward(g)
    return rec.ops, y, x.grad, [p.grad for p in module.parameters()]


def _one_rank_linear_body(group):
    h, n = 12, 20
    cases = []
    for bias in (True, False):
        for sp in (True, False):
            for shape in ((2, 5, h), (7, h)):
                cases.append((bias, sp, shape))
    for i, (bias, sp, shape) in enumerate(cases):
        lin = _linear(i, h, n, bias)
        back = _linear(50 + i, n, h, bias)
        for plain, cls in ((lin, inn.ColumnParallelLinear), (back, inn.RowParallelLinear)):
            layer = cls.from_linear(plain, group, sequence_parallel=sp)
            assert layer.weight.shape == plain.weight.shape and not layer.kn
            x = seeded(100 + i, *shape[:-1], plain.in_features, dtype=torch.float32)
            g = seeded(200 + i, *shape[:-1], plain.out_features, dtype=torch.float32)
            want = _ops_and_grads(plain, x, g)
            got = _ops_and_grads(layer, x, g)
            what = f"{cls.__name__} bias={bias} sp={sp} x{list(shape)}"
            assert got[0] == want[0], f"{what}: {got[0]} != {want[0]}"
            assert not any("copy" in op or "clone" in op for op in got[0]), what
            for a, b in zip(got[1:3], want[1:3]):
                assert torch.equal(a, b), what
            for a, b in zip(got[3], want[3]):
                assert torch.equal(a, b) and a.stride() == b.stride(), what
    return True


@pytest.mark.parametrize("world", [pytest.param(("cpu", 1), id="cpu1")], indirect=True)
def test_one_rank_layers_are_nn_linear(world):
    assert world.run(_one_rank_linear_body) == [True]


def _one_rank_decoder_body(group):
    from interlace.bench.model import DecoderConfig, build_stack

    c = DecoderConfig(hidden=16, intermediate=24, heads=4, kv_heads=2, head_dim=4, layers=2)
    plain = build_stack(c, torch.float32, group.device)
    ours = inn.parallelize(copy.deepcopy(plain), group)
    x = seeded(1, 1, 6, c.hidden, dtype=torch.float32)
    g = seeded(2, 1, 6, c.hidden, dtype=torch.float32)
    want_ops, want, _, _ = _ops_and_grads(plain, x, g)
    got_ops, got, dx, _ = _ops_and_grads(ours, x, g)
    assert rel(got, want) < 1e-5
    assert not any(op.startswith("interlace.") for op in got_ops), got_ops
    for kind in ("copy", "clone", "contiguous", "new_empty_strided"):
        n_got = sum(kind in op for op in got_ops)
        n_want = sum(kind in op for op in want_ops)
        assert n_got <= n_want, f"{kind}: {n_got} ops, the plain model {n_want}"
    # the fused QKV and gate/up weights run one GEMM per projection, as the plain model's
    # separate ones do, and their input gradients are summed inside the GEMMs
    for kind in ("aten.cat", "aten.add", "aten.slice_backward"):
        n_got = sum(op == kind for op in got_ops)
        n_want = sum(op == kind for op in want_ops)
        assert n_got <= n_want, f"{kind}: {n_got} ops, the plain model {n_want}"
    gemms = ("aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm")
    assert sum(op in gemms for op in got_ops) == sum(op in gemms for op in want_ops)
    return True


@pytest.mark.parametrize("world", [pytest.param(("cpu", 1), id="cpu1")], indirect=True)
def test_one_rank_decoder_adds_no_copies(world):
    assert world.run(_one_rank_decoder_body) == [True]


def _one_rank_parts_body(group):
    """``forward_parts`` over one rank: each block of the fused weight is its own GEMM;
    outputs and weight gradients bitwise those of separate ``nn.Linear`` layers, the
    input gradient theirs summed (in the GEMMs); a block whose output is unused gets a
    zero gradient; bias or not, 2-D and 3-D inputs; no grad mode and autocast too."""
    h, parts = 8, [12, 4, 4]
    for bias in (True, False):
        for shape, used in (((2, 3, h), (0, 1, 2)), ((5, h), (0, 2))):
            plain = [_linear(10 * i + bias, h, n, bias) for i, n in enumerate(parts)]
            w = torch.cat([p.weight for p in plain])
            b = torch.cat([p.bias for p in plain]) if bias else None
            layer = inn.ColumnParallelLinear.from_weights(w, b, group, parts=parts)
            x0 = seeded(3, *shape, dtype=torch.float32)
            gs = [seeded(4 + i, *shape[:-1], n, dtype=torch.float32) for i, n in enumerate(parts)]
            x, xr = leaf(x0), leaf(x0)
            outs = layer.forward_parts(x)
            refs = [p(xr) for p in plain]
            sum(outs[i].mul(gs[i]).sum() for i in used).backward()
            sum(refs[i].mul(gs[i]).sum() for i in used).backward()
            what = f"bias={bias} x{list(shape)} parts used {used}"
            for o, r in zip(outs, refs):
                assert o.is_contiguous() and torch.equal(o, r), what
            assert rel(x.grad, xr.grad) < 1e-6, what
            dws = layer.weight.grad.split(parts)
            dbs = layer.bias.grad.split(parts) if bias else [None] * 3
            for i, p in enumerate(plain):
                if i in used:
                    assert torch.equal(dws[i], p.weight.grad), what
                    assert not bias or torch.equal(dbs[i], p.bias.grad), what
                else:
                    assert p.weight.grad is None and not dws[i].any(), what
            with torch.no_grad():
                assert all(torch.equal(o, p(x0)) for o, p in zip(layer.forward_parts(x0), plain))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = layer.forward_parts(x0)
                assert all(torch.equal(o, p(x0)) for o, p in zip(got, plain)), what
    return True


@pytest.mark.parametrize("world", [pytest.param(("cpu", 1), id="cpu1")], indirect=True)
def test_one_rank_forward_parts_are_separate_linears(world):
    assert world.run(_one_rank_parts_body) == [True]


@pytest.mark.parametrize("act", [F.silu, nn.SiLU(), F.gelu])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_product_matches_unfused(act, dtype):
    """``act(gate) * up`` of ``[gate | up]``: bitwise the unfused expression's output and
    gradient; with SiLU the gradient is made without concatenating its two halves."""
    h0 = seeded(1, 2, 3, 10, dtype=dtype)
    dy = seeded(2, 2, 3, 5, dtype=dtype)
    results = []
    for fn in (gated, lambda h, a: a(h[..., :5]) * h[..., 5:]):
        h = leaf(h0)
        with _Record() as rec:
            out = fn(h, act)
            out.backward(dy)
        results.append((out, h.grad, rec.ops))
    (out, dh, ops), (want, want_dh, _) = results
    assert torch.equal(out, want) and torch.equal(dh, want_dh)
    assert ("aten.cat" in ops) == (act is F.gelu), ops
    with torch.no_grad():
        assert torch.equal(gated(h0, act), want)


class _Layers(nn.Module):
    """Sequence-parallel column then row linear, a non-sequence-parallel pair, the
    sequence scatter / gather and a replicated weight whose gradient is synced by a hook:
    every eager entry point of interlace.nn's dense layers."""

    def __init__(self, group, h, i):
        super().__init__()
        self.group, self.h = group, h
        self.col = inn.ColumnParallelLinear.from_linear(_linear(1, h, i, True), group)
        self.row = inn.RowParallelLinear.from_linear(_linear(3, i, h, True), group)
        self.col2 = inn.ColumnParallelLinear.from_linear(
            _linear(5, h, i, True), group, sequence_parallel=False
        )
        self.row2 = inn.RowParallelLinear.from_linear(
            _linear(7, i, h, True), group, sequence_parallel=False
        )
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, h))
        inn.sync_sequence_parallel_grads([self.scale], group)

    def forward(self, x):
        s = x.shape[1]
        t = inn.scatter_to_sequence(x, self.group, dim=1) * self.scale
        b, sl, h = t.shape
        t = self.row(torch.relu(self.col(t.reshape(b * sl, h)))).view(b, sl, h)
        t = inn.gather_from_sequence(t, self.group, dim=1, length=s)
        return self.row2(torch.relu(self.col2(t)))


def _run_layers(fn, model, x0, g):
    x = leaf(x0)
    y = fn(x)
    y.backward(g)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y, x.grad, grads


def _eager_and_compiled_body(group):
    r, dev = group.rank, group.device
    h, i = 8, 6 * group.world_size
    model = _Layers(group, h, i).to(dev, torch.bfloat16)  # (the fused GEMMs: 16-bit)
    assert model.col.weight.shape == (h, i // group.world_size)  # [in, out / W]
    assert model.row.weight.shape == (i // group.world_size, h)  # [in / W, out]
    x = seeded(10, 2, 5, h, device=dev)
    g = seeded(11, 2, 5, h, device=dev)
    with _Record() as rec:
        eager = _run_layers(model, model, x, g)
        with torch.no_grad():
            model(x)
    custom = sorted({op for op in rec.ops if op.startswith("interlace.")})
    assert not custom, f"rank {r}: eager calls entered the custom ops {custom}"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    traced = _run_layers(compiled, model, x, g)
    names = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    for op in ("interlace.ag_gemm", "interlace.gemm_rs", "interlace.gemm_ar"):
        assert any(op in name for name in names), f"{op} not in the traced graph: {names}"
    assert rel(traced[0], eager[0]) < TOL and rel(traced[1], eager[1]) < TOL
    for a, b in zip(traced[2], eager[2]):
        assert rel(a, b) < TOL
    torch._dynamo.reset()
    return True


@pytest.mark.parametrize("world", [pytest.param(("cpu", 2), id="cpu2")], indirect=True)
def test_eager_calls_skip_the_custom_ops(world):
    assert world.run(_eager_and_compiled_body) == [True, True]


def _layout_body(group):
    w, dev = group.world_size, group.device
    lin = _linear(1, 8, 4 * w, True).to(torch.bfloat16)
    down = _linear(2, 4 * w, 8, False).to(torch.bfloat16)
    col = inn.ColumnParallelLinear.from_linear(lin, group).to(dev)
    row = inn.RowParallelLinear.from_linear(down, group).to(dev)
    for layer, full, dim in ((col, lin.weight, 0), (row, down.weight, 1)):
        assert layer.kn and layer.weight.is_contiguous()
        want = inn.shard(full.detach(), group.rank, w, dim)
        assert torch.equal(layer.linear_weight, want)  # [out, in] view of the shard
        assert torch.equal(layer.weight, want.t())
        state = layer.state_dict()
        fresh = type(layer)(layer.in_features, layer.out_features, group,
                            layer.bias is not None, dtype=torch.bfloat16)  # fmt: skip
        fresh.load_state_dict(state)
        assert torch.equal(fresh.weight, layer.weight)
    return True


@pytest.mark.parametrize("world", [pytest.param(("cpu", 3), id="cpu3")], indirect=True)
def test_sharded_weight_layout_and_state_dict(world):
    assert world.run(_layout_body) == [True] * 3
