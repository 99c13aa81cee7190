"""Kernels of the standalone collectives: SM-driven pulls and fp32 reductions over
symmetric memory. Kernels only; the contexts that launch them live in ``interlace.ops``.

All loops over blocks are persistent (``for b in range(pid, n_blocks, n_programs)``) so a
launch never needs more programs than the GPU holds at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import (
    call_flag,
    consume,
    consume_call,
    guard,
    last_program_clears,
    notify,
    remote_base,
    rounded,
    wait,
    wait_call,
)


@triton.jit
def gather_pull_kernel(out, src_table, like, n, rank, world, BLOCK: tl.constexpr):
    """``out[p*n : (p+1)*n] = rank p's symmetric input[:n]`` for every rank p.

    Each program walks (peer, block) pairs starting at its own rank's shard and rotating,
    so at any moment ranks read from different peers.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_blocks = tl.cdiv(n, BLOCK)
    offs0 = tl.arange(0, BLOCK)
    for item in range(pid, n_blocks * world, n_prog):
        peer = (rank + item // n_blocks) % world
        offs = (item % n_blocks) * BLOCK + offs0
        mask = offs < n
        src = remote_base(src_table, peer, like)
        vals = tl.load(src + offs, mask=mask)
        tl.store(out + peer.to(tl.int64) * n + offs, vals, mask=mask)


@triton.jit
def copy_and_consume_kernel(
    dst, src, n, sig, first, count, skip, err, rank, max_spins, BLOCK: tl.constexpr,
    CALL_FLAGS: tl.constexpr = False,
):  # fmt: skip
    """``dst[:n] = src[:n]`` on SMs while program 0 consumes the local signals ``first ..
    first + count - 1`` except ``first + skip`` (each must reach 1; ``CALL_FLAGS``: this
    call's ``call_flag``, and a peer's flag of another call is a mismatch at once): an
    all-gather's own shard copied beside the copy engine's transfers, and the wait for the
    peers' shards, in one launch."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs0 = tl.arange(0, BLOCK)
    for blk in range(pid, tl.cdiv(n, BLOCK), n_prog):
        offs = blk * BLOCK + offs0
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    if pid == 0:
        if CALL_FLAGS:
            flag = call_flag(err)
            for i in range(count):
                if i != skip:
                    consume_call(sig + first + i, flag, err, rank, first + i, max_spins)
        else:
            for i in range(count):
                if i != skip:
                    consume(sig + first + i, 1, err, rank, first + i, max_spins)


@triton.jit
def reduce_pull_kernel(out, src_table, like, n, src_offset, rank, world, BLOCK: tl.constexpr):
    """``out[:n] = sum over ranks p (in rank order 0..world-1) of input_p[src_offset:][:n]``,
    accumulated in fp32. Rank order makes every rank's result bitwise identical."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_blocks = tl.cdiv(n, BLOCK)
    offs0 = tl.arange(0, BLOCK)
    for b in range(pid, n_blocks, n_prog):
        offs = b * BLOCK + offs0
        mask = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in range(world):
            src = remote_base(src_table, p, like) + src_offset
            acc += tl.load(src + offs, mask=mask).to(tl.float32)
        tl.store(out + offs, rounded(acc, out.dtype.element_ty), mask=mask)


@triton.jit
def reduce_arrivals_kernel(
    out,
    own,
    recv,
    slot_stride,
    n,
    piece_len,
    n_pieces,
    sig,
    sig_first,
    rank,
    world,
    err,
    max_spins,
    done_slot=0,
    clear_count=0,
    BLOCK: tl.constexpr = 2048,
    CLEAR_AT_END: tl.constexpr = False,
    CALL_FLAGS: tl.constexpr = False,
):
    """Reduce-scatter's reduction: ``out = own + sum of recv[src]`` over the other ranks, in
    fp32, consuming each block as soon as its piece from ``src`` has landed.

    ``recv[src]`` (stride ``slot_stride``) is written by rank ``src``'s copy engine, which
    raises ``sig[sig_first + src * n_pieces + piece]`` when that piece has landed. Pieces
    are ``piece_len`` elements (the last may be shorter); a block waits for every piece it
    touches. ``CLEAR_AT_END``: the last program to finish zeroes the ``clear_count`` slots
    from ``sig_first`` (``done_slot``, its counter, among them), so the flags need no
    clearing before the next call. ``CALL_FLAGS``: the flags hold the sender's
    ``call_flag``, and one of another call is a mismatch, recorded at once.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_blocks = tl.cdiv(n, BLOCK)
    offs0 = tl.arange(0, BLOCK)
    # Blocks are visited in increasing order, so pieces arrive in the order a program needs
    # them: it waits once per (piece, source), not once per block.
    confirmed = -1
    token = 0
    flag = 1
    if CALL_FLAGS:
        flag = call_flag(err)
    for b in range(pid, n_blocks, n_prog):
        offs = b * BLOCK + offs0
        mask = offs < n
        # the pieces this block touches (one, when pieces are block-aligned)
        last = (tl.minimum(b * BLOCK + BLOCK, n) - 1) // piece_len
        if last > confirmed:
            token = 1
            for piece in range(confirmed + 1, last + 1):
                for i in range(1, world):
                    src = (rank + world - i) % world
                    slot = sig_first + src * n_pieces + piece
                    if CALL_FLAGS:
                        seen = wait_call(sig + slot, flag, err, rank, slot, max_spins)
                        token = tl.minimum(token, tl.where(seen == flag, 1, 0))
                    else:
                        token = tl.minimum(token, wait(sig + slot, 1, err, rank, slot, max_spins))
            confirmed = last
        ok = guard(mask, token, 1)
        acc = tl.load(own + offs, mask=mask).to(tl.float32)
        for i in range(1, world):
            src = (rank + world - i) % world
            vals = tl.load(recv + src.to(tl.int64) * slot_stride + offs, mask=ok)
            acc += vals.to(tl.float32)
        tl.store(out + offs, rounded(acc, out.dtype.element_ty), mask=mask)
    if CLEAR_AT_END:
        last_program_clears(sig, done_slot, sig_first, clear_count)


@triton.jit
def pull_chunks_kernel(
    local, table, chunks, n_chunks, K, sig, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """SM-driven all-gather into a symmetric ``[rows, K]`` buffer: for each chunk
    ``(row0, rows, slot, owner)`` of the int32 table ``chunks``, in table order, copy those
    rows from rank ``owner``'s buffer into the same rows of ``local``, then release-add 1 to
    local signal ``slot``. Every program adds once per chunk (after its share of the rows),
    so a chunk has landed when its slot reaches the number of programs."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for c in range(n_chunks):
        row0 = tl.load(chunks + c * 4)
        rows = tl.load(chunks + c * 4 + 1)
        slot = tl.load(chunks + c * 4 + 2)
        src = remote_base(table, tl.load(chunks + c * 4 + 3), local)
        for blk in range(pid, tl.cdiv(rows, BLOCK_M), n_prog):
            r = blk * BLOCK_M + offs_m
            base = (row0 + r)[:, None].to(tl.int64) * K
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                mask = (r < rows)[:, None] & (ks < K)[None, :]
                vals = tl.load(src + base + ks[None, :], mask=mask)
                tl.store(local + base + ks[None, :], vals, mask=mask)
        notify(sig + slot, 1, ADD=True)
