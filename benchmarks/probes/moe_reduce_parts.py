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
    from interlace.ops.moe import _gemm

    m, hidden, dev, world, k = pb.m, pb.hidden, pb.dev, pb.world, pb.k
    rows = torch.zeros(rt.rows, hidden, dtype=row_dtype, device=dev)
    n_peer = world - 1 if distinct else 1
    peers = [torch.zeros(rt.rows, hidden, dtype=row_dtype, device=dev) for _ in range(n_peer)]
    ptrs = [rows.data_ptr()] + [peers[i % n_peer].data_ptr() for i in range(world - 1)]
    table = torch.tensor(ptrs, device=dev)
    row_of = torch.zeros(rt.m_loc * world * k, dtype=torch.int32, device=dev)
    maps = torch.tensor([row_of.data_ptr()] * world, device=dev)
    sig = torch.zeros(8, dtype=torch.int32, device=dev)
    sig_table = torch.tensor([sig.data_ptr()] * world, device=dev)
    y = torch.empty(m, hidden, dtype=torch.bfloat16, device=dev)
    grid = _gemm.programs(rt, hidden, cfg, dev, "cuda", reduce=True)
    err_ptr = pb.err.data_ptr()

    def gemm():
        _gemm.launch_gemm(
            a=hp, x_own=None, w=pb.w2, out=None, routing=rt, n=hidden, up=0, cfg=cfg,
            grid=grid, gather=False, swiglu=False, reduce=True, rows_out=rows, row_of=row_of,
            sig=sig, sig_table=sig_table, err=err_ptr, rank=0, max_spins=1 << 20,
            done_slot=0, contrib_slot=1, world=world,
        )  # fmt: skip

    def finish():
        sig[1:2].fill_(world)  # every contribution counted (the finish clears it)
        _gemm.launch_finish(
            table, 0, maps, 0, y, m, k, sig, 1, 2, err_ptr, 0, 1 << 20, world, dev, "cuda",
            rows_f32=row_dtype == torch.float32, aligned=True,
        )  # fmt: skip

    y.fill_(float("nan"))
    gemm()
    finish()
    torch.cuda.synchronize()
    err = float((y.float() - pb.y_ref).norm() / pb.y_ref.norm())
    t_gemm = graph_ms(gemm, iters)
    t_finish = graph_ms(finish, iters)
    sig.zero_()
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
