"""Device time of the MoE routing build (``ops.moe.routing.launch_routing``) at the shapes
of ``bench moe``, as rank 0 of W = 4 with every meta flag raised: the whole build (one
launch) and the two launches it takes without a grid barrier, each alone, each captured
in a CUDA graph and replayed (median of ``--iters``), beside the grouped GEMM it feeds
(``torch._grouped_mm`` on the same rows).

    python benchmarks/probes/moe_routing_time.py [--iters 50] [--world 4] [--warps 4 8]
        [--counts-by-blocks]   (one GPU)

``--warps``: the build with each of these warp counts (default: the library's);
``--counts-by-blocks``: the counts summed ``CB`` chunks at a time instead of in one load
(``NC_PAD`` 0). The first line: the floor, a replayed graph of one empty kernel (1 and
132 programs).
"""

from __future__ import annotations

import argparse

import torch
import triton


def main() -> int:
    from interlace.bench.moe import SHAPES
    from interlace.ops.moe import _gemm

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--warps", nargs="*", type=int, default=[0])
    p.add_argument("--counts-by-blocks", action="store_true")
    args = p.parse_args()
    from interlace.bench.moe import graph_ms
    from interlace.ops.moe import routing

    floor = [graph_ms(lambda n=n: _empty[(n,)](), args.iters) * 1e3 for n in (1, 132)]
    print(f"floor: empty kernel {floor[0]:.1f} us (1 program), {floor[1]:.1f} us (132)")
    dev, w = torch.device("cuda"), args.world
    gen = torch.Generator().manual_seed(0)
    cfg = _gemm.GPU_CONFIGS["gather"]
    head = f"{'shape':>22} {'routing':>8} {'all us':>7} {'count / build us (alone)':>26}"
    print(f"{head} {'gmm us':>7}")
    if args.counts_by_blocks:
        routing.COUNTS_IN_ONE_LOAD = 0
    library_warps = routing.ROUTE_WARPS
    for warps in args.warps:
        routing.ROUTE_WARPS = warps or library_warps
        print(f"== warps {warps or 'library'}{' counts by blocks' * args.counts_by_blocks}")
        for hidden, inter, experts, k in SHAPES:
            for kind in ("balanced", "zipf"):
                shape = (hidden, inter, experts, k, kind)
                print(_case(shape, w, gen, dev, cfg, args.iters), flush=True)
    return 0


@triton.jit
def _empty():
    pass


def _case(shape, w, gen, dev, cfg, iters) -> str:
    """One table row: the routing build of one shape and routing kind."""
    from interlace.bench.moe import TOKENS, graph_ms, routing_ids
    from interlace.kernels import grouped_gemm as kg
    from interlace.ops.moe import routing
    from interlace.runtime.signals import ERROR_WORDS

    hidden, inter, experts, k, kind = shape
    m = TOKENS // w
    ids = routing_ids(TOKENS, k, experts, kind, gen).to(dev)
    wts = torch.softmax(torch.randn(TOKENS, k, device=dev), -1)
    stride = 2 * m * k
    meta = torch.empty(w, stride, dtype=torch.int32, device=dev)
    for s in range(w):
        routing.pack_meta(meta[s], ids[s * m : (s + 1) * m], wts[s * m : (s + 1) * m])
    sig = torch.ones(64, dtype=torch.int32, device=dev)
    sig[32:] = 0  # the one-launch build's grid barrier
    err = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev)
    work = routing.alloc_routing(m, k, experts, w, cfg.block_m, dev)

    def build():
        routing.launch_routing(
            work, meta, stride, rank=0, sig=sig, flag0=0, err=err.data_ptr(),
            max_spins=1 << 20, wait=True, bar_slot=32,
        )  # fmt: skip

    build()
    torch.cuda.synchronize()
    t_all = graph_ms(build, iters) * 1e3
    parts = [graph_ms(f, iters) * 1e3 for f in _launches(kg, routing, work, meta, stride, sig, err)]
    x = torch.randn(TOKENS * k, hidden, device=dev, dtype=torch.bfloat16)
    wt = torch.randn(experts, hidden, 2 * inter // w, device=dev, dtype=torch.bfloat16)
    ends = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=experts), 0).to(torch.int32)
    t_gmm = graph_ms(lambda: torch._grouped_mm(x, wt, offs=ends), iters) * 1e3
    name = f"H{hidden} I{inter} E{experts} k{k}"
    split = " / ".join(f"{v:.1f}" for v in parts)
    return f"{name:>22} {kind:>8} {t_all:7.1f} {split:>26} {t_gmm:7.1f}"


def _launches(kg, routing, work, meta, stride, sig, err):
    """The build as two launches, each alone: the count, then the build from its counts
    (the path the interpreter, or more chunks than SMs, takes)."""
    rt = work.routing
    w, e = rt.world, rt.experts
    mk = rt.m_loc * rt.topk
    chunk = routing.chunk_size(mk)
    cps = -(-mk // chunk)
    n_chunks = w * cps
    args = (
        meta, stride, mk, mk, cps, e, work.counts, n_chunks, rt.offsets, rt.tiles,
        rt.tile_count, work.scratch, work.base_scratch, rt.entry_ids, rt.weights, sig, 0, 0,
        err.data_ptr(), 0, 1 << 20,
    )  # fmt: skip
    consts = routing.route_consts(rt, wait=True)
    return [
        lambda phase=phase: kg.moe_route_kernel[(n_chunks,)](*args, PHASE=phase, **consts)
        for phase in (1, 2)
    ]


if __name__ == "__main__":
    raise SystemExit(main())
