"""Whether a stream-K tail brings the plain persistent GEMM to cuBLAS on the per-rank GEMMs
whose tiles fill the last wave of SMs badly (M 2048 at TP 8: 96 wide tiles on 132 SMs).

The kernel here is the plain GEMM of ``kernels.gemm`` reduced to its store path (TMA loads
and stores, grouped tile order, one flattened persistent loop) plus a stream-K phase:
the ``DP`` leading tiles run whole, one per program and wave; the remaining ``SK`` tiles'
``k`` iterations are dealt evenly to ``SK_PROGS`` programs, each taking one contiguous run
of them (at most a partial tile at each end, whole tiles between). A partial tile goes to
a float32 workspace slot of its program; the program that brings a tile's iteration count
to ``k_tiles`` (an acq_rel counter, no waiting) sums the tile's pieces in program order
(the same order whatever arrives last: the result does not depend on timing) and stores
it, then clears the counter for the next launch.

For each shape: cuBLAS, the library's plain segment GEMM (``segment_gemm.matmul``), this
kernel without a stream-K phase (as a check that it matches the library's), and with
one, per tile config, each checked against float32 first; CUDA-graph replays timed
interleaved (``paired_median_ms``) as ``bench kernels`` does.

``--small`` adds tiles of 64 rows (one warpgroup) and two programs per SM, ``--no-sk``
leaves out the stream-K variants; ``WS_TMA`` stores the partial tiles through a tensor
descriptor (in halves) instead of pointer stores.

    python benchmarks/probes/stream_k.py [--ms 2048 8192] [--worlds 4 8] [--small] [--no-sk]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import triton
import triton.language as tl

from interlace.bench.dense import MODELS, OTHER_MODELS, model_shape
from interlace.bench.timing import graph_of, paired_median_ms
from interlace.kernels.gemm import _dot, _halves
from interlace.language.primitives import bulk_stores_done
from interlace.ops._launch import install_scratch_allocator
from interlace.ops.segment_gemm import matmul
from interlace.testing.emulated import rel_err


@triton.jit
def _coords(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (t % per_group) % group_m, (t % per_group) // group_m


@triton.jit
def _sk_phase(
    a_desc, b_desc, c_desc, ws, cnt, pid, DP_TILES, SK_TILES, SK_PROGS, tiles_m, tiles_n, kt,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, out_ty,
    ws_desc, WS_TMA: tl.constexpr,
):  # fmt: skip
    if pid < SK_PROGS:
        iters = SK_TILES * kt
        start = pid * iters // SK_PROGS
        end = (pid + 1) * iters // SK_PROGS
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        it = start
        while it < end:
            t_local = it // kt
            k0 = it - t_local * kt
            k1 = tl.minimum(kt, k0 + end - it)
            pm, pn = _coords(DP_TILES + t_local, tiles_m, tiles_n, GROUP_M)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kk in range(k0, k1):
                acc = _dot(a_desc.load([pm * BM, kk * BK]), b_desc.load([kk * BK, pn * BN]), acc)
            if (k0 == 0) & (k1 == kt):
                c_desc.store([pm * BM, pn * BN], acc.to(out_ty))
            else:
                j = tl.where(it == start, 0, 1)  # head piece of this program's run, or tail
                if WS_TMA:  # through shared memory, in halves, from the accumulator's layout
                    left, right = _halves(acc, BM, BN)
                    ws_desc.store([(pid * 2 + j) * BM, 0], left)
                    ws_desc.store([(pid * 2 + j) * BM, BN // 2], right)
                    bulk_stores_done()
                else:
                    tl.store(ws + (pid * 2 + j).to(tl.int64) * (BM * BN) + offs, acc)
                tl.debug_barrier()
                old = tl.atomic_add(cnt + t_local, k1 - k0, sem="acq_rel", scope="gpu")
                if old + (k1 - k0) == kt:
                    q0 = ((t_local * kt + 1) * SK_PROGS - 1) // iters
                    q1 = ((t_local + 1) * kt * SK_PROGS - 1) // iters
                    tot = tl.zeros((BM, BN), dtype=tl.float32)
                    for q in range(q0, q1 + 1):
                        jq = tl.where(q * iters // SK_PROGS >= t_local * kt, 0, 1)
                        tot += tl.load(
                            ws + (q * 2 + jq).to(tl.int64) * (BM * BN) + offs,
                            cache_modifier=".cg",
                        )
                    c_desc.store([pm * BM, pn * BN], tot.to(out_ty))
                    tl.atomic_xchg(cnt + t_local, 0)
            it = (t_local + 1) * kt


@triton.jit
def sk_gemm_kernel(
    a, b, c, ws, cnt, M, N, K, DP_TILES, SK_TILES, SK_PROGS,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    SK_FIRST: tl.constexpr, WS_TMA: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    a_desc = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    c_desc = tl.make_tensor_descriptor(c, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    ws_desc = tl.make_tensor_descriptor(
        ws, shape=[2 * tl.num_programs(0) * BM, BN], strides=[BN, 1], block_shape=[BM, BN // 2]
    )
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    kt = tl.cdiv(K, BK)
    out_ty = c.dtype.element_ty
    if SK_FIRST:
        _sk_phase(
            a_desc, b_desc, c_desc, ws, cnt, pid, DP_TILES, SK_TILES, SK_PROGS, tiles_m,
            tiles_n, kt, BM, BN, BK, GROUP_M, out_ty, ws_desc, WS_TMA,
        )  # fmt: skip
    for t in tl.range(pid, DP_TILES, n_prog, flatten=True):
        pm, pn = _coords(t, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(kt):
            acc = _dot(a_desc.load([pm * BM, kk * BK]), b_desc.load([kk * BK, pn * BN]), acc)
        c_desc.store([pm * BM, pn * BN], acc.to(out_ty))
    if not SK_FIRST:
        _sk_phase(
            a_desc, b_desc, c_desc, ws, cnt, pid, DP_TILES, SK_TILES, SK_PROGS, tiles_m,
            tiles_n, kt, BM, BN, BK, GROUP_M, out_ty, ws_desc, WS_TMA,
        )  # fmt: skip


CONFIGS = {  # name: (BM, BN, BK, GROUP_M, warps, stages, programs per SM)
    "128x256w8s3": (128, 256, 64, 8, 8, 3, 1),
    "128x128w4s5": (128, 128, 64, 8, 4, 5, 1),
    "128x128w8s4": (128, 128, 64, 8, 8, 4, 1),
}
#: ``--small``: tiles of 64 rows (one warpgroup), one or two programs per SM, no stream-K
SMALL = {
    "64x128w4s4": (64, 128, 64, 8, 4, 4, 1),
    "64x128w4s4x2": (64, 128, 64, 8, 4, 4, 2),
    "64x256w4s4": (64, 256, 64, 8, 4, 4, 1),
    "64x256w4s3x2": (64, 256, 64, 8, 4, 3, 2),
    "128x128w4s3x2": (128, 128, 64, 8, 4, 3, 2),
}


def plan(m, n, k, cfg, sms, sk_waves: int, min_iters: int):
    """``(DP, SK, SK_PROGS)``: the last partial wave (and ``sk_waves - 1`` full waves
    before it) as stream-K tiles, over at most ``sms`` programs with ``min_iters`` k
    iterations or more each; ``sk_waves`` 0: no stream-K phase."""
    bm, bn, bk = cfg[:3]
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    kt = math.ceil(k / bk)
    rem = tiles % sms
    if sk_waves == 0 or rem == 0:
        return tiles, 0, 0
    sk = min(tiles, rem + (sk_waves - 1) * sms)
    progs = max(1, min(sms, sk * kt // min_iters))
    return tiles - sk, sk, progs


def runner(a, b, c, cfg, dp, sk, progs, sk_first, sms, ws_tma=False):
    bm, bn, bk, gm, warps, stages, per_sm = cfg
    sms *= per_sm
    ws = torch.empty(2 * sms * bm * bn, device=a.device, dtype=torch.float32)
    cnt = torch.zeros(max(sk, 1), device=a.device, dtype=torch.int32)
    m, k = a.shape
    n = b.shape[1]
    grid = (sms,)

    def run():
        sk_gemm_kernel[grid](
            a, b, c, ws, cnt, m, n, k, dp, sk, progs, BM=bm, BN=bn, BK=bk, GROUP_M=gm,
            SK_FIRST=sk_first, WS_TMA=ws_tma, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--min-iters", type=int, nargs="+", default=[8])
    p.add_argument("--sk-waves", type=int, nargs="+", default=[1, 2])
    p.add_argument("--small", action="store_true", help="also the 64-row tiles (no stream-K)")
    p.add_argument("--no-sk", action="store_true", help="no stream-K variants")
    p.add_argument("--out")
    args = p.parse_args()
    install_scratch_allocator()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = []
    for model in list(MODELS) + list(OTHER_MODELS):
        for m in args.ms:
            for w in args.worlds:
                for op in ("ag_gemm", "gemm_rs"):
                    s = model_shape(op, model, m, w)
                    if (s.M, s.N, s.K) not in [x[2:] for x in shapes]:
                        shapes.append((model, w, s.M, s.N, s.K))
    results = []
    print(f"{torch.cuda.get_device_name()} ({sms} SMs); time / cuBLAS per variant")
    for model, w, m, n, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(3)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5
        ref = a.float() @ b.float()
        ref_out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        lib_out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        names = ["cublas", "library"]
        fns = [
            graph_of(None, lambda a=a, b=b, o=ref_out: torch.matmul(a, b, out=o)).replay,
            graph_of(None, lambda a=a, b=b, o=lib_out: matmul(a, b, out=o)).replay,
        ]
        errs = {"library": rel_err(lib_out, ref)}
        keep = []  # the variants' closures hold their output, workspace and counters
        configs = CONFIGS | (SMALL if args.small else {})
        for cname, cfg in configs.items():
            variants = {(0, 8, False, False)}
            for waves in [] if args.no_sk or cfg[0] < 128 or cfg[6] > 1 else args.sk_waves:
                for mi in args.min_iters:
                    for first in (False, True):
                        for ws_tma in (False, True):
                            variants.add((waves, mi, first, ws_tma))
            seen = set()
            for waves, mi, first, ws_tma in sorted(variants):
                dp, sk, progs = plan(m, n, k, cfg, sms, waves, mi)
                key = (dp, sk, progs, first, ws_tma) if sk else (dp,)
                if key in seen:
                    continue
                seen.add(key)
                c = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                run = runner(a, b, c, cfg, dp, sk, progs, first, sms, ws_tma)
                run()
                run()  # the counters must be clear for a second call
                err = rel_err(c, ref)
                name = f"{cname} dp{dp} sk{sk}/{progs}" + (
                    (" first" if first else "") + (" tma" if ws_tma else "") if sk else ""
                )
                errs[name] = err
                if not err < 2e-2:
                    print(f"  {name}: rel err {err:.3g}, not timed")
                    continue
                names.append(name)
                keep.append(run)
                fns.append(graph_of(None, run).replay)
        times = paired_median_ms(None, fns, args.iters, 5)
        t_ref = times[0]
        row = {"model": model, "as_world": w, "M": m, "N": n, "K": k, "t_cublas_ms": t_ref,
               "variants": {nm: {"t_ms": t, "x_cublas": t / t_ref, "rel_err": errs.get(nm)}
                            for nm, t in zip(names[1:], times[1:])}}  # fmt: skip
        results.append(row)
        best = min(row["variants"].items(), key=lambda kv: kv[1]["t_ms"])
        lib_x = row["variants"]["library"]["x_cublas"]
        print(
            f"{model:11} W{w} {m}x{n}x{k}: cuBLAS {t_ref:.4f} ms, library {lib_x:.3f}, "
            f"best {best[0]} {best[1]['x_cublas']:.3f}"
        )
        for nm, v in sorted(row["variants"].items(), key=lambda kv: kv[1]["t_ms"]):
            print(f"    {nm:34} {v['x_cublas']:.3f}  err {v['rel_err']:.2e}")
    lib = [r["variants"]["library"]["x_cublas"] for r in results]
    best = [min(v["x_cublas"] for v in r["variants"].values()) for r in results]
    gm = statistics.geometric_mean
    print(
        f"library: worst {max(lib):.3f}, geomean {gm(lib):.3f}; best per shape: worst "
        f"{max(best):.3f}, geomean {gm(best):.3f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
