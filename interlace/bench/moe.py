"""``python -m interlace bench moe``: the MoE ops' per-rank kernels on one GPU.

For each of TileLink's MoE shapes (8192 tokens; (H, I, E, top-k) below) at TP 4 and 8,
with balanced and Zipf-skewed routing, one process times the per-rank work of rank 0 with
every wait already met (the arrival flags preset, the same kernels the ops launch). Every
time is the GPU time of a replayed CUDA graph of the work (median of the runs), so the
host's launch cost, which the ops hide in a graph and which differs between Triton's and
torch's launchers, is in none of them.

* ``ag_moe``: the routing build (one launch) + the grouped GEMM that gathers its rows and
  applies SwiGLU (``t_ms``); that GEMM alone (``t_gemm_only_ms``); the same GEMM on rows
  already permuted (``t_kernel_ms``: no table, no gather). Reference (``ref:
  grouped_mm``, ``t_ref_ms``): ``torch._grouped_mm`` ``[M * k, H] x [E, H, 2 I / W]``
  alone on rows already permuted; and what a user runs instead (``t_torch_path_ms``, path
  in ``torch_path``): ``index_select`` of the rows + that ``torch._grouped_mm`` + SwiGLU.
* ``moe_rs``: the grouped GEMM whose epilogue stores the weighted rows (bf16: ``MoERS``'s
  default ``rows_dtype``) in expert-sorted order into the local row buffer + the owner's
  finish, which sums the ``k`` rows of each of its tokens in the ``W`` ranks' row buffers
  (here: this rank's and ``W - 1`` zero stand-ins, each its own buffer in this GPU's
  memory, read the same way: ``finish_peers``) and converts them (``t_ms``); the GEMM
  alone (``t_kernel_ms``); the same as ``t_ms`` with float32 rows
  (``rows_dtype=torch.float32``: ``t_f32_rows_ms``, ``f32_rows_rel_err``). Reference:
  ``torch._grouped_mm`` ``[M * k, I / W] x [E, I / W, H]`` alone (``t_ref_ms``), and the
  user's path, that + the routing-weight multiply + ``index_add_`` in float32
  (``t_torch_path_ms``). ``rel_err``: against a float32 matmul per expert;
  ``ref_rel_err``: torch's path against the same.

With ``--sweep`` (the default) each shape is timed with every candidate tile config
(``ops.moe._gemm.CANDIDATES``) and the fastest is recorded (``config``).

With two or more GPUs, ``several_gpus``: every rank a GPU, each half's ``fused`` op
against ``none`` and against the bound, same run (``--several-only``: that alone).
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..runtime.signals import ERROR_WORDS
from .cli import add_several_only, runs_one_gpu

SHAPES = [(2048, 1536, 8, 2), (2048, 1536, 32, 2), (2048, 1536, 32, 5),
          (4096, 2048, 8, 2), (4096, 2048, 32, 2), (4096, 2048, 32, 5)]  # fmt: skip
TOKENS = 8192
#: the first slot of the bench's flag array that starts at zero (the routing's barrier)
BAR_SLOT = 32


def routing_ids(tokens, k, experts, kind, gen):
    """``[tokens, k]`` distinct experts per token: ``balanced`` (every expert the same
    load) or ``zipf`` (expert popularity ~ 1 / rank^1.2, sampled without replacement)."""
    if kind == "balanced":
        t = torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]
        return (t % experts).long()
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
    return torch.multinomial(p.expand(tokens, experts), k, replacement=False, generator=gen)


def _cfg_name(c):
    flat = "f" if c.flatten else ""
    occ = f"o{c.occupancy}" if c.occupancy > 1 else ""
    return f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}{flat}{occ}"


#: a candidate config whose result is further than this from float32 is not timed
CANDIDATE_TOL = 1e-2


def _fastest(runs, what, err_at):
    """The fastest of ``runs`` (tuples: time first, relative error at index ``err_at``,
    config last) whose error is within :data:`CANDIDATE_TOL`; a config outside it is
    named."""
    ok = []
    for v in runs:
        err = v[err_at]
        if err > CANDIDATE_TOL:
            print(f"note {what} config {_cfg_name(v[-1])}: rel err {err:.1e}, not taken")
        else:
            ok.append(v)
    if not ok:
        raise RuntimeError(f"every {what} config missed float32 by more than {CANDIDATE_TOL}")
    return min(ok, key=lambda v: v[0])


def graph_ms(fn, iters):
    """Median GPU time in ms of ``fn``'s work, captured once in a CUDA graph and replayed
    (``timing.median_ms`` around each replay)."""
    from .timing import graph_of, median_ms

    graph = graph_of(None, fn)
    return median_ms(None, graph.replay, iters)


class _Problem:
    """One per-rank problem (rank 0 of ``world``) and torch's results and times on it."""

    def __init__(self, hidden, inter, experts, k, world, kind, gen, dev, iters):
        from ..ops.moe.baseline import swiglu
        from ..ops.moe.routing import pack_meta

        bf = torch.bfloat16
        self.hidden, self.experts, self.k, self.world = hidden, experts, k, world
        self.t_triton_kernel, self.reduce_kernel = {}, {}  # per reduce config
        self.m, self.i_loc, self.dev = TOKENS // world, inter // world, dev
        m, i_loc = self.m, self.i_loc
        ids = routing_ids(TOKENS, k, experts, kind, gen).to(dev)
        wts = torch.softmax(torch.randn(TOKENS, k, device=dev), -1)
        self.ids, self.wts = ids, wts
        self.x = torch.randn(TOKENS, hidden, device=dev).to(bf)
        self.w1 = (torch.randn(experts, hidden, 2 * i_loc, device=dev) * 0.05).to(bf)
        self.w2 = (torch.randn(experts, i_loc, hidden, device=dev) * 0.05).to(bf)
        # every source rank's packed routing, as the copies would have left it
        self.stride = 2 * m * k
        self.meta = torch.empty(world, self.stride, dtype=torch.int32, device=dev)
        for s in range(world):
            pack_meta(self.meta[s], ids[s * m : (s + 1) * m], wts[s * m : (s + 1) * m])
        # every arrival flag raised; slots from BAR_SLOT at zero (the routing's barrier)
        self.sig = torch.ones(64, dtype=torch.int32, device=dev)
        self.sig[BAR_SLOT:] = 0
        self.err = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev)
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        ends = torch.cumsum(torch.bincount(flat, minlength=experts), 0).to(torch.int32)
        tok_of = order // k
        x_sorted = self.x[tok_of]
        w_sorted = wts.reshape(-1)[order]
        x, w1, w2 = self.x, self.w1, self.w2

        def ref1():  # index + grouped GEMM + SwiGLU
            return swiglu(torch._grouped_mm(x.index_select(0, tok_of), w1, offs=ends), i_loc)

        h_ref = ref1()

        def ref2():  # grouped GEMM + weights + float32 top-k sum (index_add)
            rows = torch._grouped_mm(h_ref, w2, offs=ends).float() * w_sorted[:, None]
            y = torch.zeros(TOKENS, hidden, dtype=torch.float32, device=dev)
            return y.index_add_(0, tok_of, rows)

        self.t_gmm1 = graph_ms(lambda: torch._grouped_mm(x_sorted, w1, offs=ends), iters)
        self.t_ref1 = graph_ms(ref1, iters)
        self.t_gmm2 = graph_ms(lambda: torch._grouped_mm(h_ref, w2, offs=ends), iters)
        self.t_ref2 = graph_ms(ref2, iters)
        self.h_ref = h_ref
        # float32 reference of rank 0's rows: one matmul per expert on h_ref's rows
        y32 = torch.zeros(m, hidden, dtype=torch.float32, device=dev)
        lo = 0
        for e, hi in enumerate(ends.tolist()):
            sel = tok_of[lo:hi] < m
            rows = h_ref[lo:hi][sel].float() @ w2[e].float()
            y32.index_add_(0, tok_of[lo:hi][sel], rows * w_sorted[lo:hi][sel][:, None])
            lo = hi
        self.y_ref = y32
        self.torch_err = float((ref2()[:m] - y32).norm() / y32.norm())

    def routing(self, cfg):
        """A built routing for ``cfg``'s row height, and the closure that rebuilds it."""
        from ..ops.moe.routing import alloc_routing, launch_routing

        work = alloc_routing(self.m, self.k, self.experts, self.world, cfg.block_m, self.dev)

        def route():
            launch_routing(
                work, self.meta, self.stride, rank=0, sig=self.sig, flag0=0,
                err=self.err.data_ptr(), max_spins=1 << 20, wait=True, bar_slot=BAR_SLOT,
            )  # fmt: skip

        route()
        torch.cuda.synchronize()
        return work.routing, route

    def weights_err(self, rt):
        """Largest difference between the routing's row weights and torch's."""
        used = int(rt.offsets[-1])
        tok = rt.token_ids[:used].long()
        live = tok >= 0
        offs = rt.offsets.tolist()
        expert = torch.zeros(used, dtype=torch.long, device=self.dev)
        for e in range(self.experts):
            expert[offs[e] : offs[e + 1] if e + 1 < self.experts else used] = e
        slot = (self.ids[tok[live]] == expert[live][:, None]).int().argmax(1)
        want = self.wts[tok[live], slot]
        return float((rt.weights[:used][live] - want).abs().max())

    def permuted(self, rt, src):
        """``src`` rows in the routing's padded row order (padding rows zero)."""
        tok = rt.token_ids[: int(rt.offsets[-1])]
        live = tok >= 0
        out = torch.zeros(rt.rows, src.shape[1], dtype=src.dtype, device=self.dev)
        out[: tok.shape[0]][live] = src
        return out, tok, live

    def gather_gemm(self, rt, cfg, h):
        """Rank 0's gather GEMM (SwiGLU) on ``rt`` into ``h`` as a closure, and the launch
        arguments it shares with the same GEMM on rows already permuted."""
        from ..ops.moe import _gemm

        grid = _gemm.programs(rt, self.i_loc, cfg, self.dev, "cuda")
        run = dict(
            w=self.w1, out=h, routing=rt, n=self.i_loc, up=self.i_loc, cfg=cfg, grid=grid,
            swiglu=True, reduce=False, rank=0, err=self.err.data_ptr(), world=self.world,
        )  # fmt: skip

        def gemm():
            _gemm.launch_gemm(
                a=self.x, x_own=self.x[: self.m], gather=True, sig=self.sig, flag0=0,
                max_spins=1 << 20, wait=self.world > 1, **run,
            )  # fmt: skip

        return gemm, run

    def gather(self, cfg, iters):
        """(t_ms: routing + gather GEMM, t_gemm: the GEMM alone, t_kernel: on permuted
        rows, rel err of h)."""
        from ..ops.moe import _gemm

        rt, route = self.routing(cfg)
        h = torch.empty(rt.rows, self.i_loc, dtype=torch.bfloat16, device=self.dev)
        gemm, run = self.gather_gemm(rt, cfg, h)

        def both():
            route()
            gemm()

        h.fill_(float("nan"))
        both()
        torch.cuda.synchronize()
        tok = rt.token_ids[: int(rt.offsets[-1])]
        live = tok >= 0
        got = h[: tok.shape[0]][live].float()
        err = float((got - self.h_ref.float()).norm() / self.h_ref.float().norm())
        xp, _, _ = self.permuted(rt, self.x[tok[live].long()])

        def plain():
            _gemm.launch_gemm(a=xp, x_own=None, gather=False, **run)

        times = [graph_ms(f, iters) for f in (both, gemm, plain)]
        return (*times, err)

    def reduce(self, cfg, iters, row_dtype=torch.bfloat16):
        """(t_ms: the reduce GEMM + the owner's finish, t_kernel: the GEMM alone, rel err
        of rank 0's rows, weights err), the rows stored in ``row_dtype``."""
        rt, _ = self.routing(cfg)
        hp, _, _ = self.permuted(rt, self.h_ref)
        t, t_kernel, err = self._reduce_run(rt, hp, cfg, iters, row_dtype)
        return t, t_kernel, err, self.weights_err(rt)

    def reduce_launches(self, rt, hp, cfg, row_dtype, distinct_peers=False):
        """Rank 0's reduce GEMM and owner's finish on ``hp`` as closures (``gemm``,
        ``finish``; ``y``: the finish's output), the rows in ``row_dtype``. The finish
        reads this rank's rows and ``W - 1`` zero stand-ins through this rank's map: one
        buffer shared by the stand-ins, or one each (``distinct_peers``: reads that miss
        L2 as peers' would). ``finish(counted=True)`` first raises the contribution
        counter itself (the finish alone, without the GEMM that raises it). Keep the
        namespace while its closures run: it holds the row buffers."""
        from ..ops.moe import _gemm

        m, hidden, dev, world, k = self.m, self.hidden, self.dev, self.world, self.k
        rows = torch.zeros(rt.rows, hidden, dtype=row_dtype, device=dev)
        n_peer = world - 1 if distinct_peers else 1
        peers = [torch.zeros(rt.rows, hidden, dtype=row_dtype, device=dev) for _ in range(n_peer)]
        ptrs = [rows.data_ptr()] + [peers[i % n_peer].data_ptr() for i in range(world - 1)]
        table = torch.tensor(ptrs, device=dev)
        # every rank's entry -> row map: this rank's (the stand-ins' rows are zeros)
        row_of = torch.zeros(TOKENS * k, dtype=torch.int32, device=dev)
        maps = torch.tensor([row_of.data_ptr()] * world, device=dev)
        sig = torch.zeros(8, dtype=torch.int32, device=dev)
        sig_table = torch.tensor([sig.data_ptr()] * world, device=dev)
        y = torch.empty(m, hidden, dtype=torch.bfloat16, device=dev)
        grid = _gemm.programs(rt, hidden, cfg, dev, "cuda", reduce=True)
        err_ptr = self.err.data_ptr()

        def gemm():
            return _gemm.launch_gemm(
                a=hp, x_own=None, w=self.w2, out=None, routing=rt, n=hidden, up=0, cfg=cfg,
                grid=grid, gather=False, swiglu=False, reduce=True, rows_out=rows,
                row_of=row_of, sig=sig, sig_table=sig_table, err=err_ptr, rank=0,
                max_spins=1 << 20, done_slot=0, contrib_slot=1, world=world,
            )  # fmt: skip

        def finish(counted=False):
            if counted:
                sig[1:2].fill_(world)
            _gemm.launch_finish(
                table, 0, maps, 0, y, m, k, sig, 1, 2, err_ptr, 0, 1 << 20, world, dev,
                "cuda", rows_f32=row_dtype == torch.float32, aligned=True,
            )  # fmt: skip

        # (the finish's tables hold only the buffers' addresses: the namespace keeps them)
        return SimpleNamespace(gemm=gemm, finish=finish, y=y, sig=sig, buffers=(rows, *peers))

    def _reduce_run(self, rt, hp, cfg, iters, row_dtype):
        from ..ops.moe import _gemm

        run = self.reduce_launches(rt, hp, cfg, row_dtype, distinct_peers=True)
        gemm = run.gemm

        def rs():
            gemm()
            run.finish()

        run.y.fill_(float("nan"))
        rs()
        torch.cuda.synchronize()
        err = float((run.y.float() - self.y_ref).norm() / self.y_ref.norm())
        t = graph_ms(rs, iters)
        # the GEMM alone (its rows never read), its flags cleared
        t_kernel = graph_ms(gemm, iters)
        if row_dtype == torch.bfloat16:  # the Triton kernel beside it (on Hopper)
            self.reduce_kernel[cfg] = gemm()  # the kernel the op launches
            hopper, _gemm.HOPPER_REDUCE = _gemm.HOPPER_REDUCE, False
            try:
                self.t_triton_kernel[cfg] = graph_ms(gemm, iters)
            finally:
                _gemm.HOPPER_REDUCE = hopper
        run.sig.zero_()
        return t, t_kernel, err


def one_gpu(shapes, worlds, routings, sweep, iters, save=None):
    from ..ops.moe import _gemm

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    records = []
    cands = _gemm.CANDIDATES
    if not sweep:
        cands = {mode: [_gemm.GPU_CONFIGS[mode]] for mode in cands}
    for (hidden, inter, experts, k), world, kind in [
        (s, w, r) for s in shapes for w in worlds for r in routings
    ]:
        pb = _Problem(hidden, inter, experts, k, world, kind, gen, dev, iters)
        g = _fastest([(*pb.gather(c, iters), c) for c in cands["gather"]], "gather", 3)
        r = _fastest([(*pb.reduce(c, iters), c) for c in cands["reduce"]], "reduce", 2)
        t2_f32, _, err2_f32, _ = pb.reduce(r[-1], iters, torch.float32)
        if int(pb.err[0]):
            raise RuntimeError(f"a wait timed out in the bench: {pb.err.tolist()}")
        common = dict(
            S=TOKENS, H=hidden, I=inter, E=experts, topk=k, routing=kind, as_world=world,
            dtype="bfloat16", waits_met=True, ref="grouped_mm", timing="cuda_graph",
        )  # fmt: skip
        t_all, t_gemm, t_plain, err1, cfg1 = g
        flops = 2 * TOKENS * k * hidden * 2 * pb.i_loc
        records.append(dict(
            op="ag_moe", strategy="fused", **common, t_ms=round(t_all, 5),
            t_gemm_only_ms=round(t_gemm, 5), t_kernel_ms=round(t_plain, 5),
            t_ref_ms=round(pb.t_gmm1, 5), t_torch_path_ms=round(pb.t_ref1, 5),
            torch_path="index_select+grouped_mm+swiglu", tflops=round(flops / t_all / 1e9, 1),
            config=_cfg_name(cfg1), rel_err=round(err1, 5),
        ))  # fmt: skip
        t2, t2_kernel, err2, werr, cfg2 = r
        records.append(dict(
            op="moe_rs", strategy="fused", **common, t_ms=round(t2, 5),
            t_kernel_ms=round(t2_kernel, 5), t_ref_ms=round(pb.t_gmm2, 5),
            t_torch_path_ms=round(pb.t_ref2, 5), torch_path="grouped_mm+weights+index_add_fp32",
            tflops=round(flops / 2 / t2 / 1e9, 1), config=_cfg_name(cfg2), rel_err=round(err2, 5),
            ref_rel_err=round(pb.torch_err, 5), rows_dtype="bfloat16", finish_peers="distinct",
            t_f32_rows_ms=round(t2_f32, 5), f32_rows_rel_err=round(err2_f32, 5),
            t_triton_kernel_ms=round(pb.t_triton_kernel[cfg2], 5),
            gemm_kernel=pb.reduce_kernel[cfg2],
        ))  # fmt: skip
        print(f"H{hidden} I{inter} E{experts} k{k} W{world} {kind}: ag {t_all:.3f} "
              f"(gemm {t_gemm:.3f}, plain {t_plain:.3f}) ref {pb.t_ref1:.3f} "
              f"gmm {pb.t_gmm1:.3f} err {err1:.1e} {_cfg_name(cfg1)} | rs {t2:.3f} "
              f"(gemm {t2_kernel:.3f}, f32 rows {t2_f32:.3f} err {err2_f32:.1e}) "
              f"ref {pb.t_ref2:.3f} gmm {pb.t_gmm2:.3f} err {err2:.1e} "
              f"w_err {werr:.1e} torch_err {pb.torch_err:.1e} {_cfg_name(cfg2)}",
              flush=True)  # fmt: skip
        if save is not None:  # what is measured so far survives a run cut short
            save(records[-2:])
    return records


def _multi_body(group, shapes, routings, iters):
    """One rank of the several-GPU comparison (see ``several_gpus``)."""
    records = []
    for shape in shapes:
        for kind in routings:
            records += _multi_case(group, *shape, kind, iters)
            torch.cuda.empty_cache()
    return records


def _multi_case(group, hidden, inter, experts, k, kind, iters) -> list[dict]:
    from ..ops.moe import AGMoE, MoERS
    from .timing import graph_of, host_us, max_over_ranks, paired_median_ms

    w, dev, rank, pg = group.world_size, group.device, group.rank, group.process_group
    m, bf, i_loc = TOKENS // w, torch.bfloat16, inter // w
    # the same global routing on every rank; each takes its shard
    gen = torch.Generator().manual_seed(hidden + inter + experts + k)
    ids = routing_ids(TOKENS, k, experts, kind, gen)[rank * m : (rank + 1) * m]
    ids = ids.to(dev).contiguous()
    gen_d = torch.Generator(device=dev).manual_seed(rank)
    wts = torch.softmax(torch.randn(m, k, device=dev, generator=gen_d), -1)
    x = torch.randn(m, hidden, device=dev, generator=gen_d).to(bf)
    w1 = (torch.randn(experts, hidden, 2 * i_loc, device=dev, generator=gen_d) * 0.05).to(bf)
    w2 = (torch.randn(experts, i_loc, hidden, device=dev, generator=gen_d) * 0.05).to(bf)
    sizes = dict(max_tokens=TOKENS, hidden=hidden, inter=i_loc, experts=experts, topk=k,
                 validate=False)  # fmt: skip
    ag = {st: AGMoE(group, strategy=st, **sizes) for st in ("fused", "none")}
    rs = {st: MoERS(group, strategy=st, **sizes) for st in ("fused", "none")}
    try:
        h_n, rt_n = ag["none"](x, ids, wts, w1)
        h_f, rt_f = ag["fused"](x, ids, wts, w1)
        # what the bound is made of: the per-rank grouped GEMMs and NCCL alone
        x_all = torch.empty(TOKENS, hidden, dtype=bf, device=dev)
        dist.all_gather_into_tensor(x_all, x, group=pg)
        rows = x_all.index_select(0, rt_n.token_ids.long())
        ends = rt_n.offsets[1:]
        y_full = torch.empty(TOKENS, hidden, dtype=bf, device=dev)
        y_mine = torch.empty(m, hidden, dtype=bf, device=dev)
        first = {
            "fused": lambda: ag["fused"](x, ids, wts, w1),
            "none": lambda: ag["none"](x, ids, wts, w1),
            "gemm": lambda: torch._grouped_mm(rows, w1, offs=ends),
            "comm": lambda: dist.all_gather_into_tensor(x_all, x, group=pg),
        }
        second = {
            "fused": lambda: rs["fused"](h_f, rt_f, w2),
            "none": lambda: rs["none"](h_n, rt_n, w2),
            "gemm": lambda: torch._grouped_mm(h_n, w2, offs=ends),
            "comm": lambda: dist.reduce_scatter_tensor(y_mine, y_full, group=pg),
        }
        y_f, y_n = second["fused"](), second["none"]()
        torch.cuda.synchronize()
        times = {"err": float((y_f.float() - y_n.float()).norm() / y_n.float().norm())}
        for op, fns in (("ag_moe", first), ("moe_rs", second)):
            names = list(fns)
            got = paired_median_ms(group, [fns[n] for n in names], iters=iters)
            times.update({f"{op}_{n}": t for n, t in zip(names, got)})
            times[f"{op}_host"] = host_us(group, fns["fused"], iters)
        # the whole layer (both halves) replayed from a CUDA graph: device time, no host
        graphs = {}
        for st in ("fused", "none"):
            try:
                graphs[st] = graph_of(group, lambda st=st: rs[st](*ag[st](x, ids, wts, w1), w2))
            except Exception as e:  # noqa: BLE001 - a capture that fails is reported
                print(f"rank {rank}: moe layer {st!r} not captured: {type(e).__name__}: {e}")
        # (the strategies captured on every rank: the replays run collectives)
        ok = max_over_ranks(group, {st: float(st not in graphs) for st in ("fused", "none")})
        captured = [st for st in ("fused", "none") if not ok[st]]
        got = paired_median_ms(group, [graphs[st].replay for st in captured], iters=iters)
        layer = dict(zip(captured, got))
        times.update(layer_fused=layer.get("fused"), layer_none=layer.get("none"))
        t = max_over_ranks(group, times)
    finally:
        for c in (*ag.values(), *rs.values()):
            c.close()
    records = []
    for op in ("ag_moe", "moe_rs"):
        bound = max(t[f"{op}_gemm"], t[f"{op}_comm"])
        rec = dict(
            op=op, strategy="fused", dtype="bfloat16", S=TOKENS, H=hidden, I=inter, E=experts,
            topk=k, routing=kind, t_ms=round(t[f"{op}_fused"], 4),
            t_none_ms=round(t[f"{op}_none"], 4), t_gemm_ms=round(t[f"{op}_gemm"], 4),
            t_comm_ms=round(t[f"{op}_comm"], 4), t_bound_ms=round(bound, 4),
            speedup_vs_none=round(t[f"{op}_none"] / t[f"{op}_fused"], 3),
            x_bound=round(t[f"{op}_fused"] / bound, 3), rel_err_none=round(t["err"], 5),
            host_us=round(t[f"{op}_host"], 1),
        )  # fmt: skip
        records.append(rec)
        if rank == 0:
            print(f"W={w} {op} H={hidden} I={inter} E={experts} k={k} {kind:8s} "
                  f"{rec['t_ms']:.3f} ms, none {rec['t_none_ms']:.3f} "
                  f"(x{rec['speedup_vs_none']:.2f}), bound {bound:.3f} "
                  f"(x{rec['x_bound']:.2f}), host {rec['host_us']:.0f} us, "
                  f"err {t['err']:.1e}", flush=True)  # fmt: skip
    # the layer from graphs against the sum of the halves' bounds
    bound = sum(r["t_bound_ms"] for r in records)
    if t["layer_fused"] is None:
        return records
    rec = dict(
        records[0], op="moe_layer", timing="graph", t_ms=round(t["layer_fused"], 4),
        t_none_ms=t["layer_none"] and round(t["layer_none"], 4), t_bound_ms=round(bound, 4),
        speedup_vs_none=round(t["layer_none"] / t["layer_fused"], 3) if t["layer_none"] else None,
        x_bound=round(t["layer_fused"] / bound, 3),
    )  # fmt: skip
    for key in ("t_gemm_ms", "t_comm_ms", "host_us"):
        rec.pop(key)
    records.append(rec)
    if rank == 0:
        print(f"W={w} moe_layer (graphs) {rec['t_ms']:.3f} ms, none {rec['t_none_ms']} "
              f"(x{rec['speedup_vs_none']}), bound {bound:.3f} (x{rec['x_bound']:.2f})",
              flush=True)  # fmt: skip
    return records


def several_gpus(n: int, routings, iters: int) -> list[dict]:
    """Every rank a GPU (TP ``n``): each half's ``fused`` op against ``none`` (NCCL +
    ``torch._grouped_mm``) and against bound = max(the per-rank ``torch._grouped_mm``,
    the NCCL all-gather of the token shards / reduce-scatter of the bf16 outputs), all
    eager calls timed interleaved in the same run (``timing.paired_median_ms``, max over
    ranks), with the host time of one eager ``fused`` call (``host_us``). ``rel_err_none``:
    the second half's output, ``fused`` (both halves) against ``none``. Records: op
    ``ag_moe`` / ``moe_rs`` with ``t_none_ms``, ``t_gemm_ms``, ``t_comm_ms``,
    ``t_bound_ms``; op ``moe_layer`` (``timing: graph``): both halves replayed from one
    CUDA graph per strategy (device time), against the sum of the halves' bounds."""
    from ..testing import World

    with World(n, "cuda", timeout=900) as world:
        return world.run(_multi_body, SHAPES, routings, iters)[0]


def table(records):
    lines = [f"{'op':7} {'H':>5} {'I':>5} {'E':>3} {'k':>2} {'W':>2} {'routing':9} "
             f"{'t_ms':>7} {'gmm':>7} {'x gmm':>6} {'x path':>6} {'err':>7}"]  # fmt: skip
    for r in records:
        lines.append(
            f"{r['op']:7} {r['H']:5} {r['I']:5} {r['E']:3} {r['topk']:2} {r['as_world']:2} "
            f"{r['routing']:9} {r['t_ms']:7.3f} {r['t_ref_ms']:7.3f} "
            f"{r['t_ref_ms'] / r['t_ms']:6.2f} {r['t_torch_path_ms'] / r['t_ms']:6.2f} "
            f"{r['rel_err']:7.1e}"
        )
    for op in ("ag_moe", "moe_rs"):
        for key, name in (("t_ref_ms", "grouped_mm"), ("t_torch_path_ms", "user's torch path")):
            sp = [r[key] / r["t_ms"] for r in records if r["op"] == op]
            if sp:
                g = math.exp(sum(math.log(v) for v in sp) / len(sp))
                lines.append(f"{op}: vs {name} geomean {g:.3f}, worst {min(sp):.3f} ({len(sp)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interlace bench moe", description=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="TP 4 only, fewer runs")
    ap.add_argument("--no-sweep", action="store_true", help="only the default tile configs")
    ap.add_argument("--no-write", action="store_true")
    add_several_only(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench moe needs a GPU")
        return 1
    from .records import device_name, write_records

    worlds = (4,) if args.quick else (4, 8)

    def save(recs, world=1, plot=False):
        """Merge ``recs`` into the results file (each shape as it ends; the plots last)."""
        if not args.no_write:
            path = write_records(args.out, device_name(), world, recs, plot=plot)
            if plot:
                print("wrote", path)

    gpus = torch.cuda.device_count()
    if runs_one_gpu(args, gpus):
        records = one_gpu(SHAPES, worlds, ("balanced", "zipf"), not args.no_sweep,
                          iters=20 if args.quick else 30, save=save)  # fmt: skip
        save(records, plot=True)
        print(table(records))
    if gpus < 2:
        print("several-GPU overlap (op vs none vs bound) needs 2+ GPUs: not run")
        return 0
    multi = several_gpus(gpus, ("balanced", "zipf"), iters=10 if args.quick else 20)
    save(multi, gpus, plot=True)

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"{'op':9} {'H':>5} {'I':>5} {'E':>3} {'k':>2} {'routing':8} {'t_ms':>7} "
          f"{'none':>7} {'x none':>6} {'bound':>7} {'x bound':>7}")  # fmt: skip
    for r in multi:
        print(f"{r['op']:9} {r['H']:5d} {r['I']:5d} {r['E']:3d} {r['topk']:2d} "
              f"{r['routing']:8} {r['t_ms']:7.3f} {num(r['t_none_ms'], '7.3f'):>7} "
              f"{num(r['speedup_vs_none'], '6.2f'):>6} {r['t_bound_ms']:7.3f} "
              f"{r['x_bound']:7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
