"""PNG figures of a results file, one per op, drawn beside the JSON.

Each figure shows, per measured shape, time over the yardstick the op is judged by:

- one-GPU kernel records (``t_ref_ms``): kernel time / the library a user would call
  (cuBLAS, torch._grouped_mm, SDPA), per strategy;
- several-GPU op records (``t_bound_ms``, or ``t_gemm_ms`` and ``t_comm_ms``): time /
  bound, where bound = max(T_gemm, T_comm), for each strategy and the ``none`` / torch
  baselines;
- several-GPU attention (``t_kernel_ms``): time / this rank's kernels alone with their
  waits met, for ``fused``, ``ring`` and ``none``;
- several-GPU model records (``t_torch_tp_ms``): step time / torch TP, for interlace
  (eager and compiled) and torch's async TP;
- collectives and EP (``t_nccl_ms``): time / NCCL; otherwise ``t_none_ms``: time / none;
- host-cost records (``host_us``): microseconds of host time per eager call.

Lower is better everywhere; a dashed line marks 1.0. ``python -m interlace plot FILE.json``
draws them again from any results file.
"""

from __future__ import annotations

import json
import os

#: Fields that name a shape in a bar's label, in this order.
LABEL_FIELDS = (
    "model", "M", "N", "K", "S", "H", "I", "E", "topk", "routing", "batch", "heads", "kv_heads",
    "d", "causal", "kv_len", "tokens", "hidden", "mode", "bytes_per_rank", "as_world", "train",
)  # fmt: skip


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "plots need matplotlib: pip install 'interlace[plot]' (or pip install matplotlib)"
        ) from exc
    return plt


def _label(rec: dict) -> str:
    parts = []
    for k in LABEL_FIELDS:
        v = rec.get(k)
        if v is None:
            continue
        parts.append(str(v) if k in ("model", "routing", "mode") else f"{k}={v}")
    return " ".join(parts)


def _series(records: list[dict], host: bool = False) -> tuple[str, dict[str, dict[str, float]]]:
    """(y-axis title, {series name: {shape label: value}}) for one op's records: with
    ``host``, their host times; else their times over the first yardstick they carry."""
    out: dict[str, dict[str, float]] = {}

    def put(name, label, value):
        if value is not None:
            out.setdefault(name, {})[label] = value

    def ratios(key, pairs, title):
        for r in records:
            if r.get(key):
                for name, field in pairs(r):
                    put(name, _label(r), r.get(field) and r[field] / r[key])
        return title, out

    if host:
        for r in records:
            put(str(r.get("strategy")), _label(r), r.get("host_us"))
        return "host time of one eager call (us)", out
    if any(r.get("t_ref_ms") for r in records):
        refs = sorted({str(r.get("ref", "reference")) for r in records})
        return ratios("t_ref_ms", lambda r: [(str(r.get("strategy")), "t_ms")],
                      f"time / {', '.join(refs)} (same per-rank problem)")  # fmt: skip
    if any(r.get("t_bound_ms") or (r.get("t_gemm_ms") and r.get("t_comm_ms")) for r in records):
        for r in records:
            bound = r.get("t_bound_ms") or (
                r.get("t_gemm_ms") and r.get("t_comm_ms") and max(r["t_gemm_ms"], r["t_comm_ms"])
            )
            if bound:
                label = _label(r)
                put(str(r.get("strategy")), label, r.get("t_ms") and r["t_ms"] / bound)
                put("none (baseline)", label, r.get("t_none_ms") and r["t_none_ms"] / bound)
                put("torch fused", label, r.get("t_torch_ms") and r["t_torch_ms"] / bound)
        return "time / bound (max(T_gemm, T_comm) per half)", out
    if any(r.get("t_kernel_ms") for r in records):
        return ratios(
            "t_kernel_ms",
            lambda r: [(str(r.get("strategy")), "t_ms"), ("ring", "t_ring_ms"),
                       ("none (baseline)", "t_none_ms")],
            "time / this rank's kernels alone, waits met (1 / (W x one-GPU rate))",
        )  # fmt: skip
    if any(r.get("t_torch_tp_ms") for r in records):
        return ratios(
            "t_torch_tp_ms",
            lambda r: [("interlace", "t_ms"), ("interlace compiled", "t_interlace_compiled_ms"),
                       ("torch async TP", "t_torch_async_tp_ms")],
            "step time / torch TP (DTensor)",
        )  # fmt: skip
    if any(r.get("t_nccl_ms") for r in records):
        return ratios("t_nccl_ms", lambda r: [(str(r.get("strategy")), "t_ms")], "time / NCCL")
    if any(r.get("t_none_ms") for r in records):
        return ratios(
            "t_none_ms", lambda r: [(str(r.get("strategy")), "t_ms")], "time / none (baseline)"
        )
    return "", {}


def plot_file(path: str, quiet: bool = False) -> list[str]:
    """Draw one PNG per op of the results file at ``path``; returns the files written.
    ``quiet``: print one line instead of raising when matplotlib is missing."""
    try:
        plt = _pyplot()
    except PlotUnavailable as exc:
        if not quiet:
            raise
        print(f"no plots: {exc}")
        return []
    with open(path) as f:
        doc = json.load(f)
    by_op: dict[str, list[dict]] = {}
    for rec in doc.get("records", []):
        # host times get their own figure (``<op>-host``), times theirs
        op = rec.get("op", "?")
        if rec.get("t_ms") is not None:
            by_op.setdefault(op, []).append(rec)
        if rec.get("host_us") is not None:
            by_op.setdefault(op + "-host", []).append(rec)
    written = []
    stem = os.path.splitext(path)[0]
    for op, records in sorted(by_op.items()):
        ylabel, series = _series(records, host=op.endswith("-host"))
        if not series:
            continue
        labels = sorted({lab for s in series.values() for lab in s})
        width = 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(labels) * len(series) + 2), 4.5))
        for i, (name, values) in enumerate(sorted(series.items())):
            xs = [j + i * width for j, lab in enumerate(labels) if lab in values]
            ys = [values[lab] for lab in labels if lab in values]
            ax.bar(xs, ys, width, label=name)
        if not ylabel.startswith("host"):
            ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        world = doc.get("world_size")
        ax.set_title(f"{op} on {doc.get('device')} (world {world}, {doc.get('date')})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        out = f"{stem}-{op}.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written
