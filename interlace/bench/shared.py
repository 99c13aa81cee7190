"""``python -m interlace bench shared``: every dense op's overlapped strategies checked
against a float32 reference in worlds whose ranks share one GPU (``World(share_device=
True)``, W = 2 and 4): the same kernels, copies and signals as on separate GPUs, run
concurrently on one device. Correctness only: ranks on one GPU say nothing about speed.

Each (op, strategy) is called on a ragged shape (rows per rank and N, K off every tile
size) and a tile-aligned one (the kernel's one-loop mode), twice on one context, into a
poisoned ``out``. The reference gathers and sums through host copies (the ranks' process
group is gloo). ``none`` and ``signal_reorder`` run ``torch.distributed`` collectives on
GPU tensors, which a shared world cannot, and are left out. Prints one line per op and
world size.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

#: op -> (context class name, the strategies checked)
OPS = {
    "ag_gemm": ("AGGemm", ("fused", "sm_pull")),
    "gemm_rs": ("GemmRS", ("fused", "ce_fused", "ce_scatter", "ring")),
    "gemm_ar": ("GemmAR", ("fused", "ce_fused", "ce_scatter")),
}
WORLDS = (2, 4)
MAX_REL_ERR = 2e-2


def shapes(world: int) -> list[tuple[str, int, int, int]]:
    """``(name, rows per rank, n, k)``: ragged, then tile-aligned."""
    return [("ragged", 37, 40, 24), ("aligned", 256, 512, 384)]


def _reference(group, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The op's float32 result from every rank's ``a``, through host copies."""
    w, r = group.world_size, group.rank
    if op == "ag_gemm":
        parts = [torch.empty_like(a.cpu()) for _ in range(w)]
        dist.all_gather(parts, a.cpu(), group=group.process_group)
        return torch.cat(parts).float() @ b.cpu().float()
    c = a.cpu().float() @ b.cpu().float()
    dist.all_reduce(c, group=group.process_group)
    return c.chunk(w)[r] if op == "gemm_rs" else c


def check_op(group, op: str) -> list[dict]:
    """Rank body: every strategy of ``op`` on both shapes; one record per (strategy,
    shape) with the worst relative error over ranks and calls."""
    import interlace

    cls_name, strategies = OPS[op]
    cls = getattr(interlace, cls_name)
    w, r, dev = group.world_size, group.rank, group.device
    records = []
    for name, m_loc, n, k in shapes(w):
        gen = torch.Generator(device="cpu").manual_seed(11 + r)
        b = (torch.randn(k, n, generator=torch.Generator().manual_seed(5)) / k**0.5).to(
            dev, torch.bfloat16
        )
        for strategy in strategies:
            worst, note = 0.0, None
            rows = m_loc if op == "ag_gemm" else w * m_loc
            try:
                with cls(group, max_m=w * m_loc, n=n, k=k, strategy=strategy) as ctx:
                    for _ in range(2):
                        a = torch.randn(rows, k, generator=gen).to(dev, torch.bfloat16)
                        out_rows = {"ag_gemm": w * m_loc, "gemm_rs": m_loc}.get(op, w * m_loc)
                        out = torch.full((out_rows, n), float("nan"), device=dev,
                                         dtype=torch.bfloat16)  # fmt: skip
                        y = ctx(a, b, out=out)
                        torch.cuda.synchronize()
                        ctx.check()
                        ref = _reference(group, op, a, b)
                        err = float((y.cpu().float() - ref).norm() / ref.norm().clamp_min(1e-12))
                        worst = max(worst, err if err == err else float("inf"))
            except Exception as exc:  # noqa: BLE001 - reported in the record, every rank
                worst, note = float("inf"), f"{type(exc).__name__}: {str(exc)[:200]}"
            err_t = torch.tensor([worst], dtype=torch.float64)
            dist.all_reduce(err_t, op=dist.ReduceOp.MAX, group=group.process_group)
            worst = float(err_t)
            rec = {"op": op, "strategy": strategy, "model": name, "M": w * m_loc, "N": n,
                   "K": k, "as_world": w, "rel_err": worst, "ok": worst <= MAX_REL_ERR}  # fmt: skip
            if note:
                rec["note"] = note
            records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    from ..testing import World
    from .records import DEFAULT_OUT

    p = argparse.ArgumentParser(prog="python -m interlace bench shared")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="e.g. 2,4")
    p.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    p.add_argument("--out", default=DEFAULT_OUT, help="(unused: correctness only)")
    p.add_argument("--quick", action="store_true", help="W = 2 only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench shared: needs a GPU (the CPU suite covers the CPU emulation)")
        return 0
    worlds = [2] if args.quick else [int(x) for x in args.worlds.split(",") if x]
    ops = [o for o in args.ops.split(",") if o]
    bad = 0
    for w in worlds:
        with World(w, "cuda", share_device=True, timeout=600) as ranks:
            for op in ops:
                records = ranks.run(check_op, op)[0]
                bad += sum(not rec["ok"] for rec in records)
                parts = [
                    f"{rec['strategy']}/{rec['model']} "
                    + (f"ok {rec['rel_err']:.1e}" if rec["ok"] else "FAILED")
                    + (f" ({rec['note']})" if rec.get("note") else "")
                    for rec in records
                ]
                print(f"shared GPU W={w} {op}: " + ", ".join(parts), flush=True)
    print(f"shared-GPU checks: {'all passed' if not bad else f'{bad} failed'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
