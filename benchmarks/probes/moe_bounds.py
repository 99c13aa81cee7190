"""What the one-GPU MoE targets ask of the kernels, against cuBLAS and HBM on the same GPU,
and the owner's finish in other tile shapes (rank 0 of W with every wait met, the shapes
and routings of ``bench moe``; CUDA-graph replays).

    python benchmarks/probes/moe_bounds.py [--worlds 4 8] [--shapes 0 1] [--iters 30]

Per case:

* ``gmm1`` / ``gmm2``: ``torch._grouped_mm`` on rows already sorted (the records'
  ``t_ref_ms``); ``dense1`` / ``dense2``: cuBLAS (``torch.mm``) on one GEMM of the same
  size with no expert boundaries (``[M k, H] x [H, 2 I / W]``, ``[M k, I / W] x [I / W,
  H]``), the speed a grouped GEMM of those FLOPs would have with every group as large as
  possible; ``route``: the routing build (``AGMoE``'s, before its GEMM).
* ``ag need``: ``dense1 + route`` against ``gmm1 / 1.10``: above 1, the first half's
  target asks the GEMM to run faster than cuBLAS's dense GEMM of the same size.
* ``finish``: ``MoERS``'s finish alone (bf16 rows, a stand-in buffer per peer) in each
  tile shape of ``--blocks`` (rows x columns x warps x programs per SM), with its bytes
  (``W k`` rows read per token, the output written) over the copy bandwidth measured
  here (``copy``: a 2 GiB device-to-device copy, bytes read + written per second);
  ``rs need``: ``dense2 + the fastest finish`` against ``gmm2 / 1.10``.
"""

from __future__ import annotations

import argparse

import torch

BLOCKS = ["32x128x8x2", "16x256x8x2", "8x512x8x2", "32x256x8x2", "16x512x8x1", "64x128x8x1"]


def _copy_tbps(iters: int) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (TB/s)."""
    from interlace.bench.moe import graph_ms

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_ms(lambda: dst.copy_(src), iters) / 1e9


def main() -> int:
    from interlace.bench import moe as bm
    from interlace.ops.moe import _gemm

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worlds", nargs="*", type=int, default=[4, 8])
    p.add_argument("--shapes", nargs="*", type=int, help="indices into bench moe's SHAPES")
    p.add_argument("--blocks", nargs="*", default=BLOCKS)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    bw = _copy_tbps(args.iters)
    big = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    t_big = bm.graph_ms(lambda: big @ big, args.iters)
    print(f"copy {bw:.2f} TB/s; torch.mm 8192^3 bf16 {2 * 8192**3 / t_big / 1e9:.0f} TFLOP/s")
    print(f"{'case':<30} {'gmm1':>7} {'dense1':>7} {'route':>6} {'ag need':>7} | "
          f"{'gmm2':>7} {'dense2':>7} {'rs need':>7} | finish ms (TB/s) per block")  # fmt: skip
    cfg = _gemm.GPU_CONFIGS["reduce"]
    shapes = [bm.SHAPES[i] for i in args.shapes] if args.shapes else bm.SHAPES
    saved = _gemm.FINISH_BLOCK, _gemm.FINISH_WARPS, _gemm.FINISH_PER_SM
    for world in args.worlds:
        for hidden, inter, experts, k in shapes:
            for kind in ("balanced", "zipf"):
                pb = bm._Problem(hidden, inter, experts, k, world, kind, gen, dev, args.iters)
                mk, i_loc = bm.TOKENS * k, pb.i_loc
                a1 = torch.randn(mk, hidden, device=dev).to(torch.bfloat16)
                b1 = torch.randn(hidden, 2 * i_loc, device=dev).to(torch.bfloat16)
                a2 = torch.randn(mk, i_loc, device=dev).to(torch.bfloat16)
                b2 = torch.randn(i_loc, hidden, device=dev).to(torch.bfloat16)
                dense1 = bm.graph_ms(lambda a1=a1, b1=b1: a1 @ b1, args.iters)
                dense2 = bm.graph_ms(lambda a2=a2, b2=b2: a2 @ b2, args.iters)
                rt, route = pb.routing(cfg)  # (both halves' configs: one row height)
                t_route = bm.graph_ms(route, args.iters)
                hp, _, _ = pb.permuted(rt, pb.h_ref)
                run = pb.reduce_launches(rt, hp, cfg, torch.bfloat16, distinct_peers=True)
                run.gemm()
                torch.cuda.synchronize()
                nbytes = (world * k + 1) * pb.m * hidden * 2
                fin = []
                for b in args.blocks:
                    bm_, bn, warps, per_sm = map(int, b.split("x"))
                    _gemm.FINISH_BLOCK, _gemm.FINISH_WARPS, _gemm.FINISH_PER_SM = (
                        (bm_, bn), warps, per_sm
                    )  # fmt: skip
                    try:
                        run.y.fill_(float("nan"))
                        run.finish(counted=True)
                        torch.cuda.synchronize()
                        err = float((run.y.float() - pb.y_ref).norm() / pb.y_ref.norm())
                        assert err < 1e-2, (b, err)
                        t = bm.graph_ms(lambda run=run: run.finish(counted=True), args.iters)
                    finally:
                        _gemm.FINISH_BLOCK, _gemm.FINISH_WARPS, _gemm.FINISH_PER_SM = saved
                    fin.append((t, b))
                best = min(fin)[0]
                need1 = (dense1 + t_route) / (pb.t_gmm1 / 1.10)
                need2 = (dense2 + best) / (pb.t_gmm2 / 1.10)
                cells = " ".join(f"{b}:{t:.4f}({nbytes / t / 1e9:.2f})" for t, b in fin)
                name = f"W{world} H{hidden} I{inter} E{experts} k{k} {kind[:4]}"
                print(f"{name:<30} {pb.t_gmm1:7.4f} {dense1:7.4f} {t_route * 1e3:6.1f} "
                      f"{need1:7.2f} | {pb.t_gmm2:7.4f} {dense2:7.4f} {need2:7.2f} | {cells}",
                      flush=True)  # fmt: skip
                run.sig.zero_()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
