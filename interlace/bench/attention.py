"""Benchmark of sequence-parallel attention (``python -m interlace bench attention``).

One GPU (always): the per-rank kernels with every wait already met, as rank 0 of
``--as-world`` ranks, against torch SDPA on the same per-rank problem: 32 heads, d 128,
bf16, S from 16k to 64k, causal and not. SDPA is timed as a user calls it (torch picks
the backend) and with each backend forced (flash, cudnn, efficient; one that cannot run
the problem is left out); ``t_ref_ms`` is the fastest of them and ``ref_backend`` names
it. Rank 0 holds ``S / W`` queries and the gathered buffer holds every chunk of the ``S``
keys, its arrival flags raised (and the backward's partial-gradient counters full), so the
kernels never wait.

* non-causal: SDPA on ``q [1, 32, S/W, 128]`` against ``k, v [1, 32, S, 128]``, the same
  problem.
* causal: rank 0's zigzag share (queries of chunks 0 and 2W - 1) does ``1/W`` of the whole
  causal work. ``t_ref_ms`` is SDPA's causal attention over the whole sequence divided by
  ``W`` (SDPA's rate on its best-shaped problem: the stricter reference);
  ``t_ref_split_ms`` is SDPA on exactly rank 0's share (two calls, lower-right causal).

Records (``op`` ``sp_attention`` / ``sp_attention_bwd``, ``strategy`` ``fused``): batch,
heads, kv_heads, d, S, causal, ``t_ms`` (kernels with their flag waits, all met),
``t_nowait_ms`` (the same kernels compiled without waits, timed interleaved with them),
``tflops`` (useful FLOPs: causal counts the visible half), ``as_world``, ``waits_met``,
``ref: sdpa``, ``t_ref_ms``, ``ref_backend``, ``t_sdpa_<backend>_ms`` for every SDPA
timing (``default`` = no backend forced). The backward is the delta, dK/dV, dQ and
reduction kernels as the op runs them (the dQ kernel beside the dK/dV kernel, on a second
stream); ``t_serial_ms``: the same with the dQ kernel after the dK/dV kernel. Host-cost
records (``mode: host``, ``host_us``) time one eager forward call of a one-rank context,
replayed from a CUDA graph (``variant: graph_replay``, the default) and launched kernel by
kernel (``variant: launches``). ``--tune`` times candidate configs of the forward, dK / dV
and dQ kernels (records ``op`` ``sp_attention_cfg``, ``kernel``, with the relative errors
of the outputs; ``--tune-only``: nothing else).

Several GPUs: every rank runs ``fused``, ``none`` (NCCL all-gather + SDPA) and ``ring``
forward on its shard, same run; records add ``t_none_ms`` and ``t_ring_ms``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import torch

from ..runtime.signals import ERROR_WORDS
from .cli import add_several_only, runs_one_gpu
from .timing import host_us, median_ms, paired_median_ms

AS_WORLD = 4
SEQS = (16384, 32768, 65536)
HEADS, KV_HEADS, D = 32, 32, 128
#: the several-GPU run times the ring backward up to this many tokens per rank
RING_BWD_MAX_LOCAL = 8192


def _flops(batch, heads, sq, sk, d, causal, bwd=False) -> float:
    f = 4.0 * batch * heads * sq * sk * d * (0.5 if causal else 1.0)
    return f * (2.5 if bwd else 1.0)


#: ``timing.median_ms`` on this process alone, 3 warm-up calls: ``_time_ms(fn, iters=...,
#: setup=...)``
_time_ms = functools.partial(median_ms, None, warmup=3)


class _PerRank:
    """Rank 0's per-rank problem of one (S, causal) case, its waits met."""

    def __init__(self, s, causal, world=AS_WORLD, heads=HEADS, kv_heads=KV_HEADS, d=D,
                 dtype=torch.bfloat16):  # fmt: skip
        from ..ops._launch import install_scratch_allocator
        from ..ops.attention.sp_attention import KernelArgs

        install_scratch_allocator()
        dev = torch.device("cuda")
        self.s, self.causal, self.world = s, causal, world
        self.s_loc = s_loc = s // world
        gen = torch.Generator(device=dev).manual_seed(1)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, device=dev).to(dtype)

        self.q = rnd(1, heads, s_loc, d)
        self.k_full, self.v_full = rnd(1, kv_heads, s, d), rnd(1, kv_heads, s, d)
        self.do = rnd(1, heads, s_loc, d)
        # rank 0's chunk and every rank's chunk in the gathered buffer (its layout)
        chunks_k = self._chunks(self.k_full)
        chunks_v = self._chunks(self.v_full)
        self.k, self.v = chunks_k[0], chunks_v[0]
        self.k_all = torch.cat([c.reshape(-1) for c in chunks_k])
        self.v_all = torch.cat([c.reshape(-1) for c in chunks_v])
        self.sig = torch.zeros(4 * (world + 1), dtype=torch.int32, device=dev)
        self.err = torch.zeros(ERROR_WORDS, dtype=torch.int32, pin_memory=True)
        self.args = KernelArgs(
            0, world, heads, kv_heads, d, s_loc, causal, False, 1.0 / math.sqrt(d),
            torch.zeros(2, dtype=torch.int32, device=dev),
            torch.zeros(2, dtype=torch.int32, device=dev), self.sig, self.err.data_ptr(),
            1 << 25, "cuda",
        )  # fmt: skip
        self.o = torch.empty_like(self.q)
        self.lse = torch.empty(heads, s_loc, dtype=torch.float32, device=dev)
        # every owner is this GPU: one receive buffer per owner, so each chunk's partial
        # dK / dV lands in its own place (the same bytes move as across GPUs)
        self.recvs = [
            torch.empty(2 * world * self.k.numel(), dtype=dtype, device=dev) for _ in range(world)
        ]
        self.recv = self.recvs[0]
        self.recv_table = torch.tensor(
            [r.data_ptr() for r in self.recvs], dtype=torch.int64, device=dev
        )
        self.sig_table = torch.full((world,), self.sig.data_ptr(), dtype=torch.int64, device=dev)
        self.dq, self.dk, self.dv = (torch.empty_like(x) for x in (self.q, self.k, self.v))
        self.delta = torch.empty_like(self.lse)

    def _chunks(self, x):
        from ..ops.attention.layout import zigzag_shard

        if self.causal:
            return [zigzag_shard(x, self.world, r) for r in range(self.world)]
        return [c.contiguous() for c in x.chunk(self.world, dim=2)]

    def flags_up(self):
        """Every arrival flag raised (slots 0..W-1), the dK/dV counters full (W+1..)."""
        w = self.world
        self.sig.zero_()
        self.sig[:w] = 1
        self.sig[w + 1 : 2 * w + 1] = self.k.shape[1] * self.s_loc

    def fwd(self, wait=True, cfg=None):
        from ..ops.attention.sp_attention import launch_fwd

        launch_fwd(
            self.args, self.q, self.k, self.v, self.k_all, self.v_all, self.o, self.lse, 0,
            wait=wait, clear=False, cfg=cfg,
        )  # fmt: skip

    def bwd(self, wait=True, cfg_dkdv=None, cfg_dq=None, side=None):
        """The backward as the op runs it (``launch_backward``): the dQ kernel beside the
        dK / dV kernel where ``side`` (default: ``SPAttention.SIDE_DQ``), else after it."""
        from ..ops.attention import sp_attention as sp

        if side is None:
            side = sp.SPAttention.SIDE_DQ
        bufs = sp.BackwardBuffers(
            self.k_all, self.v_all, self.recv, self.recv_table, self.sig_table, 0,
            self.world + 1,
        )  # fmt: skip
        sp.launch_backward(
            self.args, self.q, self.k, self.v, self.o, self.do, self.lse, self.delta, self.dq,
            self.dk, self.dv, bufs, wait=wait, clear=False,
            side=sp.side_stream(self.q.device) if side else None, cfg_dkdv=cfg_dkdv,
            cfg_dq=cfg_dq,
        )  # fmt: skip

    def dkdv(self, wait=True, cfg=None):
        """The dK / dV kernel alone (its counters only grow; nothing waits on them)."""
        from ..ops.attention.sp_attention import launch_dkdv

        launch_dkdv(
            self.args, self.q, self.k, self.v, self.k_all, self.v_all, self.do, self.lse,
            self.delta, self.recv, self.recv_table, self.sig_table, 0, self.world + 1,
            wait=wait, cfg=cfg,
        )  # fmt: skip

    def dq_only(self, wait=True, cfg=None):
        """The dQ kernel alone."""
        from ..ops.attention.sp_attention import launch_dq

        launch_dq(
            self.args, self.q, self.k, self.v, self.k_all, self.v_all, self.do, self.lse,
            self.delta, self.dq, 0, wait=wait, clear=False, cfg=cfg,
        )  # fmt: skip

    def reference(self):
        """float32 SDPA output, dQ, and rank 0's queries' share of dK / dV per chunk of
        rank 0's queries (cached)."""
        if getattr(self, "_ref", None) is None:
            self._ref = self._reference()
        return self._ref

    def check(self, cfg=None, cfg_dkdv=None, cfg_dq=None) -> dict:
        """Relative errors of o, dq and every chunk's partial dK / dV (the worst chunk)
        against SDPA in float32 on rank 0's queries (cheap: ``S/W`` queries), with every
        wait met; ``cfg`` / ``cfg_dkdv`` / ``cfg_dq``: the kernels' configs."""
        self.flags_up()
        for r in self.recvs:
            r.fill_(float("nan"))
        self.fwd(cfg=cfg)
        self.bwd(cfg_dkdv=cfg_dkdv, cfg_dq=cfg_dq)
        torch.cuda.synchronize()
        ref, dq, dks, dvs = self.reference()
        err = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
        n = self.k.numel()
        # owner c's buffer [2 (dK, dV), W (source), ...]: rank 0's partial in source slot 0
        e_dk = max(err(self.recvs[c][:n].view_as(self.k), dks[c]) for c in range(self.world))
        w = self.world
        e_dv = max(err(self.recvs[c][w * n : w * n + n].view_as(self.v), dvs[c]) for c in range(w))
        return {"rel_err": err(self.o, ref), "rel_err_dq": err(self.dq, dq),
                "rel_err_dkdv": max(e_dk, e_dv)}  # fmt: skip

    def _reference(self):
        from torch.nn.attention.bias import causal_lower_right

        q = self.q.float().requires_grad_()
        kf = self.k_full.float().requires_grad_()
        vf = self.v_full.float().requires_grad_()
        half = self.s_loc // 2
        if self.causal:
            outs = []
            for i, chunk in enumerate((0, 2 * self.world - 1)):
                end = (chunk + 1) * half
                outs.append(
                    torch.nn.functional.scaled_dot_product_attention(
                        q[:, :, i * half : (i + 1) * half], kf[:, :, :end], vf[:, :, :end],
                        attn_mask=causal_lower_right(half, end),
                    )
                )  # fmt: skip
            ref = torch.cat(outs, 2)
        else:
            ref = torch.nn.functional.scaled_dot_product_attention(q, kf, vf)
        (ref * self.do.float()).sum().backward()
        return ref.detach(), q.grad, self._chunks(kf.grad), self._chunks(vf.grad)


SDPA_BACKENDS = ("default", "flash", "cudnn", "efficient")


def _sdpa_context(backend: str):
    """SDPA as a user calls it (``default``: torch picks) or with one backend forced."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    return contextlib.nullcontext() if backend == "default" else sdpa_kernel([forced[backend]])


def _sdpa_times(s, causal, world, iters):
    """SDPA forward and backward on the per-rank problem (see the module docstring), as
    a user calls it and with each backend forced: ``{"fwd": {backend: ms}, "bwd": {...},
    "fwd_split": ms or None}``; a backend that cannot run the problem is left out."""
    import warnings

    from torch.nn.attention.bias import causal_lower_right

    F = torch.nn.functional
    dev, dt = torch.device("cuda"), torch.bfloat16
    s_loc = s // world
    sq = s if causal else s_loc
    q = torch.randn(1, HEADS, sq, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, HEADS, s, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, HEADS, s, D, device=dev, dtype=dt, requires_grad=True)
    # causal: the whole sequence's causal attention, counted 1/W (rank 0's share)
    share = world if causal else 1
    out = {"fwd": {}, "bwd": {}, "fwd_split": None}
    for backend in SDPA_BACKENDS:
        with _sdpa_context(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            try:
                out["fwd"][backend] = _time_ms(fwd, iters=iters) / share
                o = fwd()
                do = torch.randn_like(o)
                bwd = functools.partial(torch.autograd.grad, o, (q, k, v), do, retain_graph=True)
                out["bwd"][backend] = _time_ms(bwd, iters=iters) / share
            except RuntimeError as e:  # this backend cannot run the problem here
                print(f"sdpa {backend}: skipped ({str(e).splitlines()[0][:80]})", flush=True)
            o = do = None
    if causal:
        half = s_loc // 2

        def split():
            for chunk in (0, 2 * world - 1):
                end = (chunk + 1) * half
                F.scaled_dot_product_attention(
                    q[:, :, :half], k[:, :, :end], v[:, :, :end],
                    attn_mask=causal_lower_right(half, end),
                )  # fmt: skip

        try:
            with torch.no_grad():
                out["fwd_split"] = _time_ms(split, iters=iters)
        except RuntimeError:
            pass
    return out


def _ref_fields(times: dict) -> tuple[float, dict]:
    """The fastest SDPA time, and the fields naming it and every SDPA timing."""
    best = min(times, key=times.get)
    fields = {"ref_backend": best}
    fields.update({f"t_sdpa_{b}_ms": round(t, 4) for b, t in times.items()})
    return times[best], fields


def _record(op, s, causal, world, t, t_nowait, t_ref, extra=None) -> dict:
    s_loc = s // world
    flops = _flops(1, HEADS, s_loc, s, D, causal, bwd=op.endswith("bwd"))
    rec = {
        "op": op, "strategy": "fused", "dtype": "bfloat16", "batch": 1, "heads": HEADS,
        "kv_heads": KV_HEADS, "d": D, "S": s, "causal": causal, "t_ms": round(t, 4),
        "t_nowait_ms": round(t_nowait, 4), "tflops": round(flops / t / 1e9, 1),
        "as_world": world, "waits_met": True, "ref": "sdpa", "t_ref_ms": round(t_ref, 4),
        "tflops_ref": round(flops / t_ref / 1e9, 1),
    }  # fmt: skip
    rec.update(extra or {})
    return rec


#: Configs ``--tune`` times per kernel: ``AttnConfig``'s fields (block_m, block_n, warps,
#: stages, warp_specialize, fast_exp[, maxnreg]). ``block_m`` is the query block, ``block_n``
#: the key block (dK / dV: one key block per program, looping over query blocks).
TUNE = {
    "fwd": (
        (128, 128, 8, 3, False, 0), (128, 128, 8, 3, True, 0), (128, 128, 8, 3, False, 1),
        (128, 128, 8, 2, False, 0), (128, 64, 8, 3, False, 0), (128, 64, 8, 2, False, 0),
        (128, 64, 8, 2, False, 0, 128), (128, 64, 8, 2, False, 1, 128),
        (64, 64, 4, 2, False, 0), (64, 64, 4, 3, False, 0), (64, 64, 4, 3, False, 1),
        (64, 64, 4, 3, True, 0), (64, 32, 4, 3, False, 0), (64, 128, 4, 3, False, 0),
    ),
    "dkdv": (
        (64, 128, 8, 2, False, 0), (64, 128, 8, 3, False, 1), (64, 64, 8, 2, False, 1),
        (64, 64, 4, 2, False, 1), (64, 64, 4, 2, False, 0), (64, 64, 4, 3, False, 1),
        (32, 64, 4, 2, False, 1), (32, 64, 4, 3, False, 1), (64, 32, 4, 2, False, 1),
    ),
    "dq": (
        (128, 64, 8, 3, False, 0), (128, 64, 8, 3, False, 1), (64, 128, 4, 3, False, 0),
        (64, 64, 4, 2, False, 0), (64, 64, 4, 2, False, 1), (64, 64, 4, 3, False, 0),
        (64, 32, 4, 3, False, 0),
    ),
}  # fmt: skip
#: Causal: only the fastest non-causal configs of each kernel are timed again.
TUNE_CAUSAL_TOP = 4


def _variant(cfg) -> str:
    """A config's short name, e.g. ``128x128-w8-s3-ws-e1``."""
    name = f"{cfg.block_m}x{cfg.block_n}-w{cfg.num_warps}-s{cfg.num_stages}"
    name += "-ws" if cfg.warp_specialize else ""
    name += f"-e{cfg.fast_exp}" if cfg.fast_exp else ""
    name += f"-r{cfg.maxnreg}" if cfg.maxnreg else ""
    return name


def _tune_one(p, kernel, cfg, iters) -> tuple[float, dict]:
    """Time one kernel with ``cfg`` (the others at their defaults), after checking it."""
    if kernel == "fwd":
        errs = p.check(cfg=cfg)
        return _time_ms(functools.partial(p.fwd, cfg=cfg), iters=iters), errs
    if kernel == "dkdv":
        errs = p.check(cfg_dkdv=cfg)
        return _time_ms(functools.partial(p.dkdv, cfg=cfg), iters=iters), errs
    errs = p.check(cfg_dq=cfg)
    return _time_ms(functools.partial(p.dq_only, cfg=cfg), iters=iters), errs


def tune(s, iters, deadline: float, world=AS_WORLD, kernels=tuple(TUNE),
         variants=()) -> list[dict]:  # fmt: skip
    """Time each candidate config of each kernel (forward, dK / dV, dQ) with its waits met,
    with the relative errors of its outputs (records ``op: sp_attention_cfg``, ``kernel``);
    non-causal first, then the fastest ``TUNE_CAUSAL_TOP`` of each kernel causal; stops
    at ``deadline`` (``time.monotonic()``). ``variants``: only the candidates of these
    names (``_variant``), where given."""
    from ..ops.attention.sp_attention import AttnConfig, config_of

    records = []
    best: dict[str, list] = {}
    for causal in (False, True):
        p = _PerRank(s, causal, world)
        for kernel in kernels:
            cands = TUNE[kernel]
            if variants:
                cands = [f for f in cands if _variant(AttnConfig(*f)) in variants]
            current = config_of(kernel, D, "cuda", s)
            if causal:
                cands = best.get(kernel, [])[:TUNE_CAUSAL_TOP]
            timed = []
            for fields in cands:
                if time.monotonic() > deadline:
                    print("tune: out of time, stopped", flush=True)
                    return records
                cfg = AttnConfig(*fields)
                try:
                    t, errs = _tune_one(p, kernel, cfg, iters)
                except Exception as e:  # noqa: BLE001 - a config that fails to build is skipped
                    print(f"tune {kernel} {cfg}: failed {type(e).__name__}: {str(e)[:80]}",
                          flush=True)  # fmt: skip
                    torch.cuda.synchronize()
                    continue
                timed.append((t, fields))
                flops = _flops(1, HEADS, p.s_loc, s, D, causal)
                rec = {
                    "op": "sp_attention_cfg", "kernel": kernel, "strategy": "fused",
                    "dtype": "bfloat16", "batch": 1, "heads": HEADS, "kv_heads": KV_HEADS,
                    "d": D, "S": s, "causal": causal, "as_world": world, "waits_met": True,
                    "variant": _variant(cfg),
                    "current": cfg == current, "t_ms": round(t, 4),
                    **{k: round(v, 5) for k, v in errs.items()},
                }  # fmt: skip
                if kernel == "fwd":
                    rec["tflops"] = round(flops / t / 1e9, 1)
                records.append(rec)
                print(
                    f"tune {kernel:<4} S={s} causal={causal!s:<5} {rec['variant']:<18} "
                    f"{t:8.3f} ms{' (current)' if rec['current'] else ''}  errors "
                    + " ".join(f"{k[8:] or 'o'} {v:.1e}" for k, v in errs.items()),
                    flush=True,
                )  # fmt: skip
            if not causal:
                best[kernel] = [c for _, c in sorted(timed)]
        del p
        torch.cuda.empty_cache()
    return records


def one_gpu(seqs, iters, world=AS_WORLD) -> list[dict]:
    from ..ops.attention.sp_attention import config_of, hopper_forward

    records = []
    for s in seqs:
        for causal in (False, True):
            p = _PerRank(s, causal, world)
            errs = p.check() if s == seqs[0] else {}
            p.flags_up()
            # with and without the flag waits interleaved: their ratio is the waits' cost;
            # beside them the Triton forward (``t_triton_ms``: a config forces it)
            triton_cfg = config_of("fwd", p.args.d, p.args.backend, world * p.args.s_loc)
            t_fwd, t_fwd_nw, t_fwd_triton = paired_median_ms(
                None,
                [p.fwd, functools.partial(p.fwd, wait=False),
                 functools.partial(p.fwd, cfg=triton_cfg)],
                iters=iters, warmup=3,
            )  # fmt: skip
            kernel = "hopper" if hopper_forward(p.args, p.q) else "triton"
            # the op's backward, without its waits, and with its dQ kernel after dK / dV
            t_bwd, t_bwd_nw, t_bwd_serial = paired_median_ms(
                None,
                [p.bwd, functools.partial(p.bwd, wait=False), functools.partial(p.bwd, side=False)],
                iters=iters, warmup=3, setup=p.flags_up,
            )  # fmt: skip
            del p
            torch.cuda.empty_cache()
            ref = _sdpa_times(s, causal, world, iters)
            torch.cuda.empty_cache()
            t_ref_fwd, extra_fwd = _ref_fields(ref["fwd"])
            t_ref_bwd, extra_bwd = _ref_fields(ref["bwd"])
            extra_bwd["t_serial_ms"] = round(t_bwd_serial, 4)
            extra_fwd["t_triton_ms"] = round(t_fwd_triton, 4)
            extra_fwd["fwd_kernel"] = kernel
            if errs:
                extra_fwd["rel_err"] = round(errs["rel_err"], 5)
                extra_bwd["rel_err_dq"] = round(errs["rel_err_dq"], 5)
                extra_bwd["rel_err_dkdv"] = round(errs["rel_err_dkdv"], 5)
            if causal and ref["fwd_split"] is not None:
                extra_fwd["t_ref_split_ms"] = round(ref["fwd_split"], 4)
            records.append(
                _record("sp_attention", s, causal, world, t_fwd, t_fwd_nw, t_ref_fwd, extra_fwd)
            )
            records.append(
                _record("sp_attention_bwd", s, causal, world, t_bwd, t_bwd_nw, t_ref_bwd, extra_bwd)
            )  # fmt: skip
            for r in records[-2:]:
                print(
                    f"{r['op']:<17} S={s:>6} causal={causal!s:<5} {r['t_ms']:8.3f} ms "
                    f"{r['tflops']:6.0f} TF/s  sdpa ({r['ref_backend']}) {r['t_ref_ms']:8.3f} ms  "
                    f"x{r['t_ref_ms'] / r['t_ms']:.3f}  "
                    f"wait +{100 * (r['t_ms'] / r['t_nowait_ms'] - 1):.1f}%"
                    + (f"  dQ after dK/dV {r['t_serial_ms']:.3f} ms" if "t_serial_ms" in r else "")
                    + (f"  triton {r['t_triton_ms']:.3f} ms" if "t_triton_ms" in r else ""),
                    flush=True,
                )  # fmt: skip
    return records


HOST_SHAPE = dict(heads=8, kv_heads=8, d=128, s=1024)


def _host_body(group, eager_graphs: bool, n: int = 200):
    """Host time of one eager forward call of a context on ``group`` (us), the median of
    ``n`` calls each timed alone (device idle first, so no call waits for a queue)."""
    from ..ops.attention import SPAttention

    dev, sh = group.device, HOST_SHAPE
    ctx = SPAttention(
        group, sh["heads"], sh["kv_heads"], sh["d"], max_tokens=sh["s"], eager_graphs=eager_graphs
    )  # fmt: skip
    q = torch.randn(1, sh["heads"], sh["s"], sh["d"], device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, sh["kv_heads"], sh["s"], sh["d"], device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    try:
        for _ in range(5):
            ctx(q, k, v, causal=True)
        t = host_us(None, lambda: ctx(q, k, v, causal=True), n)
        ctx.check()
    finally:
        ctx.close()
    return t


def host_records() -> list[dict]:
    from ..testing.world import run_world

    out = []
    for variant, eager_graphs in (("graph_replay", True), ("launches", False)):
        host = run_world(_host_body, 1, eager_graphs, backend="cuda")[0]
        out.append({
            "op": "sp_attention", "strategy": "fused", "mode": "host", "variant": variant,
            "batch": 1, "heads": HOST_SHAPE["heads"], "kv_heads": HOST_SHAPE["kv_heads"],
            "d": HOST_SHAPE["d"], "S": HOST_SHAPE["s"], "causal": True,
            "host_us": round(host, 1),
        })  # fmt: skip
        print(f"host: {variant} {host:.1f} us per eager forward call", flush=True)
    return out


def _multi_body(group, seqs, iters):
    """Several GPUs: ``fused`` vs ``none`` vs ``ring`` on each rank's shard, same run, and
    this rank's kernels alone with their waits met (``_PerRank``, rank 0's share of the
    same problem) on the same GPU: ``t_kernel_ms``. ``t_kernel_ms / t_ms`` is the run's
    throughput as a fraction of W x the one-GPU kernel rate. The backward
    (``sp_attention_bwd``): ``fused`` and ``ring`` (``none`` recomputes the ring forward
    first) from the forward's ``out`` and ``lse``."""
    from ..ops.attention import SPAttention
    from .timing import max_over_ranks

    w, dev = group.world_size, group.device
    out = []
    for s in seqs:
        s_loc = s // w
        scale = 1.0 / math.sqrt(D)
        for causal in (False, True):
            gen = torch.Generator(device=dev).manual_seed(1000 * group.rank + int(causal))
            q, k, v, do = (
                torch.randn(1, h, s_loc, D, device=dev, generator=gen).to(torch.bfloat16)
                for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)
            )
            ctxs = {st: SPAttention(group, HEADS, KV_HEADS, D, max_tokens=s_loc, strategy=st)
                    for st in ("fused", "none", "ring")}  # fmt: skip
            try:
                fwd = {st: functools.partial(c.forward_with_lse, q, k, v, causal, None, scale)
                       for st, c in ctxs.items()}  # fmt: skip
                names = list(fwd)
                times = dict(zip(names, paired_median_ms(group, [fwd[n] for n in names], iters)))
                o_f, lse_f = fwd["fused"]()
                o_r, lse_r = fwd["ring"]()
                o_n, _ = fwd["none"]()
                err = float((o_f.float() - o_n.float()).norm() / o_n.float().norm())
                bwd = {
                    "fused": functools.partial(ctxs["fused"].backward_with_lse, do, q, k, v,
                                               o_f, lse_f, causal, None, scale),
                    "ring": functools.partial(ctxs["ring"].backward_with_lse, do, q, k, v,
                                              o_r, lse_r, causal, None, scale),
                }  # fmt: skip
                # the ring backward's torch blocks hold [heads, S/W, S/W] float32 scores
                # (32 GiB at S/W = 16k): it runs up to RING_BWD_MAX_LOCAL rows per rank
                if s_loc <= RING_BWD_MAX_LOCAL:
                    t_bwd = paired_median_ms(group, [bwd["fused"], bwd["ring"]], iters)
                    g_f, g_r = bwd["fused"](), bwd["ring"]()
                    err_b = max(
                        float((a.float() - b.float()).norm() / b.float().norm())
                        for a, b in zip(g_f, g_r)
                    )
                else:
                    t_bwd = [median_ms(group, bwd["fused"], iters), None]
                    err_b = None
            finally:
                for c in ctxs.values():
                    c.close()
            del q, k, v, do
            torch.cuda.empty_cache()
            # this rank's kernels alone, waits met, on the same GPU (rank 0's share)
            p = _PerRank(s, causal, w)
            p.flags_up()
            t_kernel = median_ms(None, p.fwd, iters)
            t_kernel_bwd = median_ms(None, p.bwd, iters, setup=p.flags_up)
            del p
            torch.cuda.empty_cache()
            times.update(bwd_fused=t_bwd[0], bwd_ring=t_bwd[1], kernel=t_kernel,
                         kernel_bwd=t_kernel_bwd, err=err, err_b=err_b)  # fmt: skip
            t = max_over_ranks(group, times)
            common = {
                "strategy": "fused", "dtype": "bfloat16", "batch": 1, "heads": HEADS,
                "kv_heads": KV_HEADS, "d": D, "S": s, "causal": causal,
            }  # fmt: skip
            flops = _flops(1, HEADS, s_loc, s, D, causal)
            out.append({
                "op": "sp_attention", **common,
                "t_ms": round(t["fused"], 4), "t_none_ms": round(t["none"], 4),
                "t_ring_ms": round(t["ring"], 4), "t_kernel_ms": round(t["kernel"], 4),
                "tflops": round(flops / t["fused"] / 1e9, 1),
                "x_w_kernel_rate": round(t["kernel"] / t["fused"], 3),
                "rel_err_none": round(t["err"], 5),
            })  # fmt: skip
            flops_b = _flops(1, HEADS, s_loc, s, D, causal, bwd=True)
            out.append({
                "op": "sp_attention_bwd", **common,
                "t_ms": round(t["bwd_fused"], 4),
                "t_ring_ms": None if t["bwd_ring"] is None else round(t["bwd_ring"], 4),
                "t_kernel_ms": round(t["kernel_bwd"], 4),
                "tflops": round(flops_b / t["bwd_fused"] / 1e9, 1),
                "x_w_kernel_rate": round(t["kernel_bwd"] / t["bwd_fused"], 3),
                "rel_err_ring": None if t["err_b"] is None else round(t["err_b"], 5),
            })  # fmt: skip
            if group.rank == 0:
                for r in out[-2:]:
                    print(
                        f"W={w} {r['op']:<17} S={s:>6} causal={causal!s:<5} "
                        f"{r['t_ms']:8.3f} ms (kernel alone {r['t_kernel_ms']:.3f}: "
                        f"x{r['x_w_kernel_rate']:.3f}) ring {r['t_ring_ms']} "
                        f"none {r.get('t_none_ms', '-')}",
                        flush=True,
                    )
    return out


def _table(records) -> None:
    head = ("op", "S", "causal", "t_ms", "TF/s", "ref_ms", "ref", "x ref", "wait")
    print("{:<17} {:>6} {:<6} {:>9} {:>6} {:>9} {:<9} {:>6} {:>6}".format(*head))
    for r in records:
        if "t_ms" not in r:
            print(f"{r['op']:<17} host {r['host_us']} us per eager call ({r.get('variant')})")
            continue
        ref = r.get("t_ref_ms") or r.get("t_none_ms")
        name = r.get("ref_backend", r.get("variant", "none"))
        wait = f"+{100 * (r['t_ms'] / r['t_nowait_ms'] - 1):.1f}%" if r.get("t_nowait_ms") else ""
        ratio = f"{ref / r['t_ms']:6.3f}" if ref else "     -"
        print(
            f"{r['op']:<17} {r['S']:>6} {r['causal']!s:<6} {r['t_ms']:9.3f} {r['tflops']:6.0f} "
            f"{ref or 0:9.3f} {name:<9} {ratio} {wait:>6}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m interlace bench attention")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON results")
    parser.add_argument("--quick", action="store_true", help="S 16k only, fewer runs")
    parser.add_argument("--tune", action="store_true", help="time candidate kernel configs")
    parser.add_argument("--tune-only", action="store_true", help="--tune, and nothing else")
    parser.add_argument("--tune-kernels", default="fwd,dkdv,dq", help="kernels --tune times")
    parser.add_argument("--tune-seconds", type=float, default=120.0, help="time limit of --tune")
    parser.add_argument("--tune-s", type=int, default=None, help="--tune's S (default: 16k)")
    parser.add_argument(
        "--tune-variants", default="", help="only these candidates, e.g. 64x64-w4-s3,128x128-w8-s3"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--as-world", type=int, default=AS_WORLD)
    add_several_only(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench attention needs a GPU (the CPU emulation is covered by the tests)")
        return 2
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    seqs = SEQS[:1] if args.quick else SEQS
    iters = args.iters
    device = torch.cuda.get_device_name(0)
    from .records import write_records

    if args.tune_only:
        kernels = tuple(args.tune_kernels.split(","))
        variants = tuple(v for v in args.tune_variants.split(",") if v)
        tuned = tune(args.tune_s or seqs[0], iters, time.monotonic() + args.tune_seconds,
                     args.as_world, kernels, variants)  # fmt: skip
        path = write_records(args.out, device, 1, tuned)
        print(f"results written to {path}")
        return 0
    n_gpu = torch.cuda.device_count()
    records, path = [], None
    if runs_one_gpu(args, n_gpu):
        records = one_gpu(seqs, iters, args.as_world)
        path = write_records(args.out, device, 1, records)
        try:
            host = host_records()
            write_records(args.out, device, 1, host)
            records += host
        except Exception as e:  # noqa: BLE001
            print(f"host-time records skipped: {type(e).__name__}: {e}")
    if args.tune:
        tuned = tune(seqs[0], iters, time.monotonic() + args.tune_seconds, args.as_world)
        if tuned:
            write_records(args.out, device, 1, tuned)
            records += tuned
    if n_gpu < 2:
        print("several-GPU overlap (fused vs none vs ring) needs 2+ GPUs: skipped")
    else:
        from ..testing import World

        with World(n_gpu, "cuda", timeout=600) as ranks:
            multi = ranks.run(_multi_body, seqs, iters)[0]
        path = write_records(args.out, device, n_gpu, multi)
        records += multi
    _table(records)
    print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
