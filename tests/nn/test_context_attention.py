"""interlace.nn.ContextParallelAttention against a float32 single-device reference of the
whole sequence (explicit softmax attention, the same rotary embedding): causal (zigzag
layout) and full attention, GQA, q/k/v biases, strategies fused / none / ring; the output,
the input gradient and every weight's gradient (summed over ranks by the block's hooks);
two calls on one block with fresh inputs, the second larger (its context rebuilt); the
layout helpers against explicit position lists; bad constructions and calls raising on
every rank.

Every rank builds the same whole-sequence inputs from seeds and lays them out with
``shard_sequence``; the output is gathered back with ``unshard_sequence``, so the input
gradient compared is the whole sequence's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import interlace.nn as inn
from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.ops.attention import zigzag_shard
from tests.nn._models import MODEL_TOL, leaf, rel, seeded, worlds
from tests.ops._helpers import expect_error

TOL = MODEL_TOL  # bf16 projections on both sides of bf16 attention, against float32
HIDDEN, HEAD_DIM = 32, 64
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
# The key bias's gradient is mostly cancellation (without rotary a key bias shifts every
# logit of a query row alike, which softmax ignores): small, so its relative error is
# about twice the others'; it is checked at twice the tolerance.


def _rotary(s: int, d: int, device):
    """Rotary ``cos``, ``sin`` ``[1, s, d]`` (float32) of positions ``0 .. s - 1``."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[None].to(device), emb.sin()[None].to(device)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def _reference(x, mods, heads, kv_heads, cos, sin, causal):
    """float32 attention block of the whole sequence ``x [B, S, H]``."""
    b, s, _ = x.shape
    d = HEAD_DIM
    q = mods["q_proj"](x).view(b, s, heads, d).transpose(1, 2)
    k = mods["k_proj"](x).view(b, s, kv_heads, d).transpose(1, 2)
    v = mods["v_proj"](x).view(b, s, kv_heads, d).transpose(1, 2)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    logits = (q @ k.transpose(-1, -2)) * d**-0.5
    if causal:
        pos = torch.arange(s, device=x.device)
        logits = logits.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return mods["o_proj"](out.transpose(1, 2).reshape(b, s, heads * d))


def _linears(seed, heads, kv_heads, bias, dev):
    shapes = {
        "q_proj": (HIDDEN, heads * HEAD_DIM, bias),
        "k_proj": (HIDDEN, kv_heads * HEAD_DIM, bias),
        "v_proj": (HIDDEN, kv_heads * HEAD_DIM, bias),
        "o_proj": (heads * HEAD_DIM, HIDDEN, False),
    }
    mods = {}
    for i, (name, (n_in, n_out, b)) in enumerate(shapes.items()):
        lin = nn.Linear(n_in, n_out, bias=b)
        with torch.no_grad():
            lin.weight.copy_(seeded(seed + 2 * i, n_out, n_in, scale=n_in**-0.5))
            if b:
                lin.bias.copy_(seeded(seed + 2 * i + 1, n_out, scale=0.2))
        mods[name] = lin.to(torch.bfloat16).to(dev)
    return mods


def _expected_positions(rank, world, s, causal):
    """Positions of a rank's tokens, written out: rank ``r`` holds ``[r * s / W, ...)``,
    or (causal) chunks ``r`` and ``2W - 1 - r`` of ``2W``."""
    if not causal:
        n = s // world
        return list(range(rank * n, (rank + 1) * n))
    c = s // (2 * world)
    first = list(range(rank * c, (rank + 1) * c))
    last = (2 * world - 1 - rank) * c
    return first + list(range(last, last + c))


def _layout_checks(group, s, causal):
    w, r = group.world_size, group.rank
    want = _expected_positions(r, w, s, causal)
    dev = group.device
    ids = torch.arange(s, dtype=torch.float32, device=dev)[None]  # (all-gather: floats)
    assert inn.shard_sequence(ids, group, causal)[0].tolist() == want
    assert inn.sequence_positions(group, s // w, causal).tolist() == want
    parts = [torch.tensor(_expected_positions(i, w, s, causal), dtype=torch.float32,
                          device=dev)[None] for i in range(w)]  # fmt: skip
    assert torch.equal(inn.unshard_sequence(parts, group, causal), ids)
    assert torch.equal(inn.unshard_sequence(parts[r], group, causal), ids)
    if causal:  # the ops' own zigzag helper agrees
        assert torch.equal(zigzag_shard(ids, w, r, dim=1), inn.shard_sequence(ids, group, True))


def _fwd_bwd_body(group, strategy, causal, heads, kv_heads, bias):
    w, dev = group.world_size, group.device
    lin = _linears(11, heads, kv_heads, bias, dev)
    attn = inn.ContextParallelAttention.from_linears(
        *(lin[n] for n in PROJ), HEAD_DIM, group, strategy=strategy, causal=causal
    )
    assert attn.q_proj.weight.data_ptr() != lin["q_proj"].weight.data_ptr()  # copied
    ref = {n: copy.deepcopy(m).float() for n, m in lin.items()}
    # (batch, tokens per rank): ragged against the emulation's 16-token tiles; the second
    # call needs a larger context
    for call, (b, s_loc) in enumerate([(1, 6), (2, 10)]):
        s = w * s_loc
        _layout_checks(group, s, causal)
        x = seeded(100 + call, b, s, HIDDEN, device=dev)
        g = seeded(200 + call, b, s, HIDDEN, device=dev)
        cos, sin = _rotary(s, HEAD_DIM, dev)
        xl = leaf(x)
        pos = tuple(inn.shard_sequence(t, group, causal) for t in (cos, sin))
        out_local, extra = attn(inn.shard_sequence(xl, group, causal), position_embeddings=pos)
        assert extra is None and out_local.shape == (b, s_loc, HIDDEN)
        out = inn.unshard_sequence(out_local, group, causal)
        out.backward(g)
        xr = leaf(x.float())
        ref_out = _reference(xr, ref, heads, kv_heads, cos, sin, causal)
        ref_out.backward(g.float())
        what = f"{strategy} causal={causal} call {call}"
        checks = [("out", out, ref_out), ("dx", xl.grad, xr.grad)]
        for n in PROJ:
            checks.append((f"{n}.weight.grad", getattr(attn, n).weight.grad, ref[n].weight.grad))
            if ref[n].bias is not None:
                checks.append((f"{n}.bias.grad", getattr(attn, n).bias.grad, ref[n].bias.grad))
        for name, got, want in checks:
            assert got is not None and torch.isfinite(got).all(), f"{what}: {name} not finite"
            err = rel(got, want)
            tol = 2 * TOL if name == "k_proj.bias.grad" else TOL
            assert err < tol, f"{what}: {name} rel err {err:.2e}"
        attn.zero_grad()
        for m in ref.values():
            m.zero_grad()
    assert attn._ctx.current is not None and attn._ctx.current.max_tokens >= 2 * 10
    attn.close()
    return True


@pytest.mark.parametrize("world", worlds(), indirect=True)
@pytest.mark.parametrize("strategy", ["fused", "none"])
def test_causal_gqa(world, strategy):
    """Zigzag causal, 4 query heads on 2 K/V heads, q/k/v biases."""
    world.run(_fwd_bwd_body, strategy, True, 4, 2, True)


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
@pytest.mark.parametrize("strategy", ["fused", "none"])
def test_full_attention(world, strategy):
    """Non-causal, 2 heads on 1 K/V head, no biases."""
    world.run(_fwd_bwd_body, strategy, False, 2, 1, False)


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_ring(world):
    world.run(_fwd_bwd_body, "ring", True, 4, 2, False)


def _bad_body(group):
    w, dev = group.world_size, group.device
    cls = inn.ContextParallelAttention
    for bad, exc, text in (
        (lambda: cls(HIDDEN, 6, 4, HEAD_DIM, group), InterlaceValueError, "multiple of"),
        (lambda: cls(HIDDEN, 4, 2, 32, group), InterlaceValueError, "head_dim"),
        (lambda: cls(HIDDEN, 4, 2, HEAD_DIM, group, dtype=torch.float32), InterlaceTypeError,
         "dtype"),
        (lambda: cls(HIDDEN, 4, 2, HEAD_DIM, group, strategy="fast"), InterlaceValueError,
         "strategy"),
        (lambda: cls(HIDDEN, 4, 2, HEAD_DIM, None), InterlaceTypeError, "Group"),
        (lambda: inn.shard_sequence(torch.zeros(1, 2 * w + 1, 4), group, False),
         InterlaceValueError, "does not split"),
        (lambda: inn.shard_sequence(torch.zeros(1, 3 * w, 4), group, True),
         InterlaceValueError, "zigzag"),
        (lambda: inn.unshard_sequence([torch.zeros(1, 2, 4)] * (w + 1), group, False),
         InterlaceValueError, "parts"),
    ):  # fmt: skip
        expect_error(exc, text, bad)
    attn = cls(HIDDEN, 4, 2, HEAD_DIM, group, causal=True)
    x = torch.randn(1, 8, HIDDEN).to(torch.bfloat16).to(dev)
    expect_error(InterlaceValueError, "must be even", attn, x[:, :7])
    expect_error(InterlaceTypeError, "hidden_states are", attn, x.float())
    expect_error(InterlaceValueError, "hidden_states must be", attn, x[0])
    expect_error(InterlaceValueError, "attention_mask", attn, x, attention_mask=torch.ones(8, 8))
    cos, sin = _rotary(8 * w, HEAD_DIM, dev)  # the whole sequence's, not this rank's
    expect_error(InterlaceValueError, "this rank's 8 positions", attn, x, (cos, sin))
    attn.float()
    expect_error(InterlaceTypeError, "weights must be", attn, x.float())
    attn.bfloat16()
    out, _ = attn(x)  # still usable, with its hooks
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all() and attn.o_proj.weight.grad is not None
    attn.close()
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_bad_inputs_raise(world):
    world.run(_bad_body)
