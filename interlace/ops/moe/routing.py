"""The routing of one MoE call as the GEMMs read it (:class:`MoeRouting`), built on the
device with no host synchronisation (``kernels.grouped_gemm.moe_route_kernel``: a
histogram per chunk of entries, then the offsets, the tile table and a stable counting
sort, in one launch on a GPU), and argument checks shared by both halves.

Row layout (``layout="padded"``): rows are sorted by (expert, arrival position of the
source rank, token, slot); each expert's rows are padded to ``block_m`` (token -1, weight
0), so a row tile never mixes experts. ``offsets[e]`` is expert ``e``'s first row,
``offsets[E]`` the rows in use; ``tiles`` lists the row tiles in the order the GEMMs run
them (``kernels.grouped_gemm``), ``tile_count[0]`` how many there are. The ``none``
strategy builds the same dataclass with torch ops (``layout="dense"``: no padding, no tile
table); both halves take either where they can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.grouped_gemm import TILE_COLS, moe_route_kernel
from ...runtime.signals import ERROR_WORDS
from .._context import cdiv, next_pow2, sm_count


@dataclass(frozen=True)
class MoeRouting:
    """What the second half needs of the first half's routing (device tensors, valid until
    the caller drops them; each call makes new ones).

    ``entry_ids[row]``: the (token, slot) entry of each expert-sorted row, ``token * k +
    slot``, where ``token`` is a global index ``src * m + t`` into the gathered tokens
    (rank ``src``'s token ``t``), -1 for a padding row (:attr:`token_ids`: the tokens);
    ``weights[row]``: its routing weight (float32, 0 for padding); ``offsets``: int32
    ``[E + 1]``, each expert's first row and (last) the rows in use; ``tiles`` /
    ``tile_count``: the tile table (``layout="padded"`` only); ``storage``: the one
    allocation all of them are views of (``padded``: a graph-replayed call re-points
    it)."""

    entry_ids: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor
    tiles: torch.Tensor | None
    tile_count: torch.Tensor | None
    m_loc: int
    topk: int
    experts: int
    world: int
    block_m: int
    layout: str  # "padded" (the fused kernels) or "dense" (torch ops)
    storage: torch.Tensor | None = None

    @property
    def token_ids(self) -> torch.Tensor:
        """The token of each row (``entry_ids // topk``; -1 for a padding row), made anew."""
        e = self.entry_ids
        return torch.where(e >= 0, e // self.topk, -1)

    @property
    def rows(self) -> int:
        """Rows of the expert-sorted buffers (a worst case for ``padded``; the rows in use
        are ``offsets[E]``)."""
        return self.entry_ids.shape[0]


def padded_rows(tokens: int, topk: int, experts: int, block_m: int) -> int:
    """Worst-case rows of the padded layout: every entry, plus up to ``block_m - 1``
    padding rows per expert, rounded to whole tiles."""
    return (cdiv(tokens * topk, block_m) + experts) * block_m


#: entries per routing chunk at most: 512 built TileLink's shapes at TP 4 in 12.9-18.7 us
#: on one H200, 1024 in 17.3-23.2, 256 in 12.0-19.7 (benchmarks/results/history/
#: 2026-11-29-h200-w1-moe-tile-order.txt)
MAX_CHUNK = 512


def chunk_size(mk: int) -> int:
    """Entries per routing chunk (a power of two): :data:`MAX_CHUNK`, or fewer for small
    shards."""
    return max(16, next_pow2(min(mk, MAX_CHUNK)))


def e_pad(experts: int) -> int:
    """Histogram bins: a power of two above ``experts`` (the last bin collects ids out of
    range)."""
    return max(2, next_pow2(experts + 1))


@dataclass
class RoutingWork:
    """The device buffers of one routing build (one allocation; views into it)."""

    routing: MoeRouting
    counts: torch.Tensor
    scratch: torch.Tensor
    base_scratch: torch.Tensor


def alloc_routing(m_loc, topk, experts, world, block_m, device) -> RoutingWork:
    """New routing tensors for one call: a single allocation cut into views (the caching
    allocator makes that one cheap call; inside a CUDA graph it comes from its pool)."""
    mk = m_loc * topk
    chunk = chunk_size(mk)
    n_chunks = world * cdiv(mk, chunk)
    ep = e_pad(experts)
    rows = padded_rows(world * m_loc, topk, experts, block_m)
    max_tiles = rows // block_m
    sizes = [
        rows, rows, experts + 1, max_tiles * TILE_COLS.value, 1, n_chunks * ep,
        n_chunks * (3 * world + 1) * ep, n_chunks * ep,
    ]  # fmt: skip
    buf = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    views, at = [], 0
    for s in sizes:
        views.append(buf[at : at + s])
        at += s
    ent, wts, offsets, tiles, count, counts, scratch, base = views
    routing = MoeRouting(
        entry_ids=ent, weights=wts.view(torch.float32), offsets=offsets,
        tiles=tiles.view(max_tiles, TILE_COLS.value), tile_count=count, m_loc=m_loc,
        topk=topk, experts=experts, world=world, block_m=block_m, layout="padded",
        storage=buf,
    )  # fmt: skip
    return RoutingWork(routing, counts, scratch, base)


#: sig slots a one-launch routing build needs (``launch_routing``'s ``bar_slot``)
BARRIER_SLOTS = 2


def launch_routing(
    work: RoutingWork, meta: torch.Tensor, meta_stride: int, *, rank: int, sig=None,
    flag0: int = 0, err: int = 0, max_spins: int = 0, wait: bool = False,
    bar_slot: int | None = None,
) -> MoeRouting:  # fmt: skip
    """Enqueue the routing build (``moe_route_kernel``) on the current stream. ``meta``:
    the packed ids and weights of every source rank (``meta_stride`` int32 per source:
    ``m * k`` ids, then ``m * k`` weights); ``wait``: entries of other ranks wait for
    their meta flag (``sig + flag0 + arrival position``). ``bar_slot``: two ``sig`` slots
    at zero (left at zero) for the grid barrier of a one-launch build, which runs on a GPU
    where every chunk's program can be resident at once (one per SM); otherwise (None, the
    interpreter, more chunks than SMs) the count and the build are two launches."""
    rt = work.routing
    w, e = rt.world, rt.experts
    mk = rt.m_loc * rt.topk
    chunk = chunk_size(mk)
    cps = cdiv(mk, chunk)
    n_chunks = w * cps
    sig_t = sig if sig is not None else work.counts
    one = (
        bar_slot is not None and sig is not None and meta.is_cuda
        and n_chunks <= sm_count(meta.device.index)
    )  # fmt: skip
    args = (
        meta, meta_stride, mk, mk, cps, e, work.counts, n_chunks, rt.offsets, rt.tiles,
        rt.tile_count, work.scratch, work.base_scratch, rt.entry_ids, rt.weights, sig_t,
        flag0, bar_slot or 0, err or _no_err(meta), rank, max_spins,
    )  # fmt: skip
    consts = route_consts(rt, wait)
    for phase in (0,) if one else (1, 2):
        moe_route_kernel[(n_chunks,)](*args, PHASE=phase, **consts)
    return rt


#: The routing build reads every chunk's counts in one load where they are at most this
#: many int32 (``NC_PAD * E_PAD``: 32 KB of registers over a program's threads), else
#: 32 chunks' at a time; one load replaced a round trip per arrival position
#: (``benchmarks/results/history/2026-11-29-h200-w1-moe-routing-one-load.txt``).
COUNTS_IN_ONE_LOAD = 8192

#: Warps of a routing program. With 4, the build took 255 registers a thread and spilled at
#: E 32 (64 histogram bins); 8 halve its tensors per thread: 46 -> 26 us at W 8, E 32,
#: k 5 and 24.5 -> 15 us at W 4, E 32, k 2 under ncu, the same within 1 us at E 8
#: (``benchmarks/results/history/2026-11-30-h200-w1-moe-routing-warps.txt``).
ROUTE_WARPS = 8


def route_consts(rt: MoeRouting, wait: bool) -> dict:
    """The constexprs (and warps) of ``moe_route_kernel`` for ``rt``'s sizes."""
    mk = rt.m_loc * rt.topk
    chunk = chunk_size(mk)
    n_chunks = rt.world * cdiv(mk, chunk)
    ep = e_pad(rt.experts)
    nc_pad = next_pow2(n_chunks)
    return dict(
        CHUNK=chunk, E_PAD=ep, WORLD=rt.world, W_PAD=next_pow2(rt.world),
        BLOCK_M=rt.block_m, CB=32, TB=64, WAIT=wait,
        NC_PAD=nc_pad if nc_pad * ep <= COUNTS_IN_ONE_LOAD else 0, num_warps=ROUTE_WARPS,
    )  # fmt: skip


_NO_ERR: dict = {}


def _no_err(like: torch.Tensor) -> int:
    """An error word for launches that run no wait (the kernels still take an address)."""
    key = like.device
    if key not in _NO_ERR:
        _NO_ERR[key] = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=like.device)
    return _NO_ERR[key].data_ptr()


def pack_meta(dst: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """Write ``ids`` (as int32) then ``weights`` (as float32 bits) into the int32 ``dst``."""
    mk = ids.numel()
    dst[:mk].copy_(ids.reshape(-1))
    dst[mk : 2 * mk].view(torch.float32).copy_(weights.reshape(-1))


def dense_routing(ids_all, w_all, m_loc, experts, world) -> MoeRouting:
    """The ``none`` strategy's routing with torch ops (no host synchronisation): rows
    sorted by (expert, token, slot) with no padding."""
    topk = ids_all.shape[1]
    flat = ids_all.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return MoeRouting(
        entry_ids=order.to(torch.int32), weights=w_all.reshape(-1)[order].float(),
        offsets=offsets, tiles=None, tile_count=None, m_loc=m_loc, topk=topk,
        experts=experts, world=world, block_m=1, layout="dense",
    )  # fmt: skip
