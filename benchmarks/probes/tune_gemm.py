"""Tune the segment GEMM's tile configs against cuBLAS on one GPU, on the per-rank GEMMs of
the public shape table (docs/design.md, "Measuring") for the given world sizes.

    python benchmarks/probes/tune_gemm.py --worlds 2 4 --out DIR [--emit]

Prints, per shape, cuBLAS time and each config's time and writes ``gemm_tuning.json``;
``--emit`` writes the best configs into ``interlace/ops/configs/gemm.json`` (what
``interlace.ops.segment_gemm.gemm_config`` reads). Correctness of every config is checked
against a float32 reference first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch

from interlace.bench.timing import pipelined_median_ms
from interlace.ops.configs import GEMM_FIELDS, write_gemm_configs
from interlace.ops.segment_gemm import GemmConfig, matmul

MODELS = {"llama-7b": (4096, 11008), "llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672)}


def shapes(worlds):
    seen = []
    for w in worlds:
        for (h, i), m in itertools.product(MODELS.values(), (2048, 8192)):
            for mnk in ((m, i // w, h), (m, h, i // w)):  # AG+GEMM, GEMM+RS/AR
                if mnk not in seen:
                    seen.append(mnk)
    return seen


def time_ms(fn):
    """Back-to-back calls, as in a training loop (one GPU: no barrier)."""
    return pipelined_median_ms(None, fn, iters=30, warmup=5)


CANDIDATES = [
    GemmConfig(block_n=256, num_stages=3),
    GemmConfig(block_n=128, num_stages=4),
    GemmConfig(block_n=128, num_stages=5, num_warps=4),
    GemmConfig(block_n=256, block_k=64, group_m=16, num_stages=3),
    GemmConfig(block_n=256, num_stages=4, subtile=True),
    GemmConfig(block_n=256, num_stages=4, group_m=16, subtile=True),
    GemmConfig(block_n=128, num_warps=4, num_stages=6),
    GemmConfig(block_n=128, num_warps=4, num_stages=5, group_m=16),
]


def emit_table(results, device: str):
    """Write the best config per shape (where it is not the default) to
    ``interlace/ops/configs/gemm.json``."""
    table = {}
    for r in results:
        best = r["best"]
        if best and best["config"] != "default":
            cfg = CANDIDATES[[str(c) for c in CANDIDATES].index(best["config"])]
            row = {f: getattr(cfg, f) for f in GEMM_FIELDS}
            table[(r["M"], r["N"], r["K"])] = row | ({"subtile": True} if cfg.subtile else {})
    about = (
        f"Best segment-GEMM tile config per (m, n, k), measured on one {device} by "
        "benchmarks/probes/tune_gemm.py (regenerate with its --emit). Read by "
        "interlace.ops.configs."
    )
    print(f"wrote {write_gemm_configs(table, about)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--emit", action="store_true", help="write the best configs to ops/configs/gemm.json"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for m, n, k in shapes(args.worlds):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        t_cublas = time_ms(lambda a=a, b=b: torch.matmul(a, b))
        row = {"M": m, "N": n, "K": k, "t_cublas_ms": t_cublas, "configs": []}
        for cfg in CANDIDATES + [None]:
            label = "default" if cfg is None else str(cfg)
            try:
                c = matmul(a, b, cfg=cfg)
                err = float((c.float() - ref).norm() / ref.norm())
                t = time_ms(lambda a=a, b=b, cfg=cfg: matmul(a, b, cfg=cfg))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile
                row["configs"].append({"config": label, "error": repr(exc)[:200]})
                continue
            row["configs"].append({"config": label, "t_ms": t, "rel_err": err})
        ok = [c for c in row["configs"] if "t_ms" in c and c["rel_err"] < 1e-2]
        best = min(ok, key=lambda c: c["t_ms"]) if ok else None
        row["best"] = best
        default = [c for c in ok if c["config"] == "default"]
        row["default_x_cublas"] = t_cublas / default[0]["t_ms"] if default else None
        results.append(row)
        print(
            f"{m:5d} {n:6d} {k:6d} cublas {t_cublas:.3f} ms  default "
            f"{default[0]['t_ms'] if default else float('nan'):.3f}  best "
            f"{best['t_ms'] if best else float('nan'):.3f} ({best['config'] if best else '-'})"
            f"  best x cublas {t_cublas / best['t_ms'] if best else 0:.3f}",
            flush=True,
        )
        del a, b, ref
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gemm_tuning.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    if args.emit:
        emit_table(results, torch.cuda.get_device_name())
    xs = [r["t_cublas_ms"] / r["best"]["t_ms"] for r in results if r["best"]]
    ds = [r["default_x_cublas"] for r in results if r["default_x_cublas"]]
    gm = lambda v: statistics.geometric_mean(v) if v else float("nan")  # noqa: E731
    print(f"geomean best x cuBLAS {gm(xs):.3f}; default x cuBLAS {gm(ds):.3f}")
    for c in CANDIDATES:
        per = [
            r["t_cublas_ms"] / x["t_ms"]
            for r in results
            for x in r["configs"]
            if x["config"] == str(c) and "t_ms" in x
        ]
        print(f"{gm(per):.3f}  {c}")


if __name__ == "__main__":
    main()
