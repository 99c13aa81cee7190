"""The TileLink-style ring reduce-scatter that runs on a few SMs beside the segment GEMM
(GEMM+RS ``strategy="ring"``).

The GEMM stores this rank's partial sums of every owner's rows into ``partials`` (owner by
owner, in ring order: the rows of rank ``r - 1`` first, its own last) and counts each
owner's finished tiles in ``sig[done_first + owner]``. This kernel runs the ring on those
chunks as they finish: at step ``s`` rank ``r`` adds what its left neighbour sent at step
``s - 1`` to its own partial of owner ``r - s - 1`` and stores the sum into its right
neighbour's receive slot ``s``; at the last step the sum for its own rows goes to ``out``.

Running sums travel in the output dtype, rounded once per hop as in NCCL's ring (the
other GEMM+RS strategies round once, after an fp32 sum): the error grows with the world
size. The sums themselves are formed in fp32.

Synchronisation, all bounded:

* program 0 runs the device barrier first and raises ``go_slot``; every program waits for
  it before its first remote store (the right neighbour is then in this call, done with
  the receive slots of the previous one);
* each program handles the same blocks at every step and on every rank, so it waits only
  for its counterpart on the left (``sig[ring_first + s * MAX_PROGRAMS + pid]``);
* the last program to finish zeroes the op's counters (``last_program_clears``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import (
    barrier_all,
    guard,
    last_program_clears,
    notify,
    peer_ptr_aligned,
    rounded,
    signal_base,
    wait,
)

#: Signal slots per ring step: at most this many programs.
MAX_PROGRAMS = tl.constexpr(64)


@triton.jit(
    do_not_specialize=[
        "rank", "n_elems", "slot_elems", "tiles", "done_first", "ring_first", "bar_slot",
        "go_slot", "clear_first", "clear_count", "max_spins",
    ]
)  # fmt: skip
def ring_reduce_scatter_kernel(
    partials, out, recv, recv_table, slot_elems, n_elems, tiles,
    sig, sig_table, done_first, ring_first, bar_slot, go_slot, clear_first, clear_count,
    rank, err, max_spins, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``partials`` [WORLD * n_elems] (owner ``o``'s rows at ``o * n_elems``), ``out``
    [n_elems], ``recv`` symmetric with ``WORLD - 1`` slots of ``slot_elems``; ``tiles``: the
    GEMM tiles of one owner's rows (the value ``sig[done_first + o]`` reaches)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    if pid == 0:
        if barrier_all(sig_table, bar_slot, rank, WORLD, err, max_spins) != 0:
            notify(sig + go_slot, 1)  # not when a peer is in another call
    go = wait(sig + go_slot, 1, err, rank, go_slot, max_spins)
    right = (rank + 1) % WORLD
    right_recv = peer_ptr_aligned(recv, recv_table, rank, right)
    right_sig = signal_base(sig_table, right)
    n_blocks = tl.cdiv(n_elems, BLOCK)
    offs0 = tl.arange(0, BLOCK)
    for s in tl.static_range(WORLD):
        owner = (rank + 2 * WORLD - s - 1) % WORLD  # the last step: this rank's own rows
        token = wait(sig + done_first + owner, tiles, err, rank, done_first + owner, max_spins)
        token = tl.minimum(token - tiles + 1, go)  # 1 when both waits succeeded
        if s > 0:
            slot = ring_first + (s - 1) * MAX_PROGRAMS + pid
            token = tl.minimum(token, wait(sig + slot, 1, err, rank, slot, max_spins))
        for b in range(pid, n_blocks, n_prog):
            offs = b * BLOCK + offs0
            mask = offs < n_elems
            ok = guard(mask, token, 1)
            acc = tl.load(partials + owner.to(tl.int64) * n_elems + offs, mask=ok).to(tl.float32)
            if s > 0:
                acc += tl.load(recv + (s - 1) * slot_elems + offs, mask=ok).to(tl.float32)
            if s < WORLD - 1:
                val = rounded(acc, recv.dtype.element_ty)
                tl.store(right_recv + s * slot_elems + offs, val, mask=ok)
            else:
                tl.store(out + offs, rounded(acc, out.dtype.element_ty), mask=mask)
        if s < WORLD - 1:  # this program's share of step s has landed on the right
            notify(right_sig + ring_first + s * MAX_PROGRAMS + pid, 1)
    last_program_clears(sig, go_slot + 1, clear_first, clear_count)
