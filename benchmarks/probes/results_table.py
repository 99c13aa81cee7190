"""Markdown tables of a results file's dense-op records (for the README); ``--ratios``:
instead, every strategy's T / bound per shape, eager and graph (a short table for a run's
log).

python benchmarks/probes/results_table.py benchmarks/results/2026-11-22-h200-w2.json [--ratios]
"""

from __future__ import annotations

import json
import sys

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def dense_table(records: list[dict]) -> str:
    by = {}
    for r in records:
        if r.get("op") in OPS:
            by.setdefault((r["op"], r["model"], r["M"]), {})[r["strategy"]] = r
    head = (
        "| op | model | M | N | K | cuBLAS | NCCL | bound | cuBLAS+NCCL | torch fused | "
        "auto (ran) | auto / bound | auto graph | graph / bound | fastest eager |"
    )
    lines = [head, "|" + " --- |" * 3 + " ---: |" * 12]
    for (op, model, m), s in sorted(by.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1:])):
        auto, fused = s.get("auto"), s.get("fused")
        ref = auto or fused
        bound = max(ref["t_gemm_ms"], ref["t_comm_ms"])
        eager = {  # strategies timed in the same run as ``ref`` (its baselines)
            k: v["t_ms"]
            for k, v in s.items()
            if v.get("t_ms") and k != "auto" and v.get("run") == ref.get("run")
        }
        best = min(eager, key=eager.get) if eager else "-"
        g = auto.get("t_graph_ms") or (fused.get("t_graph_ms") if fused else None)
        lines.append(
            f"| {op} | {model} | {m} | {ref['N']} | {ref['K']} | {_f(ref['t_gemm_ms'])} | "
            f"{_f(ref['t_comm_ms'])} | {_f(bound)} | {_f(ref['t_none_ms'])} | "
            f"{_f(ref.get('t_torch_ms'))} | {_f(auto['t_ms'])} ({auto.get('last_strategy')}) | "
            f"{_f(auto['t_ms'] / bound, 2)} | {_f(g)} | {_f(g / bound if g else None, 2)} | "
            f"{best} |"
        )
    return "\n".join(lines)


def ratio_table(records: list[dict]) -> str:
    """Per (op, model, M): each strategy's eager / graph time over the bound, and its
    eager time over cuBLAS + NCCL's (``x`` the record's baseline; timed interleaved with
    the strategy in files that have ``t_none_solo_ms``)."""
    by = {}
    for r in records:
        if r.get("op") in OPS and r.get("t_gemm_ms") and r.get("t_comm_ms"):
            by.setdefault((r["op"], r["model"], r["M"]), []).append(r)
    lines = []
    for (op, model, m), rs in sorted(by.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1:])):
        bound = max(rs[0]["t_gemm_ms"], rs[0]["t_comm_ms"])
        cells = [
            f"{r['strategy']} {_f(r['t_ms'] and r['t_ms'] / bound, 2)}/"
            f"{_f(r.get('t_graph_ms') and r['t_graph_ms'] / bound, 2)}"
            f" x{_f(r['t_ms'] and r.get('t_none_ms') and r['t_ms'] / r['t_none_ms'], 2)}"
            for r in rs
        ]
        none = _f(rs[0]["t_none_ms"] / bound, 2)
        lines.append(f"{op} {model} {m} (none {none}): " + ", ".join(cells))
    return "\n".join(lines)


def main():
    data = json.load(open(sys.argv[1]))
    if "--ratios" in sys.argv:
        print(ratio_table(data["records"]))
        return
    print(f"{data['device']}, world size {data['world_size']}, torch {data['torch']}, "
          f"Triton {data['triton']}, {data['date']}\n")  # fmt: skip
    print(dense_table(data["records"]))


if __name__ == "__main__":
    main()
