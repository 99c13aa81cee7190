"""Two variants of the segment GEMM's kernel in one process: each kernel of ``bench
kernels`` (rank 0 of W, every wait met, checked against float32) timed with the library's
launch (A) and with constexprs overridden (B, ``--set NAME=VALUE ...``, through
``segment_gemm.KERNEL_OVERRIDES``), each paired with cuBLAS on the same GEMM
(``bench.kernels.run_cases``).

Shapes: the public table's per-rank GEMMs (``bench.dense.MODELS``) at M 2048 and 8192,
W 4 and 8, unless ``--models`` / ``--ms`` / ``--worlds`` narrow them; kernels: GEMM+RS and
GEMM+AR ``fused`` and ``ce_fused`` (``--kernels`` picks by ``op:strategy``). Prints ``t /
t_cublas`` of A and B per kernel and shape and the geometric mean of B / A; ``--out FILE``
keeps the records (JSON, a ``variant`` field in each).

    python benchmarks/probes/kernel_ab.py --set PEER_LOADS=2 [--out FILE]   (one GPU)
    python benchmarks/probes/kernel_ab.py --set PEER_LOADS=2 --cpu   (tiny shapes, interpreter)
"""

from __future__ import annotations

import argparse
import json
import math


def body(group, todo, overrides: dict, iters: int, timed: bool) -> list[dict]:
    """Rank body (a one-rank world): each case as A, then B."""
    from interlace.bench.kernels import run_cases
    from interlace.ops import segment_gemm

    out = []
    for case in todo:
        for variant, extra in (("A", {}), ("B", overrides)):
            segment_gemm.KERNEL_OVERRIDES.clear()
            segment_gemm.KERNEL_OVERRIDES.update(extra)
            rec = run_cases(group, [case], iters, 5, timed)[0]
            out.append({**rec, "variant": variant, "overrides": extra})
            print("case", json.dumps(out[-1]), flush=True)  # a partial run keeps its cases
    segment_gemm.KERNEL_OVERRIDES.clear()
    return out


def parse_value(text: str):
    """An override's value: an int, a bool (true / false) or a float."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return float(text)


def main() -> int:
    import torch

    from interlace.bench.dense import MODELS, MS, model_shape
    from interlace.bench.kernels import KERNELS
    from interlace.bench.records import probe_exit
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--set", nargs="+", required=True, metavar="NAME=VALUE")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--ms", nargs="*", type=int, default=list(MS))
    p.add_argument("--worlds", nargs="*", type=int, default=[4, 8])
    p.add_argument("--kernels", nargs="*", default=None, help="op:strategy, e.g. gemm_rs:ce_fused")
    p.add_argument("--out", default=None, help="JSON file for the records")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, interpreter, no timing")
    args = p.parse_args()
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
    timed = torch.cuda.is_available() and not args.cpu
    kernels = [c for c in KERNELS if c[0] in ("gemm_rs", "gemm_ar") and c[2] is not None]
    if args.kernels:
        kernels = [c for c in kernels if f"{c[0]}:{c[1]}" in args.kernels]
    if timed:
        todo = []
        for model in args.models:
            for m in args.ms:
                for w in args.worlds:
                    for op, strategy, mode in kernels:
                        s = model_shape(op, model, m, w)
                        todo.append((op, strategy, mode, model, s.M, s.N, s.K, w))
    else:
        todo = [(op, s, mode, "tiny", 37 * w, 48, 32, w) for op, s, mode in kernels for w in (2, 4)]
    with World(1, "cuda" if timed else "cpu", timeout=3600) as world:
        records = world.run(body, todo, overrides, args.iters, timed)[0]
    print(f"B: {overrides}")
    print(f"{'op':>8} {'strategy':>9} {'model':>11} {'M':>5} {'W':>2} {'A':>6} {'B':>6} ok")
    gains = []
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for a, b in zip(records[::2], records[1::2]):
        ra, rb = (r["t_ms"] / r["t_ref_ms"] if r["t_ms"] else None for r in (a, b))
        if ra and rb:
            gains.append(b["t_ms"] / a["t_ms"])
        ok = "yes" if a["ok"] and b["ok"] else "NO"
        print(f"{a['op']:>8} {a['strategy']:>9} {a['model']:>11} {a['M']:>5} "
              f"{a['as_world']:>2} {fmt(ra):>6} {fmt(rb):>6} {ok}")  # fmt: skip
    if gains:
        print(f"B / A geomean {math.exp(sum(map(math.log, gains)) / len(gains)):.4f}")
    return probe_exit(records, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
