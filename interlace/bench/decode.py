"""Benchmark of distributed flash-decode (``FlashDecode``).

One GPU: each rank's kernels on the per-rank problem of a KV cache split over
``as_world`` ranks (batch, 32 query heads, 8 KV heads, d 128, bf16), in a one-rank group
(waits met), timed in the same run as torch SDPA decode on the same shard (flash and
efficient backends with grouped-query heads; the faster one is the reference), each as HBM
bandwidth over the K/V bytes read, both timed as replays of captured CUDA graphs (``t_ms``,
``t_ref_ms``; the eager call's time in ``t_eager_ms``); the host time of an eager call and
of a CUDA-graph replay of one step; a few launch configurations (records ``flash_decode_variant``).
Several GPUs: the whole op over the ranks, eager and replayed from a graph, timed in the
same run as its ``none`` strategy (torch flash attention per shard, NCCL all-gather of
the partials, torch log-sum-exp merge), ``t_none_ms``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cli import add_several_only, runs_one_gpu
from .records import DEFAULT_OUT, device_name, write_records
from .timing import graph_of, max_over_ranks, median_ms, paired_median_ms

HEADS, KV_HEADS, D = 32, 8, 128
#: (batch, per-rank KV length, as_world): total KV of 32k to 1M tokens over 4 ranks
SHAPES = [
    (1, 8192, 4), (1, 32768, 4), (1, 131072, 4), (1, 262144, 4), (8, 16384, 4), (64, 8192, 4),
]  # fmt: skip
QUICK_SHAPES = [(1, 32768, 4), (8, 16384, 4)]
MAX_REL_ERR = 2e-2


def _variants():
    from ..ops.attention import DecodeConfig

    return {
        "n32_s3": DecodeConfig(block_n=32, num_stages=3),
        "n64_s4": DecodeConfig(block_n=64, num_stages=4),
        "n128_s3_w8": DecodeConfig(block_n=128, num_stages=3, num_warps=8),
        "n64_s3_p8": DecodeConfig(block_n=64, num_stages=3, programs_per_sm=8, min_split=128),
        "n64_s3_p4": DecodeConfig(block_n=64, num_stages=3, programs_per_sm=4),
        "n128_s3_w8_p2": DecodeConfig(block_n=128, num_stages=3, num_warps=8, programs_per_sm=2),
        "n128_s4_w4_p2": DecodeConfig(block_n=128, num_stages=4, programs_per_sm=2),
        "n64_s3_m512": DecodeConfig(block_n=64, num_stages=3, min_split=512),
        "n64_s3_m1024": DecodeConfig(block_n=64, num_stages=3, min_split=1024),
        "n128_s3_m512": DecodeConfig(block_n=128, num_stages=3, min_split=512),
        "n64_s3_p1": DecodeConfig(block_n=64, num_stages=3, programs_per_sm=1),
    }


def _inputs(batch, kv_len, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, HEADS, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, kv_len, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(batch, KV_HEADS, kv_len, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, k, v


def _sdpa(q, k, v):
    """The faster of SDPA's flash and efficient backends on this decode step, as
    ``(name, fn)``; the math backend only where neither runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4 = q[:, :, None, :]
    found = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip

        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        try:
            fn()
            torch.cuda.synchronize()
        except RuntimeError:
            continue
        found.append((median_ms(None, fn, iters=10, warmup=3), name, fn))
    if not found:
        return "math", lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    _, name, fn = min(found, key=lambda x: x[0])
    return name, fn


def _host_us(fn, calls=200):
    """Median host time of ``fn()`` in µs, calls back to back (the device runs behind)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _one_rank_group():
    from ..runtime import Group

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    return Group(backend="cuda")


def one_gpu(quick: bool, iters: int, shapes=None):
    from ..ops.attention import FlashDecode

    group = _one_rank_group()
    dev = device_name()
    records, rows = [], []
    for batch, kv_len, as_world in shapes or (QUICK_SHAPES if quick else SHAPES):
        q, k, v = _inputs(batch, kv_len)
        gb = 2 * k.numel() * k.element_size() / 1e9
        ref_name, ref = _sdpa(q, k, v)
        ctx = FlashDecode(group, batch, HEADS, KV_HEADS, D)
        out = torch.empty_like(q)
        call = functools.partial(ctx, q, k, v, out=out)
        call()
        err = float((out.float() - ref()[:, :, 0].float()).norm() / ref().float().norm())
        # the per-rank kernels and SDPA each timed as replays of a captured CUDA graph (the
        # host's launch cost in neither, as bench kernels does); the eager call as well
        graph, ref_graph = graph_of(None, call), graph_of(None, ref)
        t_graph, t_ref = paired_median_ms(
            None, [graph.replay, ref_graph.replay], iters=iters, warmup=3
        )
        t = median_ms(None, call, iters=iters, warmup=3)
        host_eager = _host_us(call)
        host_graph = _host_us(graph.replay)
        ctx.check()
        shape = dict(dtype="bfloat16", batch=batch, heads=HEADS, kv_heads=KV_HEADS, d=D,
                     kv_len=kv_len)  # fmt: skip
        records.append(dict(
            op="flash_decode", strategy="fused", **shape, kv_total=kv_len * as_world,
            as_world=as_world, splits=ctx.splits(batch, kv_len)[0], t_ms=round(t_graph, 5),
            t_eager_ms=round(t, 5), timing="cuda_graph", gbps=round(gb / t_graph * 1e3, 1),
            waits_met=True, ref="sdpa", ref_backend=ref_name, t_ref_ms=round(t_ref, 5),
            gbps_ref=round(gb / t_ref * 1e3, 1), rel_err=err,
        ))  # fmt: skip
        records.append(dict(op="flash_decode", strategy="fused", mode="eager", **shape,
                            as_world=as_world, host_us=round(host_eager, 2)))  # fmt: skip
        records.append(dict(op="flash_decode", strategy="fused", mode="graph", **shape,
                            as_world=as_world, host_us=round(host_graph, 2)))  # fmt: skip
        rows.append((batch, kv_len, as_world, t_graph, t_ref, ref_name, gb, host_eager, host_graph,
                     err))  # fmt: skip
        ctx.close()
        if not quick or shapes:
            for name, cfg in _variants().items():
                vctx = FlashDecode(group, batch, HEADS, KV_HEADS, D, config=cfg)
                vcall = functools.partial(vctx, q, k, v, out=out)
                vcall()
                vgraph = graph_of(None, vcall)
                tv, tr = paired_median_ms(
                    None, [vgraph.replay, ref_graph.replay], iters=iters, warmup=3
                )
                vctx.check()
                records.append(dict(
                    op="flash_decode_variant", strategy="fused", variant=name, **shape,
                    as_world=as_world,
                    t_ms=round(tv, 5), gbps=round(gb / tv * 1e3, 1), t_ref_ms=round(tr, 5),
                    ratio=round(tr / tv, 3), splits=vctx.splits(batch, kv_len)[0],
                ))  # fmt: skip
                vctx.close()
        q = k = v = out = None
        torch.cuda.empty_cache()
    return dev, records, rows


def _multi_body(group, shapes, iters):
    from ..ops.attention import FlashDecode

    out_records = []
    for batch, kv_len in shapes:
        q, k, v = _inputs(batch, kv_len, seed=1)  # same q everywhere, shards differ little
        k.add_(0.01 * group.rank)
        ctx = FlashDecode(group, batch, HEADS, KV_HEADS, D)
        base = FlashDecode(group, batch, HEADS, KV_HEADS, D, strategy="none")
        out, out_none = torch.empty_like(q), torch.empty_like(q)
        call = functools.partial(ctx, q, k, v, out=out)
        call_none = functools.partial(base, q, k, v, out=out_none)
        call()
        call_none()
        torch.cuda.synchronize()
        err = float((out.float() - out_none.float()).norm() / out_none.float().norm())
        t, t_none = paired_median_ms(group, [call, call_none], iters=iters)
        graph = graph_of(group, call)
        t_graph = median_ms(group, graph.replay, iters=iters)
        ctx.check()
        ctx.close()
        base.close()
        m = max_over_ranks(group, {"t": t, "g": t_graph, "n": t_none, "e": err})
        out_records.append(dict(
            op="flash_decode", strategy="fused", dtype="bfloat16", batch=batch, heads=HEADS,
            kv_heads=KV_HEADS, d=D, kv_len=kv_len, kv_total=kv_len * group.world_size,
            t_ms=round(m["t"], 5), t_graph_ms=round(m["g"], 5), t_none_ms=round(m["n"], 5),
            rel_err_none=m["e"],
        ))  # fmt: skip
    return out_records


def several_gpus(n: int, quick: bool, iters: int):
    from ..testing import World

    shapes = [(1, 32768), (8, 16384)] if quick else [(1, 32768), (1, 131072), (8, 16384)]
    world = World(n, "cuda")
    try:
        return world.run(_multi_body, shapes, iters)[0]
    finally:
        world.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m interlace bench decode", description=__doc__)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--shapes",
        default=None,
        help="batch:kv_per_rank pairs, comma-separated (as world 4), e.g. 1:8192",
    )
    add_several_only(p)
    args = p.parse_args(argv)
    shapes = None
    if args.shapes:
        shapes = [(int(b), int(kv), 4) for b, kv in (x.split(":") for x in args.shapes.split(","))]
    if not torch.cuda.is_available():
        print("bench decode: needs a GPU (the CPU emulation is covered by the tests)")
        return 0
    n = torch.cuda.device_count()
    dev, records, rows = device_name(), [], []
    if runs_one_gpu(args, n):
        dev, records, rows = one_gpu(args.quick, args.iters, shapes)
        print(f"wrote {write_records(args.out, dev, 1, records)}")
    if n >= 2:
        multi = several_gpus(n, args.quick, args.iters)
        print(f"wrote {write_records(args.out, dev, n, multi)}")
        for r in multi:
            print(f"W={n} batch {r['batch']} kv/rank {r['kv_len']}: {r['t_ms']:.4f} ms eager, "
                  f"{r['t_graph_ms']:.4f} ms graph, none {r['t_none_ms']:.4f} ms "
                  f"({r['t_none_ms'] / r['t_ms']:.2f} x), rel err vs none "
                  f"{r['rel_err_none']:.1e}")  # fmt: skip
    else:
        print("several-GPU flash-decode (partials pushed over NVLink) needs 2+ GPUs")
    print(f"{'batch':>5} {'kv/rank':>8} {'W':>2} {'ms':>8} {'sdpa ms':>8} {'GB/s':>7} "
          f"{'sdpa GB/s':>9} {'x sdpa':>6} {'host us':>7} {'graph us':>8} rel_err")  # fmt: skip
    for b, kv, w, t, tr, name, gb, he, hg, err in rows:
        bw, bw_ref = gb / t * 1e3, gb / tr * 1e3
        print(f"{b:>5} {kv:>8} {w:>2} {t:8.4f} {tr:8.4f} {bw:7.0f} {bw_ref:7.0f}{name[0]:>2} "
              f"{tr / t:6.3f} {he:7.1f} {hg:8.1f} {err:.1e}")  # fmt: skip
    variants = [r for r in records if r["op"] == "flash_decode_variant"]
    if variants:
        print("launch configurations, x sdpa (graph replays, same run):")
        for r in variants:
            print(f"  {r['variant']:>14} batch {r['batch']:>3} kv/rank {r['kv_len']:>7}: "
                  f"{r['ratio']:.3f} ({r['splits']} splits)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
