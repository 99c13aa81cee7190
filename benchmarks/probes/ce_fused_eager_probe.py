"""Two ranks (two GPUs, or sharing one): which eager-call pattern makes GEMM+RS / GEMM+AR
``ce_fused`` time out, as ``python -m interlace bench host`` saw at LLaMA-3-8B, M 2048?

Per variant, a fresh context and ``--calls`` eager calls with fresh inputs; after each
call (``sync``) or after all of them, ``check()`` and the relative error of every call's
result against a float32 reference. One line per variant: ``ok`` with the worst error, or
the call at which the first error was raised and the error. Variants:

* ``graphs-sync``: eager calls replayed from CUDA graphs (the default), device and host
  synchronised between calls;
* ``graphs-b2b``: the same, back to back (the benchmark's warm-up);
* ``plain-b2b``: ``eager_graphs=False``, back to back;
* ``graphs-sync-fused``: the ``fused`` strategy, as a control.

    python benchmarks/probes/ce_fused_eager_probe.py [--op gemm_rs] [--m 2048]
"""

from __future__ import annotations

import argparse
import sys

import torch

VARIANTS = {
    "graphs-sync": ("ce_fused", True, True),
    "graphs-b2b": ("ce_fused", True, False),
    "plain-sync": ("ce_fused", False, True),
    "plain-b2b": ("ce_fused", False, False),
    "graphs-sync-fused": ("fused", True, True),
    # the GEMM with one loop per segment instead of the one-loop mode
    "plain-sync-noloop": ("ce_fused", False, True),
}


def _diagnose(ctx, m, n) -> str:
    """The plan of every buffer set (config, one-loop mode, each copy's counter slot and
    the count it waits for) and the signal slots' values now."""
    parts = []
    for key, plan in ctx._plans.items():
        if key[0] != "ce_fused":
            continue
        lead = None if plan.one_loop is None else plan.one_loop.lead_tiles
        copies = [(c.done, c.tiles, c.slot) for st in plan.steps for c in st.copies]
        parts.append(f"set {plan.set}: cfg {plan.cfg} one_loop lead {lead} copies "
                     f"(done slot, tiles, flag slot) {copies}")  # fmt: skip
    torch.cuda.synchronize()
    for region in ("ce_done", "ce_sets", "go"):
        if region in ctx.pad.regions:
            vals = ctx.pad.local(region).tolist()
            parts.append(f"{region} @{ctx.pad.offset(region)}: {vals[:40]}")
    return "\n    ".join(parts)


def _body(group, op, m, n, k, calls, variants):
    import interlace
    from interlace.errors import InterlaceError

    cls = {"gemm_rs": interlace.GemmRS, "gemm_ar": interlace.GemmAR}[op]
    w, r, dev = group.world_size, group.rank, group.device
    lines = []
    for name in variants:
        strategy, graphs, sync = VARIANTS[name]
        gen = torch.Generator(device="cpu").manual_seed(7)
        inputs = [(torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen) / k**0.5)
                  for _ in range(calls * w)]  # fmt: skip
        outs, failed = [], None
        ctx = cls(group, max_m=m, n=n, k=k, strategy=strategy, eager_graphs=graphs,
                  max_spins=3_000_000)  # fmt: skip
        if name.endswith("noloop"):
            ctx.ONE_LOOP_CE_FUSED = False
        try:
            for i in range(calls):
                a, b = inputs[i * w + r]
                y = ctx(a.to(dev, torch.bfloat16), b.to(dev, torch.bfloat16))
                outs.append(y.clone())  # (GEMM+AR returns a view valid until the next call)
                if sync:
                    ctx.check()
                    group.host_barrier()
            ctx.check()
        except InterlaceError as e:
            failed = f"call {len(outs)}: {type(e).__name__}: {e}"
            try:
                failed += "\n    " + _diagnose(ctx, m, n)
            except Exception as d:  # noqa: BLE001 - a diagnostic
                failed += f" (diagnosis failed: {d})"
        group.host_barrier()
        worst = 0.0
        if failed is None:
            for i, y in enumerate(outs):
                total = sum(inputs[i * w + q][0] @ inputs[i * w + q][1] for q in range(w))
                ref = total[r * (m // w) : (r + 1) * (m // w)] if op == "gemm_rs" else total
                err = float((y.float().cpu() - ref).norm() / ref.norm())
                worst = max(worst, err)
        try:
            ctx.close()
        except Exception as e:  # noqa: BLE001 - reported, the probe goes on
            failed = (failed or "") + f" (close: {type(e).__name__})"
        graphs_on = getattr(ctx, "eager_graphs", None)
        lines.append(
            f"{name:18s} eager_graphs={graphs_on} "
            + (f"FAILED {failed}" if failed else f"ok, worst rel err {worst:.1e}")
        )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gemm_rs", choices=["gemm_rs", "gemm_ar"])
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=14336 // 2)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    from interlace.testing import World

    share = torch.cuda.device_count() < 2
    with World(2, "cuda", share_device=share, timeout=240) as world:
        out = world.run(_body, args.op, args.m, args.n, args.k, args.calls,
                        args.variants.split(","))  # fmt: skip
    for r, lines in enumerate(out):
        for line in lines:
            print(f"{args.op} rank {r} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
