"""Distributed flash-decode kernels: a split-KV decode kernel that leaves each rank's
partial output and log-sum-exp in the ranks that merge them, and the merge kernel.

Layout. ``q [B, HQ, D]`` (one query token per sequence); the rank's KV cache shard
``k, v [B, HKV, L, D]`` (any strides, unit stride along ``D``); ``HQ = HKV * G``. One
program of ``split_decode_kernel`` handles one ``(sequence, kv head, split)``: it loads
the ``G`` query heads of its kv head together (grouped-query attention), so every K/V
block is read once for all of them, and runs the online softmax in base 2 over its split
of the sequence. Partials of the splits of one ``(sequence, kv head)`` go to a local
scratch; the program that finishes last (a per-group arrival counter) combines them by
log-sum-exp and stores the rank's partial ``(o, lse)`` straight into the symmetric
``push`` buffers of every rank that merges (SM stores into peer memory). The program
that finishes the whole launch last bumps this rank's epoch and raises the
``arrive[rank]`` flag of every merging rank to it.

Epochs, not resets. Each rank's signal pad holds an ``epoch`` word: the number of calls
so far, bumped by the decode kernel. Flags are set to the epoch (never reset) and waited
on with ``>=``, and partials go to buffer parity ``epoch % 2``, so a call needs no
clearing launch and a CUDA-graph replay works as an eager call does. Parity reuse is
safe: a rank writes parity ``p`` again two calls later, and when every rank merges, that
rank has by then waited for each peer's next flag, which each peer raises only after its
own merge of the older call (stream order). When one ``owner`` merges, nothing orders the
other ranks after it, so the owner's merge acknowledges its epoch in each rank's ``ack``
word and a rank waits for ``ack >= epoch - 2`` before it overwrites a parity.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import (
    INTERPRETED,
    guard,
    notify,
    peer_ptr_aligned,
    rounded,
    signal_base,
    wait,
)
from ..language.trace import (
    EV_END,
    EV_NOTIFY,
    EV_START,
    EV_TILE_END,
    EV_WAIT_BEGIN,
    EV_WAIT_END,
    trace_event,
    trace_step,
)  # fmt: skip


@triton.jit
def _dot(a, b):
    """``tl.dot`` in float32 accumulation; operands widened to float32 under
    ``TRITON_INTERPRET``, whose ``tl.dot`` mishandles bfloat16."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _merge_step(m, l_sum, acc, lse_j, o_j):
    """Fold one partial ``(o_j, lse_j)`` (base-2 log-sum-exp, ``-inf`` where empty) into
    the running ``(max, sum, acc)`` of a log-sum-exp merge."""
    m_new = tl.maximum(m, lse_j)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    w = tl.exp2(lse_j - m_safe)
    return m_new, l_sum * alpha + w, acc * alpha[:, None] + w[:, None] * o_j


@triton.jit
def _merged(m, l_sum, acc):
    """The merged output and its base-2 log-sum-exp (``0`` and ``-inf`` where empty)."""
    full = l_sum > 0
    o = acc / tl.where(full, l_sum, 1.0)[:, None]
    lse = tl.where(full, m + tl.log2(tl.where(full, l_sum, 1.0)), float("-inf"))
    return o, lse


@triton.jit
def split_decode_kernel(
    q, k, v, lens, part_o, part_lse, push_o, push_lse, o_table, lse_table, sig_table,
    err, rank, world, owner, max_spins, count_first, epoch_slot, arrive_first, ack_slot,
    n_groups, kv_cap, split_len, n_splits, max_rows,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_LENS: tl.constexpr, ONE_SPLIT: tl.constexpr,
    OWNER_ONLY: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """One program per ``(sequence b, kv head, split)``, program id ``group * n_splits +
    split``; see the module docstring. ``lens [B]`` (``HAS_LENS``): each sequence's valid
    KV length in this rank's shard (at most ``kv_cap``). ``qk_scale`` is the softmax scale
    times log2(e). ``part_o [B * HQ, n_splits, D]`` and ``part_lse [B * HQ, n_splits]``
    are local float32 scratch (unused with ``ONE_SPLIT``); ``push_o [2, world, max_rows,
    D]`` and ``push_lse [2, world, max_rows]`` the symmetric partial buffers; signal slots
    ``count_first .. + n_groups`` (arrival counters, left zero) on the local pad.

    Traced (``language.trace``; program ``p`` of ``P`` owns tiles ``p``, ``p + P`` and ``p +
    2 P``): program start / end; the split's end (tile ``p``: split, group); in the group's
    last program the combine's end (tile ``p + P``, several splits only) and, as tile ``p +
    2 P``, the wait for the owner's acknowledgement (``OWNER_ONLY``; begin: ack slot, epoch
    - 2; end: the same), the end of the pushes and, in the launch's last program,
    the arrival flags raised (notify: epoch, the rank flagged, -1 = every rank)."""
    pid = tl.program_id(0)
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    bh = pid // n_splits
    split = pid % n_splits
    b = bh // HKV
    hk = bh % HKV
    sig = signal_base(sig_table, rank)

    length = kv_cap
    if HAS_LENS:
        length = tl.minimum(tl.load(lens + b), kv_cap)
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    heads = hk * G + offs_g
    qv = tl.load(
        q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None], other=0.0,
    )  # fmt: skip
    k_base = k + b.to(tl.int64) * stride_kb + hk * stride_kh
    v_base = v + b.to(tl.int64) * stride_vb + hk * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        cmask = cols < end
        rows = cols.to(tl.int64)
        kt = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=cmask[:, None],
                     other=0.0)  # fmt: skip
        vt = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=cmask[:, None],
                     other=0.0)  # fmt: skip
        s = _dot(qv, tl.trans(kt)) * qk_scale
        s = tl.where(cmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt)
        m_i = m_new
    o, lse = _merged(m_i, l_i, acc)
    trace_step(TRACE, tbuf, EV_TILE_END, 0, split, bh)

    rows_q = b * (HKV * G) + heads  # this program's rows of [B * HQ]
    last = True
    if not ONE_SPLIT:
        scratch = rows_q * n_splits + split
        tl.store(part_o + scratch[:, None] * D + offs_d[None, :], o, mask=gmask[:, None])
        tl.store(part_lse + scratch, lse, mask=gmask)
        tl.debug_barrier()
        arrived = tl.atomic_add(sig + count_first + bh, 1, sem="acq_rel", scope="gpu")
        last = arrived == n_splits - 1
        if last:  # every split of this (sequence, kv head) is in the scratch: combine
            tl.debug_barrier()
            tl.atomic_xchg(sig + count_first + bh, 0, sem="relaxed", scope="gpu")
            m_c = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_c = tl.zeros([BLOCK_G], tl.float32)
            acc_c = tl.zeros([BLOCK_G, D], tl.float32)
            for j in range(n_splits):
                at = rows_q * n_splits + j
                lse_j = tl.load(part_lse + at, mask=gmask, other=float("-inf"),
                                cache_modifier=".cg")  # fmt: skip
                o_j = tl.load(part_o + at[:, None] * D + offs_d[None, :], mask=gmask[:, None],
                              other=0.0, cache_modifier=".cg")  # fmt: skip
                m_c, l_c, acc_c = _merge_step(m_c, l_c, acc_c, lse_j, o_j)
            o, lse = _merged(m_c, l_c, acc_c)
            trace_step(TRACE, tbuf, EV_TILE_END, 1, n_splits, bh)

    if last:  # push this rank's partial of the group to every rank that merges it
        epoch = tl.load(sig + epoch_slot, volatile=True) + 1  # this call's epoch
        parity = epoch % 2
        row0 = (parity * world + rank) * max_rows
        o_at = push_o + (row0 + rows_q)[:, None].to(tl.int64) * D + offs_d[None, :]
        lse_at = push_lse + row0 + rows_q
        if OWNER_ONLY:
            if owner != rank:  # the owner must be done with this parity's older call
                trace_step(TRACE, tbuf, EV_WAIT_BEGIN, 2, ack_slot, epoch - 2)
                wait(sig + ack_slot, epoch - 2, err, rank, ack_slot, max_spins)
                trace_step(TRACE, tbuf, EV_WAIT_END, 2, ack_slot, epoch - 2)
            tl.store(peer_ptr_aligned(o_at, o_table, rank, owner), o, mask=gmask[:, None])
            tl.store(peer_ptr_aligned(lse_at, lse_table, rank, owner), lse, mask=gmask)
        else:
            for i in range(world):
                dest = (rank + i) % world
                tl.store(peer_ptr_aligned(o_at, o_table, rank, dest), o, mask=gmask[:, None])
                tl.store(peer_ptr_aligned(lse_at, lse_table, rank, dest), lse, mask=gmask)
        trace_step(TRACE, tbuf, EV_TILE_END, 2, n_splits, bh)
        tl.debug_barrier()
        done = tl.atomic_add(sig + count_first + n_groups, 1, sem="acq_rel", scope="sys")
        if done == n_groups - 1:  # the launch's last group: publish the epoch
            tl.atomic_xchg(sig + count_first + n_groups, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sig + epoch_slot, epoch, sem="relaxed", scope="gpu")
            if OWNER_ONLY:
                notify(signal_base(sig_table, owner) + arrive_first + rank, epoch)
                trace_step(TRACE, tbuf, EV_NOTIFY, 2, epoch, owner)
            else:
                for i in range(world):
                    dest = (rank + i) % world
                    notify(signal_base(sig_table, dest) + arrive_first + rank, epoch)
                trace_step(TRACE, tbuf, EV_NOTIFY, 2, epoch, -1)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def merge_kernel(
    push_o, push_lse, out, sig_table, err, rank, world, max_spins, epoch_slot,
    arrive_first, ack_slot, done_slot, n_rows, max_rows, stride_ob, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, ACK: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """Each program merges ``BLOCK_R`` rows of ``[B * HQ]``: for every source rank (its
    own first, then rank-rotated) it waits until ``arrive[src]`` reaches this call's
    epoch (read from the local pad, where this rank's decode kernel just bumped it), then
    folds in that rank's partial by log-sum-exp; writes ``out [B, HQ, D]`` (strides
    ``stride_ob, stride_oh``, unit along ``D``). With ``ACK`` (one owner merges) the last
    program to finish writes the epoch into every other rank's ``ack`` word.

    Traced (``language.trace``; step ``i`` of program ``p`` of ``P`` is tile ``p + i P``):
    program start / end; per source rank (step ``i``) the wait for its flag (begin: source,
    epoch; end: source, token) and the end of its fold (source, program); with ``ACK`` the
    acknowledgements written (a notify in the first step's slots: epoch, -1 = every other
    rank)."""
    pid = tl.program_id(0)
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    sig = signal_base(sig_table, rank)
    epoch = tl.load(sig + epoch_slot, volatile=True)
    parity = epoch % 2
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    rmask = rows < n_rows
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for i in range(world):
        src = (rank + i) % world
        token = epoch
        if src != rank:
            trace_step(TRACE, tbuf, EV_WAIT_BEGIN, i, src, epoch)
            token = wait(sig + arrive_first + src, epoch, err, rank, arrive_first + src,
                         max_spins)  # fmt: skip
            trace_step(TRACE, tbuf, EV_WAIT_END, i, src, token)
        mask = guard(rmask, token, epoch)
        row0 = (parity * world + src) * max_rows
        lse_j = tl.load(push_lse + row0 + rows, mask=mask, other=float("-inf"))
        o_j = tl.load(push_o + (row0 + rows)[:, None].to(tl.int64) * D + offs_d[None, :],
                      mask=mask[:, None], other=0.0)  # fmt: skip
        m, l_sum, acc = _merge_step(m, l_sum, acc, lse_j, o_j)
        trace_step(TRACE, tbuf, EV_TILE_END, i, src, pid)
    o, _ = _merged(m, l_sum, acc)
    dst = out + (rows // HQ)[:, None] * stride_ob + (rows % HQ)[:, None] * stride_oh
    tl.store(dst + offs_d[None, :], rounded(o, out.dtype.element_ty), mask=rmask[:, None])
    if ACK:
        tl.debug_barrier()
        done = tl.atomic_add(sig + done_slot, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.atomic_xchg(sig + done_slot, 0, sem="relaxed", scope="gpu")
            for i in range(1, world):
                src = (rank + i) % world
                notify(signal_base(sig_table, src) + ack_slot, epoch)
            trace_step(TRACE, tbuf, EV_NOTIFY, 0, epoch, -1)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)
