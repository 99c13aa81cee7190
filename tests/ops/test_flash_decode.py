"""Distributed flash-decode against a float32 reference over the whole (gathered) KV
cache: grouped-query heads, shard lengths that differ per rank and are not multiples of
the KV block, per-sequence valid lengths (one rank's shard empty for a sequence), caches
sliced from a larger allocation (strided), one split and several splits per sequence,
poisoned outputs, repeated calls on one context (epoch flags and buffer parities
wrapping), the one-owner mode, bad inputs raising on every rank, and (on GPUs) CUDA-graph
capture and replay mixed with eager calls. The reference and one-owner tests also run the
``none`` baseline (torch attention per shard, process-group gather, torch merge; it costs
milliseconds on the CPU); where the ranks share one GPU it gathers through host memory
(gloo), so it runs there too, its per-shard flash-attention call included."""

from __future__ import annotations

import pytest
import torch

from interlace.errors import InterlaceError, InterlaceTypeError, InterlaceValueError
from interlace.ops.attention import FlashDecode
from tests.ops._helpers import capture, expect_error, nans, rel_err, replay, run_on_gpus, sync

TOL = 1e-2


def _dims(group):
    """(max batch, q heads, kv heads, head dim, shard length of each rank)."""
    w = group.world_size
    if group.backend == "cuda":
        return 4, 32, 8, 128, [1000 + 77 * r for r in range(w)]
    return 2, 4, 2, 16, [37 + 5 * r for r in range(w)]


def _inputs(group, batch, hq, hkv, d, lens, seed, cap_extra=3):
    """The same query on every rank and every rank's cache shard (each rank builds them
    all from one seed: the reference needs them, the op gets its own). Each shard is a
    slice of a longer cache allocation, so its strides are not those of a packed tensor."""
    gen = torch.Generator().manual_seed(seed)
    dt, dev = torch.bfloat16, group.device
    q = torch.randn(batch, hq, d, generator=gen).to(dt).to(dev)
    shards = []
    for n in lens:
        cache = torch.randn(2, batch, hkv, n + cap_extra, d, generator=gen).to(dt).to(dev)
        shards.append((cache[0, :, :, :n], cache[1, :, :, :n]))
    return q, shards


def _reference(q, shards, valid, hkv):
    """Attention of ``q`` over every shard's first ``valid[r][b]`` rows, in float32."""
    batch, hq, d = q.shape
    g = hq // hkv
    out = torch.empty(batch, hq, d, dtype=torch.float32, device=q.device)
    for b in range(batch):
        k = torch.cat([s[0][b, :, : valid[r][b]] for r, s in enumerate(shards)], dim=1).float()
        v = torch.cat([s[1][b, :, : valid[r][b]] for r, s in enumerate(shards)], dim=1).float()
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [hq, n, d]
        p = torch.softmax((q[b].float()[:, None, :] @ k.transpose(1, 2)) / d**0.5, dim=-1)
        out[b] = (p @ v)[:, 0]
    return out


def _body(group, owner, calls, strategy="auto"):
    r = group.rank
    max_b, hq, hkv, d, lens = _dims(group)
    ctx = FlashDecode(group, max_b, hq, hkv, d, owner=owner, strategy=strategy)
    ran = "fused" if strategy == "auto" else strategy
    splits = set()
    try:
        for i in range(calls):
            batch = max_b if i % 2 == 0 else 1
            q, shards = _inputs(group, batch, hq, hkv, d, lens, seed=100 + i)
            k, v = shards[r]
            kv_lens, valid = None, [[n] * batch for n in lens]
            if i % 3 == 1:  # per-sequence lengths; rank 0 holds nothing of sequence 0
                valid = [[(n * (b + 1)) // (batch + 1) for b in range(batch)] for n in lens]
                valid[0][0] = 0
                kv_lens = torch.tensor(valid[r], dtype=torch.int32, device=group.device)
            out = nans(batch, hq, d, dtype=torch.bfloat16, device=group.device)
            got = ctx(q, k, v, kv_lens=kv_lens, out=out if i != 2 else None)
            sync(group)
            assert ctx.last_strategy == ran
            splits.add(ctx.splits(batch, k.shape[2])[0])
            if owner is not None and r != owner:
                assert got is None
                continue
            assert got.shape == (batch, hq, d)
            err = rel_err(got, _reference(q, shards, valid, hkv))
            assert err < TOL, f"call {i} batch {batch}: rel err {err:.2e}"
            if i != 2:
                assert got.data_ptr() == out.data_ptr()
        ctx.check()
    finally:
        ctx.close()
    return sorted(splits)


@pytest.mark.parametrize("strategy", ["auto", "none"])
def test_flash_decode_matches_reference(world, strategy):
    splits = world.run(_body, None, 4, strategy)[0]
    if world.backend == "cpu" and strategy == "auto":  # batch 1 splits each shard, B not
        assert 1 in splits and max(splits) > 1, splits


@pytest.mark.parametrize("strategy", ["auto", "none"])
def test_flash_decode_owner(world, strategy):
    """One rank merges; the others return None (fused: and wait for its acknowledgement
    before they overwrite a buffer parity; five calls: each parity reused twice)."""
    world.run(_body, world.world_size - 1, 5, strategy)


def _bad_body(group):
    max_b, hq, hkv, d, lens = _dims(group)
    expect_error(InterlaceValueError, "not a multiple of kv_heads", FlashDecode,
                 group, max_b, 6, 4, d)  # fmt: skip
    expect_error(InterlaceValueError, "head_dim", FlashDecode, group, max_b, hq, hkv, 96)
    expect_error(InterlaceTypeError, "dtype", FlashDecode, group, max_b, hq, hkv, d,
                 dtype=torch.float32)  # fmt: skip
    expect_error(InterlaceValueError, "owner", FlashDecode, group, max_b, hq, hkv, d,
                 owner=group.world_size)  # fmt: skip
    expect_error(InterlaceValueError, "strategy must be one of", FlashDecode, group, max_b,
                 hq, hkv, d, strategy="ring")  # fmt: skip
    for strategy in ("none", "auto"):
        _bad_calls(group, FlashDecode(group, max_b, hq, hkv, d, strategy=strategy))
    return True


def _bad_calls(group, ctx):
    dev = group.device
    max_b, hq, hkv, d, lens = _dims(group)
    try:
        q, shards = _inputs(group, max_b, hq, hkv, d, lens, seed=5)
        k, v = shards[group.rank]
        expect_error(InterlaceTypeError, "dtype", ctx, q.half(), k, v)
        expect_error(InterlaceTypeError, "dtype", ctx, q, k, v.half())
        expect_error(InterlaceValueError, "q must be", ctx, q[:, : hq - 1], k, v)
        expect_error(InterlaceValueError, "outside", ctx, q.repeat(2, 1, 1), k.repeat(2, 1, 1, 1),
                     v.repeat(2, 1, 1, 1))  # fmt: skip
        expect_error(InterlaceValueError, "k must be", ctx, q, k[:, :1], v[:, :1])
        expect_error(InterlaceValueError, "differ in shape", ctx, q, k, v[:, :, :-1])
        wide = torch.zeros(*k.shape[:3], 2 * d, dtype=k.dtype, device=dev)
        expect_error(InterlaceValueError, "unit stride", ctx, q, wide[..., ::2], v)
        expect_error(InterlaceTypeError, "kv_lens", ctx, q, k, v,
                     kv_lens=torch.ones(max_b, dtype=torch.int64, device=dev))  # fmt: skip
        expect_error(InterlaceValueError, "kv_lens", ctx, q, k, v,
                     kv_lens=torch.ones(max_b + 1, dtype=torch.int32, device=dev))  # fmt: skip
        expect_error(InterlaceValueError, "out must be", ctx, q, k, v,
                     out=torch.empty(max_b, hq, d + 1, dtype=q.dtype, device=dev))  # fmt: skip
        out = ctx(q, k, v)  # nothing was launched by the bad calls: a good one still works
        sync(group)
        full = [[n] * max_b for n in lens]
        assert rel_err(out, _reference(q, shards, full, hkv)) < TOL
    finally:
        ctx.close()
    expect_error(InterlaceError, "closed", ctx, q, k, v)


def test_flash_decode_bad_inputs(world):
    world.run(_bad_body)


def _graph_body(group):
    r = group.rank
    max_b, hq, hkv, d, lens = _dims(group)
    ctx = FlashDecode(group, max_b, hq, hkv, d)
    try:
        q, shards = _inputs(group, max_b, hq, hkv, d, lens, seed=11)
        k, v = (t.clone() for t in shards[r])
        kv_lens = torch.full((max_b,), lens[r], dtype=torch.int32, device=group.device)
        out = torch.empty_like(q)
        graph, _ = capture(lambda: ctx(q, k, v, kv_lens=kv_lens, out=out))  # compiles first
        for i in range(4):  # new contents and lengths per step, eager calls in between
            q2, shards2 = _inputs(group, max_b, hq, hkv, d, lens, seed=200 + i)
            valid = [[n - 13 * i - b for b in range(max_b)] for n in lens]
            q.copy_(q2)
            k.copy_(shards2[r][0])
            v.copy_(shards2[r][1])
            kv_lens.copy_(torch.tensor(valid[r], dtype=torch.int32))
            replay(graph, out)
            assert rel_err(out, _reference(q2, shards2, valid, hkv)) < TOL, f"replay {i}"
            eager = ctx(q, k, v, kv_lens=kv_lens)
            torch.cuda.synchronize()
            assert rel_err(eager, _reference(q2, shards2, valid, hkv)) < TOL, f"eager {i}"
        ctx.check()
    finally:
        ctx.close()
    return True


@pytest.mark.gpu
def test_flash_decode_graph_replay(world):
    run_on_gpus(world, _graph_body, why="CUDA graphs need a GPU")
