"""The sequence-parallel attention forward on Hopper, in Gluon (stock Triton's
``triton.experimental.gluon``): the schedule of ``attention.sp_attn_fwd_kernel`` (same
arguments, masks, chunk waits and outputs) with its warps specialised.

One program per 128 query rows and batch x head, in three partitions:

* a one-warp **loader**: both query tiles, then every key block the program sees, K and V
  by TMA into rings of ``STAGES`` slots (an mbarrier per slot fills, another empties
  when both warpgroups have read it). It walks the chunks in the order the peers' copies
  land (the local chunk, then ``rank - 1``, ``rank - 2``, ...) and waits on a peer's arrival
  flag before its first load from that chunk (a chunk the block does not see is neither
  waited for nor read);
* two **consumer warpgroups** of 64 query rows each, over the same key blocks. Per key
  block ``g`` a warpgroup issues ``S_{g+1} = Q K_{g+1}^T`` and ``O += P_g V_g`` together, hands
  the tensor cores to the other warpgroup (a pair of mbarriers orders the two: while one
  computes its softmax the other's products run), then computes the online softmax of
  ``S_{g+1}`` while its own ``P V`` may still run.

The blocks of every chunk come as in the Triton kernel: those no row masks first, then the
masked ones (the causal diagonal, document edges), from ``attention._block_ranges``; the
masks follow ``attention._mask``'s rules (built here: a partition that calls ``_mask``
fails Triton 3.6's lowering). Requires ``S_loc`` a multiple of 128 (the tiles
are read through 2-D views of ``[rows, d]``) and ``d`` 64 or 128; ``sp_attention`` picks this
kernel on Hopper GPUs where those hold (``hopper_forward``) and the Triton kernel elsewhere.
On one H200 (rank 0 of 4, waits met, ``bench attention``): 582-659 TFLOP/s non-causal and
543-616 causal at S 16k-64k, 0.88-1.09 x SDPA's fastest backend, against 1.17-1.49 x
this time for the Triton kernel (``benchmarks/results/2026-11-29-h200-w1.json``); the same
schedule without chunks or masks ran at 653 TFLOP/s against cuDNN's 660 at S 16k
(benchmarks/results/history/2026-11-29-h200-w1-gluon-attention.txt).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .attention import (
    _block_ranges,
    _exit_clear,
    _fwd_window,
    _masked_block,
    _peer_chunk,
    _pos,
    _query_program,
)

#: query rows per warpgroup and per program
WG_M = gl.constexpr(64)
BLOCK_M = gl.constexpr(128)


@gluon.jit
def _chunk(t, rank, vlo, vhi, flo, fhi, S_loc, half, BLOCK_N: gl.constexpr,
           WORLD: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """Step ``t``'s chunk (``rank - t``: the local one first, then the peers' in arrival
    order) and its block ranges."""
    c = (rank + WORLD - t) % WORLD
    jlo, jf_lo, jf_hi, jhi = _block_ranges(
        vlo, vhi, flo, fhi, c, S_loc, half, BLOCK_N, WORLD, CAUSAL
    )
    return c, jlo, jf_lo, jf_hi, jhi


@gluon.jit
def _block(i, jlo, jf_lo, jf_hi):
    """The ``i``-th block of a chunk (the unmasked ones first) and whether it is masked."""
    n_full = jf_hi - jf_lo
    masked = i >= n_full
    j = gl.where(masked, _masked_block(i - n_full, jlo, jf_lo, jf_hi), jf_lo + i)
    return j, masked


@gluon.jit
def _n_blocks(rank, vlo, vhi, flo, fhi, S_loc, half, BLOCK_N: gl.constexpr,
              WORLD: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """Key blocks the program sees, over every chunk."""
    n = 0
    for t in range(WORLD):
        c, jlo, jf_lo, jf_hi, jhi = _chunk(
            t, rank, vlo, vhi, flo, fhi, S_loc, half, BLOCK_N, WORLD, CAUSAL
        )
        n += jhi - jlo
    return n


@gluon.jit
def _load_block(desc, peer_desc, smem, full, empty, s, ph, r, local):
    """Once ring slot ``s`` is free (``empty``, parity ``ph``), a TMA load of rows ``r ..``
    into it, from the local K / V (``local``) or the gathered peers' (``peer_desc``)."""
    mbarrier.wait(empty.index(s), ph)
    mbarrier.expect(full.index(s), desc.block_type.nbytes)
    if local:
        tma.async_copy_global_to_shared(desc, [r, 0], full.index(s), smem.index(s))
    else:
        tma.async_copy_global_to_shared(peer_desc, [r, 0], full.index(s), smem.index(s))


@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, kp_desc, vp_desc, q_smem, k_smem, v_smem, q_bar,
               k_full, k_empty, v_full, v_empty, q_row, kv_row, rank, vlo, vhi, flo, fhi,
               S_loc, half, sig, arrival, err, max_spins, BKV, n_total, WORLD: gl.constexpr,
               CAUSAL: gl.constexpr, WAIT: gl.constexpr):  # fmt: skip
    """The TMA partition: the two query tiles, then the program's key blocks in order, a
    ring slot refilled once both warpgroups have released it (tile sizes read off the
    buffers' shapes)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    for wg in gl.static_range(2):
        mbarrier.expect(q_bar.index(wg), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [q_row + wg * WG_M, 0], q_bar.index(wg), q_smem.index(wg)
        )
    t = 0
    c, jlo, jf_lo, jf_hi, jhi = _chunk(
        0, rank, vlo, vhi, flo, fhi, S_loc, half, BLOCK_N, WORLD, CAUSAL
    )
    base = kv_row * S_loc  # first row of the chunk in its 2-D view
    i = 0
    for g in range(n_total):
        while i >= jhi - jlo:  # the next chunk with a visible block (peers': after its flag)
            t += 1
            c = (rank + WORLD - t) % WORLD
            row, jlo, jf_lo, jf_hi, jhi = _peer_chunk(
                c, vlo, vhi, flo, fhi, rank, sig, arrival, err, max_spins, BKV, kv_row,
                S_loc, half, BLOCK_N, WORLD, CAUSAL, WAIT,
            )  # fmt: skip
            base = row * S_loc
            i = 0
        j, masked = _block(i, jlo, jf_lo, jf_hi)
        s = g % STAGES
        ph = ((g // STAGES) & 1) ^ 1  # a fresh barrier passes the wait for parity 1
        r = base + j * BLOCK_N
        _load_block(k_desc, kp_desc, k_smem, k_full, k_empty, s, ph, r, t == 0)
        _load_block(v_desc, vp_desc, v_smem, v_full, v_empty, s, ph, r, t == 0)
        i += 1


@gluon.jit
def _softmax(qk, m_i, l_i, masked, q_pos, j, c, S_loc, half, seg, qk_scale,
             s_layout: gl.constexpr, row_o: gl.constexpr, WORLD: gl.constexpr,
             CAUSAL: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """Online softmax of one block of logits (base 2): the probabilities, the rescale of
    the earlier rows (in the output's row layout) and the new row max and sum. A masked
    block's hidden logits are ``-inf`` (``attention._mask``'s rules: causal order, the
    same document); a row with nothing visible yet keeps ``m = -inf``
    (its offset is taken as 0 so no ``inf - inf`` arises)."""
    BLOCK_N: gl.constexpr = qk.shape[1]
    if CAUSAL or VARLEN:  # else no block is masked: every row sees every key
        if masked:
            k_idx = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            k_pos = gl.expand_dims(_pos(k_idx, c, S_loc, half, WORLD, CAUSAL), 0)
            # (every row and key is inside its chunk: S_loc is a multiple of the blocks)
            if VARLEN:
                ok = gl.load(seg + k_pos) == gl.expand_dims(gl.load(seg + q_pos), 1)
                if CAUSAL:
                    ok = ok & (k_pos <= gl.expand_dims(q_pos, 1))
            else:
                ok = k_pos <= gl.expand_dims(q_pos, 1)
            qk = gl.where(ok, qk, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    m_use = m_new
    if CAUSAL or VARLEN:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, gl.convert_layout(alpha, row_o), m_new, l_i


@gluon.jit
def _ws_consumer(wg: gl.constexpr, o_desc, lse, seg, q_smem, k_smem, v_smem, q_bar, k_full,
                 k_empty, v_full, v_empty, turn, q_row, m0, bh, rank, vlo, vhi, flo, fhi,
                 S_loc, half, qk_scale, n_total, WORLD: gl.constexpr, CAUSAL: gl.constexpr,
                 VARLEN: gl.constexpr):  # fmt: skip
    """Warpgroup ``wg``'s 64 query rows over the program's key blocks (the loader's
    order). Each step takes its turn on the tensor cores (``turn``), issues the next
    block's ``Q K^T`` and this block's ``P V``, passes the turn, then the next block's
    softmax. Writes its rows of ``o`` (TMA, staged in its Q tile) and ``lse``."""
    D: gl.constexpr = q_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    other: gl.constexpr = 1 - wg
    q = q_smem.index(wg)
    q_idx = m0 + wg * WG_M + gl.arange(0, WG_M, layout=row_s)
    q_pos = _pos(q_idx, rank, S_loc, half, WORLD, CAUSAL)
    s_zero = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)

    # the first block
    t = 0
    c, jlo, jf_lo, jf_hi, jhi = _chunk(
        0, rank, vlo, vhi, flo, fhi, S_loc, half, BLOCK_N, WORLD, CAUSAL
    )
    j, masked = _block(0, jlo, jf_lo, jf_hi)
    i = 1
    mbarrier.wait(q_bar.index(wg), 0)
    mbarrier.wait(k_full.index(0), 0)
    mbarrier.wait(turn.index(wg), 0)
    qk = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)  # fmt: skip
    mbarrier.arrive(turn.index(other))
    qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
    mbarrier.arrive(k_empty.index(0))
    m_i = gl.full([WG_M], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([WG_M], gl.float32, row_s)
    p, alpha, m_i, l_i = _softmax(qk, m_i, l_i, masked, q_pos, j, c, S_loc, half, seg,
                                  qk_scale, s_layout, row_o, WORLD, CAUSAL, VARLEN)  # fmt: skip
    o = gl.zeros([WG_M, D], gl.float32, o_layout)
    for g in range(n_total - 1):
        while i >= jhi - jlo:  # the next chunk with a visible block
            t += 1
            c, jlo, jf_lo, jf_hi, jhi = _chunk(
                t, rank, vlo, vhi, flo, fhi, S_loc, half, BLOCK_N, WORLD, CAUSAL
            )
            i = 0
        j, masked = _block(i, jlo, jf_lo, jf_hi)
        i += 1
        nxt = (g + 1) % STAGES
        cur = g % STAGES
        mbarrier.wait(k_full.index(nxt), ((g + 1) // STAGES) & 1)
        mbarrier.wait(turn.index(wg), (g + 1) & 1)
        qk = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
        o = o * gl.expand_dims(alpha, 1)
        mbarrier.wait(v_full.index(cur), (g // STAGES) & 1)
        p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        acc = warpgroup_mma(p16, v_smem.index(cur), o, is_async=True)
        mbarrier.arrive(turn.index(other))
        qk = warpgroup_mma_wait(num_outstanding=1, deps=[qk])
        mbarrier.arrive(k_empty.index(nxt))
        p, alpha, m_i, l_i = _softmax(qk, m_i, l_i, masked, q_pos, j, c, S_loc, half, seg,
                                      qk_scale, s_layout, row_o, WORLD, CAUSAL,
                                      VARLEN)  # fmt: skip
        o = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(v_empty.index(cur))
    # the last block's P V
    cur = (n_total - 1) % STAGES
    o = o * gl.expand_dims(alpha, 1)
    mbarrier.wait(v_full.index(cur), ((n_total - 1) // STAGES) & 1)
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    mbarrier.wait(turn.index(wg), n_total & 1)
    acc = warpgroup_mma(p16, v_smem.index(cur), o, is_async=True)
    mbarrier.arrive(turn.index(other))
    o = warpgroup_mma_wait(num_outstanding=0, deps=[acc])

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = o / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    gl.store(lse + bh * S_loc + q_idx, m_i + gl.log2(l_safe))
    q.store(out.to(o_desc.dtype))  # the Q tile is read no more: the output's staging
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + wg * WG_M, 0], q)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_consumer_1(o_desc, lse, seg, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                   v_empty, turn, q_row, m0, bh, rank, vlo, vhi, flo, fhi, S_loc, half,
                   qk_scale, n_total, WORLD: gl.constexpr, CAUSAL: gl.constexpr,
                   VARLEN: gl.constexpr):  # fmt: skip
    """Warpgroup 1 (a worker partition: its index cannot come as an argument)."""
    _ws_consumer(1, o_desc, lse, seg, q_smem, k_smem, v_smem, q_bar, k_full, k_empty,
                 v_full, v_empty, turn, q_row, m0, bh, rank, vlo, vhi, flo, fhi, S_loc, half,
                 qk_scale, n_total, WORLD, CAUSAL, VARLEN)  # fmt: skip


@gluon.jit
def sp_attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, kp_desc, vp_desc, o_desc, lse, seg, cu, sig, err, rank,
    max_spins, arrival, qk_scale, S_loc, half, H, HKV,
    WORLD: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, WAIT: gl.constexpr,
    CLEAR: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """``attention.sp_attn_fwd_kernel`` on a ``(S_loc / 128, batch x heads)`` grid with
    2-D descriptors: ``q_desc`` / ``o_desc`` over ``[batch x heads x S_loc, d]`` (blocks of
    64 rows), ``k_desc`` / ``v_desc`` over the local ``[batch x kv_heads x S_loc, d]`` and
    ``kp_desc`` / ``vp_desc`` over the gathered ``[W x batch x kv_heads x S_loc, d]`` (blocks
    of ``BLOCK_N`` rows). Launched with 4 warps (the first warpgroup); the second
    warpgroup and the loader are worker partitions."""
    pid_m, bh = _query_program(half, BLOCK_M, CAUSAL, VARLEN)
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BH = gl.num_programs(1)
    GROUP = H // HKV
    BKV = BH // GROUP
    kv_row = (bh // H) * HKV + (bh % H) // GROUP
    m0 = pid_m * BLOCK_M
    q_row = bh * S_loc + m0
    qmin = _pos(m0, rank, S_loc, half, WORLD, CAUSAL)
    qmax = _pos(m0 + BLOCK_M - 1, rank, S_loc, half, WORLD, CAUSAL)
    vlo, vhi, flo, fhi = _fwd_window(qmin, qmax, S_loc, seg, cu, WORLD, CAUSAL, VARLEN)
    n_total = _n_blocks(rank, vlo, vhi, flo, fhi, S_loc, half, BLOCK_N, WORLD, CAUSAL)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, WG_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_full.index(s), count=1)
        mbarrier.init(v_full.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # both warpgroups release a slot
        mbarrier.init(v_empty.index(s), count=2)
    mbarrier.arrive(turn.index(0))  # warpgroup 0 takes the first turn
    # the partitions' arguments as tuple literals: a tuple assigned to a name first would
    # turn its compile-time constants into values
    gl.warp_specialize(
        [
            (_ws_consumer, (0, o_desc, lse, seg, q_smem, k_smem, v_smem, q_bar, k_full,
                            k_empty, v_full, v_empty, turn, q_row, m0, bh, rank, vlo, vhi,
                            flo, fhi, S_loc, half, qk_scale, n_total, WORLD, CAUSAL, VARLEN)),
            (_ws_consumer_1, (o_desc, lse, seg, q_smem, k_smem, v_smem, q_bar, k_full,
                              k_empty, v_full, v_empty, turn, q_row, m0, bh, rank, vlo, vhi,
                              flo, fhi, S_loc, half, qk_scale, n_total, WORLD, CAUSAL,
                              VARLEN)),
            (_ws_loader, (q_desc, k_desc, v_desc, kp_desc, vp_desc, q_smem, k_smem, v_smem,
                          q_bar, k_full, k_empty, v_full, v_empty, q_row, kv_row, rank, vlo,
                          vhi, flo, fhi, S_loc, half, sig, arrival, err, max_spins, BKV,
                          n_total, WORLD, CAUSAL, WAIT)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip
    if CLEAR:
        _exit_clear(sig, arrival, rank, err, max_spins, WORLD)
