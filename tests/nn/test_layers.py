"""interlace.nn layers against float32 single-device references: Column / Row parallel
linear (sequence parallel: AG+GEMM and GEMM+RS; without: local GEMM and GEMM+AR), the
fused gate/up MLP, the attention block (GQA, rotary, a ragged sequence that pads, batch
2), the MoE block; outputs and the gradients of inputs and of every weight shard, two
calls on the same layers; bad constructions raising on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import interlace.nn as inn
from interlace.bench.model import Attention, DecoderConfig, DecoderStack
from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.ops import library
from tests.nn._models import MODEL_TOL, TOL, leaf, rel, seeded, worlds
from tests.ops._helpers import expect_error

#: the blocks: two GEMMs with a bf16 intermediate (the single-device bf16 block is off from
#: float32 by about as much)
BLOCK_TOL = MODEL_TOL


def _close(out, ref, what, tol=TOL):
    err = rel(out, ref)
    assert err < tol, f"{what}: rel err {err:.2e}"
    return True


class _Chain:
    """Column then row parallel linear (sequence parallel: on rows of ``[T, h]``)."""

    def __init__(self, col, row, h, sp):
        self.col, self.row, self.h, self.sp = col, row, h, sp

    def __call__(self, t):
        if not self.sp:
            return self.row(self.col(t))
        return self.row(self.col(t.reshape(-1, self.h))).view(t.shape)


class _WithPositions:
    def __init__(self, attn, pos):
        self.attn, self.pos = attn, pos

    def __call__(self, t):
        return self.attn(t, position_embeddings=self.pos)


def _close_block(out, ref, what):
    return _close(out, ref, what, BLOCK_TOL)


def _linear(seed, n_in, n_out, bias, dev):
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(seeded(seed, n_out, n_in, scale=0.2))
        if bias:
            lin.bias.copy_(seeded(seed + 1, n_out))
    return lin.to(torch.bfloat16).to(dev)


def _f32(module):
    import copy

    return copy.deepcopy(module).float()


def _run_sp(group, layer, x_full, g_full, sp: bool):
    """Output (whole sequence) and input gradient of ``layer`` on ``x_full`` [B, S, H]:
    sequence parallel layers get this rank's share and their output is gathered back."""
    x = leaf(x_full)
    inp = inn.scatter_to_sequence(x, group, dim=1) if sp else x
    out = layer(inp)
    out = out[0] if isinstance(out, tuple) else out
    if sp:
        out = inn.gather_from_sequence(out, group, dim=1, length=x_full.shape[1])
    out.backward(g_full)
    return out, x.grad


def _linear_body(group, strategy):
    """Column then row parallel (a two-layer MLP without activation), both modes."""
    dev, b, s, h, i = group.device, 2, 5, 24, 36 * group.world_size // 3
    for call in range(2 if group.world_size == 2 else 1):  # (CPU time: one call at W = 3)
        for sp in (True, False):
            up = _linear(1, h, i, True, dev)
            down = _linear(3, i, h, True, dev)
            col = inn.ColumnParallelLinear.from_linear(up, group, strategy=strategy,
                                                      sequence_parallel=sp)  # fmt: skip
            row_strategy = strategy if sp else "auto"
            row = inn.RowParallelLinear.from_linear(down, group, strategy=row_strategy,
                                                   sequence_parallel=sp)  # fmt: skip
            x = seeded(10 + call, b, s, h, device=dev)
            g = seeded(20 + call, b, s, h, device=dev)
            out, dx = _run_sp(group, _Chain(col, row, h, sp), x, g, sp)
            ru, rd, xr = _f32(up), _f32(down), leaf(x.float())
            ref = rd(ru(xr))
            ref.backward(g.float())
            _close(out, ref, "out")
            _close(dx, xr.grad, "dx")
            _close(col.weight.grad, col.shard(ru.weight.grad), "col.weight.grad")
            _close(col.bias.grad, col.shard(ru.bias.grad), "col.bias.grad")
            _close(row.weight.grad, row.shard(rd.weight.grad), "row.weight.grad")
            _close(row.bias.grad, rd.bias.grad, "row.bias.grad")
    return True


@pytest.mark.parametrize("world", worlds(), indirect=True)
def test_linear_layers(world):
    world.run(_linear_body, "fused")


def _blocks_body(group, strategy):
    """The MLP and attention blocks (sequence parallel, ragged S; and without)."""
    w, dev = group.world_size, group.device
    c = DecoderConfig(hidden=24, intermediate=12 * w, heads=2 * w, kv_heads=w, head_dim=4,
                      layers=1)  # fmt: skip
    torch.manual_seed(0)
    ref_model = DecoderStack(c)
    for p in ref_model.parameters():
        nn.init.normal_(p, std=0.3)
    ref_model = ref_model.to(device=dev, dtype=torch.bfloat16)
    mlp_ref, attn_ref = ref_model.layers[0].mlp, ref_model.layers[0].self_attn
    b, s = 2, 7  # S = 7: padded to a multiple of W
    for sp in (True, False):
        mlp = inn.ParallelMLP.from_module(mlp_ref, group, strategy=strategy, sequence_parallel=sp)
        attn = inn.ParallelAttention.from_module(attn_ref, group, strategy=strategy,
                                                 sequence_parallel=sp).to(dev)  # fmt: skip
        for call in range(2 if w == 2 else 1):
            x = seeded(30 + call, b, s, c.hidden, device=dev)
            g = seeded(40 + call, b, s, c.hidden, device=dev)
            out, dx = _run_sp(group, mlp, x, g, sp)
            ref, xr = _f32(mlp_ref), leaf(x.float())
            ref_out = ref(xr)
            ref_out.backward(g.float())
            _close_block(out, ref_out, "out")
            _close_block(dx, xr.grad, "dx")
            full = torch.cat([ref.gate_proj.weight.grad, ref.up_proj.weight.grad])
            _close_block(
                mlp.gate_up.weight.grad, mlp.gate_up.shard(full), "mlp.gate_up.weight.grad"
            )
            _close_block(
                mlp.down.weight.grad,
                mlp.down.shard(ref.down_proj.weight.grad),
                "mlp.down.weight.grad",
            )
            mlp.zero_grad()
            pos = ref_model.rotary(s, torch.bfloat16, dev)
            out, dx = _run_sp(group, _WithPositions(attn, pos), x, g, sp)
            ref, xr = _f32(attn_ref), leaf(x.float())
            ref_out, _ = ref(xr, position_embeddings=tuple(p.float() for p in pos))
            ref_out.backward(g.float())
            _close_block(out, ref_out, "out")
            _close_block(dx, xr.grad, "dx")
            full = torch.cat([ref.q_proj.weight.grad, ref.k_proj.weight.grad,
                              ref.v_proj.weight.grad])  # fmt: skip
            _close_block(attn.qkv.weight.grad, attn.qkv.shard(full), "attn.qkv.weight.grad")
            _close_block(
                attn.o.weight.grad, attn.o.shard(ref.o_proj.weight.grad), "attn.o.weight.grad"
            )
            attn.zero_grad()
    return True


@pytest.mark.parametrize("world", worlds(), indirect=True)
def test_mlp_and_attention_blocks(world):
    world.run(_blocks_body, "fused")


def _moe_ref(x, router, gate_up, down, top_k):
    probs = torch.softmax(x @ router.t(), dim=-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(index[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


def _moe_body(group, strategy):
    """Both layouts with ``none``; ``fused`` (sequence parallel only) twice on one block:
    its contexts are reused. Seven tokens: the sequence shards are zero-padded."""
    w, dev = group.world_size, group.device
    e, h, i, k, b, s = 4, 16, 8 * w, 2, 1, 7
    router = seeded(1, e, h, scale=0.5)
    gate_up = seeded(2, e, 2 * i, h, scale=0.3)
    down = seeded(3, e, h, i, scale=0.3)
    modes = (True,) if strategy == "fused" else (True, False)
    for sp in modes:
        block = inn.MoEBlock.from_weights(router, gate_up, down, k, group, strategy=strategy,
                                          sequence_parallel=sp)  # fmt: skip
        contexts = None
        for call in range(2 if strategy == "fused" else 1):
            x = seeded(4 + call, b, s, h, device=dev)
            g = seeded(6 + call, b, s, h, device=dev)
            block.zero_grad()
            out, dx = _run_sp(group, block, x, g, sp)
            assert block.last_strategy == strategy
            if strategy == "fused":  # (the op library's cached MoE contexts)
                (current,) = [c for key, c in library.contexts().items()
                              if key[:2] == ("moe_experts", block.handle)]  # fmt: skip
                assert contexts is None or current is contexts
                contexts = current
            params = [leaf(t.float().to(dev)) for t in (router, gate_up, down)]
            xr = leaf(x.float())
            ref = _moe_ref(xr.view(-1, h), *params, k).view(b, s, h)
            ref.backward(g.float())
            _close(out, ref, "out")
            _close(dx, xr.grad, "dx")
            _close(block.router.grad, params[0].grad, "block.router.grad")
            _close(block.gate_up.grad, block.shard_gate_up(params[1].grad), "block.gate_up.grad")
            _close(block.down.grad, block.shard_down(params[2].grad), "block.down.grad")
        block.close()
    return True


@pytest.mark.parametrize("strategy", ["none", "fused"])
@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=(2,)), indirect=True)
def test_moe_block(world, strategy):
    world.run(_moe_body, strategy)


def _bad_layers_body(group):
    w = group.world_size
    expect_error(InterlaceValueError, "split evenly", inn.ColumnParallelLinear, 8, 4 * w + 1,
                 group)  # fmt: skip
    expect_error(InterlaceValueError, "split evenly", inn.RowParallelLinear, 4 * w + 1, 8, group)
    expect_error(InterlaceValueError, "strategy", inn.ColumnParallelLinear, 8, 4 * w, group,
                 strategy="ring")  # fmt: skip
    expect_error(InterlaceTypeError, "Group", inn.RowParallelLinear, 8, 8, "group")
    expect_error(InterlaceValueError, "heads", inn.ParallelAttention, 16, w + 1, 1, 4, group)
    expect_error(InterlaceValueError, "sequence_parallel", inn.MoEBlock, 8, 4 * w, 4, 2, group,
                 strategy="fused", sequence_parallel=False)  # fmt: skip
    moe = inn.MoEBlock(8, 4 * w, 4, 2, group, strategy="fused")  # float32: no fused kernels
    expect_error(InterlaceTypeError, "bfloat16", moe, torch.zeros(1, 2, 8, device=group.device))
    row = inn.RowParallelLinear(4 * w, 8, group, dtype=torch.bfloat16)
    expect_error(InterlaceValueError, "rows", row, torch.zeros(w + 1, 4, dtype=torch.bfloat16,
                                                             device=group.device))  # fmt: skip
    attn = inn.ParallelAttention(16, w, w, 4, group, dtype=torch.bfloat16)
    x = torch.zeros(1, 2, 16, dtype=torch.bfloat16, device=group.device)
    expect_error(InterlaceValueError, "KV cache", attn, x, cache=object())
    return True


@pytest.mark.parametrize("world", worlds(cpu=(3,), gpu=(2,)), indirect=True)
def test_bad_layers_raise_on_every_rank(world):
    assert world.run(_bad_layers_body) == [True] * world.world_size


def test_shard_blocks():
    t = torch.arange(12).view(12, 1)
    assert inn.shard(t, 1, 2, 0, [4, 8]).flatten().tolist() == [2, 3, 8, 9, 10, 11]
    assert inn.shard(t.t(), 0, 3, 1).flatten().tolist() == [0, 1, 2, 3]
    with pytest.raises(InterlaceValueError):
        inn.shard(t, 0, 5)


def test_attention_rejects_plain_module_without_head_dim():
    with pytest.raises(InterlaceValueError):
        inn.ParallelAttention.from_module(nn.Module(), None)
    assert Attention  # the reference block the GPU tests share
