"""Benchmark of expert-parallel dispatch / combine (``EPAllToAll``) and ``EPMoE``::

    python -m interlace bench ep [--out DIR] [--quick]

On one GPU: (1) a world of one rank (every kernel of the op with its waits met at once):
GPU time of dispatch, combine and the MoE layer against the ``none`` baseline
(``all_to_all_single`` + ``torch._grouped_mm``) and the host time of an eager call
(replayed from a CUDA graph) as ``bench host`` measures it: ``host_us`` in a loop of calls,
``host_cold_us`` alone after a barrier, combine into a given ``out`` (``host_out_us``), each
step of the call path (``host_<step>_us``),
``torch.mm``'s host time beside it; and of a user-captured graph's replay; (2) a world of two
ranks sharing the GPU: the same calls' times (the ranks' kernels time-slice one GPU, so
these check the protocol under load, not NVLink speed). With two or more GPUs, one rank
per GPU: the op against ``all_to_all_single`` (NCCL) in the same run, with the algorithm
bandwidth. Records: op ``ep_dispatch`` / ``ep_combine`` / ``ep_moe``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import torch
import torch.distributed as dist

from .cli import add_several_only, runs_one_gpu
from .host import step_times
from .timing import host_cold_us, host_us, max_over_ranks, median_ms, torch_mm_host

MODE = "normal"


def _barrier(group):
    torch.cuda.synchronize()
    dist.barrier(group=group.process_group)
    torch.cuda.synchronize()


#: ``timing.median_ms`` with 3 warm-up calls: ``_time_ms(group, fn, iters)``
_time_ms = functools.partial(median_ms, warmup=3)


@dataclasses.dataclass
class _Times:
    """One context's dispatch and combine: GPU times (ms) and, when measured, host times
    of one eager call (us) and of one replay of a user-captured graph of both."""

    dispatch_ms: float
    combine_ms: float
    dispatch_us: float | None = None
    combine_us: float | None = None
    dispatch_cold_us: float | None = None
    combine_cold_us: float | None = None
    combine_out_us: float | None = None  # combine into a given ``out``
    graph_ms: float | None = None
    graph_us: float | None = None
    #: host time of each step of the eager call path (``host.step_times``)
    dispatch_steps: dict = dataclasses.field(default_factory=dict)
    combine_steps: dict = dataclasses.field(default_factory=dict)


def _times(group, ctx, x, idx, wts, eo, iters, host=True) -> _Times:
    """GPU times (ms) of ``ctx``'s dispatch of ``x`` and combine of ``eo``; with ``host`` also
    their host times and a user-captured graph of dispatch + combine (GPU and host time
    of one replay)."""
    t_d = _time_ms(group, lambda: ctx.dispatch(x, idx, wts), iters)
    h = ctx.dispatch(x, idx, wts)
    t = _Times(t_d, _time_ms(group, lambda: ctx.combine(eo, h), iters))
    if not host:
        return t
    t.dispatch_us = host_us(group, lambda: ctx.dispatch(x, idx, wts), iters)
    t.dispatch_cold_us = host_cold_us(group, lambda: ctx.dispatch(x, idx, wts), iters)
    h = ctx.dispatch(x, idx, wts)
    t.combine_us = host_us(group, lambda: ctx.combine(eo, h), iters)
    t.combine_cold_us = host_cold_us(group, lambda: ctx.combine(eo, h), iters)
    out = torch.empty_like(ctx.combine(eo, h))
    t.combine_out_us = host_us(group, lambda: ctx.combine(eo, h, out=out), iters)
    t.dispatch_steps = step_times(ctx, lambda c: c.dispatch(x, idx, wts), iters)
    h = ctx.dispatch(x, idx, wts)
    t.combine_steps = step_times(ctx, lambda c: c.combine(eo, h), iters)
    _barrier(group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hg = ctx.dispatch(x, idx, wts)
        ctx.combine(eo, hg)
    t.graph_ms = _time_ms(group, graph.replay, iters)
    t.graph_us = host_us(group, graph.replay, iters)
    return t


def _none_ms(group, x, idx, wts, experts, iters) -> tuple[float, float]:
    """GPU times (ms) of the ``none`` path's dispatch and combine (``all_to_all_single``)."""
    from ..ops.ep.baseline import a2a_combine, a2a_dispatch

    state = {}

    def none_dispatch():
        state["s"] = a2a_dispatch(group, x, idx, wts, experts)

    t_nd = _time_ms(group, none_dispatch, iters)
    eo_n = torch.randn(state["s"][0].shape[0], x.shape[1], device=x.device).to(torch.bfloat16)
    return t_nd, _time_ms(group, lambda: a2a_combine(group, eo_n, state["s"][3]), iters)


def copy_gbps(group, nbytes: int = 256 << 20, iters: int = 10) -> float:
    """The machine's NVLink copy bandwidth as the EP ops see it: every rank at once copies
    ``nbytes`` into the next rank's symmetric buffer with the copy engine (one
    ``copy_``); GB/s of one rank's outgoing bytes, the slowest rank's median."""
    from ..runtime import symm_empty

    buf = symm_empty((nbytes,), torch.uint8, group)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8, device=group.device)
        dst = buf.peers[(group.rank + 1) % group.world_size]
        t = _time_ms(group, lambda: dst.copy_(src), iters)
    finally:
        buf.close()
    t = max_over_ranks(group, {"t": t})["t"]
    return nbytes / (t * 1e-3) / 1e9


def _routing(n, topk, experts, gen, dev):
    scores = torch.rand(n, experts, generator=gen)
    idx = scores.topk(topk, dim=1).indices
    w = torch.rand(n, topk, generator=gen)
    return idx.to(dev), (w / w.sum(1, keepdim=True)).to(dev)


def bench_body(group, shapes, with_none: bool, iters: int) -> list[dict]:
    recs = [rec for shape in shapes for rec in _one_shape(group, shape, with_none, iters)]
    return _with_mm_host(group, recs, iters)


def _with_mm_host(group, recs: list[dict], iters: int) -> list[dict]:
    """``torch.mm``'s host time in this world (``timing.torch_mm_host``) beside every
    host-time record."""
    ref = torch_mm_host(group, iters)
    return [dict(r, **ref) if r.get("host_us") is not None else r for r in recs]


def _one_shape(group, shape, with_none: bool, iters: int) -> list[dict]:
    from ..ops.ep import EPAllToAll, EPMoE

    w, dev = group.world_size, group.device
    tokens, hidden, topk, experts = shape
    gen = torch.Generator().manual_seed(1 + group.rank)
    x = (torch.randn(tokens, hidden, generator=gen)).to(torch.bfloat16).to(dev)
    idx, wts = _routing(tokens, topk, experts, gen, dev)
    e_loc = experts // w
    ctx = EPAllToAll(group, tokens, hidden, experts, topk)
    h = ctx.dispatch(x, idx, wts)
    eo = torch.randn(ctx.capacity, hidden, device=dev).to(torch.bfloat16)
    ctx.combine(eo, h)
    ctx.check()
    base = dict(tokens=tokens, hidden=hidden, topk=topk, experts=experts, mode=MODE,
                dtype="bfloat16", as_world=w, waits_met=w == 1)  # fmt: skip
    t = _times(group, ctx, x, idx, wts, eo, iters)
    ctx.check()
    rec_d = dict(op="ep_dispatch", strategy="symm", **base, t_ms=t.dispatch_ms,
                 host_us=t.dispatch_us, host_cold_us=t.dispatch_cold_us,
                 **t.dispatch_steps)  # fmt: skip
    rec_c = dict(op="ep_combine", strategy="symm", **base, t_ms=t.combine_ms,
                 host_us=t.combine_us, host_cold_us=t.combine_cold_us,
                 host_out_us=t.combine_out_us, **t.combine_steps)  # fmt: skip
    rec_g = dict(op="ep_dispatch_combine", strategy="graph", **base, t_ms=t.graph_ms,
                 host_us=t.graph_us)  # fmt: skip
    nbytes = tokens * hidden * 2 * (topk if experts == w else _ranks_per_token(idx, e_loc))
    # the bytes that leave this GPU (rows for its own experts stay in local memory)
    remote = tokens * hidden * 2 * _ranks_per_token(idx, e_loc, group.rank)
    for rec in (rec_d, rec_c):
        rec["algbw_gbps"] = nbytes / (rec["t_ms"] * 1e-3) / 1e9
        rec["remote_gbps"] = remote / (rec["t_ms"] * 1e-3) / 1e9
    if with_none:
        rec_d["t_nccl_ms"], rec_c["t_nccl_ms"] = _none_ms(group, x, idx, wts, experts, iters)
    # the MoE layer: one [hidden, hidden] map per expert, so at most 8 local experts
    # (256 of them at hidden 7168 would take 26 GB of weights)
    moe_experts = min(experts, 8 * w)
    moe_idx, moe_w = _routing(tokens, topk, moe_experts, gen, dev)
    weight = torch.randn(moe_experts // w, hidden, hidden, device=dev, dtype=torch.bfloat16)
    weight *= 0.02
    moe = {}
    for strategy in EPMoE.STRATEGIES if with_none else ("fused", "serial"):
        with EPMoE(group, tokens, hidden, moe_experts, topk, strategy=strategy) as m:
            m(x, moe_idx, moe_w, weight)
            moe[strategy] = _time_ms(group, lambda: m(x, moe_idx, moe_w, weight), iters)
            m.check()
    rec_m = dict(op="ep_moe", strategy="fused", **base, t_ms=moe["fused"],
                 t_serial_ms=moe["serial"], t_none_ms=moe.get("none"))  # fmt: skip
    rec_m["experts"] = moe_experts
    ctx.close()
    return [rec_d, rec_c, rec_g, rec_m]


def ll_body(group, shapes, with_none: bool, iters: int) -> list[dict]:
    """Low-latency dispatch / combine, both arrival protocols, against the normal mode
    and (``with_none``) the ``all_to_all_single`` path, at each shape."""
    recs = [rec for shape in shapes for rec in _ll_shape(group, shape, with_none, iters)]
    return _with_mm_host(group, recs, iters)


def _ll_shape(group, shape, with_none: bool, iters: int) -> list[dict]:
    from ..ops.ep import EPAllToAll, EPLowLatency

    w, dev = group.world_size, group.device
    tokens, hidden, topk, experts = shape
    gen = torch.Generator().manual_seed(7 + group.rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(dev)
    idx, wts = _routing(tokens, topk, experts, gen, dev)
    base = dict(tokens=tokens, hidden=hidden, topk=topk, experts=experts, dtype="bfloat16",
                as_world=w, waits_met=w == 1)  # fmt: skip
    nbytes = tokens * hidden * 2 * topk  # low latency: a row per (token, expert)
    recs = []
    with EPAllToAll(group, tokens, hidden, experts, topk) as ctx:
        h = ctx.dispatch(x, idx, wts)
        eo = torch.randn(ctx.capacity, hidden, device=dev).to(torch.bfloat16)
        ctx.combine(eo, h)
        normal = _times(group, ctx, x, idx, wts, eo, iters, host=False)
        ctx.check()
    if with_none:
        t_nd, t_nc = _none_ms(group, x, idx, wts, experts, iters)
    for protocol in ("flag_in_data", "token_flag"):
        with EPLowLatency(group, tokens, hidden, experts, topk, protocol=protocol) as ll:
            h = ll.dispatch(x, idx, wts)
            eo = torch.randn(*ll.recv_x.shape, device=dev).to(torch.bfloat16)
            ll.combine(eo, h)
            t = _times(group, ll, x, idx, wts, eo, iters)
            ll.check()
        for op, t_ms, host, cold, steps, t_norm in (
            ("ep_dispatch", t.dispatch_ms, t.dispatch_us, t.dispatch_cold_us, t.dispatch_steps,
             normal.dispatch_ms),
            ("ep_combine", t.combine_ms, t.combine_us, t.combine_cold_us, t.combine_steps,
             normal.combine_ms),
        ):  # fmt: skip
            rec = dict(op=op, strategy=protocol, mode="low_latency", **base, t_ms=t_ms,
                       host_us=host, host_cold_us=cold, t_normal_ms=t_norm,
                       algbw_gbps=nbytes / (t_ms * 1e-3) / 1e9, **steps)  # fmt: skip
            if op == "ep_combine":
                rec["host_out_us"] = t.combine_out_us
            if with_none:
                rec["t_nccl_ms"] = t_nd if op == "ep_dispatch" else t_nc
            recs.append(rec)
        recs.append(dict(op="ep_dispatch_combine", strategy=protocol, mode="low_latency",
                         **base, t_ms=t.graph_ms, host_us=t.graph_us))  # fmt: skip
    return recs


def _ranks_per_token(idx, e_loc, skip: int | None = None) -> float:
    """Mean number of ranks a token is sent to (each crossing once); with ``skip``, not
    counting that rank (the sender's own)."""
    dest = idx // e_loc
    first = (dest[:, :, None] == dest[:, None, :]).triu(1).any(1).logical_not()
    if skip is not None:
        first &= dest != skip
    return float(first.sum(1).float().mean())


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """Max of each time over ranks, min of each bandwidth."""
    out = []
    for recs in zip(*per_rank):
        rec = dict(recs[0])
        for k in ("t_ms", "host_us", "host_cold_us", "host_out_us", "host_torch_mm_us",
                  "host_torch_mm_cold_us", "t_nccl_ms", "t_none_ms", "t_serial_ms",
                  "t_normal_ms"):  # fmt: skip
            vals = [r.get(k) for r in recs if r.get(k) is not None]
            if vals:
                rec[k] = max(vals)
        for k in ("algbw_gbps", "remote_gbps"):
            vals = [r[k] for r in recs if r.get(k) is not None]
            if vals:
                rec[k] = min(vals)
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    from ..testing import World
    from .records import DEFAULT_OUT, device_name, write_records

    p = argparse.ArgumentParser(prog="python -m interlace bench ep")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true")
    add_several_only(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ep bench: needs a GPU")
        return 1
    iters = 10 if args.quick else 20
    gpus = torch.cuda.device_count()
    dev = device_name()
    big = [(128, 7168, 8, 256), (4096, 7168, 8, 256)]
    shapes = big[:1] if args.quick else big
    ll_shapes = [(128, 7168, 8, 256), (256, 7168, 8, 256)]
    results = []
    if runs_one_gpu(args, gpus):
        with World(1, "cuda", timeout=600) as one:
            recs = _merge(one.run(bench_body, shapes, True, iters))
            recs += _merge(one.run(ll_body, ll_shapes, True, iters))
        write_records(args.out, dev, 1, recs)
        results += recs
    if gpus >= 2:
        with World(gpus, "cuda", timeout=600) as many:
            bw = many.run(copy_gbps)[0]
            recs = _merge(many.run(bench_body, shapes, True, iters))
            recs += _merge(many.run(ll_body, ll_shapes, True, iters))
        print(f"ep bench: copy-engine bandwidth to a peer, every rank at once: {bw:.1f} GB/s")
        for r in recs:
            if "remote_gbps" in r:
                r["copy_gbps"] = round(bw, 1)
                r["x_copy_bw"] = round(r["remote_gbps"] / bw, 3)
        write_records(args.out, dev, gpus, recs)
    else:
        print("ep bench: overlap across GPUs needs 2+ GPUs; timing 2 ranks sharing one GPU")
        with World(2, "cuda", timeout=600, share_device=True) as shared:
            recs = _merge(shared.run(bench_body, shapes[:1], False, iters))
            recs += _merge(shared.run(ll_body, ll_shapes[:1], False, iters))
        for r in recs:
            r["shared_gpu"] = True
        write_records(args.out, dev, 1, [dict(r, variant="shared_gpu") for r in recs])
    results += recs
    print(
        f"{'op':20s} {'mode/strategy':24s} {'W':>2s} {'tok':>4s} {'t_ms':>8s} {'normal':>8s} "
        f"{'nccl/none':>9s} {'host_us':>8s} {'cold':>6s} {'out=':>6s} {'mm':>5s}"
    )
    for r in results:
        cols = []
        for k in ("t_normal_ms", "t_nccl_ms"):
            v = r.get(k) if k != "t_nccl_ms" else (r.get("t_nccl_ms") or r.get("t_none_ms"))
            cols.append("-" if v is None else f"{v:.3f}")
        host_s = [
            "-" if r.get(k) is None else f"{r[k]:.1f}"
            for k in ("host_us", "host_cold_us", "host_out_us", "host_torch_mm_us")
        ]
        tag = f"{r.get('mode', MODE)}/{r['strategy']}" + ("/sh" if r.get("shared_gpu") else "")
        print(
            f"{r['op']:20s} {tag:24s} {r['as_world']:2d} {r['tokens']:4d} {r['t_ms']:8.3f} "
            f"{cols[0]:>8s} {cols[1]:>9s} {host_s[0]:>8s} {host_s[1]:>6s} {host_s[2]:>6s} "
            f"{host_s[3]:>5s}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
