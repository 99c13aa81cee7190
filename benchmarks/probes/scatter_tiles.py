"""The GEMM+RS / GEMM+AR kernels' tile shape: the op's (``segment_gemm.scatter_config``:
128-column tiles widened to 256 with 8 warps wherever N allows) against 128 x 128 tiles
(4 and 8 warps), each given room for the epilogue (``with_epilogue_room``). Narrow tiles
halve each reduce tile's epilogue (the tail on the programs that reduce) and double the
tiles. Rank 0 of W with its waits met, each checked against float32, CUDA-graph replays
timed interleaved with cuBLAS (``paired_median_ms``).

    python benchmarks/probes/scatter_tiles.py [--worlds 4 8] [--ms 2048 8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from interlace.bench.dense import MODELS, OTHER_MODELS, model_shape
from interlace.bench.kernels import against_cublas
from interlace.ops.segment_gemm import GemmConfig
from interlace.testing.emulated import Emulated

CONFIGS = {
    "op": None,
    "128x128w4": GemmConfig(block_n=128, num_warps=4, num_stages=5),
    "128x128w8": GemmConfig(block_n=128, num_warps=8, num_stages=4),
}
MODES = {"rs_fused": "gemm_rs", "ar_fused": "gemm_ar", "rs": "gemm_rs", "ar": "gemm_ar"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--ms", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--models", nargs="+", default=list(MODELS) + list(OTHER_MODELS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}: t / t_cublas per tile config")
    print(f"{'mode':9} {'model':11} {'M':>5} {'W':>2} " + " ".join(f"{c:>10}" for c in CONFIGS))
    for mode in args.modes:
        for model in args.models:
            for m in args.ms:
                for w in args.worlds:
                    s = model_shape(MODES[mode], model, m, w)
                    kern = {c: Emulated(w, 0, s.M, s.N, s.K, mode, device=dev, one_loop=None,
                                        cfg=cfg) for c, cfg in CONFIGS.items()}  # fmt: skip
                    errs = {c: k.check() for c, k in kern.items()}
                    t_ref, ratio = against_cublas(kern, args.iters)
                    shape = dict(mode=mode, model=model, M=s.M, N=s.N, K=s.K, as_world=w)
                    rows.append(dict(shape, t_cublas_ms=t_ref, x_cublas=ratio, rel_err=errs))
                    cells = " ".join(f"{ratio[c]:10.3f}" for c in CONFIGS)
                    print(f"{mode:9} {model:11} {s.M:5} {w:2} {cells}  err "
                          f"{max(errs.values()):.2e}", flush=True)  # fmt: skip
                    del kern
                    torch.cuda.empty_cache()
    for mode in args.modes:
        for w in args.worlds:
            for m in args.ms:
                rs = [r for r in rows if (r["mode"], r["as_world"], r["M"]) == (mode, w, m)]
                if not rs:
                    continue
                cells = ", ".join(
                    f"{c} {statistics.geometric_mean(r['x_cublas'][c] for r in rs):.3f}"
                    for c in CONFIGS
                )
                print(f"{mode} W {w} M {m} geomean x cuBLAS: {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
