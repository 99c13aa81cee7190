"""GEMM+RS / GEMM+AR ``fused`` with the own rows reduced by every program after the tiles
(the library's layout) against the same kernel reducing them in the own tiles' epilogues
(``Emulated(spread=False)``): rank 0 of W, every wait met, each checked against float32,
then both and cuBLAS captured in CUDA graphs and their replays timed interleaved
(``paired_median_ms``), as ``bench kernels`` times them.

    python benchmarks/probes/spread_ab.py [--worlds 4 8] [--ms 2048 8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from interlace.bench.dense import MODELS, OTHER_MODELS, model_shape
from interlace.bench.timing import graph_of, paired_median_ms
from interlace.testing.emulated import Emulated


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--ms", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--modes", nargs="+", default=["rs_fused", "ar_fused"])
    p.add_argument("--models", nargs="+", default=list(MODELS) + list(OTHER_MODELS))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}: t / t_cublas, A = own tiles reduce, B = spread")
    print(f"{'mode':9} {'model':11} {'M':>5} {'W':>2} {'A':>6} {'B':>6} {'B/A':>6} "
          f"{'err A':>8} {'err B':>8}")  # fmt: skip
    for mode in args.modes:
        op = "gemm_rs" if mode == "rs_fused" else "gemm_ar"
        for model in args.models:
            for m in args.ms:
                for w in args.worlds:
                    s = model_shape(op, model, m, w)
                    kern = {v: Emulated(w, 0, s.M, s.N, s.K, mode, device=dev, spread=v)
                            for v in (False, True)}  # fmt: skip
                    errs = {v: k.check() for v, k in kern.items()}
                    a, b = kern[True].a, kern[True].b
                    ref_out = torch.empty(s.M, s.N, device=dev, dtype=a.dtype)
                    fns = [graph_of(None, lambda a=a, b=b, o=ref_out: torch.matmul(a, b, out=o))]
                    fns += [graph_of(None, kern[v]) for v in (False, True)]
                    t_ref, t_a, t_b = paired_median_ms(None, [g.replay for g in fns], args.iters)
                    for k in kern.values():
                        if int(k.err[0]):
                            raise RuntimeError(f"a wait timed out: {k.err.tolist()}")
                    row = dict(mode=mode, model=model, M=s.M, N=s.N, K=s.K, as_world=w,
                               t_cublas_ms=t_ref, t_a_ms=t_a, t_b_ms=t_b,
                               err_a=errs[False], err_b=errs[True])  # fmt: skip
                    rows.append(row)
                    print(f"{mode:9} {model:11} {s.M:5} {w:2} {t_a / t_ref:6.3f} "
                          f"{t_b / t_ref:6.3f} {t_b / t_a:6.3f} {errs[False]:8.2e} "
                          f"{errs[True]:8.2e}", flush=True)  # fmt: skip
                    del kern, fns
                    torch.cuda.empty_cache()
    for mode in args.modes:
        for w in args.worlds:
            rs = [r for r in rows if r["mode"] == mode and r["as_world"] == w]
            if rs:
                g = math.exp(sum(math.log(r["t_b_ms"] / r["t_a_ms"]) for r in rs) / len(rs))
                worst = max(r["t_b_ms"] / r["t_cublas_ms"] for r in rs)
                print(f"{mode} W {w}: B / A geomean {g:.3f}, B worst {worst:.3f} x cuBLAS")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
