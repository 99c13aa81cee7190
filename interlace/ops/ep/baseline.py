"""Strategy ``none`` of expert parallelism: ``torch.distributed.all_to_all_single`` with
host-synchronised split sizes (the counts cross first, then the rows), the expansion and
its inverse done with torch indexing. Each token crosses to a rank once, as in
:class:`~interlace.ops.ep.dispatch.EPAllToAll`, and the expanded rows come out in the same
order (local expert, then source rank, then token, then k), so the two can be compared
row for row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class A2AState:
    """What :func:`a2a_combine` needs of a dispatch."""

    send_order: torch.Tensor  # home tokens in send order (dest rank, then token)
    send_splits: list[int]
    recv_splits: list[int]
    pair_rows: torch.Tensor  # [received tokens, topk]: expanded row of each pair, or -1
    recv_w: torch.Tensor  # [received tokens, topk] weights
    num_tokens: int


def a2a_dispatch(group, x, topk_idx, topk_weights, experts: int):
    """Returns ``(expanded rows, per-expert counts, inclusive offsets, state)``."""
    w, r, pg = group.world_size, group.rank, group.process_group
    e_loc = experts // w
    t, k = topk_idx.shape
    idx = topk_idx.long()
    dest = torch.where(idx >= 0, idx // e_loc, -1)
    goes = (dest[:, :, None] == torch.arange(w, device=x.device)).any(1)  # [T, W]
    dest_of, tok_of = goes.t().nonzero(as_tuple=True)  # sorted by dest, then token
    send_counts = goes.sum(0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=pg)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    n_recv = sum(recv_splits)
    recv_x = x.new_empty(n_recv, x.shape[1])
    dist.all_to_all_single(recv_x, x[tok_of], recv_splits, send_splits, group=pg)
    meta = torch.cat([idx[tok_of].float(), topk_weights[tok_of].float()], 1)
    recv_meta = meta.new_empty(n_recv, 2 * k)
    dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits, group=pg)
    recv_idx, recv_w = recv_meta[:, :k].long(), recv_meta[:, k:]
    local = (recv_idx >= r * e_loc) & (recv_idx < (r + 1) * e_loc)
    tok, j = local.nonzero(as_tuple=True)  # (received token, k) in row-major order
    e = recv_idx[tok, j] - r * e_loc
    order = torch.sort(e, stable=True).indices
    pair_rows = torch.full((n_recv, k), -1, dtype=torch.int64, device=x.device)
    pair_rows[tok[order], j[order]] = torch.arange(order.numel(), device=x.device)
    expanded = recv_x[tok[order]]
    counts = torch.bincount(e, minlength=e_loc).to(torch.int32)
    state = A2AState(tok_of, send_splits, recv_splits, pair_rows, recv_w, t)
    return expanded, counts, torch.cumsum(counts, 0, dtype=torch.int32), state


def a2a_combine(group, expert_out, state: A2AState):
    """The top-k weighted sum of ``expert_out`` (rows as :func:`a2a_dispatch` returned
    them) at each token's home rank, fp32 sums."""
    rows = state.pair_rows
    valid = rows >= 0
    gathered = expert_out[rows.clamp_min(0)].float() * (state.recv_w * valid)[:, :, None]
    partial = gathered.sum(1).to(expert_out.dtype)
    back = partial.new_empty(sum(state.send_splits), partial.shape[1])
    dist.all_to_all_single(
        back, partial, state.send_splits, state.recv_splits, group=group.process_group
    )
    out = torch.zeros(state.num_tokens, partial.shape[1], dtype=torch.float32, device=back.device)
    out.index_add_(0, state.send_order, back.float())
    return out.to(expert_out.dtype)
