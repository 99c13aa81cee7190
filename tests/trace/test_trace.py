"""Traces of AG+GEMM and GEMM+RS (``fused``, ``ce_fused``), AGMoE, the SPAttention
forward and backward, MoERS (``fused``), FlashDecode (every rank merging, and one owner),
EPAllToAll's dispatch and combine, EPLowLatency and the ``signal_reorder`` GEMM+AR /
GEMM+RS recorded in
the CPU emulation (W = 2) and, marked ``gpu``, in a world whose ranks share one GPU
(W = 4; ``signal_reorder``, whose collectives run on CUDA tensors: a GPU per rank, W = 2
and 4): the traced call is still correct; the trace holds every tile of every program of
every launch (and every program's start and end); each wait closes after the data it
waits for began moving (the copy that feeds it; MoERS: every rank's GEMM tiles; the
decode merge and the EP all-to-all: the peer's pushes), and before the work it guards;
the Chrome JSON is well-formed (ph, ts, dur, pid, tid; one process per rank, named
tracks); the PNG and the summary are written; calls outside the block are not traced."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import interlace
from interlace.ops import _trace as hooks
from tests.ops._helpers import gathered, nans, rand, reduced_rows, rel_err, sync

#: (op, strategy, rows per rank a multiple of the tile: AG+GEMM's one-loop mode)
CASES = [
    ("ag_gemm", "fused", False), ("ag_gemm", "fused", True), ("gemm_rs", "fused", False),
    ("gemm_rs", "ce_fused", False),
]  # fmt: skip
WORLDS = [
    pytest.param(("cpu", 2), id="cpu2"),
    pytest.param(("cuda", 4), id="cuda4", marks=pytest.mark.gpu),
]


def _call(group, op, strategy, shape):
    """One call of ``op`` on fresh random inputs: ``(ctx, run, check)`` where ``run()``
    makes the call (output poisoned) and ``check(c)`` returns its error."""
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m_loc, n, k = shape
    gen = torch.Generator().manual_seed(3 + group.rank)
    b = rand(torch.Generator().manual_seed(11), k, n, dtype=dtype, device=dev, scale=0.2)
    if op == "ag_gemm":
        ctx = interlace.AGGemm(group, max_m=w * m_loc, n=n, k=k, strategy=strategy)
        a = rand(gen, m_loc, k, dtype=dtype, device=dev)
        out = nans(w * m_loc, n, dtype=dtype, device=dev)

        def check(c):
            return rel_err(c, gathered(a, group).float() @ b.float())
    else:
        ctx = interlace.GemmRS(group, max_m=w * m_loc, n=n, k=k, strategy=strategy)
        a = rand(gen, w * m_loc, k, dtype=dtype, device=dev)
        out = nans(m_loc, n, dtype=dtype, device=dev)

        def check(c):
            return rel_err(c, reduced_rows(a.float() @ b.float(), group))

    return ctx, (lambda: ctx(a, b, out=out)), check


def _trace_body(group, op, strategy, shape, folder):
    ctx, run, check = _call(group, op, strategy, shape)
    try:
        run()  # a first, untraced call (compiles; eager graphs may capture later calls)
        sync(group)
        with interlace.trace.record(group, label=f"{op}-{strategy}", meta=dict(op=op)) as rec:
            c = run()
        sync(group)
        assert not hooks.ACTIVE
        err = check(c)
        assert err < 1e-2, f"traced call: rel err {err:.2e}"
        trace = rec.trace()
        run()  # outside the block: nothing more is recorded
        sync(group)
        assert len(rec.launches) >= 1 and not hooks.ACTIVE
        paths = trace.save(os.path.join(folder, f"{op}-{strategy}-r{group.rank}"), quiet=True)
    finally:
        ctx.close()
    return dict(
        spans=trace.spans, instants=trace.instants, launches=trace.meta["launches"],
        paths=paths, summary=interlace.trace.summarize(trace), world=group.world_size,
        clock=trace.clock,
    )  # fmt: skip


def _check_tiles(res):
    """Every tile of every launch once, each on the program that owns it (g % grid)."""
    for rank, launches in enumerate(res["launches"]):
        for index, launch in enumerate(launches):
            tiles = [
                s for s in res["spans"]
                if s.rank == rank and s.cat == "compute" and s.args["launch"] == index
            ]  # fmt: skip
            got = sorted(s.args["tile"] for s in tiles)
            assert len(got) == launch["tiles"] == len(set(got)), (rank, index, got, launch)
            for s in tiles:
                assert s.args["tile"] % launch["grid"] == s.tid
                assert s.t1 >= s.t0
            programs = [s for s in res["spans"] if s.rank == rank and s.cat == "program"
                        and s.args["launch"] == index]  # fmt: skip
            assert len(programs) == launch["grid"]
            for s in tiles:  # inside its program's run
                (prog,) = [p for p in programs if p.tid == s.tid]
                assert prog.t0 <= s.t0 and s.t1 <= prog.t1


def _check_waits(res, op, strategy):
    """Each wait ends before the tiles of its chunk (in its program) end, and (AG+GEMM,
    ``ce_fused``) after the copy that fills its chunk began on the peer (within the
    clocks' stated uncertainty: 0 in the CPU emulation)."""
    clock = res["clock"]

    def tol(src, dst):
        return (clock["stream_uncertainty_ns"][src] + clock["uncertainty_ns"][src]
                + clock["uncertainty_ns"][dst])  # fmt: skip

    waits = [s for s in res["spans"] if s.cat == "wait" and "segment" in s.args]
    assert waits, "no wait recorded"
    for w in waits:
        assert w.t1 >= w.t0
        later = [s for s in res["spans"] if s.rank == w.rank and s.tid == w.tid
                 and s.cat == "compute" and s.args["launch"] == w.args["launch"]
                 and s.args["segment"] == w.args["segment"]]  # fmt: skip
        assert later, w
        assert all(s.t1 >= w.t1 for s in later), w
        if op == "ag_gemm":
            peer = w.args["peer"]
            copies = [s for s in res["spans"] if s.rank == peer and s.cat == "copy"
                      and s.args["peer"] == w.rank]  # fmt: skip
            assert copies, w
            assert w.t1 >= min(s.t0 for s in copies) - tol(peer, w.rank), (w, copies)
        if strategy == "ce_fused" and w.args["kind"] == 2:  # reduce: every peer's copy
            for q in range(res["world"]):
                if q != w.rank:
                    copies = [s for s in res["spans"] if s.rank == q and s.cat == "copy"
                              and s.args["peer"] == w.rank]  # fmt: skip
                    assert copies and w.t1 >= min(s.t0 for s in copies) - tol(q, w.rank), (w, q)


def _check_files(res):
    with open(res["paths"]["json"]) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    world = res["world"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    procs = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == set(range(world))
    timed = [e for e in events if e["ph"] != "M"]
    assert len(timed) == len(res["spans"]) + len(res["instants"])
    for e in timed:
        assert e["ph"] == "X" and isinstance(e["name"], str)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert e["pid"] in range(world) and isinstance(e["tid"], int)
        assert (e["pid"], e["tid"]) in names, e
    assert any(v.startswith("program") for v in names.values())
    with open(res["paths"]["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(res["paths"]["summary"]) as f:
        summary = json.load(f)
    assert summary["world"] == world and len(summary["ranks"]) == world
    assert all(r["traced"] and r["tiles"] > 0 for r in summary["ranks"])


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("op, strategy, whole_tiles", CASES)
def test_trace_of_op(world, op, strategy, whole_tiles, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG check needs matplotlib")
    cuda = world.run(_backend)[0] == "cuda"
    # ragged: rows per rank not a multiple of the tile; CPU tiles are 32 x 32
    shape = (300, 520, 264) if cuda else (37, 40, 32)
    if whole_tiles:
        shape = (256, 520, 264) if cuda else (64, 40, 32)
    results = world.run(_trace_body, op, strategy, shape, str(tmp_path))
    for res in results[:1]:  # every rank holds the same trace
        assert all(ln["one_loop"] == whole_tiles for ln in res["launches"][0]) or cuda
        _check_tiles(res)
        _check_waits(res, op, strategy)
        _check_files(res)
        s = res["summary"]
        if op == "ag_gemm" or strategy == "ce_fused":
            assert s["op"]["comm_ms"] and s["op"]["overlap_ratio"] is not None
        assert len(s["ranks"][0]["wait_ms_per_program"]) == res["launches"][0][0]["grid"]


def _backend(group):
    return group.backend


# ---------------------------------------------------------------------- AGMoE, SPAttention
def _record(group, label, run, folder, launches=1):
    """``run()`` once untraced (compiles), once recorded (``launches`` traced launches):
    ``(output, trace, paths)``."""
    run()
    sync(group)
    with interlace.trace.record(group, label=label, meta=dict(op=label)) as rec:
        out = run()
    sync(group)
    assert not hooks.ACTIVE
    trace = rec.trace()
    got = len(rec.launches)
    run()  # outside the block: nothing more is recorded
    sync(group)
    assert len(rec.launches) == got == launches, (got, launches)
    paths = trace.save(os.path.join(folder, f"{label}-r{group.rank}"), quiet=True)
    return out, trace, paths


def _result(group, trace, paths) -> dict:
    return dict(
        spans=trace.spans, instants=trace.instants, launches=trace.meta["launches"],
        paths=paths, summary=interlace.trace.summarize(trace), world=group.world_size,
        clock=trace.clock,
    )  # fmt: skip


def _moe_trace_body(group, folder):
    """A traced ``AGMoE`` call (SwiGLU, random top-2 routing, tokens per rank not a multiple
    of the tile) checked against float32 on the rows in use."""
    import torch.nn.functional as F

    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m, hidden, inter, experts, topk = 11, 32, 16, 4, 2
    gen = torch.Generator().manual_seed(5 + group.rank)
    x = rand(gen, m, hidden, dtype=dtype, device=dev)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)]).to(dev)
    wts = torch.softmax(torch.randn(m, topk, generator=gen), -1).to(dev)
    wg = rand(torch.Generator().manual_seed(9), experts, hidden, 2 * inter, dtype=dtype,
              device=dev, scale=0.3)  # fmt: skip
    ctx = interlace.AGMoE(group, max_tokens=w * m, hidden=hidden, inter=inter,
                          experts=experts, topk=topk, strategy="fused")  # fmt: skip
    try:
        (h, routing), trace, paths = _record(group, "ag_moe", lambda: ctx(x, ids, wts, wg), folder)
        ctx.check()
    finally:
        ctx.close()
    x_all = gathered(x, group).float().cpu()
    tok = routing.token_ids.cpu().long()
    offs = routing.offsets.cpu().tolist()
    rows = [i for i in range(offs[-1]) if tok[i] >= 0]
    assert len(rows) == w * m * topk
    expert = [max(e for e in range(experts) if offs[e] <= i) for i in rows]
    a = torch.stack([x_all[tok[i]] @ wg[e].float().cpu() for i, e in zip(rows, expert)])
    err = rel_err(h.cpu()[rows], F.silu(a[:, :inter]) * a[:, inter:])
    assert err < 1e-2, f"traced AGMoE: rel err {err:.2e}"
    return _result(group, trace, paths)


def _attn_trace_body(group, folder):
    """A traced ``SPAttention`` forward (causal zigzag, GQA 2 / 1, S_loc not a multiple of
    the block) checked against float32 attention of the whole sequence."""
    from tests.ops.test_sp_attention import _case

    s_loc = 40  # three query blocks of the interpreter's 16: the causal order is not by index
    (q, k, v, _), refs, _ = _case(group, 21, 1, 2, 1, 64, s_loc, True, 0, torch.bfloat16)
    ctx = interlace.ops.attention.SPAttention(group, 2, 1, 64, max_tokens=s_loc)
    try:
        o, trace, paths = _record(group, "sp_attention", lambda: ctx(q, k, v, causal=True),
                                  folder)  # fmt: skip
        ctx.check()
    finally:
        ctx.close()
    err = rel_err(o.cpu(), refs[0])
    assert err < 1e-2, f"traced SPAttention: rel err {err:.2e}"
    return _result(group, trace, paths)


def _check_new_op(res, kernel, copy_what):
    """One traced launch per rank whose programs all start and end, every tile (MoE: tile
    ``g`` on program ``g % grid``; attention: step ``j`` of program ``p`` as tile ``p W +
    j``) once inside its program's run; every wait ends after the copy of each rank it
    waits for began on that rank, and before the tile that reads the chunk ends."""
    clock, world = res["clock"], res["world"]
    for rank, launches in enumerate(res["launches"]):
        assert [ln["kernel"] for ln in launches] == [kernel], launches
        (launch,) = launches
        mine = [s for s in res["spans"] if s.rank == rank and s.args.get("launch") == 0]
        programs = {s.tid: s for s in mine if s.cat == "program"}
        assert sorted(programs) == list(range(launch["grid"])), (rank, sorted(programs))
        tiles = [s for s in mine if s.cat == "compute"]
        got = sorted(s.args["tile"] for s in tiles)
        assert got == list(range(launch["tiles"])) and got, (rank, got, launch)
        for s in tiles:
            prog = programs[s.tid]
            assert prog.t0 <= s.t0 <= s.t1 <= prog.t1, s
            if kernel == "moe_gemm":
                assert s.args["tile"] % launch["grid"] == s.tid
            else:
                assert s.args["tile"] // world == s.tid
        waits = [s for s in mine if s.cat == "wait" and "tile" in s.args]
        assert waits, f"rank {rank}: no wait recorded"
        by_tile = {(s.tid, s.args["tile"]): s for s in tiles}
        for w in waits:
            assert w.t1 >= w.t0
            use = by_tile[(w.tid, w.args["tile"])]
            assert use.t0 >= w.t1 and use.t1 >= w.t1, (w, use)
            peers = w.args["peers"] if kernel == "moe_gemm" else [w.args["chunk"]]
            assert peers and rank not in peers, w
            for q in peers:
                copies = [s for s in res["spans"] if s.rank == q and s.cat == "copy"
                          and s.args["peer"] == rank
                          and s.args.get("what", copy_what) == copy_what]  # fmt: skip
                assert copies, (w, q)
                tol = (clock["stream_uncertainty_ns"][q] + clock["uncertainty_ns"][q]
                       + clock["uncertainty_ns"][rank])  # fmt: skip
                assert w.t1 >= min(s.t0 for s in copies) - tol, (w, copies)


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("op", ["ag_moe", "sp_attention"])
def test_trace_of_moe_and_attention(world, op, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG check needs matplotlib")
    body = _moe_trace_body if op == "ag_moe" else _attn_trace_body
    kernel, what = ("moe_gemm", "tokens") if op == "ag_moe" else ("sp_attn_fwd", None)
    (res, *_) = world.run(body, str(tmp_path))
    _check_new_op(res, kernel, what)
    if op == "sp_attention":
        _check_attention_blocks(res)
    _check_files(res)
    s = res["summary"]
    assert s["op"]["comm_ms"] and s["op"]["overlap_ratio"] is not None
    assert len(s["ranks"][0]["wait_ms_per_program"]) == res["launches"][0][0]["grid"]


def _check_attention_blocks(res):
    """Each forward program names its query block and batch x head (the causal launch
    order maps programs to blocks other than by position): every (block, head) once, and
    the block its chunk spans name."""
    for rank in range(len(res["launches"])):
        mine = [s for s in res["spans"] if s.rank == rank and s.args.get("launch") == 0]
        programs = [s for s in mine if s.cat == "program"]
        named = sorted((s.args["block"], s.args["batch_head"]) for s in programs)
        heads = len({s.args["column"] for s in programs})
        want = [(b, h) for b in range(len(programs) // heads) for h in range(heads)]
        assert named == want, (rank, named)
        block_of = {s.tid: s.args["block"] for s in programs}
        for s in mine:
            if s.cat == "compute":
                assert s.name.startswith(f"block {block_of[s.tid]} chunk"), (rank, s.name)


# ---------------------------------------------------------------------- MoERS, FlashDecode
#: rank 0 starts each call this late, so the other ranks' waits for its data do wait (a
#: wait recorded as ending before it really did would end before rank 0's data moved)
LATE_S = 0.2


def _late(group, run):
    """``run`` with rank 0 starting ``LATE_S`` late."""

    def late_run():
        if group.rank == 0:
            time.sleep(LATE_S)
        return run()

    return late_run


def _moe_rs_trace_body(group, folder):
    """A traced ``MoERS`` call (``fused``, on the routing and activations of an untraced
    ``AGMoE`` call; random top-2 routing, tokens per rank not a multiple of the tile; each
    call with other weights) checked against float32: every rank's weighted rows summed
    per token."""
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m, hidden, inter, experts, topk = 11, 32, 16, 4, 2
    gen = torch.Generator().manual_seed(7 + group.rank)
    x = rand(gen, m, hidden, dtype=dtype, device=dev)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)]).to(dev)
    wts = torch.softmax(torch.randn(m, topk, generator=gen), -1).to(dev)
    wg = rand(gen, experts, hidden, 2 * inter, dtype=dtype, device=dev, scale=0.3)
    wd = rand(gen, experts, inter, hidden, dtype=dtype, device=dev, scale=0.3)
    kw = dict(max_tokens=w * m, hidden=hidden, inter=inter, experts=experts, topk=topk,
              strategy="fused")  # fmt: skip
    # (MoERS without its per-call host check, a collective that would line the ranks up)
    with interlace.AGMoE(group, **kw) as ag, interlace.MoERS(group, validate=False, **kw) as rs:
        h, routing = ag(x, ids, wts, wg)
        sync(group)
        scales = iter((1.0, 2.0, 3.0))  # per call: an unwritten output left over fails

        def run():
            return rs(h, routing, wd * next(scales))

        y, trace, paths = _record(group, "moe_rs", _late(group, run), folder, 2)
        rs.check()
        tok, weight = routing.token_ids.cpu().long(), routing.weights.cpu()
        offs = routing.offsets.cpu().tolist()
        h_rows, w_down = h.float().cpu(), 2 * wd.float().cpu()  # the traced call's
    part = torch.zeros(w * m, hidden)  # this rank's weighted rows, summed per token
    for i in range(offs[-1]):
        if tok[i] >= 0:
            e = max(e for e in range(experts) if offs[e] <= i)
            part[tok[i]] += weight[i] * (h_rows[i] @ w_down[e])
    err = rel_err(y.cpu(), reduced_rows(part, group).cpu())
    assert err < 1e-2, f"traced MoERS: rel err {err:.2e}"
    return _result(group, trace, paths)


def _decode_trace_body(group, folder, owner):
    """A traced ``FlashDecode`` call (grouped-query heads, shards of different lengths not
    multiples of the KV block; every rank merging: batch 1, two splits per shard; one
    owner: batch 2, one split) checked against float32 attention over every shard."""
    from tests.ops.test_flash_decode import _dims, _inputs, _reference

    r = group.rank
    max_b, hq, hkv, d, lens = _dims(group)
    batch = 1 if owner is None else max_b
    q, shards = _inputs(group, batch, hq, hkv, d, lens, seed=31)
    k, v = shards[r]
    merges = owner is None or owner == r
    ctx = interlace.ops.attention.FlashDecode(group, max_b, hq, hkv, d, owner=owner,
                                              strategy="fused")  # fmt: skip

    def run():
        return ctx(q, k, v, out=nans(batch, hq, d, dtype=torch.bfloat16, device=group.device))

    try:
        out, trace, paths = _record(group, "flash_decode", _late(group, run), folder,
                                    2 if merges else 1)  # fmt: skip
        ctx.check()
        splits = ctx.splits(batch, k.shape[2])[0]
    finally:
        ctx.close()
    if merges:
        err = rel_err(out, _reference(q, shards, [[n] * batch for n in lens], hkv))
        assert err < 1e-2, f"traced FlashDecode: rel err {err:.2e}"
    else:
        assert out is None
    return dict(_result(group, trace, paths), splits=splits, owner=owner)


def _tol(res, src, dst):
    clock = res["clock"]
    return (clock["stream_uncertainty_ns"][src] + clock["uncertainty_ns"][src]
            + clock["uncertainty_ns"][dst])  # fmt: skip


def _check_launch(res, rank, index, launch):
    """Launch ``index`` of ``rank``: every program's start and end; every tile once (a
    compute or copy span with its id), tile ``g`` on program ``g % grid``, inside that
    program's run. Returns ``(programs by track, tile spans)``."""
    mine = [s for s in res["spans"] if s.rank == rank and s.args.get("launch") == index]
    programs = {s.tid: s for s in mine if s.cat == "program"}
    assert sorted(programs) == list(range(launch["grid"])), (rank, index, sorted(programs))
    tiles = [s for s in mine if s.cat in ("compute", "copy") and "tile" in s.args]
    got = sorted(s.args["tile"] for s in tiles)
    assert got == sorted(set(got)) and len(got) == launch["tiles"] > 0, (rank, got, launch)
    for s in tiles:
        assert s.args["tile"] % launch["grid"] == s.tid, s
        prog = programs[s.tid]
        assert prog.t0 <= s.t0 <= s.t1 <= prog.t1, s
    return programs, tiles


def _check_moe_rs(res):
    """The GEMM's tiles and its one raise of the owners' counters per rank; each finish
    program's one wait, ending after every rank's GEMM tiles (each rank raises the
    counters after its last tile) and before the program's tiles."""
    world, spans = res["world"], res["spans"]
    gemm_tiles = {}
    for rank, launches in enumerate(res["launches"]):
        assert [ln["kernel"] for ln in launches] == ["moe_gemm_reduce", "moe_finish"], launches
        _, gemm_tiles[rank] = _check_launch(res, rank, 0, launches[0])
        notes = [i for i in res["instants"] if i.rank == rank and i.cat == "notify"]
        assert len(notes) == 1 and notes[0].args["dest"] == -1, notes
        assert notes[0].t >= max(s.t1 for s in gemm_tiles[rank])
    for rank, launches in enumerate(res["launches"]):
        programs, tiles = _check_launch(res, rank, 1, launches[1])
        waits = [s for s in spans if s.rank == rank and s.cat == "wait"
                 and s.args["launch"] == 1]  # fmt: skip
        assert sorted(w.tid for w in waits) == sorted(programs), waits
        for w in waits:
            assert w.name == "wait contributions of every rank" and w.t1 >= w.t0
            for q in range(world):
                assert w.t1 >= max(s.t1 for s in gemm_tiles[q]) - _tol(res, q, rank), (w, q)
            assert all(s.t0 >= w.t1 for s in tiles if s.tid == w.tid), w


def _check_decode(res):
    """The split kernel's tiles (split, combine where several splits, push: a copy, the
    owner's a store), one push per (sequence, kv head) and one notify per rank; each merge
    program's wait per peer ends after every push of that peer (its flag is raised after
    them) and before that step's merge; the one-owner mode's acknowledgement waits end
    before their push, and the owner's merge acknowledges once."""
    world, spans, owner = res["world"], res["spans"], res["owner"]
    pushes = {}
    for rank, launches in enumerate(res["launches"]):
        merges = owner is None or owner == rank
        kernels = ["split_decode"] + (["decode_merge"] if merges else [])
        assert [ln["kernel"] for ln in launches] == kernels, launches
        _, tiles = _check_launch(res, rank, 0, launches[0])
        pushes[rank] = [s for s in tiles if s.args["step"] == "push"]
        assert all((s.cat == "copy") == (rank != owner) for s in pushes[rank]), pushes
        combines = [s for s in tiles if s.args["step"] == "combine"]
        groups = sorted((s.args["seq"], s.args["kv_head"]) for s in pushes[rank])
        assert groups and groups == sorted(set(groups)), groups
        assert len(combines) == (len(groups) if res["splits"] > 1 else 0), combines
        notes = [i for i in res["instants"] if i.rank == rank and i.cat == "notify"
                 and i.args["launch"] == 0]  # fmt: skip
        assert len(notes) == 1 and notes[0].t >= max(s.t1 for s in pushes[rank]), notes
        acks = [s for s in spans if s.rank == rank and s.cat == "wait" and s.args["launch"] == 0]
        assert len(acks) == (len(groups) if owner not in (None, rank) else 0), acks
        for w in acks:
            (push,) = [s for s in pushes[rank] if s.args["tile"] == w.args["tile"]]
            assert w.t0 <= w.t1 <= push.t0, (w, push)
    for rank, launches in enumerate(res["launches"]):
        if len(launches) < 2:
            continue
        programs, tiles = _check_launch(res, rank, 1, launches[1])
        acks = [i for i in res["instants"] if i.rank == rank and i.args["launch"] == 1]
        assert len(acks) == (0 if owner is None else 1), acks  # the owner's acknowledgement
        by_tile = {s.args["tile"]: s for s in tiles}
        waits = [s for s in spans if s.rank == rank and s.cat == "wait" and s.args["launch"] == 1]
        assert len(waits) == len(programs) * (world - 1), waits
        for w in waits:
            src = w.args["peer"]
            assert src != rank and w.t1 >= w.t0
            assert w.t1 >= max(s.t1 for s in pushes[src]) - _tol(res, src, rank), (w, src)
            use = by_tile[w.args["tile"]]
            assert use.args["src"] == src and use.t0 >= w.t1, (w, use)


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("op", ["moe_rs", "flash_decode", "flash_decode_owner"])
def test_trace_of_moe_rs_and_decode(world, op, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG check needs matplotlib")
    if op == "moe_rs":
        (res, *_) = world.run(_moe_rs_trace_body, str(tmp_path))
        _check_moe_rs(res)
    else:
        owner = world.world_size - 1 if op == "flash_decode_owner" else None
        (res, *_) = world.run(_decode_trace_body, str(tmp_path), owner)
        assert res["splits"] > 1 or owner is not None
        _check_decode(res)
        assert res["summary"]["op"]["comm_ms"]  # the pushes
    _check_files(res)
    s = res["summary"]
    grids = max(ln["grid"] for ln in res["launches"][0])
    assert len(s["ranks"][0]["wait_ms_per_program"]) == grids
    assert s["op"]["wait_ms_max"] >= 0


# ---------------------------------------------------------------------- EPAllToAll
EP_KERNELS = ["ep_route", "ep_send", "ep_layout", "ep_expand", "ep_combine_send",
              "ep_combine_recv"]  # fmt: skip
#: a kernel whose waits wait for data -> the kernel whose pushes carry that data
EP_FEEDS = {"ep_layout": "ep_route", "ep_expand": "ep_send", "ep_combine_recv": "ep_combine_send"}


def _ep_trace_body(group, folder):
    """A traced ``EPAllToAll`` dispatch then combine (random top-2 routing over 2 W
    experts, tokens per rank not a multiple of the token block, the experts the identity:
    each token comes back as itself times the sum of its weights), checked against
    float32; each call with other tokens."""
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m, hidden, experts, topk = 7, 48, 2 * w, 2
    gen = torch.Generator().manual_seed(13 + group.rank)
    xs = [rand(gen, m, hidden, dtype=dtype, device=dev) for _ in range(3)]
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)]).to(dev)
    wts = torch.softmax(torch.randn(m, topk, generator=gen), -1).to(dev)
    ctx = interlace.EPAllToAll(group, max_tokens=m, hidden=hidden, experts=experts, topk=topk,
                               dtype=dtype)  # fmt: skip
    calls = iter(xs)

    def run():
        x = next(calls)
        handle = ctx.dispatch(x, ids, wts)
        out = ctx.combine(handle.recv_x, handle, out=nans(m, hidden, dtype=dtype, device=dev))
        return x, out

    try:
        (x, y), trace, paths = _record(group, "ep_dispatch", _late(group, run), folder,
                                       len(EP_KERNELS))  # fmt: skip
        ctx.check()
    finally:
        ctx.close()
    err = rel_err(y, x.float() * wts.float().sum(1, keepdim=True))
    assert err < 1e-2, f"traced EPAllToAll: rel err {err:.2e}"
    return _result(group, trace, paths)


def _check_ep(res):
    """Every launch's programs start and end, every step's work once inside its program;
    each wait for data pushed in the call (a peer's routing, tokens, combined rows) ends
    after the pushes of that peer into this rank began, and before the step's work; every
    rank pushed to every peer in route, send and combine."""
    world, spans = res["world"], res["spans"]
    for rank, launches in enumerate(res["launches"]):
        assert [ln["kernel"] for ln in launches] == EP_KERNELS, launches
        for index, launch in enumerate(launches):
            _check_launch(res, rank, index, launch)
        for kernel in ("ep_route", "ep_send", "ep_combine_send"):
            pushed = {q for s in spans if s.rank == rank and s.cat == "copy"
                      and s.args["kernel"] == kernel for q in s.args["peers"]}  # fmt: skip
            assert pushed == set(range(world)) - {rank}, (rank, kernel, pushed)
        # the routing a rank writes into its own memory is a store, not a copy
        own = [s for s in spans if s.rank == rank and s.args.get("kernel") == "ep_route"
               and s.cat not in ("program", "wait")
               and s.name.endswith(f"to rank {rank}")]  # fmt: skip
        assert own and all(s.name.startswith("store") and s.cat == "compute" for s in own), own
    data_waits = 0
    for w in (s for s in spans if s.cat == "wait"):
        assert w.t1 >= w.t0 and w.args["waits_for"] in ("data", "slot"), w
        work = [s for s in spans if s.rank == w.rank and s.tid == w.tid and s.cat != "wait"
                and s.args.get("launch") == w.args["launch"]
                and s.args.get("step") == w.args["step"]]  # fmt: skip
        assert all(s.t0 >= w.t1 for s in work if s.cat != "program"), (w, work)
        q = w.args["peer"]
        if w.args["waits_for"] != "data" or q == w.rank:
            continue
        data_waits += 1
        pushes = [s for s in spans if s.rank == q and s.cat == "copy"
                  and s.args["kernel"] == EP_FEEDS[w.args["kernel"]]
                  and w.rank in s.args["peers"]]  # fmt: skip
        assert pushes, w
        assert w.t1 >= min(s.t0 for s in pushes) - _tol(res, q, w.rank), (w, pushes)
    # per rank: layout and expand wait for every peer; combine_recv too
    assert data_waits >= world * (world - 1) * 3, data_waits


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_trace_of_ep_all_to_all(world, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG check needs matplotlib")
    (res, *_) = world.run(_ep_trace_body, str(tmp_path))
    _check_ep(res)
    _check_files(res)
    s = res["summary"]
    assert s["op"]["comm_ms"]  # the pushes
    grids = max(ln["grid"] for ln in res["launches"][0])
    assert len(s["ranks"][0]["wait_ms_per_program"]) == grids


# ---------------------------------------------------------------------- EPLowLatency
EP_LL_KERNELS = [hooks.EP_LL_DISPATCH, hooks.EP_LL_COMBINE]
#: (protocol, fp8)
EP_LL_CASES = [("flag_in_data", False), ("token_flag", False), ("token_flag", True)]


def _ep_ll_trace_body(group, folder, protocol, fp8):
    """A traced ``EPLowLatency`` dispatch then combine (random top-3 routing over 2 W
    experts, a different token count on each rank, the experts the identity: each token
    comes back as itself, FP8: quantised and dequantised, times the sum of its weights),
    checked against float32; each call with other tokens."""
    from tests.ops.test_ep import _dequant, _quant

    w, r, dev, dtype = group.world_size, group.rank, group.device, torch.bfloat16
    t_max, experts, topk = 7, 2 * w, 3
    hidden = 128 if fp8 else 48
    n = max(1, t_max - 2 * r)  # ragged: 7, 5, 3, 1 tokens
    gen = torch.Generator().manual_seed(41 + r)
    xs = [rand(gen, n, hidden, dtype=dtype, device=dev) for _ in range(3)]
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(n)]).to(dev)
    wts = torch.softmax(torch.randn(n, topk, generator=gen), -1).to(dev)
    ctx = interlace.EPLowLatency(group, t_max, hidden, experts, topk, dtype=dtype,
                                 protocol=protocol, fp8=fp8)  # fmt: skip
    calls = iter(xs)

    def run():
        x = next(calls)
        handle = ctx.dispatch(x, ids, wts)
        rows = handle.recv_x
        if fp8:  # the experts' input dequantised (combine takes ``dtype`` rows)
            rows = _dequant(rows, handle.recv_scale).to(dtype)
        out = ctx.combine(rows, handle, out=nans(n, hidden, dtype=dtype, device=dev))
        return x, out, handle.expert_counts.clone()

    try:
        (x, y, counts), trace, paths = _record(group, "ep_low_latency", _late(group, run),
                                               folder, len(EP_LL_KERNELS))  # fmt: skip
        ctx.check()
    finally:
        ctx.close()
    x_ref = _dequant(*_quant(x.float())) if fp8 else x.float()
    err = rel_err(y, x_ref * wts.float().sum(1, keepdim=True))
    assert err < 1e-2, f"traced EPLowLatency ({protocol}, fp8 {fp8}): rel err {err:.2e}"
    assert int(counts.sum()) > 0
    return dict(_result(group, trace, paths), tokens=n, e_loc=experts // w)


def _check_ep_ll(res):
    """Both launches' programs start and end, every send, received segment and summed
    token once inside its program; every rank pushed to every rank in both kernels; each
    wait for rows ends after every rank it reads began pushing them (dispatch: the
    segment's expert, from the source and every rank before it, whose row counts it
    reads; combine: the ranks holding the token's experts), and before its step's work;
    program 0 of combine waits for every rank's arrival word, each ending after that
    rank's combine started; one wait per segment and per token."""
    world, spans = res["world"], res["spans"]
    pushes = [s for s in spans if s.args.get("kernel") in EP_LL_KERNELS and "rows" in s.args
              and "step" in s.args and s.name.startswith(("push", "store"))]  # fmt: skip
    for rank, launches in enumerate(res["launches"]):
        assert [ln["kernel"] for ln in launches] == EP_LL_KERNELS, launches
        for index, launch in enumerate(launches):
            _check_launch(res, rank, index, launch)
        for kernel in EP_LL_KERNELS:
            pushed = {q for s in pushes if s.rank == rank and s.cat == "copy"
                      and s.args["kernel"] == kernel for q in s.args["peers"]}  # fmt: skip
            assert pushed == set(range(world)) - {rank}, (rank, kernel, pushed)
    waits = [s for s in spans if s.cat == "wait"]
    for w in waits:
        assert w.t1 >= w.t0 and w.args["waits_for"] in ("data", "arrival"), w
        work = [s for s in spans if s.rank == w.rank and s.tid == w.tid
                and s.args.get("launch") == w.args["launch"] and s.cat != "wait"
                and s.args.get("step") == w.args["step"]]  # fmt: skip
        assert all(s.t0 >= w.t1 for s in work), (w, work)
        kernel = w.args["kernel"]
        if w.args["waits_for"] == "arrival":  # after the peer's combine began
            q = w.args["peer"]
            (start,) = [s for s in spans if s.rank == q and s.cat == "program" and s.tid == 0
                        and s.args["kernel"] == kernel]  # fmt: skip
            assert w.tid == 0 and w.t1 >= start.t0 - _tol(res, q, w.rank), (w, start)
            continue
        assert w.args["peers"], w
        for q in w.args["peers"]:
            if q == w.rank:
                continue
            feed = [s for s in pushes if s.rank == q and s.args["kernel"] == kernel
                    and w.rank in s.args.get("peers", ())
                    and (kernel == hooks.EP_LL_COMBINE
                         or s.args["expert"] == w.args["expert"])]  # fmt: skip
            assert feed, (w, q)
            assert w.t1 >= min(s.t0 for s in feed) - _tol(res, q, w.rank), (w, feed)
    by_kernel = {k: [w for w in waits if w.args["kernel"] == k] for k in EP_LL_KERNELS}
    dispatch = [w for w in by_kernel[hooks.EP_LL_DISPATCH] if w.args["waits_for"] == "data"]
    assert len(dispatch) == world * res["e_loc"] * world, len(dispatch)
    arrivals = [w for w in by_kernel[hooks.EP_LL_COMBINE] if w.args["waits_for"] == "arrival"]
    assert sorted((w.rank, w.args["peer"]) for w in arrivals) == [
        (r, q) for r in range(world) for q in range(world)
    ]  # fmt: skip
    tokens = [w for w in by_kernel[hooks.EP_LL_COMBINE] if w.args["waits_for"] == "data"]
    assert len(tokens) == res["tokens_all"], (len(tokens), res["tokens_all"])


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize(
    "protocol, fp8", EP_LL_CASES, ids=["flag_in_data", "token_flag", "token_flag_fp8"]
)
def test_trace_of_ep_low_latency(world, protocol, fp8, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG check needs matplotlib")
    results = world.run(_ep_ll_trace_body, str(tmp_path), protocol, fp8)
    res = dict(results[0], tokens_all=sum(r["tokens"] for r in results))
    assert res["launches"][0][0]["grid"] >= 1
    _check_ep_ll(res)
    _check_files(res)
    s = res["summary"]
    assert s["op"]["comm_ms"]  # the pushes
    grids = max(ln["grid"] for ln in res["launches"][0])
    assert len(s["ranks"][0]["wait_ms_per_program"]) == grids


# ---------------------------------------------------------------------- SPAttention backward
ATTN_KERNELS = [hooks.ATTENTION_FWD, hooks.ATTENTION_DKDV, hooks.ATTENTION_DQ,
                hooks.ATTENTION_REDUCE]  # fmt: skip
#: steps per program of each attention kernel (``None``: one per rank)
ATTN_STEPS = {hooks.ATTENTION_DKDV: 2}


def _attn_bwd_trace_body(group, folder):
    """A traced ``SPAttention`` forward and backward (causal zigzag, GQA 2 / 1, S_loc not a
    multiple of the block; rank 0 starting both late), the gradients checked against
    float32 autograd of the whole sequence; each call on fresh leaves."""
    from tests.ops.test_sp_attention import _case

    s_loc = 20
    (q, k, v, do), refs, _ = _case(group, 23, 1, 2, 1, 64, s_loc, True, 0, torch.bfloat16)
    ctx = interlace.ops.attention.SPAttention(group, 2, 1, 64, max_tokens=s_loc)

    def run():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = ctx(*leaves, causal=True)
        if group.rank == 0:
            time.sleep(LATE_S)
        o.backward(do)
        return o.detach(), [x.grad for x in leaves]

    try:
        (o, grads), trace, paths = _record(group, "sp_attention_bwd", _late(group, run),
                                           folder, len(ATTN_KERNELS))  # fmt: skip
        ctx.check()
    finally:
        ctx.close()
    err = rel_err(o.cpu(), refs[0])
    assert err < 1e-2, f"traced SPAttention forward: rel err {err:.2e}"
    for name, g, ref in zip("qkv", grads, refs[1:]):
        assert torch.isfinite(g).all(), f"traced SPAttention: d{name} not finite"
        err = rel_err(g.cpu(), ref)
        assert err < 2e-2, f"traced SPAttention: d{name} rel err {err:.2e}"
    return _result(group, trace, paths)


def _check_attn_bwd(res):
    """Every launch's programs start and end, each step once inside its program (tile
    ``p * steps + j``); each wait ends before the work it guards: dK/dV's and dQ's waits for
    a peer's chunk before that step's compute, and after that peer's backward copies into
    this rank began; the reduction's wait for source ``q`` before its sum, and after every
    push (or own store) of ``q``'s partials into this rank ended. dK/dV: one push per
    program, a ``copy`` into the chunk's owner for a peer's chunk, and one notify to that
    owner after it."""
    world, spans = res["world"], res["spans"]

    def launch_spans(rank, kernel):
        return [s for s in spans if s.rank == rank and s.args.get("kernel") == kernel]

    fwd_end, pushes = {}, {}
    for rank, launches in enumerate(res["launches"]):
        assert [ln["kernel"] for ln in launches] == ATTN_KERNELS, launches
        for index, launch in enumerate(launches):
            mine = [s for s in spans if s.rank == rank and s.args.get("launch") == index]
            programs = {s.tid: s for s in mine if s.cat == "program"}
            assert sorted(programs) == list(range(launch["grid"])), (rank, index, programs)
            work = [s for s in mine if s.cat in ("compute", "copy")]
            got = sorted(s.args["tile"] for s in work)
            assert got == list(range(launch["tiles"])) and got, (rank, index, got, launch)
            steps = ATTN_STEPS.get(launch["kernel"], world)
            assert launch["tiles"] == steps * launch["grid"], launch
            for s in work:
                assert s.args["tile"] // steps == s.tid, s
                prog = programs[s.tid]
                assert prog.t0 <= s.t0 <= s.t1 <= prog.t1, s
        fwd_end[rank] = max(s.t1 for s in launch_spans(rank, hooks.ATTENTION_FWD)
                            if s.cat == "program")  # fmt: skip
        dkdv = launch_spans(rank, hooks.ATTENTION_DKDV)
        pushes[rank] = [s for s in dkdv if s.args.get("step") == 1]
        assert len(pushes[rank]) == res["launches"][rank][1]["grid"], pushes[rank]
        notes = [i for i in res["instants"] if i.rank == rank
                 and i.args.get("kernel") == hooks.ATTENTION_DKDV]  # fmt: skip
        assert len(notes) == len(pushes[rank]), notes
        for p in pushes[rank]:
            c = p.args["chunk"]
            assert (p.cat == "copy") == (c != rank) and p.args["rows"] > 0, p
            if c != rank:
                assert p.args["peers"] == [c], p
            (note,) = [i for i in notes if i.tid == p.tid]
            assert note.args["dest"] == c and note.t >= p.t1, (note, p)
    counted = {hooks.ATTENTION_DKDV: 0, hooks.ATTENTION_DQ: 0, hooks.ATTENTION_REDUCE: 0}
    for w in (s for s in spans if s.cat == "wait"):
        kernel, rank = w.args["kernel"], w.rank
        assert w.t1 >= w.t0, w
        guarded = [
            s
            for s in spans
            if s.rank == rank
            and s.tid == w.tid
            and s.cat == "compute"
            and s.args["launch"] == w.args["launch"]
            and s.args["tile"] == w.args["tile"]
        ]
        assert len(guarded) == 1 and guarded[0].t0 >= w.t1, (w, guarded)  # fmt: skip
        q = w.args["peer"]
        if kernel == hooks.ATTENTION_FWD:
            continue
        counted[kernel] += 1
        if kernel == hooks.ATTENTION_REDUCE:
            feed = [p for p in pushes[q] if p.args["chunk"] == rank]
            assert feed, (w, q)
            assert w.t1 >= max(p.t1 for p in feed) - _tol(res, q, rank), (w, feed)
            continue
        assert q != rank, w
        copies = [s for s in spans if s.rank == q and s.cat == "copy" and "tile" not in s.args
                  and s.args.get("peer") == rank
                  and s.t0 >= fwd_end[q] - _tol(res, q, q)]  # the backward's  # fmt: skip
        assert copies, (w, q)
        assert w.t1 >= min(s.t0 for s in copies) - _tol(res, q, rank), (w, copies)
    grids = {ln["kernel"]: ln["grid"] for ln in res["launches"][0]}
    # dK/dV: the programs of peers' chunks (W - 1 of W); dQ: W - 1 per program; the
    # reduction: W per program
    assert (
        counted[hooks.ATTENTION_DKDV] == world * grids[hooks.ATTENTION_DKDV] * (world - 1) // world
    )
    assert counted[hooks.ATTENTION_DQ] == world * grids[hooks.ATTENTION_DQ] * (world - 1)
    assert counted[hooks.ATTENTION_REDUCE] == world * grids[hooks.ATTENTION_REDUCE] * world


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_trace_of_attention_backward(world, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG check needs matplotlib")
    (res, *_) = world.run(_attn_bwd_trace_body, str(tmp_path))
    _check_attn_bwd(res)
    _check_files(res)
    s = res["summary"]
    assert s["op"]["comm_ms"] and s["op"]["wait_ms_max"] > 0  # the copies and pushes
    grids = max(ln["grid"] for ln in res["launches"][0])
    assert len(s["ranks"][0]["wait_ms_per_program"]) == grids


# ---------------------------------------------------------------------- signal_reorder
#: the process group's collectives move CUDA tensors: a GPU per rank (``own_gpu``)
SR_WORLDS = [
    pytest.param(("cpu", 2), id="cpu2"),
    pytest.param(("cuda", 2), id="cuda2", marks=pytest.mark.gpu),
    pytest.param(("cuda", 4), id="cuda4", marks=pytest.mark.gpu),
]


def _signal_reorder_trace_body(group, folder, op):
    """A traced ``signal_reorder`` GEMM+AR (``ar``: wave groups of 2 and 1 waves, so that
    a program's tile is counted after its next tile's main loop) or GEMM+RS (``rs``: the
    default partition), ragged rows, a bias, the output poisoned, checked against float32;
    each call with other inputs. On a GPU the GEMM leaves most SMs free (few programs, so
    that the shape has several waves)."""
    from interlace.ops.signal_reorder import SignalReorderGemmAR, SignalReorderGemmRS
    from tests.ops.test_signal_reorder import _gpu_programs_kw, _reference

    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m_loc, n, k = (300, 520, 264) if group.backend == "cuda" else (37, 40, 32)
    cls = SignalReorderGemmAR if op == "ar" else SignalReorderGemmRS
    ctx = cls(group, max_m=w * m_loc, n=n, k=k, dtype=dtype, **_gpu_programs_kw(group))
    gen = torch.Generator().manual_seed(29 + group.rank)
    bias = rand(torch.Generator().manual_seed(2), n, dtype=dtype, device=dev)
    waves = ctx.waves(w * m_loc, n)
    assert waves >= 3, waves
    partition = [2, waves - 2] if op == "ar" else None
    calls = []

    def run():
        a = rand(gen, w * m_loc, k, dtype=dtype, device=dev)
        b = rand(gen, k, n, dtype=dtype, device=dev, scale=0.2)
        out = nans(*ctx.out_shape(w * m_loc, n), dtype=dtype, device=dev)
        calls.append((a, b))
        return ctx(a, b, bias=bias, out=out, partition=partition)

    try:
        y, trace, paths = _record(group, f"signal_reorder_{op}", run, folder)
        plan = ctx.plan(w * m_loc, n, partition)
        groups = [list(g) for g in plan.groups]
        ctx.check()
    finally:
        ctx.close()
    a, b = calls[1]
    err = rel_err(y, _reference(group, op, a, b, bias))
    assert err < 1e-2, f"traced signal_reorder {op}: rel err {err:.2e}"
    assert len(groups) > 1, groups
    return dict(_result(group, trace, paths), groups=groups)


def _check_signal_reorder(res):
    """The GEMM's programs start and end, every tile once inside its program (tile ``g`` on
    program ``g % grid``), each tile's group counter raised once (a notify of its group,
    after its main loop); per wave group one wait on the comm stream (the host in the
    emulation), ending after every tile of the group ended, then the group's collective
    (a ``copy``) after the wait, in group order."""
    groups = res["groups"]
    group_of = {g: i for i, (first, count) in enumerate(groups)
                for g in range(first, first + count)}  # fmt: skip
    clock = res["clock"]
    for rank, launches in enumerate(res["launches"]):
        assert [ln["kernel"] for ln in launches] == [hooks.SIGNAL_GEMM], launches
        _, tiles = _check_launch(res, rank, 0, launches[0])
        by_tile = {s.args["tile"]: s for s in tiles}
        for g, s in by_tile.items():
            assert s.args["group"] == group_of[g], s
        notes = [i for i in res["instants"] if i.rank == rank and i.cat == "notify"]
        assert sorted(i.args["tile"] for i in notes) == sorted(by_tile), notes
        for i in notes:
            tile = by_tile[i.args["tile"]]
            assert i.args["group"] == group_of[tile.args["tile"]] and i.t >= tile.t1, (i, tile)
            assert i.tid == tile.tid, (i, tile)
        stream = sorted((s for s in res["spans"] if s.rank == rank
                         and s.cat in ("chunk_wait", "copy") and "tile" not in s.args),
                        key=lambda s: s.t0)  # fmt: skip
        assert [(s.cat, s.args["group"]) for s in stream] == [
            (cat, i) for i in range(len(groups)) for cat in ("chunk_wait", "copy")
        ], stream  # fmt: skip
        tol = clock["stream_uncertainty_ns"][rank]
        for wait, coll in zip(stream[::2], stream[1::2]):
            i = wait.args["group"]
            assert wait.name == f"wait group {i}" and wait.t1 >= wait.t0, wait
            ends = [s.t1 for g, s in by_tile.items() if group_of[g] == i]
            assert wait.t1 >= max(ends) - tol, (wait, ends)
            assert coll.t0 >= wait.t1 and coll.args["bytes"] > 0, (wait, coll)
            assert coll.args["tiles"] == groups[i][1], coll


@pytest.mark.own_gpu  # the process group's collectives on CUDA tensors
@pytest.mark.parametrize("world", SR_WORLDS, indirect=True)
@pytest.mark.parametrize("op", ["ar", "rs"])
def test_trace_of_signal_reorder(world, op, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG check needs matplotlib")
    (res, *_) = world.run(_signal_reorder_trace_body, str(tmp_path), op)
    _check_signal_reorder(res)
    _check_files(res)
    s = res["summary"]
    assert s["op"]["comm_ms"] and s["op"]["overlap_ratio"] is not None  # the collectives
    assert len(s["ranks"][0]["wait_ms_per_program"]) == res["launches"][0][0]["grid"]


# ------------------------------------------------------- collectives and P2PRing (CLI)
#: (op, strategy as the CLI takes it, copies per rank and call: a function of W)
COPY_CASES = [
    pytest.param("all_gather", "fused", lambda w: w - 1, id="all_gather"),  # a push per peer
    pytest.param("reduce_scatter", "fused", lambda w: w - 1, id="reduce_scatter"),  # per peer
    pytest.param("p2p_ring", "gemm_rs", lambda w: w - 1, id="ring_gemm_rs"),  # per ring step
    pytest.param("p2p_ring", "ag_gemm", lambda w: w - 1, id="ring_ag_gemm"),  # per ring step
]


@pytest.mark.parametrize("world", WORLDS[:1], indirect=True)
@pytest.mark.parametrize(
    "op, strategy, copies", COPY_CASES, ids=lambda c: getattr(c, "__name__", c)
)
def test_trace_of_copy_engine_ops(world, op, strategy, copies, tmp_path):
    """``trace all_gather / reduce_scatter / p2p_ring`` (the CLI's body, W 2 in the CPU
    emulation): every rank's copies to every peer are in the trace as ``copy`` spans, the
    summary counts them and their time, and the Chrome JSON is well-formed."""
    from interlace.bench.trace import SHAPES, trace_body

    w = world.world_size
    shape = SHAPES[op].cpu(w)
    prefix = str(tmp_path / op)
    res = world.run(trace_body, op, strategy, shape, 1, 1, prefix, op, {})[0]
    ranks = res["summary"]["ranks"]
    assert len(ranks) == w
    for r in ranks:
        assert r["copies"] >= copies(w), (op, r)
        assert r["comm_ms"] > 0 and r["bytes_copied"] > 0, (op, r)
    with open(res["paths"]["json"]) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "copy"]
    peers = {(e["pid"], e["args"]["peer"]) for e in spans}
    assert peers == {(r, q) for r in range(w) for q in range(w) if q != r}, peers
    for e in events:
        assert {"ph", "pid", "tid"} <= set(e) and (e["ph"] == "M" or {"ts", "dur"} <= set(e))
