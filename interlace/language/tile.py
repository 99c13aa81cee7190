"""TileLink's tile-centric layer: comm tiles (channels) and compute tiles, decoupled.

A *channel* is a contiguous range of rows of a (gathered) tensor that one rank owns and
that travels as one unit: its producer raises one signal slot per channel when the rows
are in place. A compute *tile* is ``BLOCK_M`` rows; it may overlap several channels, even
channels of several ranks, because tile size and channel size are chosen independently
(the one by the compute kernel's tuning, the other by the communication's). A consumer
tile therefore waits on the run of channels it overlaps, given by a mapping:

* static (affine): rank ``r`` owns rows ``[r * R, (r + 1) * R)`` split evenly into ``C``
  channels (channel ``c`` of rank ``r`` is global channel ``r * C + c`` and holds local
  rows ``[c * R // C, (c + 1) * R // C)``), computed in-kernel by ``static_*``;
* dynamic: int32 lookup tables built on the host by :class:`TileMapping` from arbitrary
  ragged channel boundaries (routing-dependent shapes, permuted channel ids), read in-kernel
  by ``dynamic_*``.

Signals follow the primitives' protocol: a notify is a release-add of 1 (after a CTA
barrier, so every thread's stores of the tile are covered), a wait is a bounded acquire
spin that returns a token for ``primitives.guard``. Everything here runs in Triton's
interpreter too (no inline asm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import InterlaceValueError
from .primitives import guard, notify, remote_base, signal_base, wait

# --------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------


@triton.jit
def producer_tile_notify(sig, slot):
    """Release-add 1 to local signal ``sig + slot`` once this program's tile is written.

    The CTA barrier first makes the stores of every thread of the program part of what the
    release publishes (the atomic itself is issued by one thread)."""
    tl.debug_barrier()
    notify(sig + slot, 1, ADD=True)


@triton.jit
def peer_tile_notify(sig_table, peer, slot):
    """Release-add 1 to signal ``slot`` of rank ``peer``'s pad (``sig_table``: pad bases),
    e.g. after pushing a tile into ``peer``'s buffer, or to say a tile is ready to pull."""
    tl.debug_barrier()
    notify(signal_base(sig_table, peer) + slot, 1, ADD=True)


@triton.jit
def peer_tile_wait(sig, slot, expected, err, rank, max_spins):
    """Bounded acquire-wait until local signal ``sig + slot`` (raised by a peer) reaches
    ``expected``; returns the token for ``guard``."""
    return wait(sig + slot, expected, err, rank, slot, max_spins)


@triton.jit
def consumer_tile_wait(sig, first_slot, n_slots, expected, err, rank, max_spins):
    """Wait until each of the ``n_slots`` (>= 1) signals from ``sig + first_slot`` reaches
    ``expected``.

    Returns the smallest value seen: ``guard(mask, token, expected)`` lets the tile's loads
    through only if every channel arrived (a timed-out wait masks them off)."""
    token = wait(sig + first_slot, expected, err, rank, first_slot, max_spins)
    for i in range(1, n_slots):
        seen = wait(sig + first_slot + i, expected, err, rank, first_slot + i, max_spins)
        token = tl.minimum(token, seen)
    return token


@triton.jit
def consumer_tile_wait_table(sig, slot_base, order, first, n_slots, expected, err, rank, max_spins):
    """``consumer_tile_wait`` over the channels ``order[first : first + n_slots]`` (the
    dynamic mapping's row-ordered channel ids), at slots ``slot_base + channel``."""
    slot = slot_base + tl.load(order + first)
    token = wait(sig + slot, expected, err, rank, slot, max_spins)
    for i in range(1, n_slots):
        slot = slot_base + tl.load(order + first + i)
        seen = wait(sig + slot, expected, err, rank, slot, max_spins)
        token = tl.minimum(token, seen)
    return token


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


@triton.jit
def _copy_rows(
    src, dst, row_start, row_end, n_cols, stride, token, expected,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Copy rows ``[row_start, row_end)`` x columns ``[0, n_cols)`` (row stride ``stride``)
    from ``src`` to ``dst`` in masked blocks, the loads guarded by ``token >= expected``."""
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            offs = rows[:, None] * stride + cols[None, :]
            mask = (rows[:, None] < row_end) & (cols[None, :] < n_cols)
            mask = guard(mask, token, expected)
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def tile_push_data(
    base,
    table,
    peer,
    row_start,
    row_end,
    n_cols,
    stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Copy rows ``[row_start, row_end)`` x columns ``[0, n_cols)`` of this rank's symmetric
    tensor (``base``: its local base pointer, ``table``: the tensor's pointer table, row
    stride ``stride``) to the same place in rank ``peer``'s copy, in masked blocks.

    Starts with a CTA barrier: the rows may have just been written by other threads of
    this program. Follow with ``peer_tile_notify`` to publish them."""
    tl.debug_barrier()
    dst = remote_base(table, peer, base)
    _copy_rows(base, dst, row_start, row_end, n_cols, stride, 0, 0, BLOCK_M, BLOCK_N)


@triton.jit
def tile_pull_data(
    base,
    table,
    peer,
    row_start,
    row_end,
    n_cols,
    stride,
    token,
    expected,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Copy rows ``[row_start, row_end)`` x columns ``[0, n_cols)`` from rank ``peer``'s copy
    of a symmetric tensor into the same place of this rank's (``base``, local base).

    ``token``/``expected`` come from the wait that saw the rows ready: the loads are
    guarded by them, so they stay after the wait (and do nothing if it timed out)."""
    src = remote_base(table, peer, base)
    _copy_rows(src, base, row_start, row_end, n_cols, stride, token, expected, BLOCK_M, BLOCK_N)


# --------------------------------------------------------------------------------------
# Static (affine) mapping, computed in-kernel
# --------------------------------------------------------------------------------------


@triton.jit
def static_channel_of_row(row, rows_per_rank, channels_per_rank):
    """Global channel id holding global ``row``: the largest ``c`` with
    ``c * R // C <= local row``."""
    rank = row // rows_per_rank
    local = row - rank * rows_per_rank
    return rank * channels_per_rank + ((local + 1) * channels_per_rank - 1) // rows_per_rank


@triton.jit
def static_channel_rank(channel, channels_per_rank):
    """Rank owning global channel ``channel``."""
    return channel // channels_per_rank


@triton.jit
def static_channel_rows(channel, rows_per_rank, channels_per_rank):
    """Global row range ``(start, stop)`` of global channel ``channel``."""
    rank = channel // channels_per_rank
    c = channel - rank * channels_per_rank
    base = rank * rows_per_rank
    start = base + c * rows_per_rank // channels_per_rank
    stop = base + (c + 1) * rows_per_rank // channels_per_rank
    return start, stop


@triton.jit
def static_tile_channels(tile_m, BLOCK_M, rows_per_rank, channels_per_rank, M):
    """``(first global channel, number of channels)`` overlapped by rows
    ``[tile_m * BLOCK_M, min((tile_m + 1) * BLOCK_M, M))``; the channels are consecutive.

    Needs ``M == world * rows_per_rank`` and ``channels_per_rank <= rows_per_rank`` (no
    empty channel)."""
    first_row = tile_m * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, M) - 1
    first = static_channel_of_row(first_row, rows_per_rank, channels_per_rank)
    last = static_channel_of_row(last_row, rows_per_rank, channels_per_rank)
    return first, last - first + 1


# --------------------------------------------------------------------------------------
# Dynamic mapping: tables built by TileMapping, read in-kernel
# --------------------------------------------------------------------------------------


@triton.jit
def dynamic_tile_channels(table_first, table_count, tile):
    """``(first, count)`` of ``tile``: positions in the row-ordered ``order`` table (equal
    to channel ids when channels are numbered in row order)."""
    return tl.load(table_first + tile), tl.load(table_count + tile)


@triton.jit
def dynamic_channel_rank(table_rank, channel):
    """Rank owning ``channel``, from the ``channel_rank`` table."""
    return tl.load(table_rank + channel)


@triton.jit
def dynamic_channel_rows(table_start, table_stop, channel):
    """Global row range ``(start, stop)`` of ``channel``, from the tables."""
    return tl.load(table_start + channel), tl.load(table_stop + channel)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


def _check_static(rows_per_rank: int, channels_per_rank: int) -> None:
    if channels_per_rank < 1 or rows_per_rank < channels_per_rank:
        raise InterlaceValueError(
            f"static tile mapping needs 1 <= channels_per_rank <= rows_per_rank, got "
            f"channels_per_rank={channels_per_rank}, rows_per_rank={rows_per_rank}"
        )


def static_channel_bounds(
    world_size: int, rows_per_rank: int, channels_per_rank: int
) -> list[tuple[int, int, int]]:
    """``(start, stop, rank)`` of every global channel of the static layout, by channel id."""
    _check_static(rows_per_rank, channels_per_rank)
    r, c = rows_per_rank, channels_per_rank
    return [
        (rank * r + i * r // c, rank * r + (i + 1) * r // c, rank)
        for rank in range(world_size)
        for i in range(c)
    ]


def static_tile_channels_host(
    tile: int, block_m: int, rows_per_rank: int, channels_per_rank: int, m: int
) -> tuple[int, int]:
    """Python twin of the jit ``static_tile_channels``: ``(first channel, count)``."""
    _check_static(rows_per_rank, channels_per_rank)

    def channel_of(row: int) -> int:
        rank, local = divmod(row, rows_per_rank)
        return rank * channels_per_rank + ((local + 1) * channels_per_rank - 1) // rows_per_rank

    first_row = tile * block_m
    first = channel_of(first_row)
    last = channel_of(min(first_row + block_m, m) - 1)
    return first, last - first + 1


@dataclass(frozen=True)
class TileTables:
    """A :class:`TileMapping`'s int32 tables on one device (pass them to kernels)."""

    first_channel: torch.Tensor  # [num_tiles] position in ``order`` of the tile's first channel
    num_channels: torch.Tensor  # [num_tiles] channels the tile overlaps
    order: torch.Tensor  # [channels] channel ids by row (empty channels last)
    channel_rank: torch.Tensor  # [channels]
    channel_start: torch.Tensor  # [channels] first global row
    channel_stop: torch.Tensor  # [channels] one past the last global row


class TileMapping:
    """Tile -> channels lookup tables for arbitrary channels.

    ``channels[c] = (start, stop, rank)`` gives channel ``c``'s global rows
    ``[start, stop)`` and owner; the channels, listed in any order and of any (also zero)
    size, must tile ``[0, M)`` exactly. Tile ``t`` is rows ``[t * block_m, (t + 1) *
    block_m)`` clipped to ``M``; it overlaps the channels ``order[first_channel[t] :
    first_channel[t] + num_channels[t]]`` (``order`` lists the non-empty channels by row,
    then the empty ones, which no tile waits on).
    """

    def __init__(self, channels, block_m: int):
        chans = [tuple(int(v) for v in ch) for ch in channels]
        if block_m < 1:
            raise InterlaceValueError(f"TileMapping: block_m must be >= 1, got {block_m}")
        if not chans:
            raise InterlaceValueError("TileMapping: needs at least one channel")
        for c, ch in enumerate(chans):
            if len(ch) != 3 or ch[0] < 0 or ch[1] < ch[0] or ch[2] < 0:
                raise InterlaceValueError(
                    f"TileMapping: channel {c} must be (start, stop, rank) with "
                    f"0 <= start <= stop and rank >= 0, got {ch}"
                )
        order = sorted(range(len(chans)), key=lambda c: (chans[c][0] == chans[c][1], chans[c][0]))
        row = 0
        for c in order:
            start, stop, _ = chans[c]
            if start == stop:
                continue
            if start < row:
                raise InterlaceValueError(
                    f"TileMapping: channel {c} = {chans[c]} overlaps rows below {row}; "
                    "channels must tile [0, M) exactly"
                )
            if start > row:
                raise InterlaceValueError(
                    f"TileMapping: rows [{row}, {start}) are in no channel; "
                    "channels must tile [0, M) exactly"
                )
            row = stop
        self.m = row
        self.block_m = int(block_m)
        self.channels = chans
        self.order = order
        self.num_tiles = -(-self.m // self.block_m)
        pos_of_row = []  # position in ``order`` of each row's channel
        for p, c in enumerate(order):
            start, stop, _ = chans[c]
            pos_of_row.extend([p] * (stop - start))
        self.first_channel, self.num_channels = [], []
        for t in range(self.num_tiles):
            lo = t * self.block_m
            hi = min(lo + self.block_m, self.m) - 1
            self.first_channel.append(pos_of_row[lo])
            self.num_channels.append(pos_of_row[hi] - pos_of_row[lo] + 1)

    @classmethod
    def static(
        cls, world_size: int, rows_per_rank: int, channels_per_rank: int, block_m: int
    ) -> TileMapping:
        """The static layout expressed as tables (channel ids are in row order)."""
        return cls(static_channel_bounds(world_size, rows_per_rank, channels_per_rank), block_m)

    def tile_channels(self, tile: int) -> list[int]:
        """Channel ids tile ``tile`` overlaps, in row order."""
        first = self.first_channel[tile]
        return self.order[first : first + self.num_channels[tile]]

    def rank_channels(self, rank: int) -> list[int]:
        """Ids of the channels ``rank`` owns, in id order."""
        return [c for c, ch in enumerate(self.channels) if ch[2] == rank]

    def tables(self, device) -> TileTables:
        """The tables as int32 tensors on ``device``."""

        def t(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        return TileTables(
            first_channel=t(self.first_channel),
            num_channels=t(self.num_channels),
            order=t(self.order),
            channel_rank=t([ch[2] for ch in self.channels]),
            channel_start=t([ch[0] for ch in self.channels]),
            channel_stop=t([ch[1] for ch in self.channels]),
        )
