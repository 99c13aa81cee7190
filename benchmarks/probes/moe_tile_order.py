"""The MoE gather GEMM's time against the order of its tile table, and the routing build's
time against its chunk size, on one GPU (rank 0 of W with every wait met, the shapes of
``bench moe``).

    python benchmarks/probes/moe_tile_order.py [--world 4] [--bands 2 4 8] [--chunks 256 512 1024]

The routing build orders row tiles by the last arrival position they read, then by expert
(``arrival``): with balanced routing at E 32 every position's bucket holds a tile of every
expert, so each expert's weights are read from HBM once per position. The same tiles
permuted (each keeps its rows and the positions it waits for): ``serpentine`` (the
arrival buckets in the same order, each odd position's experts reversed: a bucket starts
on the experts whose weights the previous one read last); ``expert`` (by expert, then
row: each expert's weights read once, but a first tile may need the last shard) and
``bandB`` (key ``expert // B + last position``, then expert: a wavefront where an expert's
tiles of successive positions are one band apart, so the weights of about two bands of
experts are live). Times: CUDA-graph replays of the gather GEMM (``AGMoE``, SwiGLU) beside
``torch._grouped_mm``. (The reduce GEMM, whose tiles wait for nothing, was timed here in
each order too, and now runs its row tiles in row order: benchmarks/results/history/
2026-11-29-h200-w1-moe-tile-order.txt.)
"""

from __future__ import annotations

import argparse

import torch


def _orders(t: torch.Tensor, bands):
    """``{name: permutation}`` of the tile table's arrival-order columns ``t [n, 4]``
    (row0, expert, first, last)."""
    row0, e, last = t[:, 0].long(), t[:, 1].long(), t[:, 3].long()
    big = int(row0.max()) + 1
    n_e = int(e.max()) + 1
    # serpentine: arrival buckets as they are, the experts of odd positions' buckets in
    # reverse, so each bucket starts on the experts whose weights the last one read last
    snake = torch.where(last % 2 == 1, n_e - 1 - e, e)
    out = {"arrival": torch.arange(t.shape[0], device=t.device),
           "expert": torch.argsort(e * big + row0),
           "serpentine": torch.argsort((last * n_e + snake) * big + row0)}  # fmt: skip
    for b in bands:
        key = ((e // b + last) * (int(e.max()) + 1) + e) * big + row0
        out[f"band{b}"] = torch.argsort(key)
    return out


def main() -> int:
    from interlace.bench import moe as bm
    from interlace.ops.moe import _gemm, routing

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--bands", nargs="*", type=int, default=[2, 4, 8])
    p.add_argument("--chunks", nargs="*", type=int, default=[256, 512, 1024])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--shapes", nargs="*", type=int, help="indices into bench moe's SHAPES")
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cg = _gemm.GPU_CONFIGS["gather"]
    max_chunk = routing.MAX_CHUNK
    print("case | route us per chunk | gather GEMM ms per order (gmm)")
    shapes = [bm.SHAPES[i] for i in args.shapes] if args.shapes else bm.SHAPES
    for hidden, inter, experts, k in shapes:
        for kind in ("balanced", "zipf"):
            pb = bm._Problem(hidden, inter, experts, k, args.world, kind, gen, dev, args.iters)
            route_us = []
            for c in args.chunks:
                routing.MAX_CHUNK = c
                try:
                    _, route = pb.routing(cg)
                    route_us.append(f"{c}:{bm.graph_ms(route, args.iters) * 1e3:.1f}")
                finally:
                    routing.MAX_CHUNK = max_chunk
            rt, _ = pb.routing(cg)
            n = int(rt.tile_count[0])
            table = rt.tiles[:n, :4].clone()  # (the row-order column stays)
            h = torch.empty(rt.rows, pb.i_loc, dtype=torch.bfloat16, device=dev)
            gemm, _ = pb.gather_gemm(rt, cg, h)

            g_ms = []
            for name, perm in _orders(table, args.bands).items():
                rt.tiles[:n, :4] = table[perm]
                h.fill_(float("nan"))
                gemm()
                torch.cuda.synchronize()
                tok = rt.token_ids[: int(rt.offsets[-1])]
                got = h[: tok.shape[0]][tok >= 0].float()
                err = float((got - pb.h_ref.float()).norm() / pb.h_ref.float().norm())
                assert err < 1e-2, (name, err)
                g_ms.append(f"{name}:{bm.graph_ms(gemm, args.iters):.4f}")
            print(f"H{hidden} I{inter} E{experts} k{k} {kind} | {' '.join(route_us)} | "
                  f"{' '.join(g_ms)} ({pb.t_gmm1:.4f})",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
