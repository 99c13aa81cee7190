"""The ``none`` strategy of the MoE ops: stock torch and the process group's collectives,
one step after another (the baseline and the fallback).

First half: all-gather of the tokens, ids and weights; routing by a stable sort
(``routing.dense_routing``); an index of the gathered tokens; ``torch._grouped_mm`` (a
per-expert loop where torch lacks it or the strides do not suit it); SwiGLU. Second half:
``torch._grouped_mm``, each row times its weight, ``index_add`` into the tokens (float32),
then a reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .routing import MoeRouting, dense_routing


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``a[rows of e] @ w[e]`` for every expert ``e`` (rows of ``e`` end at ``ends[e]``,
    int32 on ``a``'s device): ``torch._grouped_mm`` where it applies, else a loop over the
    experts (which reads ``ends`` on the host)."""
    k, n = w.shape[1], w.shape[2]
    fits = (
        hasattr(torch, "_grouped_mm")
        and a.dtype == torch.bfloat16
        and (k * a.element_size()) % 16 == 0
        and (n * a.element_size()) % 16 == 0
    )
    if fits:
        return torch._grouped_mm(a, w, offs=ends)
    out = torch.zeros(a.shape[0], n, dtype=a.dtype, device=a.device)
    lo = 0
    for e, hi in enumerate(ends.tolist()):
        if hi > lo:
            out[lo:hi] = (a[lo:hi].float() @ w[e].float()).to(a.dtype)
        lo = hi
    return out


def swiglu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``[rows, 2 * inter]`` (gate columns first)."""
    return F.silu(gate_up[:, :inter].float()).mul_(gate_up[:, inter:].float()).to(gate_up.dtype)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of every rank, concatenated in rank order."""
    pg = group.process_group
    if group.nccl:
        out = torch.empty(group.world_size * x.shape[0], *x.shape[1:], dtype=x.dtype,
                          device=x.device)  # fmt: skip
        dist.all_gather_into_tensor(out, x.contiguous(), group=pg)
        return out
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x.contiguous(), group=pg)
    return torch.cat(parts)


def ag_moe_none(group, x, ids, weights, w, experts, activation):
    """The first half as torch ops: ``(h, routing)``."""
    x_all = _all_gather(x, group)
    ids_all = _all_gather(ids.to(torch.int32), group)
    w_all = _all_gather(weights.float(), group)
    routing = dense_routing(ids_all, w_all, x.shape[0], experts, group.world_size)
    rows = x_all.index_select(0, routing.entry_ids.long() // routing.topk)  # (no padding)
    h = grouped_mm(rows, w, routing.offsets[1:])
    if activation == "swiglu":
        h = swiglu(h, w.shape[2] // 2)
    return h, routing


def moe_rs_none(group, h, routing: MoeRouting, w_down, out_dtype):
    """The second half as torch ops: this rank's ``[m, H]`` token rows."""
    m, world = routing.m_loc, group.world_size
    hidden = w_down.shape[2]
    rows = grouped_mm(h, w_down, routing.offsets[1:])
    rows = rows[: routing.rows].float()
    tok = routing.token_ids.long()
    # rows past offsets[E] (a padded layout's worst case) hold nothing
    used = torch.arange(tok.shape[0], device=tok.device) < routing.offsets[-1]
    live = (tok >= 0) & used
    contrib = torch.where(live[:, None], rows * routing.weights[:, None], 0.0)
    full = torch.zeros(world * m, hidden, dtype=torch.float32, device=h.device)
    # a padded layout's rows past offsets[E] hold whatever the buffer held: index 0 there
    full.index_add_(0, torch.where(live, tok, 0), contrib)
    if group.nccl:
        mine = torch.empty(m, hidden, dtype=torch.float32, device=h.device)
        dist.reduce_scatter_tensor(mine, full, group=group.process_group)
    else:  # gloo has no reduce-scatter
        dist.all_reduce(full, group=group.process_group)
        mine = full[group.rank * m : (group.rank + 1) * m]
    return mine.to(out_dtype)
