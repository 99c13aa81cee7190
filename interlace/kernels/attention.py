"""Flash-attention kernels of sequence-parallel attention (forward and backward).

Every rank holds ``S_loc`` tokens of Q, K and V (``[batch, heads, S_loc, d]``, K/V with
``kv_heads`` heads, GQA). The K/V chunk of rank ``c`` sits at the global token positions
given by the layout:

* contiguous (non-causal): local index ``i`` of rank ``c`` is position ``c * S_loc + i``;
* zigzag (causal): rank ``c`` holds the sequence chunks ``c`` and ``2W - 1 - c`` of length
  ``half = S_loc / 2``, so index ``i < half`` is at ``c * half + i`` and index ``i >= half``
  at ``(2W - 1 - c) * half + i - half``. Positions grow with the local index in both.

Packed variable-length sequences (``VARLEN``): ``seg[p]`` is the document of global
position ``p`` and ``cu`` its boundaries (``cu[s] .. cu[s + 1]``); a query sees only keys
of its own document (and, causal, at or before it).

Because positions grow with the local index, the keys of chunk ``c`` that a block of
queries sees form one index range, and those it sees *entirely* (no mask needed) a range
inside it: each kernel computes both from the block's first and last positions
(``_block_ranges``), runs the unmasked blocks in one loop and the rest (the causal
diagonal, document edges, a ragged tail) in a second loop with a mask, and skips fully
masked blocks. The same holds with the roles of queries and keys swapped (dK / dV).

Peers' chunks arrive in a gathered buffer ``[W * batch * kv_heads, S_loc, d]`` (chunk of
rank ``c`` at rows ``c * batch * kv_heads ...``), each behind an arrival flag raised by the
copy engine: a program waits on a chunk's flag before its first load from it, the load's
coordinate depending on the wait's token (``guard_coord``) so it cannot be hoisted above
the wait; a program whose block meets no visible position of a chunk (the causal mask,
documents) neither waits for nor reads it. The local chunk is read in place from the
caller's K / V. Softmax statistics are kept in base 2 (``qk_scale = sm_scale * log2(e)``);
``lse`` is stored in base 2 too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import (
    INTERPRETED,
    guard_coord,
    notify,
    peer_ptr_aligned,
    rounded,
    wait,
    wait_inline,
)
from ..language.trace import (
    EV_END,
    EV_NOTIFY,
    EV_START,
    EV_TILE_END,
    EV_WAIT_BEGIN,
    EV_WAIT_END,
    trace_event,
)  # fmt: skip

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc):
    """``acc + a @ b`` in float32. The interpreter's 16-bit dot is wrong, so there the
    operands are widened first."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _exp2(x, FAST_EXP: tl.constexpr):
    """``2 ** x`` for the probabilities of unmasked blocks (``x <= 0``). ``FAST_EXP`` 0:
    float32 (one special-function op per element); 1: ``ex2.approx.f16x2`` on ``x``
    rounded to float16, two elements per op, the result float16 (the special-function
    unit, not the tensor cores, bounds the softmax of a d = 128 block); 2:
    ``ex2.approx.ftz.bf16x2`` likewise in bfloat16. The probabilities are rounded to the
    inputs' 16-bit type for the ``P @ V`` product anyway. The interpreter rounds as the
    GPU would and takes the float32 exponential."""
    if FAST_EXP == 0:
        return tl.math.exp2(x)
    elif FAST_EXP == 1:
        if INTERPRETED:
            return tl.math.exp2(x.to(tl.float16).to(tl.float32)).to(tl.float16)
        else:
            return tl.inline_asm_elementwise(
                "ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                is_pure=True, pack=2,
            )  # fmt: skip
    else:
        if INTERPRETED:
            return tl.math.exp2(x.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
        else:
            return tl.inline_asm_elementwise(
                "ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)],
                dtype=tl.bfloat16, is_pure=True, pack=2,
            )  # fmt: skip


@triton.jit
def _count_le(x, c, S_loc, half, WORLD: tl.constexpr, ZIGZAG: tl.constexpr):
    """How many local indices of rank ``c``'s chunk sit at a global position <= ``x``."""
    if ZIGZAG:
        lo = tl.minimum(tl.maximum(x - c * half + 1, 0), half)
        hi = tl.minimum(tl.maximum(x - (2 * WORLD - 1 - c) * half + 1, 0), half)
        return lo + hi
    else:
        return tl.minimum(tl.maximum(x - c * S_loc + 1, 0), S_loc)


@triton.jit
def _pos(idx, c, S_loc, half, WORLD: tl.constexpr, ZIGZAG: tl.constexpr):
    """Global position of local index ``idx`` of rank ``c``'s chunk."""
    if ZIGZAG:
        return tl.where(idx < half, c * half + idx, (2 * WORLD - 1 - c) * half + idx - half)
    else:
        return c * S_loc + idx


@triton.jit
def _block_ranges(vlo, vhi, flo, fhi, c, S_loc, half, BLOCK: tl.constexpr,
                  WORLD: tl.constexpr, ZIGZAG: tl.constexpr):  # fmt: skip
    """Blocks of ``BLOCK`` indices of chunk ``c`` whose positions meet ``[vlo, vhi]``
    (visible) and those wholly inside ``[flo, fhi]`` (no mask needed): returns ``(jlo,
    jf_lo, jf_hi, jhi)``, the masked blocks being ``[jlo, jf_lo)`` and ``[jf_hi, jhi)``."""
    a = _count_le(vlo - 1, c, S_loc, half, WORLD, ZIGZAG)
    b = _count_le(vhi, c, S_loc, half, WORLD, ZIGZAG)
    af = _count_le(flo - 1, c, S_loc, half, WORLD, ZIGZAG)
    bf = _count_le(fhi, c, S_loc, half, WORLD, ZIGZAG)
    jlo = a // BLOCK
    jhi = tl.where(b > a, tl.maximum(tl.cdiv(b, BLOCK), jlo), jlo)  # none visible: no block
    jf_lo = tl.maximum(tl.cdiv(af, BLOCK), jlo)
    jf_hi = tl.minimum(bf // BLOCK, jhi)
    empty = jf_hi <= jf_lo
    jf_lo = tl.where(empty, jhi, jf_lo)
    jf_hi = tl.where(empty, jhi, jf_hi)
    return jlo, jf_lo, jf_hi, jhi


@triton.jit
def _masked_block(t, jlo, jf_lo, jf_hi):
    """The ``t``-th masked block: ``[jlo, jf_lo)`` first, then ``[jf_hi, ...)``."""
    first = jf_lo - jlo
    return tl.where(t < first, jlo + t, jf_hi + t - first)


@triton.jit
def _doc_bounds(seg, cu, p):
    """First and last position of the document holding position ``p``."""
    s = tl.load(seg + p)
    return tl.load(cu + s), tl.load(cu + s + 1) - 1


@triton.jit
def _grid(q, k, KQ: tl.constexpr):
    """Per-query ``q`` and per-key ``k`` broadcast to a [queries, keys] tile, or, ``KQ``,
    to a [keys, queries] one."""
    if KQ:
        return q[None, :], k[:, None]
    else:
        return q[:, None], k[None, :]


@triton.jit
def _mask(q_pos, k_pos, k_idx, S_loc, seg, WORLD: tl.constexpr, CAUSAL: tl.constexpr,
          VARLEN: tl.constexpr, KQ: tl.constexpr = False):  # fmt: skip
    """[queries, keys] mask of the keys each query sees: a valid row (``q_pos >= 0``), a
    key inside the chunk (``k_idx < S_loc``), causal order, the same document. ``KQ``:
    [keys, queries], built in that orientation (the dK / dV kernel's tiles are keys by
    queries; a transposed boolean tile would cost a layout conversion and registers)."""
    q_ok, k_ok = _grid(q_pos >= 0, k_idx < S_loc, KQ)
    ok = q_ok & k_ok
    if CAUSAL:
        qp, kp = _grid(q_pos, k_pos, KQ)
        ok = ok & (kp <= qp)
    if VARLEN:
        last = WORLD * S_loc - 1
        qs = tl.load(seg + tl.minimum(tl.maximum(q_pos, 0), last))
        ks = tl.load(seg + tl.minimum(k_pos, last))
        q_doc, k_doc = _grid(qs, ks, KQ)
        ok = ok & (q_doc == k_doc)
    return ok


# ---------------------------------------------------------------------------- forward
@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_desc, v_desc, row, j0, n, jlo, jf_lo, jf_hi, q_pos,
                c, S_loc, half, seg, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, WORLD: tl.constexpr, CAUSAL: tl.constexpr,
                VARLEN: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr,
                FAST_EXP: tl.constexpr):  # fmt: skip
    """Online softmax over ``n`` key blocks of one chunk: blocks ``j0 ..`` (unmasked) or
    the masked blocks (``MASKED``, ``_masked_block``). Unmasked, the scale is folded into
    the exponent's argument (one fused multiply-add per logit) and the exponential is
    ``_exp2(.., FAST_EXP)``; ``WS``: the loop is warp-specialised (producer warps issue
    the TMA loads)."""
    for t in tl.range(0, n, warp_specialize=WS and not MASKED):
        if MASKED:
            j = _masked_block(t, jlo, jf_lo, jf_hi)
        else:
            j = j0 + t
        n0 = j * BLOCK_N
        k = k_desc.load([row, n0, 0]).reshape(BLOCK_N, D)
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))
        if MASKED:
            qk = qk * qk_scale
            k_idx = n0 + tl.arange(0, BLOCK_N)
            k_pos = _pos(k_idx, c, S_loc, half, WORLD, CAUSAL)
            ok = _mask(q_pos, k_pos, k_idx, S_loc, seg, WORLD, CAUSAL, VARLEN)
            qk = tl.where(ok, qk, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = _exp2(qk * qk_scale - m_use[:, None], FAST_EXP)
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([row, n0, 0]).reshape(BLOCK_N, D)
        acc = _dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_chunk(acc, l_i, m_i, q, k_desc, v_desc, row, c, jlo, jf_lo, jf_hi, jhi, q_pos,
               S_loc, half, seg, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, WORLD: tl.constexpr, CAUSAL: tl.constexpr,
               VARLEN: tl.constexpr, WS: tl.constexpr, FAST_EXP: tl.constexpr):  # fmt: skip
    """Chunk ``c``'s key blocks ``_block_ranges`` gave: the unmasked ones, then the rest."""
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_desc, v_desc, row, jf_lo, jf_hi - jf_lo, jlo, jf_lo, jf_hi,
        q_pos, c, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL, VARLEN,
        False, WS, FAST_EXP,
    )  # fmt: skip
    n_masked = (jf_lo - jlo) + (jhi - jf_hi)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_desc, v_desc, row, jlo, n_masked, jlo, jf_lo, jf_hi, q_pos,
        c, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL, VARLEN, True, WS,
        FAST_EXP,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _fwd_window(qmin, qmax, S_loc, seg, cu, WORLD: tl.constexpr, CAUSAL: tl.constexpr,
                VARLEN: tl.constexpr):  # fmt: skip
    """Key positions a query block ``[qmin, qmax]`` sees at all ``[vlo, vhi]`` and by
    every one of its rows ``[flo, fhi]``."""
    big = WORLD * S_loc - 1
    vlo = qmin * 0
    flo = qmin * 0
    vhi = vlo + big
    fhi = vlo + big
    if VARLEN:
        vlo, fhi = _doc_bounds(seg, cu, qmin)
        flo, vhi = _doc_bounds(seg, cu, qmax)
    if CAUSAL:
        vhi = tl.minimum(vhi, qmax)
        fhi = tl.minimum(fhi, qmin)
    return vlo, vhi, flo, fhi


@triton.jit
def _peer_chunk(c, vlo, vhi, flo, fhi, rank, sig, arrival, err, max_spins, BKV, kv_row, S_loc,
                half, BLOCK_N: tl.constexpr, WORLD: tl.constexpr, CAUSAL: tl.constexpr,
                WAIT: tl.constexpr):  # fmt: skip
    """Peer chunk ``c`` for a query block whose key window is ``vlo .. fhi``
    (``_fwd_window``): its row in the gathered buffer, after its arrival flag (``WAIT``)
    where the block sees any key of it (a chunk wholly masked is not waited for), and its
    block ranges (``_block_ranges``)."""
    jlo, jf_lo, jf_hi, jhi = _block_ranges(
        vlo, vhi, flo, fhi, c, S_loc, half, BLOCK_N, WORLD, CAUSAL
    )
    row = c * BKV + kv_row
    if WAIT:
        seen = (jhi > jlo).to(tl.int32)
        token = wait_inline(sig + arrival + c, 1, seen, err, rank, arrival + c, max_spins)
        row = guard_coord(row, token, 1, WORLD * BKV)
    return row, jlo, jf_lo, jf_hi, jhi


@triton.jit
def _exit_clear(sig, arrival, rank, err, max_spins, WORLD: tl.constexpr):
    """Last act of every program of a consumer launch: the program that finishes last
    waits for every peer's arrival flag (a flag whose chunk no program needed may still be
    landing) and zeroes the flags and the finished-program counter (slot ``arrival +
    WORLD``), so the next call with this buffer set starts from zero."""
    tl.debug_barrier()
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    arrived = tl.atomic_add(sig + arrival + WORLD, 1, sem="acq_rel", scope="gpu")
    if arrived == n_prog - 1:
        _clear_flags(sig, arrival, rank, err, max_spins, WORLD)


@triton.jit
def _clear_flags(sig, arrival, rank, err, max_spins, WORLD: tl.constexpr):
    """Wait for every peer's arrival flag, then zero the flags and the finished-program
    counter (slot ``arrival + WORLD``)."""
    for t in range(1, WORLD):
        c = (rank + WORLD - t) % WORLD
        wait(sig + arrival + c, 1, err, rank, arrival + c, max_spins)
    for i in tl.static_range(WORLD + 1):  # scalar stores: also callable from Gluon
        tl.store(sig + arrival + i, 0)


@triton.jit
def sp_attn_clear_kernel(sig, arrival, err, rank, max_spins, WORLD: tl.constexpr):
    """One program, once every kernel that waits on this call's arrival flags is done (the
    backward's dQ and dK/dV kernels run side by side, so neither can clear them as it
    ends): ``_clear_flags``."""
    _clear_flags(sig, arrival, rank, err, max_spins, WORLD)


@triton.jit
def trace_step(TRACE: tl.constexpr, tbuf, KIND: tl.constexpr, j, a, b):
    """``language.trace.trace_event`` for a ``(query blocks, batch x heads)`` grid: the
    buffer holds one block of that layout per column ``program_id(1)`` (header and
    ``num_programs(0)`` programs each, ``1 + stride * num_programs(0)`` rows); ``j``: the
    program's step (its ``j``-th tile slots). Compiles to nothing unless ``TRACE``."""
    if TRACE:
        rows = 1 + tl.load(tbuf) * tl.num_programs(0)
        col = tbuf + tl.program_id(1).to(tl.int64) * rows * 4
        trace_event(TRACE, col, KIND, j * tl.num_programs(0) + tl.program_id(0), a, b)


@triton.jit
def _query_program(half, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """``(query block, batch x head)`` of this program of a ``(query blocks, batch x
    heads)`` grid. The launch starts programs in the order of ``program_id(0) +
    program_id(1) * num_programs(0)``; each head's blocks run together (they read the same
    keys while those are in L2), last block first. Causal (the zigzag layout: a block's
    work grows with its position, and the second half of the chunk sits later in the
    sequence than the first): every head's second-half blocks before any head's first-half
    ones, so that no heavy block starts last and leaves the GPU idle beside it (S 16k as
    rank 0 of 4 on one H200: forward 1.06 x, dQ 1.09 x faster than head by head;
    benchmarks/results/history/2026-11-29-h200-w1-attention-order.txt)."""
    n_mb = tl.num_programs(0)
    if CAUSAL and not VARLEN:
        n_bh = tl.num_programs(1)
        linear = tl.program_id(0) + tl.program_id(1) * n_mb
        n_hi = n_mb - half // BLOCK_M  # blocks reaching into the second half
        hi = linear < n_hi * n_bh
        rest = tl.where(hi, linear, linear - n_hi * n_bh)
        n = tl.maximum(tl.where(hi, n_hi, n_mb - n_hi), 1)
        top = tl.where(hi, n_mb, n_mb - n_hi)  # one past the group's last block
        return top - 1 - rest % n, rest // n
    else:
        return n_mb - 1 - tl.program_id(0), tl.program_id(1)


@triton.jit
def sp_attn_fwd_kernel(
    q, k, v, k_all, v_all, o, lse, seg, cu, sig, err, rank, max_spins, arrival,
    qk_scale, S_loc, half,
    H, HKV, D: tl.constexpr, WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, WAIT: tl.constexpr, CLEAR: tl.constexpr, WS: tl.constexpr = False,
    FAST_EXP: tl.constexpr = 0, TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """One program per (query block, batch x head), heaviest query blocks first
    (``_query_program``). Runs the local chunk, then each peer's as its flag lands
    (``WAIT``; without it the gathered buffer must already hold every chunk). ``CLEAR``:
    the last program zeroes the arrival flags (``_exit_clear``). Writes ``o`` and the
    base-2 log-sum-exp ``lse`` [batch x heads, S_loc] (float32).

    Traced: program start (query block, batch x head) / end; step ``t`` (0: the local
    chunk, then the peers' in arrival order) records its wait (begin: chunk's rank, step;
    end: chunk's rank, the guarded row) and its end (chunk's rank, query block)."""
    pid_m, bh = _query_program(half, BLOCK_M, CAUSAL, VARLEN)
    trace_step(TRACE, tbuf, EV_START, 0, pid_m, bh)
    BH = tl.num_programs(1)
    GROUP = H // HKV
    BKV = BH // GROUP
    kv_row = (bh // H) * HKV + (bh % H) // GROUP
    q_desc = tl.make_tensor_descriptor(
        q, shape=[BH, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_M, D]
    )
    o_desc = tl.make_tensor_descriptor(
        o, shape=[BH, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_M, D]
    )
    k_desc = tl.make_tensor_descriptor(
        k, shape=[BKV, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_N, D]
    )
    v_desc = tl.make_tensor_descriptor(
        v, shape=[BKV, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_N, D]
    )
    m0 = pid_m * BLOCK_M
    q_idx = m0 + tl.arange(0, BLOCK_M)
    q_pos = tl.where(q_idx < S_loc, _pos(q_idx, rank, S_loc, half, WORLD, CAUSAL), -1)
    qmin = _pos(m0, rank, S_loc, half, WORLD, CAUSAL)
    qmax = _pos(tl.minimum(m0 + BLOCK_M, S_loc) - 1, rank, S_loc, half, WORLD, CAUSAL)
    qb = q_desc.load([bh, m0, 0]).reshape(BLOCK_M, D)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    vlo, vhi, flo, fhi = _fwd_window(qmin, qmax, S_loc, seg, cu, WORLD, CAUSAL, VARLEN)
    jlo, jf_lo, jf_hi, jhi = _block_ranges(
        vlo, vhi, flo, fhi, rank, S_loc, half, BLOCK_N, WORLD, CAUSAL
    )
    acc, l_i, m_i = _fwd_chunk(
        acc, l_i, m_i, qb, k_desc, v_desc, kv_row, rank, jlo, jf_lo, jf_hi, jhi, q_pos, S_loc,
        half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL, VARLEN, WS, FAST_EXP,
    )  # fmt: skip
    trace_step(TRACE, tbuf, EV_TILE_END, 0, rank, pid_m)
    if WORLD > 1:
        kp_desc = tl.make_tensor_descriptor(
            k_all, shape=[WORLD * BKV, S_loc, D], strides=[S_loc * D, D, 1],
            block_shape=[1, BLOCK_N, D],
        )  # fmt: skip
        vp_desc = tl.make_tensor_descriptor(
            v_all, shape=[WORLD * BKV, S_loc, D], strides=[S_loc * D, D, 1],
            block_shape=[1, BLOCK_N, D],
        )  # fmt: skip
        for t in range(1, WORLD):  # peers' chunks in arrival order: rank - 1, rank - 2, ...
            c = (rank + WORLD - t) % WORLD
            trace_step(TRACE, tbuf, EV_WAIT_BEGIN, t, c, t)
            row, jlo, jf_lo, jf_hi, jhi = _peer_chunk(
                c, vlo, vhi, flo, fhi, rank, sig, arrival, err, max_spins, BKV, kv_row, S_loc,
                half, BLOCK_N, WORLD, CAUSAL, WAIT,
            )  # fmt: skip
            trace_step(TRACE, tbuf, EV_WAIT_END, t, c, row)
            acc, l_i, m_i = _fwd_chunk(
                acc, l_i, m_i, qb, kp_desc, vp_desc, row, c, jlo, jf_lo, jf_hi, jhi, q_pos,
                S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL, VARLEN, WS,
                FAST_EXP,
            )  # fmt: skip
            trace_step(TRACE, tbuf, EV_TILE_END, t, c, pid_m)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_desc.store([bh, m0, 0], rounded(out, o.dtype.element_ty).reshape(1, BLOCK_M, D))
    tl.store(lse + bh * S_loc + q_idx, m_i + tl.math.log2(l_safe), mask=q_idx < S_loc)
    if CLEAR:
        _exit_clear(sig, arrival, rank, err, max_spins, WORLD)
    trace_step(TRACE, tbuf, EV_END, 0, 0, 0)


# ---------------------------------------------------------------------------- backward
@triton.jit
def sp_attn_bwd_delta_kernel(o, do, delta, S_loc, D: tl.constexpr, BLOCK: tl.constexpr):
    """``delta[bh, i] = sum_d o[bh, i, d] * do[bh, i, d]`` in float32."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    offs = (bh * S_loc + rows)[:, None] * D + cols[None, :]
    ok = (rows < S_loc)[:, None]
    a = tl.load(o + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(do + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(delta + bh * S_loc + rows, tl.sum(a * b, 1), mask=rows < S_loc)


@triton.jit
def _dkdv_blocks(dk, dv, kb, vb, q_desc, do_desc, lse, delta, qrow, i0, n, ilo, if_lo, if_hi,
                 k_pos, k_idx, rank, S_loc, half, seg, qk_scale, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, D: tl.constexpr, WORLD: tl.constexpr,
                 CAUSAL: tl.constexpr, VARLEN: tl.constexpr, MASKED: tl.constexpr,
                 FAST_EXP: tl.constexpr):  # fmt: skip
    """dK / dV of one key block over ``n`` query blocks of one head (see ``_fwd_blocks``)."""
    for t in tl.range(0, n):
        if MASKED:
            i = _masked_block(t, ilo, if_lo, if_hi)
        else:
            i = i0 + t
        m0 = i * BLOCK_M
        q_idx = m0 + tl.arange(0, BLOCK_M)
        qb = q_desc.load([qrow, m0, 0]).reshape(BLOCK_M, D)
        dob = do_desc.load([qrow, m0, 0]).reshape(BLOCK_M, D)
        if MASKED:
            rows_ok = q_idx < S_loc
            m_row = tl.load(lse + qrow * S_loc + q_idx, mask=rows_ok, other=0.0)
            d_row = tl.load(delta + qrow * S_loc + q_idx, mask=rows_ok, other=0.0)
        else:
            m_row = tl.load(lse + qrow * S_loc + q_idx)
            d_row = tl.load(delta + qrow * S_loc + q_idx)
        qk_t = _dot(kb, tl.trans(qb), tl.zeros([BLOCK_N, BLOCK_M], tl.float32)) * qk_scale
        if MASKED:
            p_t = tl.math.exp2(qk_t - m_row[None, :])
            q_pos = tl.where(q_idx < S_loc, _pos(q_idx, rank, S_loc, half, WORLD, CAUSAL), -1)
            ok = _mask(q_pos, k_pos, k_idx, S_loc, seg, WORLD, CAUSAL, VARLEN, True)
            p_t = tl.where(ok, p_t, 0.0)
        else:
            p_t = _exp2(qk_t - m_row[None, :], FAST_EXP)
        dv = _dot(p_t.to(qb.dtype), dob, dv)
        dp_t = _dot(vb, tl.trans(dob), tl.zeros([BLOCK_N, BLOCK_M], tl.float32))
        ds_t = p_t.to(tl.float32) * (dp_t - d_row[None, :])
        dk = _dot(ds_t.to(qb.dtype), qb, dk)
    return dk, dv


@triton.jit
def sp_attn_bwd_dkdv_kernel(
    q, k, v, k_all, v_all, do, lse, delta, recv, recv_table, seg, cu, sig, sig_table, err,
    rank, max_spins, arrival, dkv_slot, sm_scale, qk_scale, S_loc, half, n_kb,
    H, HKV, D: tl.constexpr, WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, WAIT: tl.constexpr, FAST_EXP: tl.constexpr = 0,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """This rank's share of dK / dV for one key block of one chunk (one program per
    (chunk, key block), batch x kv head), summed over the GQA group's query heads and this
    rank's queries. Chunks in arrival order, the local one first. The partial goes to the
    chunk's owner: into slot ``rank`` of its ``recv`` buffer ``[2, WORLD (source),
    batch x kv_heads, S_loc, d]`` with plain stores over NVLink, after which the owner's
    counter ``dkv_slot + rank`` grows by the rows stored (the owner's reduction waits for
    ``batch x kv_heads x S_loc`` from every source).

    Traced: program start / end; step 0: the wait on a peer chunk's arrival flag (begin:
    chunk's rank, chunk step; end: chunk's rank, the token) and the end of the key
    block's dK / dV (chunk's rank, key block); step 1: the end of the stores into the
    owner's ``recv`` (owner, rows) and the owner's counter raised (a notify: owner,
    rows)."""
    trace_step(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    t = pid // n_kb
    jb = pid % n_kb
    kv_row = tl.program_id(1)
    BKV = tl.num_programs(1)
    GROUP = H // HKV
    b = kv_row // HKV
    hk = kv_row % HKV
    BH = BKV * GROUP
    c = (rank + WORLD - t) % WORLD
    n0 = jb * BLOCK_N
    k_idx = n0 + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    k_ok = k_idx < S_loc
    k_pos = _pos(k_idx, c, S_loc, half, WORLD, CAUSAL)
    kmin = _pos(n0, c, S_loc, half, WORLD, CAUSAL)
    kmax = _pos(tl.minimum(n0 + BLOCK_N, S_loc) - 1, c, S_loc, half, WORLD, CAUSAL)
    # query positions that see this key block at all, and those that see all of it
    big = WORLD * S_loc - 1
    vlo = kmin * 0
    flo = kmin * 0
    vhi = vlo + big
    fhi = vlo + big
    if CAUSAL:
        vlo = kmin
        flo = kmax
    if VARLEN:
        d_lo, d_hi = _doc_bounds(seg, cu, kmin)
        e_lo, e_hi = _doc_bounds(seg, cu, kmax)
        vlo = tl.maximum(vlo, d_lo)
        vhi = e_hi
        flo = tl.maximum(flo, e_lo)
        fhi = d_hi
    ilo, if_lo, if_hi, ihi = _block_ranges(
        vlo, vhi, flo, fhi, rank, S_loc, half, BLOCK_M, WORLD, CAUSAL
    )
    # a key block that no query of this rank sees is neither waited for nor loaded
    seen = ihi > ilo
    ok_load = k_ok & seen
    if c == rank:
        src_k = k + kv_row.to(tl.int64) * S_loc * D
        src_v = v + kv_row.to(tl.int64) * S_loc * D
    else:
        src_k = k_all + (c * BKV + kv_row).to(tl.int64) * S_loc * D
        src_v = v_all + (c * BKV + kv_row).to(tl.int64) * S_loc * D
        if WAIT:
            trace_step(TRACE, tbuf, EV_WAIT_BEGIN, 0, c, t)
            token = wait_inline(
                sig + arrival + c, 1, seen.to(tl.int32), err, rank, arrival + c, max_spins
            )
            trace_step(TRACE, tbuf, EV_WAIT_END, 0, c, token)
            ok_load = ok_load & (token >= 1)
    kv_offs = k_idx[:, None] * D + cols[None, :]
    kb = tl.load(src_k + kv_offs, mask=ok_load[:, None], other=0.0)
    vb = tl.load(src_v + kv_offs, mask=ok_load[:, None], other=0.0)
    q_desc = tl.make_tensor_descriptor(
        q, shape=[BH, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_M, D]
    )
    do_desc = tl.make_tensor_descriptor(
        do, shape=[BH, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_M, D]
    )
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    n_masked = (if_lo - ilo) + (ihi - if_hi)
    for g in range(GROUP):
        qrow = b * H + hk * GROUP + g
        dk, dv = _dkdv_blocks(
            dk, dv, kb, vb, q_desc, do_desc, lse, delta, qrow, if_lo, if_hi - if_lo, ilo,
            if_lo, if_hi, k_pos, k_idx, rank, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D,
            WORLD, CAUSAL, VARLEN, False, FAST_EXP,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, kb, vb, q_desc, do_desc, lse, delta, qrow, ilo, n_masked, ilo, if_lo,
            if_hi, k_pos, k_idx, rank, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD,
            CAUSAL, VARLEN, True, FAST_EXP,
        )  # fmt: skip
    dk = dk * sm_scale
    trace_step(TRACE, tbuf, EV_TILE_END, 0, c, jb)
    # slot ``rank`` (this rank as the source) of the owner's recv buffer
    part = (rank * BKV + kv_row).to(tl.int64) * S_loc * D
    whole = (WORLD * BKV).to(tl.int64) * S_loc * D
    dst_k = peer_ptr_aligned(recv + part, recv_table, rank, c)
    dst_v = peer_ptr_aligned(recv + whole + part, recv_table, rank, c)
    tl.store(dst_k + kv_offs, rounded(dk, recv.dtype.element_ty), mask=k_ok[:, None])
    tl.store(dst_v + kv_offs, rounded(dv, recv.dtype.element_ty), mask=k_ok[:, None])
    rows = tl.minimum(S_loc - n0, BLOCK_N)
    trace_step(TRACE, tbuf, EV_TILE_END, 1, c, rows)
    owner_sig = tl.load(sig_table + c).to(tl.pointer_type(tl.int32))
    notify(owner_sig + dkv_slot + rank, rows, ADD=True)
    trace_step(TRACE, tbuf, EV_NOTIFY, 1, c, rows)
    trace_step(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def _dq_blocks(dq, qb, dob, m_row, d_row, k_desc, v_desc, row, j0, n, jlo, jf_lo, jf_hi,
               q_pos, c, S_loc, half, seg, qk_scale, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, D: tl.constexpr, WORLD: tl.constexpr,
               CAUSAL: tl.constexpr, VARLEN: tl.constexpr, MASKED: tl.constexpr,
               FAST_EXP: tl.constexpr):  # fmt: skip
    """dQ of one query block over ``n`` key blocks of one chunk (see ``_fwd_blocks``)."""
    for t in tl.range(0, n):
        if MASKED:
            j = _masked_block(t, jlo, jf_lo, jf_hi)
        else:
            j = j0 + t
        n0 = j * BLOCK_N
        kb = k_desc.load([row, n0, 0]).reshape(BLOCK_N, D)
        vb = v_desc.load([row, n0, 0]).reshape(BLOCK_N, D)
        qk = _dot(qb, tl.trans(kb), tl.zeros([BLOCK_M, BLOCK_N], tl.float32)) * qk_scale
        if MASKED:
            p = tl.math.exp2(qk - m_row[:, None])
            k_idx = n0 + tl.arange(0, BLOCK_N)
            k_pos = _pos(k_idx, c, S_loc, half, WORLD, CAUSAL)
            p = tl.where(_mask(q_pos, k_pos, k_idx, S_loc, seg, WORLD, CAUSAL, VARLEN), p, 0.0)
        else:
            p = _exp2(qk - m_row[:, None], FAST_EXP)
        dp = _dot(dob, tl.trans(vb), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))
        ds = p.to(tl.float32) * (dp - d_row[:, None])
        dq = _dot(ds.to(kb.dtype), kb, dq)
    return dq


@triton.jit
def _dq_chunk(dq, qb, dob, m_row, d_row, k_desc, v_desc, row, c, jlo, jf_lo, jf_hi, jhi,
              q_pos, S_loc, half, seg, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              D: tl.constexpr, WORLD: tl.constexpr, CAUSAL: tl.constexpr,
              VARLEN: tl.constexpr, FAST_EXP: tl.constexpr):  # fmt: skip
    """``_fwd_chunk`` for dQ."""
    dq = _dq_blocks(
        dq, qb, dob, m_row, d_row, k_desc, v_desc, row, jf_lo, jf_hi - jf_lo, jlo, jf_lo,
        jf_hi, q_pos, c, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL,
        VARLEN, False, FAST_EXP,
    )  # fmt: skip
    n_masked = (jf_lo - jlo) + (jhi - jf_hi)
    dq = _dq_blocks(
        dq, qb, dob, m_row, d_row, k_desc, v_desc, row, jlo, n_masked, jlo, jf_lo, jf_hi,
        q_pos, c, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL, VARLEN,
        True, FAST_EXP,
    )  # fmt: skip
    return dq


@triton.jit
def sp_attn_bwd_dq_kernel(
    q, k, v, k_all, v_all, do, lse, delta, dq, seg, cu, sig, err, rank, max_spins, arrival,
    sm_scale, qk_scale, S_loc, half,
    H, HKV, D: tl.constexpr, WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, WAIT: tl.constexpr, CLEAR: tl.constexpr, FAST_EXP: tl.constexpr = 0,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """dQ of one query block (one program per (query block, batch x head)) over every
    chunk, local first, as ``sp_attn_fwd_kernel``; ``CLEAR`` as there. Traced as the
    forward: program start (query block, batch x head) / end, per chunk step its wait and
    its end."""
    pid_m, bh = _query_program(half, BLOCK_M, CAUSAL, VARLEN)
    trace_step(TRACE, tbuf, EV_START, 0, pid_m, bh)
    BH = tl.num_programs(1)
    GROUP = H // HKV
    BKV = BH // GROUP
    kv_row = (bh // H) * HKV + (bh % H) // GROUP
    q_desc = tl.make_tensor_descriptor(
        q, shape=[BH, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_M, D]
    )
    do_desc = tl.make_tensor_descriptor(
        do, shape=[BH, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_M, D]
    )
    dq_desc = tl.make_tensor_descriptor(
        dq, shape=[BH, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_M, D]
    )
    k_desc = tl.make_tensor_descriptor(
        k, shape=[BKV, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_N, D]
    )
    v_desc = tl.make_tensor_descriptor(
        v, shape=[BKV, S_loc, D], strides=[S_loc * D, D, 1], block_shape=[1, BLOCK_N, D]
    )
    m0 = pid_m * BLOCK_M
    q_idx = m0 + tl.arange(0, BLOCK_M)
    rows_ok = q_idx < S_loc
    q_pos = tl.where(rows_ok, _pos(q_idx, rank, S_loc, half, WORLD, CAUSAL), -1)
    qmin = _pos(m0, rank, S_loc, half, WORLD, CAUSAL)
    qmax = _pos(tl.minimum(m0 + BLOCK_M, S_loc) - 1, rank, S_loc, half, WORLD, CAUSAL)
    qb = q_desc.load([bh, m0, 0]).reshape(BLOCK_M, D)
    dob = do_desc.load([bh, m0, 0]).reshape(BLOCK_M, D)
    m_row = tl.load(lse + bh * S_loc + q_idx, mask=rows_ok, other=0.0)
    d_row = tl.load(delta + bh * S_loc + q_idx, mask=rows_ok, other=0.0)
    dq_acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    vlo, vhi, flo, fhi = _fwd_window(qmin, qmax, S_loc, seg, cu, WORLD, CAUSAL, VARLEN)
    jlo, jf_lo, jf_hi, jhi = _block_ranges(
        vlo, vhi, flo, fhi, rank, S_loc, half, BLOCK_N, WORLD, CAUSAL
    )
    dq_acc = _dq_chunk(
        dq_acc, qb, dob, m_row, d_row, k_desc, v_desc, kv_row, rank, jlo, jf_lo, jf_hi, jhi,
        q_pos, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL, VARLEN,
        FAST_EXP,
    )  # fmt: skip
    trace_step(TRACE, tbuf, EV_TILE_END, 0, rank, pid_m)
    if WORLD > 1:
        kp_desc = tl.make_tensor_descriptor(
            k_all, shape=[WORLD * BKV, S_loc, D], strides=[S_loc * D, D, 1],
            block_shape=[1, BLOCK_N, D],
        )  # fmt: skip
        vp_desc = tl.make_tensor_descriptor(
            v_all, shape=[WORLD * BKV, S_loc, D], strides=[S_loc * D, D, 1],
            block_shape=[1, BLOCK_N, D],
        )  # fmt: skip
        for t in range(1, WORLD):  # as the forward's
            c = (rank + WORLD - t) % WORLD
            trace_step(TRACE, tbuf, EV_WAIT_BEGIN, t, c, t)
            row, jlo, jf_lo, jf_hi, jhi = _peer_chunk(
                c, vlo, vhi, flo, fhi, rank, sig, arrival, err, max_spins, BKV, kv_row, S_loc,
                half, BLOCK_N, WORLD, CAUSAL, WAIT,
            )  # fmt: skip
            trace_step(TRACE, tbuf, EV_WAIT_END, t, c, row)
            dq_acc = _dq_chunk(
                dq_acc, qb, dob, m_row, d_row, kp_desc, vp_desc, row, c, jlo, jf_lo, jf_hi, jhi,
                q_pos, S_loc, half, seg, qk_scale, BLOCK_M, BLOCK_N, D, WORLD, CAUSAL, VARLEN,
                FAST_EXP,
            )  # fmt: skip
            trace_step(TRACE, tbuf, EV_TILE_END, t, c, pid_m)
    dq_acc = dq_acc * sm_scale
    dq_desc.store([bh, m0, 0], rounded(dq_acc, dq.dtype.element_ty).reshape(1, BLOCK_M, D))
    if CLEAR:
        _exit_clear(sig, arrival, rank, err, max_spins, WORLD)
    trace_step(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def sp_attn_bwd_reduce_kernel(
    recv, dk, dv, sig, err, rank, max_spins, dkv_slot, n_rows, expected,
    D: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """dK and dV of this rank's chunk: the sum (float32) of the ``WORLD`` partials in
    ``recv`` ``[2, WORLD, n_rows, d]``, each read once its source's counter reached
    ``expected`` rows. The program that finishes last zeroes the counters and its own
    finished-program counter (slot ``dkv_slot + WORLD``).

    Traced (its events laid out as a grid of one column): program start / end; step ``t``
    per source (this rank first): the wait on its counter (begin: source, step; end: source,
    the token) and the end of its partial's sum (source, step)."""
    trace_step(TRACE, tbuf, EV_START, 0, 0, 0)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows < n_rows
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    acc_k = tl.zeros([BLOCK, D], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK, D], dtype=tl.float32)
    whole = (WORLD * n_rows).to(tl.int64) * D
    for t in range(WORLD):
        src = (rank + WORLD - t) % WORLD
        trace_step(TRACE, tbuf, EV_WAIT_BEGIN, t, src, t)
        token = wait(sig + dkv_slot + src, expected, err, rank, dkv_slot + src, max_spins)
        trace_step(TRACE, tbuf, EV_WAIT_END, t, src, token)
        m = (ok & (token >= expected))[:, None]
        base = (src * n_rows).to(tl.int64) * D
        acc_k += tl.load(recv + base + offs, mask=m, other=0.0).to(tl.float32)
        acc_v += tl.load(recv + whole + base + offs, mask=m, other=0.0).to(tl.float32)
        trace_step(TRACE, tbuf, EV_TILE_END, t, src, t)
    tl.store(dk + offs, rounded(acc_k, dk.dtype.element_ty), mask=ok[:, None])
    tl.store(dv + offs, rounded(acc_v, dv.dtype.element_ty), mask=ok[:, None])
    tl.debug_barrier()
    arrived = tl.atomic_add(sig + dkv_slot + WORLD, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        lanes = tl.arange(0, 64)
        tl.store(sig + dkv_slot + lanes, 0, mask=lanes <= WORLD)
    trace_step(TRACE, tbuf, EV_END, 0, 0, 0)


__all__ = [
    "LOG2E",
    "sp_attn_bwd_delta_kernel",
    "sp_attn_bwd_dkdv_kernel",
    "sp_attn_bwd_dq_kernel",
    "sp_attn_bwd_reduce_kernel",
    "sp_attn_fwd_kernel",
]
_ = triton  # the kernels above are ``triton.jit`` functions
