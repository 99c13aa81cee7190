"""The sequence layouts of sequence-parallel attention: which global positions a rank's
tokens hold (contiguous shards; the zigzag layout of the causal case, which gives every
rank the same share of the causal mask's work), and the document index of every position
of a packed variable-length batch."""

from __future__ import annotations

import torch


def zigzag_shard(x: torch.Tensor, world: int, rank: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s tokens of a whole sequence ``x`` in the causal (zigzag) layout:
    chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world`` along ``dim``."""
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim).contiguous()


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's zigzag shard (``parts`` in rank order)."""
    w = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    order = [halves[i][0] for i in range(w)] + [halves[w - 1 - i][1] for i in range(w)]
    return torch.cat(order, dim=dim)


def positions(rank: int, world: int, s_loc: int, causal: bool, device=None) -> torch.Tensor:
    """Global positions of a rank's local tokens (zigzag when ``causal``)."""
    idx = torch.arange(s_loc, device=device)
    if not causal:
        return rank * s_loc + idx
    half = s_loc // 2
    return torch.where(idx < half, rank * half + idx, (2 * world - 1 - rank) * half + idx - half)


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of every global position (int32 [total])."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lengths.numel(), dtype=torch.int32, device=cu_seqlens.device)
    return torch.repeat_interleave(ids, lengths, output_size=total)
