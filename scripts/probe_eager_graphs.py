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


def _operands(group, op, model, m, tp):
    """``(shape, a, b)``: the per-rank GEMM of TP ``tp`` and random operands for it."""
    w, dev = group.world_size, group.device
    shape = model_shape(op, model, m, tp)
    rows = shape.M // w if op == "ag_gemm" else shape.M
    a = torch.randn(rows, shape.K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(shape.K, shape.N, device=dev, dtype=torch.bfloat16) * 0.05
    return shape, a, b


def _warm_context(group, op, strategy, shape, a, b):
    """A graph-backed context of ``op`` past its eager, captured and first replayed calls."""
    ctx = CLASSES[op](group, shape.M, shape.N, shape.K, strategy=strategy, eager_graphs=True)
    for _ in range(6):
        ctx(a, b)  # the result dropped: the next call reuses its memory
    torch.cuda.synchronize()
    return ctx


def _row(group, op, strategy, model, m, tp):
    torch.manual_seed(group.rank)
    shape, a, b = _operands(group, op, model, m, tp)
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

    shape, a, b = _operands(group, op, model, m, tp)
    ctx = _warm_context(group, op, strategy, shape, a, b)
    try:
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


def _node_types(eager_graph) -> dict[str, int]:
    """How many nodes of each CUgraphNodeType the replayed graph has."""
    import ctypes

    from interlace.runtime import graphs

    raw = eager_graph._graph.raw_cuda_graph()
    count = ctypes.c_size_t(0)
    graphs._checked("cuGraphGetNodes", raw, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    graphs._checked("cuGraphGetNodes", raw, nodes, ctypes.byref(count))
    names = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
             6: "wait_event", 7: "event_record", 8: "ext_signal", 9: "ext_wait",
             10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}  # fmt: skip
    kind, out = ctypes.c_int(), {}
    for node in nodes:
        graphs._checked("cuGraphNodeGetType", node, ctypes.byref(kind))
        name = names.get(kind.value, str(kind.value))
        out[name] = out.get(name, 0) + 1
    return out


def _breakdown(group, op, strategy, model, m, tp) -> str:
    """Host µs (device idle before each, median of 50) of a graph-backed eager call and of
    its parts: the checks, the output's allocation, the call-kind key, the graph's
    re-pointing launch, the bare ``cuGraphLaunch``, and a user's ``graph.replay()``."""
    from interlace.runtime import driver, graphs

    dev = group.device
    shape, a, b = _operands(group, op, model, m, tp)
    rows = a.shape[0]
    ctx = _warm_context(group, op, strategy, shape, a, b)
    try:
        shape_out = tuple(ctx(a, b).shape)
        eg = next(g for g in ctx._graphs.values() if not isinstance(g, str))
        outs = [torch.empty(shape_out, dtype=a.dtype, device=dev) for _ in range(2)]
        args = [(a, b, None, o if op != "gemm_ar" else None) for o in outs]
        stream = driver.current_stream(dev.index)
        user = graph_of(None, lambda: ctx(a, b))
        flip = iter(range(10**9))
        parts = {
            "call": lambda: ctx(a, b),
            "checks": lambda: ctx._check_call(a, b, None, rows),
            "empty": lambda: torch.empty(shape_out, dtype=a.dtype, device=dev),
            "key": lambda: (
                strategy,
                0,
                tuple(None if t is None else (t.shape, t.data_ptr() % 16 == 0) for t in args[0]),
            ),  # fmt: skip
            "launch": lambda: eg.launch(args[0]),
            "launch_repointed": lambda: eg.launch(args[next(flip) % 2]),
            "cuGraphLaunch": lambda: graphs._call("cuGraphLaunch", eg._exec, stream),
            "user_replay": user.replay,
            "nothing": lambda: None,
        }
        times = {name: host_us(fn, None, iters=50) for name, fn in parts.items()}
        nodes = _node_types(eg)
    finally:
        ctx.close()
    cells = "  ".join(f"{k} {v:.1f}" for k, v in times.items())
    return f"{op} {strategy} {model} M {m}: {cells}  | nodes {nodes}"


def body(group, tp, ms, models, profile, breakdown=False):
    if breakdown:
        return [
            _breakdown(group, op, strategy, models[0], m, tp)
            for op, strategy in CASES[:3]
            for m in ms
        ]
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
    p.add_argument("--breakdown", action="store_true", help="host µs of a call's parts")
    args = p.parse_args()
    rows = run_on_world(
        body, args.world_size, args.tp, args.ms, args.models, args.profile, args.breakdown
    )[0]
    if args.profile or args.breakdown:
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
