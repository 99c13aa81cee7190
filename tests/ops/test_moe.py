"""Tensor-parallel MoE (AGMoE + MoERS) against a float32 reference built from every rank's
weights: balanced, random and skewed routing (an expert with no tokens, one expert with
all of them), k from 1 to 8, E from 1 to 64, tokens per rank not a multiple of the tile,
poisoned outputs, repeated calls on one context, the device-built tile table, bad inputs
raising on every rank, and (on GPUs) CUDA-graph replay with new routing."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.ops.moe import AGMoE, MoERS
from tests.ops._helpers import (
    capture,
    counting,
    expect_error,
    gathered,
    rand,
    rel_err,
    replay,
    run_on_gpus,
    sync,
)

TOL = 1e-2


def _auto_body(group):
    """``auto`` takes the fused kernel for a padded routing in the CPU emulation, and on
    GPUs where ``moe_rs.AUTO_FUSED_ON_GPU`` (else ``none``); ``fused`` runs where asked."""
    from interlace.ops.moe import moe_rs

    kw = dict(max_tokens=8 * group.world_size, hidden=32, inter=16, experts=2, topk=1)
    with _pair(group, "fused", **kw) as (ag, rs), MoERS(group, **kw) as auto:
        gen = torch.Generator().manual_seed(group.rank)
        x = rand(gen, 8, 32, dtype=torch.bfloat16, device=group.device)
        ids, wts = make_routing(gen, 8, 1, 2, "random")
        ids, wts = ids.to(group.device), wts.to(group.device)
        w1 = rand(gen, 2, 32, 2 * 16, dtype=torch.bfloat16, device=group.device)
        w2 = rand(gen, 2, 16, 32, dtype=torch.bfloat16, device=group.device)
        h, routing = ag(x, ids, wts, w1)
        auto(h, routing, w2)
        rs(h, routing, w2)
        on_gpu = group.backend == "cuda" and not moe_rs.AUTO_FUSED_ON_GPU
        assert auto.last_strategy == ("none" if on_gpu else "fused")
        assert rs.last_strategy == "fused"
    return True


def test_moe_rs_auto_choice(world):
    world.run(_auto_body)


def make_routing(gen, m, k, experts, kind):
    """``(ids [m, k] int64, weights [m, k] float32)``: distinct experts per token."""
    if kind == "balanced":  # token t takes experts t, t+1, ... (mod E): equal loads
        ids = (torch.arange(m)[:, None] + torch.arange(k)[None, :]) % experts
    elif kind == "skewed":  # expert 0 in every token, the rest from the lower half only
        span = max(k, experts // 2)
        ids = torch.stack(
            [
                torch.cat(
                    [
                        torch.zeros(1, dtype=torch.long),
                        1 + torch.randperm(span - 1, generator=gen)[: k - 1],
                    ]
                )
                for _ in range(m)
            ]
        )
    elif kind == "one":  # every token to expert E - 1 (k = 1)
        ids = torch.full((m, k), experts - 1) - torch.arange(k)[None, :]
    else:  # random
        ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(m)])
    wts = torch.softmax(torch.randn(m, k, generator=gen), dim=-1)
    return ids.long(), wts


def reference(x_all, ids_all, w_all, w1_full, w2_full, inter_total, swiglu=True):
    """y [M, H] float32 of the whole layer (every rank's intermediate shard)."""
    y = torch.zeros(x_all.shape[0], w2_full.shape[2])
    x = x_all.float()
    for e in range(w1_full.shape[0]):  # each expert's (token, slot) pairs at once
        t, j = (ids_all == e).nonzero(as_tuple=True)
        if len(t):
            a = x[t] @ w1_full[e].float()
            if swiglu:
                a = F.silu(a[:, :inter_total]) * a[:, inter_total:]
            y.index_add_(0, t, w_all[t, j].float()[:, None] * (a @ w2_full[e].float()))
    return y


def _weights(world, hidden, inter, experts, dtype, device, rank, swiglu=True):
    """Full weights from a seed every rank shares, and this rank's shards: gate/up
    ``[E, H, 2 * inter]`` (gate then up of this rank's columns) and down
    ``[E, inter, H]``."""
    g = torch.Generator().manual_seed(1234)
    it = inter * world
    w1 = (torch.randn(experts, hidden, 2 * it if swiglu else it, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(experts, it, hidden, generator=g) * 0.3).to(dtype)
    cols = slice(rank * inter, (rank + 1) * inter)
    if swiglu:
        w1_loc = torch.cat([w1[:, :, :it][:, :, cols], w1[:, :, it:][:, :, cols]], dim=2)
    else:
        w1_loc = w1[:, :, cols]
    w2_loc = w2[:, cols, :]
    return w1, w2, w1_loc.contiguous().to(device), w2_loc.contiguous().to(device)


@contextlib.contextmanager
def _pair(group, strategy="auto", activation="swiglu", rows_dtype=None, **sizes):
    """``(AGMoE, MoERS)`` on ``group`` with the sizes ``sizes`` (``max_tokens``, ``hidden``,
    ...), both closed on leaving."""
    with AGMoE(group, strategy=strategy, activation=activation, **sizes) as ag:
        with MoERS(group, strategy=strategy, rows_dtype=rows_dtype, **sizes) as rs:
            yield ag, rs


def _case(group, ag, rs, m, hidden, inter, experts, k, kind, seed, swiglu=True, check_h=True):
    w, r, dev, dtype = group.world_size, group.rank, group.device, torch.bfloat16
    gen = torch.Generator().manual_seed(seed + 17 * r)
    w1, w2, w1_loc, w2_loc = _weights(w, hidden, inter, experts, dtype, dev, r, swiglu)
    x = rand(gen, m, hidden, dtype=dtype, device="cpu")
    ids, wts = make_routing(gen, m, k, experts, kind)
    h, routing = ag(x.to(dev), ids.to(dev).int() if seed % 2 else ids.to(dev), wts.to(dev), w1_loc)
    y = rs(h, routing, w2_loc)
    sync(group)
    x_all, ids_all, w_all = (gathered(t, group) for t in (x, ids, wts))
    if check_h:  # every row in use is act(x[token] @ w1_loc[expert]) of its token
        tok = routing.token_ids.cpu().long()
        used = int(routing.offsets[-1])
        offs = routing.offsets.cpu().tolist()
        live = tok[:used] >= 0
        assert int(live.sum()) == w * m * k, "every (token, slot) has one row"
        expert_of = torch.zeros(used, dtype=torch.long)
        for e in range(experts):
            expert_of[offs[e] : offs[e + 1] if e + 1 < experts else used] = e
        rows = torch.nonzero(live).flatten()
        a = torch.stack([x_all[tok[i]].float() @ w1_loc[expert_of[i]].float().cpu() for i in rows])
        if swiglu:
            a = F.silu(a[:, :inter]) * a[:, inter:]
        err = rel_err(h[:used].cpu()[rows], a)
        assert err < TOL, f"h rel err {err:.2e}"
        # every (token, expert) pair appears once
        pairs = sorted(zip(tok[rows].tolist(), expert_of[rows].tolist()))
        want = sorted((t, int(e)) for t in range(w * m) for e in ids_all[t].tolist())
        assert pairs == want
    ref = reference(x_all, ids_all, w_all, w1, w2, inter * w, swiglu)[r * m : (r + 1) * m]
    assert y.shape == (m, hidden)
    err = rel_err(y.cpu(), ref)
    assert err < TOL, f"y rel err {err:.2e} ({kind}, E={experts}, k={k}, m={m})"
    return routing


# ------------------------------------------------------------------------- CPU shapes
def _moe_body(group, strategy, shape, calls, rows_dtype=None):
    """One pair of contexts, several calls on it (varying tokens per rank and routing)."""
    hidden, inter, experts, topk, max_m = shape
    w = group.world_size
    kw = dict(max_tokens=w * max_m, hidden=hidden, inter=inter, experts=experts, topk=topk)
    with _pair(group, strategy, rows_dtype=rows_dtype, **kw) as (ag, rs):
        assert rs.rows_dtype == (rows_dtype or torch.bfloat16)
        for i, (kind, m) in enumerate(calls):
            routing = _case(group, ag, rs, m, hidden, inter, experts, topk, kind, seed=i)
            if strategy == "fused":
                assert routing.layout == "padded"
                _check_tiles(routing, w)
        ag.check()
        rs.check()
    return True


def _check_tiles(routing, world):
    """The tile table: one entry per row tile, every row tile once with its expert, each
    tile's arrival range covers its rows' source positions, and tiles come in order of
    the last position they need; the row-order column names each row tile's expert."""
    n = int(routing.tile_count[0])
    bm = routing.block_m
    offs = routing.offsets.cpu().tolist()
    assert n * bm == offs[-1]
    tiles = routing.tiles[:n].cpu().tolist()
    assert sorted(t[0] for t in tiles) == [i * bm for i in range(n)]
    assert [t[3] for t in tiles] == sorted(t[3] for t in tiles)

    def expert_of(row):
        return max(e for e in range(routing.experts) if offs[e] <= row)

    assert [t[4] for t in tiles] == [expert_of(q * bm) for q in range(n)]
    tok = routing.token_ids.cpu().tolist()
    rank = dist.get_rank()
    for row0, e, first, last, _ in tiles:
        assert e == expert_of(row0), (row0, e, offs)
        srcs = [tok[row0 + i] // routing.m_loc for i in range(bm) if tok[row0 + i] >= 0]
        pos = [(s - rank) % world for s in srcs]
        assert pos and first == min(pos) and last == max(pos), (row0, first, last, pos)
        assert pos == sorted(pos)


@pytest.mark.parametrize("strategy", ["fused", pytest.param("none", marks=pytest.mark.own_gpu)])
def test_moe_matches_reference(world, strategy):
    # (hidden, inter, experts, topk, max tokens per rank); (routing, tokens per rank)
    calls = [("random", 7), ("balanced", 9), ("skewed", 5)]
    world.run(_moe_body, strategy, (32, 16, 6, 2, 9), calls)


def test_moe_float32_rows(world):
    """``MoERS(rows_dtype=torch.float32)``: the weighted rows unrounded until the sum."""
    calls = [("skewed", 5), ("random", 9)]
    world.run(_moe_body, "fused", (32, 16, 6, 2, 9), calls, torch.float32)


def _mixed_body(group):
    """The fused first half feeding the ``none`` second half (what ``auto`` picks on GPUs):
    the padded layout's rows past ``offsets[E]`` hold stale token ids and weights (poisoned
    here), which the ``none`` reduce must not read."""
    w = group.world_size
    hidden, inter, experts, k, m = 32, 16, 6, 2, 7
    kw = dict(max_tokens=w * 9, hidden=hidden, inter=inter, experts=experts, topk=k)
    with AGMoE(group, strategy="fused", **kw) as ag, MoERS(group, strategy="none", **kw) as rs:

        def poisoned_rs(h, routing, w2):
            used = int(routing.offsets[-1])
            assert routing.layout == "padded" and used < routing.rows
            routing.entry_ids[used:] = 1 << 30
            routing.weights[used:] = float("nan")
            h[used:] = float("nan")
            return rs(h, routing, w2)

        _case(group, ag, poisoned_rs, m, hidden, inter, experts, k, "skewed", seed=3)
    return True


def test_moe_fused_first_half_none_second_half(world):
    world.run(_mixed_body)


def _edge_body(group):
    """E = 1, k = 1 (one expert takes every token); E = 64, k = 8; odd widths (the
    pointer path: rows not 16-byte aligned); no activation."""
    w = group.world_size
    for hidden, inter, experts, k, m, kind, swiglu in (
        (24, 8, 1, 1, 3, "one", True),
        (16, 16, 64, 8, 4, "random", True),
        (20, 12, 5, 3, 6, "skewed", False),
    ):
        kw = dict(max_tokens=w * 8, hidden=hidden, inter=inter, experts=experts, topk=k)
        with _pair(group, activation="swiglu" if swiglu else None, **kw) as (ag, rs):
            _case(group, ag, rs, m, hidden, inter, experts, k, kind, seed=5, swiglu=swiglu)
    return True


def test_moe_edge_shapes(world):
    if world.world_size == 3:
        pytest.skip("W = 2 and 4 cover the edge shapes")
    world.run(_edge_body)


# ------------------------------------------------------------------------- bad inputs
def _bad_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    kw = dict(max_tokens=w * 4, hidden=16, inter=8, experts=4, topk=2)
    gen = torch.Generator().manual_seed(r)
    x = rand(gen, 3, 16, dtype=torch.bfloat16, device=dev)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], device=dev)
    wts = torch.full((3, 2), 0.5, device=dev)
    w1 = rand(gen, 4, 16, 16, dtype=torch.bfloat16, device=dev)
    with _pair(group, **kw) as (ag, rs):
        bad_ids = ids.clone()
        if r == w - 1:
            bad_ids[1, 0] = 4  # out of range on one rank only: every rank raises
        expect_error(
            InterlaceValueError, "rank" if r != w - 1 else "[0, 4)", ag, x, bad_ids, wts, w1
        )
        expect_error(
            InterlaceValueError, "topk_ids has shape", ag, x, ids[:, :1].contiguous(), wts, w1
        )
        expect_error(InterlaceValueError, "topk_weights has shape", ag, x, ids, wts[:2], w1)
        expect_error(InterlaceTypeError, "dtype", ag, x.float(), ids, wts, w1)
        expect_error(InterlaceTypeError, "topk_ids has dtype", ag, x, ids.float(), wts, w1)
        expect_error(InterlaceValueError, "w has shape", ag, x, ids, wts, w1[:3])
        xm = x if r == 0 else x[:2]  # different shapes on different ranks
        expect_error(
            InterlaceValueError,
            "",
            ag,
            xm.contiguous(),
            ids[: xm.shape[0]].contiguous(),
            wts[: xm.shape[0]].contiguous(),
            w1,
        )
        expect_error(InterlaceValueError, "rows", ag, rand(gen, 5, 16, dtype=torch.bfloat16,
                     device=dev), ids.repeat(2, 1)[:5], wts.repeat(2, 1)[:5], w1)  # fmt: skip
        # the context still works after the refusals
        h, routing = ag(x, ids, wts, w1)
        w2 = rand(gen, 4, 8, 16, dtype=torch.bfloat16, device=dev)
        expect_error(
            InterlaceValueError, "w_down has shape", rs, h, routing, w2[:, :4].contiguous()
        )
        expect_error(InterlaceValueError, "routing must be", rs, h, "routing", w2)
        expect_error(InterlaceValueError, "h has shape", rs, h[:-1].contiguous(), routing, w2)
        y = rs(h, routing, w2)
        assert torch.isfinite(y.float()).all()
        expect_error(InterlaceValueError, "strategy", AGMoE, group, strategy="fast", **kw)
        expect_error(InterlaceValueError, "topk", AGMoE, group, **{**kw, "topk": 5})
        expect_error(InterlaceTypeError, "rows_dtype", MoERS, group, rows_dtype=torch.float16,
                     **kw)  # fmt: skip
        # ``none`` inside a CUDA-graph capture on a group whose collectives a graph cannot
        # hold (gloo): a clear error before anything runs, and the contexts stay usable
        # (an NCCL group, one GPU per rank, captures them: nothing to refuse there)
        for ctx, args in ((ag, (x, ids, wts, w1)), (rs, (h, routing, w2))) * (not group.nccl):
            strategy, ctx.strategy = ctx.strategy, "none"
            ctx._capturing = lambda: True
            expect_error(InterlaceValueError, "captures only on an NCCL group", ctx, *args)
            del ctx._capturing
            ctx.strategy = strategy
        assert rel_err(rs(*ag(x, ids, wts, w1), w2).cpu(), y.float().cpu()) < TOL
    return True


def test_moe_bad_inputs_raise_on_every_rank(world):
    if world.world_size == 3:
        pytest.skip("W = 2 and 4 cover the checks")
    world.run(_bad_body)


# ------------------------------------------------------------------------- GPU only
def _graph_body(group, m, hidden, inter, experts, k):
    """CUDA-graph capture of both halves, replayed with new tokens and new routing."""
    w, r, dev = group.world_size, group.rank, group.device
    kw = dict(max_tokens=w * m, hidden=hidden, inter=inter, experts=experts, topk=k)
    gen = torch.Generator().manual_seed(40 + r)
    w1, w2, w1_loc, w2_loc = _weights(w, hidden, inter, experts, torch.bfloat16, dev, r)
    x = torch.empty(m, hidden, dtype=torch.bfloat16, device=dev)
    ids = torch.empty(m, k, dtype=torch.int64, device=dev)
    wts = torch.empty(m, k, dtype=torch.float32, device=dev)

    def fill(kind):
        xi = rand(gen, m, hidden, dtype=torch.bfloat16, device="cpu")
        ii, wi = make_routing(gen, m, k, experts, kind)
        x.copy_(xi.to(dev)), ids.copy_(ii.to(dev)), wts.copy_(wi.to(dev))
        return xi, ii, wi

    with _pair(group, **kw) as (ag, rs):

        def step():
            h, routing = ag(x, ids, wts, w1_loc)
            return rs(h, routing, w2_loc)

        fill("random")
        graph, y = capture(step)
        for kind in ("random", "skewed", "balanced"):
            xi, ii, wi = fill(kind)
            replay(graph, y)
            x_all, ids_all, w_all = (gathered(t, group) for t in (xi, ii, wi))
            ref = reference(x_all, ids_all, w_all, w1, w2, inter * w)[r * m : (r + 1) * m]
            err = rel_err(y.cpu(), ref)
            assert err < TOL, f"graph replay ({kind}): rel err {err:.2e}"
        ag.check()
        rs.check()
    return True


@pytest.mark.gpu
def test_moe_graph_replay_new_routing(world):
    run_on_gpus(world, _graph_body, 77, 256, 96, 8, 2, why="CUDA graphs need a GPU")


def _eager_graph_body(group):
    """``eager_graphs=True``: repeated eager calls of one shape with fresh tokens, routing
    (int64 and int32 ids in turn: two kinds of call) and outputs, every result against the
    float32 reference; both halves must end up replaying graphs."""
    w = group.world_size
    kw = dict(max_tokens=w * 40, hidden=64, inter=32, experts=8, topk=2)
    with (
        AGMoE(group, strategy="fused", eager_graphs=True, **kw) as ag,
        MoERS(group, strategy="fused", eager_graphs=True, **kw) as rs,
    ):
        for i in range(7):
            kind = ("random", "skewed", "balanced")[i % 3]
            _case(group, ag, rs, 40, 64, 32, 8, 2, kind, seed=i)
        ag.check()
        rs.check()
        for ctx in (ag, rs):
            replayed = [g for g in ctx._graphs.values() if not isinstance(g, str)]
            assert replayed, f"{ctx.op_name}: no call was replayed from a graph: {ctx._graphs}"
    return True


@pytest.mark.gpu
def test_moe_eager_graphs(world):
    run_on_gpus(world, _eager_graph_body, why="CUDA graphs need a GPU")


def _gpu_body(group):
    """GPU shapes: ragged tokens per rank, aligned and unaligned widths, E up to 64."""
    w = group.world_size
    for m, hidden, inter, experts, k, kind in (
        (77, 256, 96, 8, 2, "random"),
        (130, 512, 128, 32, 4, "skewed"),
        (33, 264, 40, 64, 8, "random"),
    ):
        kw = dict(max_tokens=w * m, hidden=hidden, inter=inter, experts=experts, topk=k)
        with _pair(group, **kw) as (ag, rs):
            for i in range(2):
                _case(group, ag, rs, m, hidden, inter, experts, k, kind, seed=i, check_h=i == 0)
    return True


@pytest.mark.gpu
def test_moe_gpu_shapes(world):
    run_on_gpus(world, _gpu_body, why="GPU shapes")


def _hopper_reduce_body(group):
    """``MoERS``'s reduce GEMM on the Hopper kernel (``_gemm.hopper_reduce``: K and N
    multiples of its blocks; E 8, top-2, ragged tokens, three routings), its launches
    counted: every call on a Hopper GPU, none elsewhere."""
    from interlace.ops.moe import _gemm

    w = group.world_size
    m, hidden, inter, experts, k = 97, 512, 192 * w, 8, 2
    kw = dict(max_tokens=w * m, hidden=hidden, inter=inter, experts=experts, topk=k)
    with counting(_gemm, "_launch_reduce_hopper") as calls, _pair(group, **kw) as (ag, rs):
        for i, kind in enumerate(("random", "skewed", "balanced")):
            _case(group, ag, rs, m - 10 * i, hidden, inter, experts, k, kind, seed=i)
    hopper = _gemm.KH is not None and torch.cuda.get_device_capability()[0] == 9
    assert len(calls) == (3 if hopper else 0), calls
    return True


@pytest.mark.gpu
def test_moe_reduce_hopper_kernel(world):
    run_on_gpus(world, _hopper_reduce_body, why="the Hopper kernel needs a GPU")


# ------------------------------------------------------------------------- per-rank path
def _per_rank_body(group):
    """The per-rank path ``bench.moe`` times, on rank 0 alone: the routing build for all
    ``W`` source ranks (flags preset), the reduce GEMM with few programs running many tiles
    each (several K steps, ragged N), then the owner's finish over ``W`` row buffers (the
    computing rank's poisoned first: every entry's row must be written; the others zero
    stand-ins), twice, as two different ranks; a poisoned output is fully overwritten, and
    every (token, slot) entry has exactly one row, whose token is the entry's."""
    from interlace.ops.moe import _gemm

    if group.rank != 0:
        return True
    # the op's config, and on a GPU every config the benchmark's sweep may pick
    cfg = _gemm.config_for("reduce", group.backend)
    cfgs = [cfg]
    if group.backend == "cuda":
        cfgs = list(dict.fromkeys([cfg, *_gemm.CANDIDATES["reduce"]]))
    for c in cfgs:
        _per_rank_case(group, c)
    return True


def _per_rank_case(group, cfg):
    from interlace.ops.moe import _gemm
    from interlace.ops.moe.routing import alloc_routing, launch_routing, pack_meta, padded_rows

    dev, backend = group.device, group.backend
    if backend == "cuda":
        world, m, k, experts, hidden, inter, grid = 3, 700, 2, 5, 520, 200, 4
    else:
        world, m, k, experts, hidden, inter, grid = 3, 20, 2, 5, 24, 16, 2
    gen = torch.Generator().manual_seed(3)
    tokens = world * m
    i32 = dict(dtype=torch.int32, device=dev)
    sig_in, err = torch.ones(16, **i32), torch.zeros(4, **i32)
    sig_in[8:] = 0  # slots 8, 9: the routing build's grid barrier (one launch on a GPU)
    w2 = rand(gen, experts, inter, hidden, dtype=torch.bfloat16, device="cpu")
    # every rank's row buffer and entry -> row map (only the rank computing writes its own)
    rows_cap = padded_rows(tokens, k, experts, cfg.block_m)
    bufs = torch.zeros(world, rows_cap, hidden, device=dev)
    table = torch.tensor([bufs[r].data_ptr() for r in range(world)], device=dev)
    maps = torch.zeros(world, tokens * k, **i32)
    map_table = torch.tensor([maps[r].data_ptr() for r in range(world)], device=dev)
    sig = torch.zeros(8, **i32)
    sig_table = torch.tensor([sig.data_ptr()] * world, device=dev)
    for call, rank in enumerate((0, 1)):
        ids, wts = make_routing(gen, tokens, k, experts, "random" if call else "skewed")
        meta = torch.empty(world, 2 * m * k, **i32)
        for s in range(world):
            pack_meta(meta[s], ids[s * m : (s + 1) * m].to(dev), wts[s * m : (s + 1) * m].to(dev))
        work = alloc_routing(m, k, experts, world, cfg.block_m, dev)
        launch_routing(
            work, meta, 2 * m * k, rank=rank, sig=sig_in, flag0=0, err=err.data_ptr(),
            max_spins=1 << 20, wait=True, bar_slot=8,
        )  # fmt: skip
        rt = work.routing
        h = rand(gen, rt.rows, inter, dtype=torch.bfloat16, device="cpu")
        y = torch.full((m, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
        assert int(rt.tile_count[0]) * -(-hidden // cfg.block_n) > 3 * grid  # many per program
        bufs.zero_()
        bufs[rank].fill_(float("nan"))
        # an entry whose map word were not written would read the last row: NaN, unwritten
        assert int(rt.offsets[-1]) < rows_cap
        maps.zero_()
        maps[rank].fill_(rows_cap - 1)
        _gemm.launch_gemm(
            a=h.to(dev), x_own=None, w=w2.to(dev), out=None, routing=rt, n=hidden, up=0,
            cfg=cfg, grid=grid, gather=False, swiglu=False, reduce=True, rows_out=bufs[rank],
            row_of=maps[rank], sig=sig, sig_table=sig_table, err=err.data_ptr(), rank=rank,
            max_spins=1 << 20, done_slot=0, contrib_slot=1, world=world,
        )  # fmt: skip
        _gemm.launch_finish(
            table, 0, map_table, 0, y, m, k, sig, 1, 2, err.data_ptr(), rank, 1 << 20, world,
            dev, backend,
        )  # fmt: skip
        sync(group)
        assert int(err[0]) == 0 and sig.tolist() == [0] * 8
        assert sig_in[8:].tolist() == [0] * 8, "the barrier's counters are left at zero"
        # float32 reference: every row in use times its weight, summed into its token
        used = int(rt.offsets[-1])
        tok = rt.token_ids[:used].long().cpu()
        wrow = rt.weights[:used].cpu()
        offs = rt.offsets.cpu().tolist()
        ref = torch.zeros(tokens, hidden)
        for e in range(experts):
            lo, hi = offs[e], offs[e + 1] if e + 1 < experts else used
            live = tok[lo:hi] >= 0
            rows = (h[lo:hi][live].float() @ w2[e].float()) * wrow[lo:hi][live][:, None]
            ref.index_add_(0, tok[lo:hi][live], rows)
        mine = slice(rank * m, (rank + 1) * m)
        err_y = rel_err(y.cpu(), ref[mine])
        assert err_y < TOL, f"{cfg} call {call}: y rel err {err_y:.2e}"
        ent = rt.entry_ids[:used].long().cpu()
        assert torch.equal(ent[ent >= 0].sort().values, torch.arange(tokens * k))
        for e in range(experts):  # each row sits in the block of its entry's expert
            lo, hi = offs[e], offs[e + 1] if e + 1 < experts else used
            mine = ent[lo:hi][ent[lo:hi] >= 0]
            assert (ids.reshape(-1)[mine] == e).all(), f"expert {e}"


def _routing_loads_body(group):
    """The routing build reading every chunk's counts in one load and ``CB`` chunks at a
    time (``routing.COUNTS_IN_ONE_LOAD`` 0) builds the same routing: offsets, tile table,
    rows and weights, at several chunks per arrival position, skewed and random."""
    from interlace.ops.moe import routing as R

    dev = group.device
    world, m, k, experts, block_m = 3, 300, 2, 7, 32
    gen = torch.Generator().manual_seed(5)
    for kind in ("skewed", "random"):
        ids, wts = make_routing(gen, world * m, k, experts, kind)
        meta = torch.empty(world, 2 * m * k, dtype=torch.int32, device=dev)
        for s in range(world):
            R.pack_meta(meta[s], ids[s * m : (s + 1) * m].to(dev), wts[s * m : (s + 1) * m].to(dev))
        built = []
        for limit in (R.COUNTS_IN_ONE_LOAD, 0):
            work = R.alloc_routing(m, k, experts, world, block_m, dev)
            work.routing.storage.fill_(-7)
            saved, R.COUNTS_IN_ONE_LOAD = R.COUNTS_IN_ONE_LOAD, limit
            try:
                assert (R.route_consts(work.routing, False)["NC_PAD"] > 0) == (limit > 0)
                rt = R.launch_routing(work, meta, 2 * m * k, rank=group.rank)
            finally:
                R.COUNTS_IN_ONE_LOAD = saved
            sync(group)
            n_tiles = int(rt.tile_count[0])
            used = int(rt.offsets[-1])
            built.append([rt.offsets.cpu(), rt.tiles[:n_tiles].cpu(), rt.entry_ids[:used].cpu(),
                          rt.weights[:used].cpu()])  # fmt: skip
        for a, b in zip(*built):
            assert torch.equal(a, b), kind
        assert n_tiles > 0 and used >= world * m * k
    return True


def test_routing_counts_in_one_load_or_by_blocks(world):
    if world.world_size != 2:
        pytest.skip("each rank builds alone; W = 2 is enough")
    world.run(_routing_loads_body)


def test_reduce_kernels_per_rank_repeated(world):
    if world.world_size != 2:
        pytest.skip("one rank runs it; W = 2 is enough")
    world.run(_per_rank_body)
