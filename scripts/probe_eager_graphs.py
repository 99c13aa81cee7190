"""What do graph-backed eager calls (``eager_graphs=True``) save? On a world of GPU ranks
(one GPU is enough to see the host side: ``--world-size 1``), for the overlapped GEMMs at
the public shapes of TP ``--tp``: each op called eagerly as the benchmark times it (device
idle, ranks aligned, CUDA events around one call; the two contexts' calls interleaved),
with and without ``eager_graphs``, plus the host time of one aligned call and the same
op replayed from a CUDA graph the user captured. Every result is checked against the
op without graphs first.

    python scripts/probe_eager_graphs.py [--world-size 1] [--tp 4] [--json F] [--profile]
"""

from __future__ import annotations

import argparse
import json

import torch
from _probe import host_us, run_on_world

import interlace
from interlace.bench.dense import MODELS, model_shape
from interlace.bench.timing import graph_of, max_over_ranks, median_ms, paired_median_ms

CASES = [
    ("ag_gemm", "fused"), ("gemm_rs", "ce_fused"), ("gemm_ar", "ce_fused"),
    ("gemm_ar", "signal_reorder"),
]  # fmt: skip
CLASSES = {"ag_gemm": interlace.AGGemm, "gemm_rs": interlace.GemmRS, "gemm_ar": interlace.GemmAR}


def _row(group, op, strategy, model, m, tp):
    w, dev = group.world_size, group.device
    shape = model_shape(op, model, m, tp)  # the per-rank GEMM of TP ``tp``
    rows = shape.M // w if op == "ag_gemm" else shape.M
    torch.manual_seed(group.rank)
    a = torch.randn(rows, shape.K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(shape.K, shape.N, device=dev, dtype=torch.bfloat16) * 0.05
    cls = CLASSES[op]
    plain = cls(group, shape.M, shape.N, shape.K, strategy=strategy, eager_graphs=False)
    graphed = cls(group, shape.M, shape.N, shape.K, strategy=strategy, eager_graphs=True)
    try:
        ref = plain(a, b).float().clone()
        for _ in range(4):  # each kind of call: eager, captured, then replayed
            got = graphed(a, b)
        torch.cuda.synchronize()
        err = float((got.float() - ref).norm() / ref.norm())
        owner = getattr(graphed, "_signal_reorder", None) or graphed  # where the graphs live
        replayed = sum(not isinstance(g, str) for g in owner._graphs.values())
        t_plain, t_graphs = paired_median_ms(group, [lambda: plain(a, b), lambda: graphed(a, b)])
        graph = graph_of(group, lambda: plain(a, b))
        t_user_graph = median_ms(group, graph.replay)
        del graph
        row = dict(
            t_eager_ms=t_plain, t_eager_graphs_ms=t_graphs, t_user_graph_ms=t_user_graph,
            host_eager_us=host_us(lambda: plain(a, b), group),
            host_eager_graphs_us=host_us(lambda: graphed(a, b), group),
            rel_err=err, graphs_replayed=float(replayed),
        )  # fmt: skip
        row = max_over_ranks(group, row)
    finally:
        plain.close()
        graphed.close()
    return dict(op=op, strategy=strategy, model=model, M=shape.M, N=shape.N, K=shape.K, **row)


def _profile(group, op, strategy, model, m, tp, calls=300) -> str:
    """cProfile of ``calls`` graph-backed eager calls (after warm-up): where the host time
    before the graph launch goes."""
    import cProfile
    import io
    import pstats

    w, dev = group.world_size, group.device
    shape = model_shape(op, model, m, tp)
    rows = shape.M // w if op == "ag_gemm" else shape.M
    a = torch.randn(rows, shape.K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(shape.K, shape.N, device=dev, dtype=torch.bfloat16) * 0.05
    ctx = CLASSES[op](group, shape.M, shape.N, shape.K, strategy=strategy, eager_graphs=True)
    try:
        for _ in range(6):
            ctx(a, b)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            ctx(a, b)
        prof.disable()
        torch.cuda.synchronize()
    finally:
        ctx.close()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return f"== {op} {strategy} {model} M {m}, {calls} calls\n" + text.getvalue()


def body(group, tp, ms, models, profile):
    if profile:
        return [_profile(group, op, strategy, models[0], ms[0], tp) for op, strategy in CASES]
    return [
        _row(group, op, strategy, model, m, tp)
        for op, strategy in CASES
        for m in ms
        for model in models
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--tp", type=int, default=4, help="the shape table's TP (per-rank GEMMs)")
    p.add_argument("--ms", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="cProfile the graph-backed calls")
    args = p.parse_args()
    rows = run_on_world(body, args.world_size, args.tp, args.ms, args.models, args.profile)[0]
    if args.profile:
        print("\n".join(rows))
        return
    meta = dict(
        device=torch.cuda.get_device_name(), world_size=args.world_size, tp_shapes=args.tp,
        torch=torch.__version__, rows=rows,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    print(f"eager calls with and without eager_graphs, {args.world_size} rank(s), TP {args.tp} "
          "shapes, ms (host: µs of an aligned call)")  # fmt: skip
    cols = ("t_eager_ms", "t_eager_graphs_ms", "t_user_graph_ms", "host_eager_us",
            "host_eager_graphs_us", "rel_err", "graphs_replayed")  # fmt: skip
    print(f"{'op':9s}{'strategy':16s}{'model':12s}{'M':>6s}" + "".join(f"{c:>22s}" for c in cols))
    for r in rows:
        head = f"{r['op']:9s}{r['strategy']:16s}{r['model']:12s}{r['M']:6d}"
        print(head + "".join(f"{r[c]:22.4g}" for c in cols))


if __name__ == "__main__":
    main()
