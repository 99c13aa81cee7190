"""Whether GEMM+RS / GEMM+AR ``fused`` shortens its reduce tail by reducing its own chunks
in rounds (``ce_fused``'s all-reduce order, ``gemm_rs.ce_fused.gather_order``: round ``j``
holds every peer's ``j``-th chunk, this rank's own ``j``-th chunk follows round ``j + 1``)
instead of all at the end: rank 0 of W with its waits met, each layout at 1, 2 and 4 chunks
per owner, checked against float32, CUDA-graph replays timed interleaved with cuBLAS
(``paired_median_ms``). Only the last own chunk's reduction is then a tail; the others'
epilogues run beside the peers' chunks' main loops.

    python benchmarks/probes/fused_rounds.py [--worlds 4 8] [--ms 2048 8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from interlace.bench.dense import MODELS, model_shape
from interlace.bench.kernels import against_cublas
from interlace.ops.gemm_rs.ce_fused import gather_order
from interlace.testing import emulated
from interlace.testing.emulated import Emulated

_LAST = emulated.fused_segments


def _in_rounds(world, rank, *args, **kw):
    """``fused_segments`` reordered as ``gather_order`` orders chunks."""
    segments = _LAST(world, rank, *args, **kw)

    class _C:  # the chunk fields ``gather_order`` reads
        def __init__(self, s):
            self.owner, self.lo, self.seg = s.owner, s.row0, s

    return [c.seg for c in gather_order([_C(s) for s in segments], rank, world)]


def build(w, m, n, k, mode, split, rounds, dev):
    emulated.fused_segments = _in_rounds if rounds else _LAST
    try:
        return Emulated(w, 0, m, n, k, mode, split, device=dev)
    finally:
        emulated.fused_segments = _LAST


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--ms", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    names = [f"{'rounds' if r else 'last'}{s}" for s in args.splits for r in (False, True)]
    print(f"{torch.cuda.get_device_name()}: t / t_cublas per layout (own chunks last / in "
          f"rounds, chunks per owner); default = the op's split")  # fmt: skip
    print(
        f"{'mode':9} {'model':11} {'M':>5} {'W':>2} {'dflt':>5} "
        + " ".join(f"{x:>8}" for x in names)
    )
    for mode in ("rs_fused", "ar_fused"):
        op = "gemm_rs" if mode == "rs_fused" else "gemm_ar"
        for model in MODELS:
            for m in args.ms:
                for w in args.worlds:
                    s = model_shape(op, model, m, w)
                    kern, errs = {}, {}
                    for split in args.splits:
                        for r in (False, True):
                            key = f"{'rounds' if r else 'last'}{split}"
                            kern[key] = build(w, s.M, s.N, s.K, mode, split, r, dev)
                            errs[key] = kern[key].check()
                    t_ref, ratio = against_cublas({x: kern[x] for x in names}, args.iters)
                    row = dict(mode=mode, model=model, M=s.M, N=s.N, K=s.K, as_world=w,
                               t_cublas_ms=t_ref, x_cublas=ratio, rel_err=errs,
                               default_split=emulated.op_split(mode, w))  # fmt: skip
                    rows.append(row)
                    print(f"{mode:9} {model:11} {s.M:5} {w:2} {row['default_split']:5} "
                          + " ".join(f"{ratio[x]:8.3f}" for x in names)
                          + f"  err {max(errs.values()):.2e}", flush=True)  # fmt: skip
                    del kern
                    torch.cuda.empty_cache()
    for mode in ("rs_fused", "ar_fused"):
        for w in args.worlds:
            rs = [r for r in rows if r["mode"] == mode and r["as_world"] == w]
            cells = []
            for x in names:
                g = statistics.geometric_mean(r["x_cublas"][x] for r in rs)
                cells.append(f"{x} {g:.3f} (worst {max(r['x_cublas'][x] for r in rs):.3f})")
            print(f"{mode} W {w} geomean x cuBLAS: " + ", ".join(cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
