"""Soak: many back-to-back calls of each op on one context, checking that results do not
drift and memory does not grow.

``python -m interlace bench soak`` (or ``main([...])``) starts a world of ranks (on a
machine with one GPU they share it, ``World(share_device=True)``; without a GPU, the CPU
emulation), and on every rank runs ``--calls`` calls (default 10,000; ``--quick`` 200) of
AG+GEMM, GEMM+RS, GEMM+AR (``fused``), the three collectives, the MoE pair (``AGMoE`` +
``MoERS``, ``fused``), EP dispatch + combine (identity experts), ``SPAttention`` (forward,
causal) and ``FlashDecode``, each on fixed random inputs. The dense ops' reference is
float32 torch; the newer ops' is their own ``none`` strategy (torch ops and
torch.distributed) on the same inputs. Per op it reports:

* ``drift``: the largest absolute difference of any call's result from the first call's
  (the ops are deterministic for fixed inputs: anything but 0 is a leak of state between
  calls), and ``rel_err`` of the first call against a float32 reference;
* ``mem_growth_bytes``: device memory allocated after the calls minus before (after a
  warm-up), ``rss_growth_mb`` the process's resident memory likewise, ``shm_files`` the
  interlace files left in /dev/shm;
* ``faults``: errors raised (must be 0).

Records go to the results file with ``op: "soak"`` and the op's name under ``variant``.
This is a correctness run: its times are not benchmarks. Several-GPU overlap is not
measured here.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

from ..ops._context import ContextSet
from .records import DEFAULT_OUT

OPS = ("ag_gemm", "gemm_rs", "gemm_ar", "all_gather", "reduce_scatter", "all_reduce", "moe",
       "ep", "sp_attention", "flash_decode")  # fmt: skip


def _make_new(group, op: str, m: int, n: int, k: int, rand):
    """(context, call, reference) of the ops whose reference is their ``none`` strategy:
    ``m`` tokens per rank, hidden ``n``, per-rank intermediate ``k`` (MoE)."""
    import interlace

    w, dev = group.world_size, group.device
    gen = torch.Generator().manual_seed(4321 + group.rank)
    if op == "moe":
        experts, topk = 8, 2
        kw = dict(max_tokens=w * m, hidden=n, inter=k, experts=experts, topk=topk)
        x = rand(m, n)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)])
        wts = torch.rand(m, topk, generator=gen)
        ids, wts = ids.to(dev), (wts / wts.sum(1, keepdim=True)).to(dev)
        w1, w2 = rand(experts, n, 2 * k) * 0.2, rand(experts, k, n) * 0.2
        ag = interlace.AGMoE(group, strategy="fused", **kw)
        rs = interlace.MoERS(group, strategy="fused", **kw)
        with (
            interlace.AGMoE(group, strategy="none", **kw) as ag0,
            interlace.MoERS(group, strategy="none", **kw) as rs0,
        ):
            h0, routing0 = ag0(x, ids, wts, w1)
            ref = rs0(h0, routing0, w2).float().cpu()

        def call():
            h, routing = ag(x, ids, wts, w1)
            return rs(h, routing, w2)

        return ContextSet(ag, rs), call, ref
    if op == "ep":
        experts, topk = 2 * w, 2
        ctx = interlace.EPAllToAll(group, m, n, experts, topk)
        x = rand(m, n)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)])
        wts = torch.rand(m, topk, generator=gen).to(dev)
        ids = ids.to(dev)

        def call():  # identity experts: each token comes back as the sum of its weights
            h = ctx.dispatch(x, ids, wts)
            return ctx.combine(h.recv_x, h)

        return ctx, call, (x.float() * wts.sum(1, keepdim=True)).cpu()
    if op == "sp_attention":
        heads, kv_heads, d = 4, 2, 64
        s_loc = 2 * max(1, m // 2)  # the causal zigzag layout: two halves per rank
        q, kk, v = (
            rand(1, heads, s_loc, d),
            rand(1, kv_heads, s_loc, d),
            rand(1, kv_heads, s_loc, d),
        )
        ctx = interlace.SPAttention(group, heads, kv_heads, d, max_tokens=s_loc)
        with interlace.SPAttention(group, heads, kv_heads, d, max_tokens=s_loc,
                                   strategy="none") as base:  # fmt: skip
            ref = base(q, kk, v, causal=True).float().cpu()
        return ctx, lambda: ctx(q, kk, v, causal=True), ref
    if op == "flash_decode":
        batch, heads, kv_heads, d = 2, 4, 2, 64
        q, kk, v = rand(batch, heads, d), rand(batch, kv_heads, m, d), rand(batch, kv_heads, m, d)
        ctx = interlace.FlashDecode(group, batch, heads, kv_heads, d, strategy="fused")
        with interlace.FlashDecode(group, batch, heads, kv_heads, d, strategy="none") as base:
            ref = base(q, kk, v).float().cpu()
        return ctx, lambda: ctx(q, kk, v), ref
    raise ValueError(f"soak: unknown op {op!r}")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _shm_files() -> int:
    try:
        return sum(1 for n in os.listdir("/dev/shm") if n.startswith("interlace"))
    except OSError:
        return -1


def _make(group, op: str, m: int, n: int, k: int):
    """(context, call, float32 reference of this rank's result)."""
    import interlace

    w, r, dev = group.world_size, group.rank, group.device
    gen = torch.Generator().manual_seed(1234 + r)
    dt = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dt).to(dev)

    def everyone(x):  # every rank's ``x`` (same seeds on every rank), float32, on cpu
        out = []
        for q in range(w):
            g = torch.Generator().manual_seed(1234 + q)
            out.append(torch.randn(*x.shape, generator=g).to(dt).float())
        return out

    if op == "ag_gemm":
        ctx = interlace.AGGemm(group, max_m=w * m, n=n, k=k, strategy="fused")
        a, b = rand(m, k), rand(k, n)
        ref = torch.cat(everyone(a)) @ b.float().cpu()
        return ctx, lambda: ctx(a, b), ref
    if op in ("gemm_rs", "gemm_ar"):
        cls = interlace.GemmRS if op == "gemm_rs" else interlace.GemmAR
        ctx = cls(group, max_m=w * m, n=n, k=k, strategy="fused")
        a = rand(w * m, k)
        b = torch.randn(k, n, generator=torch.Generator().manual_seed(99)).to(dt).to(dev)
        full = sum(x @ b.float().cpu() for x in everyone(a))
        ref = full if op == "gemm_ar" else full[r * m : (r + 1) * m]
        return ctx, lambda: ctx(a, b), ref
    if op in ("moe", "ep", "sp_attention", "flash_decode"):
        return _make_new(group, op, m, n, k, rand)
    numel = m * n
    if op == "all_gather":
        ctx = interlace.AllGather(group, max_numel=numel, dtype=dt)
        x = rand(numel)
        return ctx, lambda: ctx(x), torch.cat(everyone(x))
    if op == "reduce_scatter":
        ctx = interlace.ReduceScatter(group, max_numel=numel, dtype=dt)
        x = rand(w * numel)
        return ctx, lambda: ctx(x), sum(everyone(x))[r * numel : (r + 1) * numel]
    ctx = interlace.AllReduce(group, max_numel=numel, dtype=dt)
    x = rand(numel)
    return ctx, lambda: ctx(x), sum(everyone(x))


def soak_body(group, ops, calls: int, m: int, n: int, k: int) -> list[dict]:
    cuda = group.backend == "cuda"
    rows = []
    for op in ops:
        ctx, call, ref = _make(group, op, m, n, k)
        faults, drift, rel = 0, 0.0, float("nan")
        first = call().float().clone()
        ctx.check()
        rel = float((first.cpu() - ref).norm() / ref.norm().clamp_min(1e-12))
        for _ in range(3):  # warm-up: plans, eager graphs
            call()
        ctx.check()
        if cuda:
            torch.cuda.synchronize()
        mem0 = torch.cuda.memory_allocated(group.device) if cuda else 0
        rss0 = _rss_mb()
        t0 = time.perf_counter()
        for i in range(calls):
            try:
                out = call()
            except Exception:  # noqa: BLE001 - counted and reported
                faults += 1
                break
            if i % 97 == 0 or i == calls - 1:  # compare some calls (a copy per compare)
                drift = max(drift, float((out.float() - first).abs().max()))
        try:
            ctx.check()
        except Exception:  # noqa: BLE001
            faults += 1
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        out = None  # the last call's result is not growth (``mem0`` was read without one)
        mem1 = torch.cuda.memory_allocated(group.device) if cuda else 0
        ctx.close()
        rows.append({
            "op": "soak", "variant": op,
            "strategy": "default" if op in ("all_gather", "reduce_scatter", "all_reduce")
            else "fused",
            "calls": calls, "M": m, "N": n, "K": k, "drift": drift, "rel_err": rel,
            "mem_growth_bytes": int(mem1 - mem0), "rss_growth_mb": round(_rss_mb() - rss0, 1),
            "faults": faults, "us_per_call": seconds / max(calls, 1) * 1e6,
        })  # fmt: skip
        group.host_barrier()
    for row in rows:
        row["shm_files"] = _shm_files()
    return rows


def _print_row(r: dict) -> None:
    print(f"{r['variant']:16s} {r['calls']:6d} {r['drift']:8.2g} {r['rel_err']:8.2g} "
          f"{r['mem_growth_bytes']:12d} {r['rss_growth_mb']:7.1f} {r['shm_files']:4d} "
          f"{r['faults']:6d} {r['us_per_call']:8.1f}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m interlace bench soak", description=__doc__)
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder")
    p.add_argument("--quick", action="store_true", help="200 calls per op")
    p.add_argument("--calls", type=int, default=None, help="calls per op (default 10000)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    p.add_argument("--shape", default="256,256,128", help="per-rank M,N,K (M: rows per rank)")
    args = p.parse_args(argv)
    calls = args.calls or (200 if args.quick else 10_000)
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    m, n, k = (int(v) for v in args.shape.split(","))

    from ..testing import World

    gpus = torch.cuda.device_count()
    if gpus:
        backend, share = "cuda", gpus < args.world
    else:
        backend, share = "cpu", False
        m, n, k = min(m, 8), min(n, 16), min(k, 8)
    if share:
        print(f"{args.world} ranks share one GPU: a correctness soak; several-GPU overlap "
              "needs 2+ GPUs")  # fmt: skip
    print(f"{'op':16s} {'calls':>6s} {'drift':>8s} {'rel_err':>8s} {'mem_growth_B':>12s} "
          f"{'rss_MB':>7s} {'shm':>4s} {'faults':>6s} {'us/call':>8s}", flush=True)  # fmt: skip
    rows = []
    # one op per run of the world (started once), its record written as soon as it ends:
    # a run cut short keeps the ops it finished
    with World(args.world, backend, timeout=3600, share_device=share) as world:
        for op in ops:
            ranks = [r[0] for r in world.run(soak_body, [op], calls, m, n, k)]
            row = dict(ranks[0])
            for key in ("drift", "rel_err", "mem_growth_bytes", "rss_growth_mb", "faults"):
                row[key] = max(r[key] for r in ranks)
            row["us_per_call"] = max(r["us_per_call"] for r in ranks)
            rows.append(row)
            if backend == "cuda":
                from .records import device_name, write_records

                write_records(args.out, device_name(), args.world, [row], False)
            _print_row(row)
    ok = True
    for r in rows:
        ok &= r["drift"] == 0 and r["faults"] == 0 and r["rel_err"] < 2e-2
        ok &= r["mem_growth_bytes"] <= 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
