"""A flash-attention forward written in Gluon (``triton.experimental.gluon``, stock Triton)
with the softmax of key block ``j`` overlapped with the ``Q K^T`` of block ``j + 1`` inside
each warpgroup, against the library's Triton forward and torch SDPA on one GPU.

Why: the library's Triton forward runs at 486-502 TFLOP/s on an H200 at every length
while cuDNN reaches 651 at S 16k (``benchmarks/NOTES.md``, 2026-11-29, twelfth session);
Triton's compiler does not overlap a warpgroup's softmax with its next product, and its
Hopper warp specialisation measured slower. Gluon issues ``wgmma`` asynchronously and
waits for named groups, so the schedule is written out:

    S_0 = Q K_0^T                                  (waited)
    for j:  issue S_{j+1} = Q K_{j+1}^T            (async)
            softmax of S_j -> P_j, row max / sum
            wait for PV_{j-1} (S_{j+1} may run on)  -> rescale O, refill the freed K/V slot
            issue O += P_j V_j                      (async)
            wait for S_{j+1} (PV_j may run on)

K / V blocks arrive by TMA into rings of ``STAGES`` slots, each slot with an mbarrier. One
chunk, not causal, GQA by head groups; the per-rank problem of ``bench attention`` at
S 16k as rank 0 of 4 by default (queries ``S / W``, keys ``S``).

    python benchmarks/probes/gluon_attention.py [--seqs 16384 32768] \\
        [--configs 128,128,8,2,0 64,64,4,3,1]

Prints each config's time, TFLOP/s and relative error against float32, beside SDPA's
backends and the library's two forwards (waits met: the Triton kernel and the Hopper one,
``kernels/attention_hopper.py``) in the same run. Needs a Hopper GPU. This one-stream
schedule gained nothing over the Triton kernel; the warp-specialised one that did (first
written here, commit 9b6f5b3, numbers in benchmarks/results/history/
2026-11-29-h200-w1-gluon-attention.txt) is the library's Hopper forward.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


@gluon.jit
def _issue(desc, smem, bar, row, slot):
    """A TMA load of one key block (of K or V) into ring slot ``slot``."""
    mbarrier.expect(bar.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], bar.index(slot), smem.index(slot))


@gluon.jit
def _softmax_step(qk, m_i, l_i, qk_scale, row_o: gl.constexpr):
    """Online softmax of one block of logits: the probabilities, the rescale of the
    earlier rows (in the output's row layout) and the new row max and sum."""
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, gl.convert_layout(alpha, row_o), m_new, l_i


@gluon.jit
def gluon_attn_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, S_q, S_k, H, HKV, qk_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    OVERLAP_PV: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """One program per (query block, batch x head); ``S_k`` a multiple of ``BLOCK_N``
    with at least ``STAGES`` blocks. A K slot is refilled once its ``Q K^T`` is done, a V
    slot once its ``P V`` is: each load has one block step of the loop to land.
    ``q_desc`` / ``o_desc`` view ``[batch x heads x S_q, D]``, ``k_desc`` / ``v_desc``
    ``[batch x kv heads x S_k, D]``. ``OVERLAP_PV``: the ``P V`` product of a block runs
    on under the next block's softmax (ptxas may then serialise the wgmmas: its C7514
    warning); else it is waited for with the next ``Q K^T`` at the end of the block."""
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    kv = (bh // H) * HKV + (bh % H) // (H // HKV)
    q_row = bh * S_q + pid_m * BLOCK_M
    k_row = kv * S_k
    n = S_k // BLOCK_N

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(s), count=1)
        mbarrier.init(v_bar.index(s), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for s in gl.static_range(STAGES):
        _issue(k_desc, k_smem, k_bar, k_row + s * BLOCK_N, s)
        _issue(v_desc, v_smem, v_bar, k_row + s * BLOCK_N, s)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    qk = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)  # fmt: skip
    qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
    if STAGES < n:  # K_0's slot is free: K of block STAGES
        _issue(k_desc, k_smem, k_bar, k_row + STAGES * BLOCK_N, 0)

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    # the output accumulator is carried as an async wgmma's result (waited where read)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, D], gl.float32, o_layout))
    for j in range(n - 1):
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_bar.index(nxt), ((j + 1) // STAGES) & 1)
        qk_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero,
                                use_acc=False, is_async=True)  # fmt: skip
        p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, qk_scale, row_o)
        # O += P_{j-1} V_{j-1} is done: V's slot takes the block STAGES ahead of it
        o = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        if (j >= 1) & (j - 1 + STAGES < n):
            _issue(v_desc, v_smem, v_bar, k_row + (j - 1 + STAGES) * BLOCK_N, (j - 1) % STAGES)
        o = o * gl.expand_dims(alpha, 1)
        cur = j % STAGES
        mbarrier.wait(v_bar.index(cur), (j // STAGES) & 1)
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma(p16, v_smem.index(cur), o, is_async=True)
        if OVERLAP_PV:  # S_{j+1} is done, O += P_j V_j may run on into the next block
            qk = warpgroup_mma_wait(num_outstanding=1, deps=[qk_next])
        else:  # both done: no wgmma is in flight across the loop's back edge
            qk, o = warpgroup_mma_wait(num_outstanding=0, deps=[qk_next, acc])
            acc = warpgroup_mma_init(o)
        # K's slot takes the block STAGES ahead
        if j + 1 + STAGES < n:
            _issue(k_desc, k_smem, k_bar, k_row + (j + 1 + STAGES) * BLOCK_N, nxt)
    # the last block
    p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, qk_scale, row_o)
    o = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    o = o * gl.expand_dims(alpha, 1)
    cur = (n - 1) % STAGES
    mbarrier.wait(v_bar.index(cur), ((n - 1) // STAGES) & 1)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    o = warpgroup_mma(p16, v_smem.index(cur), o)

    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(s))
        mbarrier.invalidate(v_bar.index(s))
    out = o / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    q_smem.store(out.to(o_desc.dtype))  # Q's tile is no longer read: the output's staging
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    tma.store_wait(pendings=0)


def gluon_attention(q, k, v, block_m=128, block_n=128, num_warps=8, stages=2, overlap_pv=0):
    """``softmax(q k^T / sqrt(d)) v`` for ``q [B, H, S_q, D]``, ``k, v [B, HKV, S_k, D]``
    (bf16, contiguous; ``S_q`` a multiple of ``block_m``, ``S_k`` of ``block_n``)."""
    b, h, s_q, d = q.shape
    hkv, s_k = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lay_q = gl.NVMMASharedLayout.get_default_for([block_m, d], gl.bfloat16)
    lay_k = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    q2, o2 = q.view(b * h * s_q, d), o.view(b * h * s_q, d)
    k2, v2 = k.view(b * hkv * s_k, d), v.view(b * hkv * s_k, d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_m, d], lay_q)
    o_desc = TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [block_m, d], lay_q)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, d], lay_k)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, d], lay_k)
    grid = (s_q // block_m, b * h)
    gluon_attn_fwd_kernel[grid](
        q_desc, k_desc, v_desc, o_desc, s_q, s_k, h, hkv, LOG2E / math.sqrt(d),
        BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, OVERLAP_PV=bool(overlap_pv),
        num_warps=num_warps,
    )  # fmt: skip
    return o


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", nargs="*", type=int, default=[16384])
    p.add_argument("--as-world", type=int, default=4)
    p.add_argument("--configs", nargs="*",
                   default=["128,128,8,2,0", "64,64,4,3,0"],
                   help="block_m,block_n,warps,stages,overlap_pv")  # fmt: skip
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from interlace.bench.timing import median_ms

    heads, kv_heads, d = 32, 8, 128
    for s in args.seqs:
        s_q = s // args.as_world
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, heads, s_q, d, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(1, kv_heads, s, d, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(1, kv_heads, s, d, device="cuda", generator=gen).to(torch.bfloat16)
        kr, vr = (x.repeat_interleave(heads // kv_heads, 1) for x in (k, v))
        ref = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float())
        flops = 4 * heads * s_q * s * d
        rows = []
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
            with sdpa_kernel([backend]):
                sdpa = functools.partial(F.scaled_dot_product_attention, q, kr, vr)
                t = median_ms(None, sdpa, iters=args.iters, warmup=3)
            rows.append((f"sdpa {name}", t, None))
        from interlace.bench.attention import _PerRank
        from interlace.ops.attention.sp_attention import config_of

        per = _PerRank(s, False, args.as_world)  # the library's forwards, waits met
        per.flags_up()
        triton_fwd = functools.partial(per.fwd, cfg=config_of("fwd", d, "cuda", s))
        rows.append(("library triton", median_ms(None, triton_fwd, args.iters, warmup=3), None))
        rows.append(("library hopper", median_ms(None, per.fwd, args.iters, warmup=3), None))
        del per
        for text in args.configs:
            run = functools.partial(gluon_attention, q, k, v, *(int(x) for x in text.split(",")))
            try:
                o = run()
                torch.cuda.synchronize()
                err = float((o.float() - ref).norm() / ref.norm())
                t = median_ms(None, run, iters=args.iters, warmup=3)
            except Exception as e:  # noqa: BLE001 - a config that fails is reported
                print(f"gluon {text}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            rows.append((f"gluon {text}", t, err))
        for name, t, err in rows:
            e = "" if err is None else f"  rel err {err:.1e}"
            print(f"S={s:>6} {name:<22} {t:8.3f} ms {flops / t / 1e9:7.1f} TF/s{e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
