"""Where ``MoERS``'s per-rank time goes, on one GPU (rank 0 of W with every wait met, the
shapes of ``bench moe``): the reduce GEMM alone and the owner's finish alone, with the
weighted rows stored in float32 (the op's) and in bf16, each timed from CUDA-graph
replays beside ``torch._grouped_mm`` on the same rows; the finish reads this rank's rows
and ``W - 1`` stand-ins, as ``bench moe`` does (``--distinct``: a separate stand-in buffer
per peer instead of one shared). ``--random``: A and the weights drawn from a normal
distribution instead (``gluon_grouped_gemm.py``'s data; the errors then mean nothing),
``torch._grouped_mm`` timed on them too.

    python benchmarks/probes/moe_reduce_parts.py [--world 4] [--distinct] [--random] [--shapes 0 1]
"""

from __future__ import annotations

import argparse
import functools

import torch


def _parts(pb, rt, hp, cfg, row_dtype, distinct, iters):
    """(GEMM ms, finish ms, rel err of rank 0's rows) with rows in ``row_dtype``."""
    from interlace.bench.moe import graph_ms

    run = pb.reduce_launches(rt, hp, cfg, row_dtype, distinct_peers=distinct)
    run.y.fill_(float("nan"))
    run.gemm()
    run.finish()
    torch.cuda.synchronize()
    err = float((run.y.float() - pb.y_ref).norm() / pb.y_ref.norm())
    t_gemm = graph_ms(run.gemm, iters)
    t_finish = graph_ms(lambda: run.finish(counted=True), iters)
    run.sig.zero_()
    return t_gemm, t_finish, err


def main() -> int:
    from interlace.bench import moe as bm
    from interlace.ops.moe import _gemm

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--distinct", action="store_true")
    p.add_argument("--random", action="store_true")
    p.add_argument("--shapes", nargs="*", type=int, default=list(range(len(bm.SHAPES))))
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cfg = _gemm.GPU_CONFIGS["reduce"]
    print(f"{'case':<28} {'gmm':>7} | {'f32 gemm':>8} {'finish':>7} {'err':>8} | "
          f"{'bf16 gemm':>9} {'finish':>7} {'err':>8}")  # fmt: skip
    for i in args.shapes:
        hidden, inter, experts, k = bm.SHAPES[i]
        for kind in ("balanced", "zipf"):
            pb = bm._Problem(hidden, inter, experts, k, args.world, kind, gen, dev, args.iters)
            rt, _ = pb.routing(cfg)
            hp, _, _ = pb.permuted(rt, pb.h_ref)
            t_gmm = pb.t_gmm2
            if args.random:
                hp = torch.randn_like(hp, dtype=torch.float32).to(hp.dtype)
                pb.w2 = (torch.randn_like(pb.w2, dtype=torch.float32) / pb.i_loc**0.5).to(
                    pb.w2.dtype
                )
                n_rows = int(rt.offsets[-1])
                ends = rt.offsets[1:].to(torch.int32)
                gmm = functools.partial(torch._grouped_mm, hp[:n_rows], pb.w2, offs=ends)
                t_gmm = bm.graph_ms(gmm, args.iters)
            f = _parts(pb, rt, hp, cfg, torch.float32, args.distinct, args.iters)
            b = _parts(pb, rt, hp, cfg, torch.bfloat16, args.distinct, args.iters)
            name = f"H{hidden} I{inter} E{experts} k{k} {kind[:4]}"
            print(f"{name:<28} {t_gmm:7.4f} | {f[0]:8.4f} {f[1]:7.4f} {f[2]:8.1e} | "
                  f"{b[0]:9.4f} {b[1]:7.4f} {b[2]:8.1e}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
