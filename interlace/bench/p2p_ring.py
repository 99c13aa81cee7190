"""Benchmark of the ``p2p_ring`` strategy (CommFuse) against vanilla and Megatron-style
slicing, on the tensor-parallel MLP and on query-split attention (LLaMA-3-8B sizes).

For each case one rank body times, in the same run (docs/design.md, "Measuring": CUDA
events, warm-up, median per rank, max over ranks; the callables interleaved round by round,
see ``_Case``):

* ``t_gemm_ms``: the unsliced compute alone; ``t_none_ms``: vanilla, compute then the NCCL
  collective(s); ``t_comm_ms``: the vanilla collective(s) alone;
* ``t_slicing_compute_ms`` / ``t_slicing_ms``: Megatron-style data slicing (``SLICES``
  chunks, async NCCL collectives on their own stream: the gather of chunk k + 1 and the
  reduce-scatter of chunk k - 1 run under the compute of chunk k), without and with
  communication;
* ``t_compute_ms`` / ``t_ms``: p2p_ring's sliced compute with no communication
  (``transport="compute_only"``) and p2p_ring itself, in its default configuration;
  ``variants`` holds the same pair for every schedule x transport x chunks tried.

``exposed_comm_ms`` = end-to-end minus the same computation with no communication; the
``_none`` and ``_slicing`` variants of it are given too. The MLP is
``reduce_scatter(act(all_gather(x) @ w1) @ w2)`` with SwiGLU; attention is non-causal
(``causal=False`` keeps the query slices equally expensive), its output projection
reduce-scattered over the sequence. Every result is checked against vanilla.

``python -m interlace bench p2p_ring --out DIR`` spawns the ranks (every GPU) and merges the
records into ``DIR/<date>-<device>-w<W>.json``; without GPUs (or with ``--cpu``) it runs
the CPU emulation on tiny sizes as a correctness check only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ops.p2p_ring import P2PRing
from .timing import max_over_ranks

MODEL = "llama3-8b"
SHAPES = ((32, 4096), (16, 8192))  # batch x sequence
SLICES = 4  # Megatron-style chunks
OPS = ("mlp_fuse", "attn_fuse")


@dataclass(frozen=True)
class Dims:
    d_model: int
    ffn: int
    heads: int
    head_dim: int


FULL = Dims(4096, 14336, 32, 128)


def tiny_dims(world: int) -> Dims:
    return Dims(32, 24 * world, 2 * world, 8)


def tiny_shapes(world: int):
    return ((2, 8 * world), (1, 16 * world))


@dataclass(frozen=True)
class Job:
    op: str
    batch: int
    seq: int


def default_jobs(world: int, timed: bool, ops=OPS) -> list[Job]:
    shapes = SHAPES if timed else tiny_shapes(world)
    return [Job(op, b, s) for op in ops for b, s in shapes]


# ----------------------------------------------------------------------------- collectives
def _all_gather(out, x, group, async_op=False):
    return dist.all_gather_into_tensor(out, x, group=group.process_group, async_op=async_op)


def _reduce_scatter(out, x, group, async_op=False):
    return dist.reduce_scatter_tensor(out, x, group=group.process_group, async_op=async_op)


def _variants(world: int, transports) -> list[tuple[str, str, int]]:
    scheds = ("ring", "pairwise") if world % 2 == 0 else ("ring",)
    return [(t, s, c) for t in transports for s in scheds for c in (1, 2)]


def _rel_err(y, ref) -> float:
    ref = ref.float()
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12))


class _Case:
    """Timing and checking of one job's callables on one rank.

    The callables are timed interleaved, round by round (each round in a rotated order),
    each call aligned across ranks and timed with CUDA events as in ``timing.median_ms``:
    long GEMM-bound runs drift with the GPU clock (seen: +-3% over seconds on H200), and
    interleaving keeps that drift out of the differences the records are about.
    """

    def __init__(self, group, iters: int, timed: bool, tol: float, warmup: int = 3):
        self.group, self.iters, self.timed, self.tol = group, iters, timed, tol
        self.warmup = warmup
        self.fns: dict[str, object] = {}
        self.times: dict[str, float] = {}
        self.err = 0.0

    def add(self, name: str, fn) -> None:
        self.fns[name] = fn

    def run(self) -> None:
        """Time every callable added (on cpu: call each once)."""
        names = list(self.fns)
        if not self.timed:
            for name in names:
                self.fns[name]()
            return
        for _ in range(self.warmup):
            for name in names:
                self.fns[name]()
        samples = {name: [] for name in names}
        pg, dev = self.group.process_group, self.group.device
        for i in range(self.iters):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                dist.barrier(group=pg, device_ids=[dev.index])
                torch.cuda.synchronize()
                start.record()
                self.fns[name]()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
        self.times = {name: statistics.median(v) for name, v in samples.items()}

    def check(self, name: str, y, ref) -> None:
        err = _rel_err(y, ref)
        if not err <= self.tol:
            raise AssertionError(f"p2p_ring bench: {name} relative error {err:.2e} vs vanilla")
        self.err = max(self.err, err)

    def merged(self) -> tuple[dict[str, float], float]:
        """Max over ranks of every timing and of the error."""
        agreed = max_over_ranks(self.group, {**self.times, "rel_err": self.err})
        err = agreed.pop("rel_err")
        return agreed, err


def _record(job: Job, dims: Dims, dtype, case: _Case, names, shape: dict) -> dict:
    t, err = case.merged()
    rnd = lambda v: None if v is None else round(v, 4)
    # batch x sequence in the model name: both shapes have the same M, N, K, and results
    # files and their checker key records by (op, model, M, N, K)
    model = f"{MODEL}-b{job.batch}xs{job.seq}"
    rec = {"op": job.op, "strategy": "p2p_ring", "model": model, "dtype": str(dtype)[6:]}
    rec.update(shape)
    rec.update(batch=job.batch, seq=job.seq, slices=SLICES, t_torch_ms=None, rel_err=err)
    rec.update(schedule="auto", transport=names["transport"], chunks="auto")
    if not t:
        return rec
    exposed = lambda e2e, compute: rnd(t[e2e] - t[compute])
    rec.update(
        t_ms=rnd(t["p2p_ring"]),
        t_compute_ms=rnd(t["compute"]),
        exposed_comm_ms=exposed("p2p_ring", "compute"),
        t_none_ms=rnd(t["none"]),
        t_gemm_ms=rnd(t["gemm"]),
        exposed_comm_none_ms=exposed("none", "gemm"),
        t_slicing_ms=rnd(t["slicing"]),
        t_slicing_compute_ms=rnd(t["slicing_compute"]),
        exposed_comm_slicing_ms=exposed("slicing", "slicing_compute"),
        t_comm_ms=rnd(t["comm"]),
    )
    bound = max(t["gemm"], t["comm"])
    rec.update(bound_ms=rnd(bound), efficiency=round(bound / t["p2p_ring"], 4))
    rec["variants"] = {
        v: {"t_ms": rnd(t[v]), "exposed_comm_ms": exposed(v, f"compute/c{v[-1]}")}
        for v in names["variants"]
    }
    return rec


# ----------------------------------------------------------------------------- the MLP
def _mlp_job(group, rings, dims: Dims, job: Job, case: _Case, dtype) -> dict:
    W, dev = group.world_size, group.device
    T = job.batch * job.seq
    R, D, Fl = T // W, dims.d_model, dims.ffn // W
    if T % (W * SLICES) or dims.ffn % W:
        raise ValueError(f"mlp: tokens {T} and FFN {dims.ffn} must split over {W} ranks")
    gen = torch.Generator(device=dev).manual_seed(1000 + group.rank)
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen, device=dev) * s).to(dtype)
    x = rand(R, D)
    w1, w2 = rand(D, 2 * Fl, s=D**-0.5), rand(Fl, D, s=Fl**-0.5)
    xg, p_pre, y = rand(T, D), rand(T, D), torch.empty(R, D, dtype=dtype, device=dev)
    Rc = R // SLICES
    x_k = [x[k * Rc : (k + 1) * Rc] for k in range(SLICES)]
    y_k = [y[k * Rc : (k + 1) * Rc] for k in range(SLICES)]
    xg_k = [torch.empty(W * Rc, D, dtype=dtype, device=dev) for _ in range(SLICES)]

    def act(h):
        gate, up = h.chunk(2, dim=1)
        return F.silu(gate) * up

    def gemm():
        return act(xg @ w1) @ w2

    def vanilla():
        _all_gather(xg, x, group)
        _reduce_scatter(y, act(xg @ w1) @ w2, group)
        return y

    def comm():
        _all_gather(xg, x, group)
        _reduce_scatter(y, p_pre, group)

    def slicing():
        gathers = [_all_gather(xg_k[k], x_k[k], group, True) for k in range(SLICES)]
        scatters = []
        for k in range(SLICES):
            gathers[k].wait()
            p = act(xg_k[k] @ w1) @ w2
            scatters.append(_reduce_scatter(y_k[k], p, group, True))
        for work in scatters:
            work.wait()
        return y

    def slicing_compute():
        for k in range(SLICES):
            act(xg_k[k] @ w1) @ w2

    def ring_fn(ring, schedule=None, chunks=None):
        h = ring.ag_gemm(x, w1, schedule=schedule, chunks=chunks)
        return ring.gemm_rs(act(h), w2, schedule=schedule, chunks=chunks)

    names = _check_and_time(
        group, rings, case, ring_fn,
        {"gemm": gemm, "none": vanilla, "comm": comm, "slicing": slicing,
         "slicing_compute": slicing_compute},
    )  # fmt: skip
    shape = {"M": T, "N": 2 * Fl, "K": D, "ffn": dims.ffn}
    return _record(job, dims, dtype, case, names, shape)


# ----------------------------------------------------------------------------- attention
def _attn_job(group, rings, dims: Dims, job: Job, case: _Case, dtype) -> dict:
    W, dev = group.world_size, group.device
    B, S, D, d = job.batch, job.seq, dims.d_model, dims.head_dim
    if dims.heads % W or S % (W * SLICES):
        raise ValueError(f"attn: heads {dims.heads} and seq {S} must split over {W} ranks")
    h, L = dims.heads // W, S // W
    Lc = L // SLICES
    gen = torch.Generator(device=dev).manual_seed(2000 + group.rank)
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen, device=dev) * s).to(dtype)
    q, k, v = (rand(B, h, S, d) for _ in range(3))
    w_o = rand(h * d, D, s=(h * d) ** -0.5)
    p_pre = rand(S * B, D)
    y = torch.empty(L, B, D, dtype=dtype, device=dev)
    y2 = y.view(L * B, D)

    def gemm():
        o = F.scaled_dot_product_attention(q, k, v)
        return o.permute(2, 0, 1, 3).reshape(S * B, h * d) @ w_o

    def vanilla():
        _reduce_scatter(y2, gemm(), group)
        return y

    def comm():
        _reduce_scatter(y2, p_pre, group)

    def slicing(with_comm=True):
        # chunk c: the queries at offsets c*Lc .. of every rank's sequence slice, so that its
        # reduce-scatter hands each rank its own rows
        scatters = []
        for c in range(SLICES):
            qc = q.view(B, h, W, SLICES, Lc, d)[:, :, :, c].reshape(B, h, W * Lc, d)
            o = F.scaled_dot_product_attention(qc, k, v)
            p = o.permute(2, 0, 1, 3).reshape(W * Lc * B, h * d) @ w_o
            if with_comm:
                out = y2[c * Lc * B : (c + 1) * Lc * B]
                scatters.append(_reduce_scatter(out, p, group, True))
        for work in scatters:
            work.wait()
        return y

    def ring_fn(ring, schedule=None, chunks=None):
        return ring.attn_rs(q, k, v, w_o, schedule=schedule, chunks=chunks)

    names = _check_and_time(
        group, rings, case, ring_fn,
        {"gemm": gemm, "none": vanilla, "comm": comm, "slicing": slicing,
         "slicing_compute": lambda: slicing(False)},
    )  # fmt: skip
    shape = {"M": S * B, "N": D, "K": h * d, "heads": dims.heads, "head_dim": d, "causal": False}
    return _record(job, dims, dtype, case, names, shape)


def _check_and_time(group, rings, case: _Case, ring_fn, baselines: dict) -> dict:
    """Check the sliced baseline and every p2p_ring variant against ``baselines["none"]``
    (vanilla), then time them all together with ``baselines`` (name -> callable)."""
    ref = baselines["none"]().clone()
    case.check("slicing", baselines["slicing"]().clone(), ref)
    names = _run_ring_variants(group, rings, case, ring_fn, ref)
    for name, fn in baselines.items():
        case.add(name, fn)
    case.run()
    return names


def _run_ring_variants(group, rings, case: _Case, ring_fn, ref) -> dict:
    """Check and time p2p_ring's default and every variant, and the compute-only runs."""
    default = rings["default"]
    case.check("p2p_ring", ring_fn(default), ref)
    variants = _variants(group.world_size, [t for t in ("symm", "p2p") if t in rings])
    for t, s, c in variants:
        case.check(f"{t}/{s}/c{c}", ring_fn(rings[t], s, c), ref)
    dry = rings["compute_only"]
    case.add("compute", lambda: ring_fn(dry))
    for c in (1, 2):
        case.add(f"compute/c{c}", lambda c=c: ring_fn(dry, None, c))
    case.add("p2p_ring", lambda: ring_fn(default))
    names = []
    for t, s, c in variants:
        names.append(f"{t}/{s}/c{c}")
        case.add(names[-1], lambda t=t, s=s, c=c: ring_fn(rings[t], s, c))
    return {"transport": default.transport, "variants": names}


# ----------------------------------------------------------------------------- entry points
def run_p2p_ring_bench(group, iters: int = 20, jobs=None, timed: bool | None = None) -> list[dict]:
    """Rank body: every job (default: MLP and attention on both shapes), checked against
    vanilla and, on cuda, timed. Returns the records, max over ranks (alike on every rank)."""
    timed = group.backend == "cuda" if timed is None else timed
    W = group.world_size
    dims = FULL if timed else tiny_dims(W)
    dtype = torch.bfloat16 if group.backend == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    jobs = default_jobs(W, timed) if jobs is None else jobs
    rings = {"default": P2PRing(group, dtype)}
    for t in ("symm", "p2p", "compute_only"):
        rings[t] = P2PRing(group, dtype, transport=t)
    records = []
    try:
        for job in jobs:
            case = _Case(group, iters, timed, tol)
            run = _mlp_job if job.op == "mlp_fuse" else _attn_job
            records.append(run(group, rings, dims, job, case, dtype))
            for ring in rings.values():
                ring.check()  # a device wait that timed out raises here
    finally:
        for ring in rings.values():
            ring.close()
    return records


def _table(records: list[dict], timed: bool) -> None:
    from .cli import ms as _ms
    from .cli import print_table as _print_table
    from .cli import ratio as _ratio

    head = ["op", "B x S", "t_ms", "compute", "exposed", "exp/comm", "none_ms", "slicing_ms",
            "comm_ms", "x slicing", "best variant", "rel_err"]  # fmt: skip
    rows = []
    for r in records:
        best = min(r.get("variants", {}).items(), key=lambda kv: kv[1]["t_ms"], default=None)
        rows.append(
            [
                r["op"],
                f"{r['batch']} x {r['seq']}",
                _ms(r.get("t_ms")),
                _ms(r.get("t_compute_ms")),
                _ms(r.get("exposed_comm_ms")),
                _ratio(r.get("exposed_comm_ms"), r.get("t_comm_ms")),
                _ms(r.get("t_none_ms")),
                _ms(r.get("t_slicing_ms")),
                _ms(r.get("t_comm_ms")),
                _ratio(r.get("t_slicing_ms"), r.get("t_ms")),
                f"{best[0]} {best[1]['t_ms']:.3f}" if best else "-",
                f"{r['rel_err']:.1e}",
            ]
        )
    title = "interlace p2p_ring" + ("" if timed else " (CPU emulation: correctness only)")
    _print_table(title, head, rows, width=170)


def main(argv=None) -> int:
    from ..testing import World
    from .cli import progress as _progress
    from .cli import ranks_plan as _ranks
    from .records import write_records as write_results

    parser = argparse.ArgumentParser(prog="python -m interlace bench p2p_ring")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: every GPU)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per rank (median)")
    parser.add_argument(
        "--warmup-s", type=float, default=20.0, help="seconds of cuBLAS + NCCL load first"
    )
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON results")
    parser.add_argument("--cpu", action="store_true", help="force the CPU emulation")
    parser.add_argument("--quick", action="store_true", help="one shape per op")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    if any(o not in OPS for o in ops):
        parser.error(f"--ops: choose from {','.join(OPS)}")
    # Multicast / NVLS stays off on the lent machines (docs/design.md, "Measuring").
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    plan = _ranks(args.world_size, args.cpu)
    if plan is None:
        return 2
    timed, world = plan
    if not timed:
        print("No GPUs in use: CPU emulation on tiny sizes, checked against vanilla; no timings.")
    jobs = default_jobs(world, timed, ops)
    if args.quick:
        jobs = [next(j for j in jobs if j.op == op) for op in ops]
    step, stop = _progress(len(jobs) + timed)
    records, path = [], None
    device = torch.cuda.get_device_name(0) if timed else ""
    with World(world, "cuda" if timed else "cpu", timeout=600) as ranks:
        try:
            if timed and args.warmup_s > 0:
                from .dense import warm_device

                ranks.run(warm_device, args.warmup_s)
                step(f"warm-up {args.warmup_s:g} s")
            for job in jobs:
                records += ranks.run(run_p2p_ring_bench, args.iters, [job], timed)[0]
                if timed:  # after every job: a time-out keeps what was measured
                    path = write_results(args.out, device, world, records)
                step(f"{job.op} {job.batch} x {job.seq}")
        finally:
            stop()
    _table(records, timed)
    if path:
        print(f"results written to {path}")
    else:
        print("every p2p_ring variant matches vanilla (CPU emulation; no timings written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
