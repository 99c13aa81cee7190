"""The two baselines of sequence-parallel attention, written with torch ops only.

* ``gather_attention`` (strategy ``none``): all-gather K and V (NCCL), rebuild the whole
  sequence in position order, then torch SDPA on this rank's queries. Differentiable:
  the gather's backward sums dK / dV over ranks and keeps this rank's share.
* ``ring_attention`` (strategy ``ring``): ring attention. K/V travel round the ring, one
  send/recv per step, while SDPA runs on the chunk in hand; the partial outputs are merged
  by their log-sum-exp. Forward only.

Layouts, ``cu_seqlens`` and shapes are those of :class:`SPAttention`. Where the ranks share
one GPU (a gloo group over CUDA tensors, tests) the transfers go through host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _on_host(group) -> bool:
    return group.backend != "cuda" or group.shared_device


def _positions(rank, world, s_loc, causal, device):
    from .sp_attention import positions

    return positions(rank, world, s_loc, causal, device)


def _gather_parts(group, x: torch.Tensor) -> list[torch.Tensor]:
    pg = group.process_group
    if _on_host(group):
        src = x.detach().cpu().contiguous()
        parts = [torch.empty_like(src) for _ in range(group.world_size)]
        dist.all_gather(parts, src, group=pg)
        return [p.to(x.device) for p in parts]
    out = torch.empty((group.world_size, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=pg)
    return list(out.unbind(0))


class _GatherKV(torch.autograd.Function):
    """All ranks' K (or V) chunks in rank order; backward: the sum over ranks of the
    gradient of this rank's chunk."""

    @staticmethod
    def forward(fctx, group, x):
        fctx.group = group
        return torch.stack(_gather_parts(group, x))

    @staticmethod
    def backward(fctx, grad):
        group = fctx.group
        pg = group.process_group
        if _on_host(group):
            full = grad.detach().cpu().contiguous()
            dist.all_reduce(full, group=pg)
            return None, full[group.rank].to(grad.device)
        out = torch.empty_like(grad[0])
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=pg)
        return None, out


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _doc_mask(qpos, kpos, seg, causal):
    ok = seg[qpos][:, None] == seg[kpos][None, :]
    if causal:
        ok &= kpos[None, :] <= qpos[:, None]
    return ok


def gather_attention(group, q, k, v, causal, cu_seqlens, scale):
    """``none``: all-gather K/V, then SDPA (see the module docstring)."""
    from .sp_attention import segment_ids, zigzag_unshard

    w, r = group.world_size, group.rank
    b, h, s_loc, d = q.shape
    ks, vs = _GatherKV.apply(group, k), _GatherKV.apply(group, v)
    if causal:
        k_full, v_full = zigzag_unshard(list(ks.unbind(0))), zigzag_unshard(list(vs.unbind(0)))
    else:
        k_full, v_full = torch.cat(list(ks.unbind(0)), 2), torch.cat(list(vs.unbind(0)), 2)
    k_full, v_full = _expand(k_full, h), _expand(v_full, h)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(q.device)
        seg = segment_ids(cu, w * s_loc)
        qpos = _positions(r, w, s_loc, causal, q.device)
        kpos = torch.arange(w * s_loc, device=q.device)
        mask = _doc_mask(qpos, kpos, seg, causal)
        return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=scale)
    if not causal:
        return F.scaled_dot_product_attention(q, k_full, v_full, scale=scale)
    from torch.nn.attention.bias import causal_lower_right

    half = s_loc // 2
    outs = []
    for i, chunk in enumerate((r, 2 * w - 1 - r)):
        qh = q[:, :, i * half : (i + 1) * half]
        end = (chunk + 1) * half  # keys at or before this chunk's last position
        bias = causal_lower_right(half, end)
        outs.append(
            F.scaled_dot_product_attention(
                qh, k_full[:, :, :end], v_full[:, :, :end], attn_mask=bias, scale=scale
            )
        )
    return torch.cat(outs, 2)


# ------------------------------------------------------------------------------ ring
def _partial(q, k, v, scale, causal_diag=False, mask=None):
    """Attention of ``q`` over ``k``/``v`` (same head counts) with its natural-log
    log-sum-exp ``[b, h, L]``: the flash kernel on a GPU where no mask is given, else in
    float32 with torch ops."""
    if q.is_cuda and mask is None:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal_diag, False, scale=scale
        )
        return res[0].float(), res[1]
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal_diag:
        n = q.shape[2]
        tri = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask = tri if mask is None else mask & tri
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ v.float(), lse


def _merge(out, lse, part, part_lse, rows=slice(None)):
    """Fold a partial (``part``, ``part_lse``) over query ``rows`` into ``out`` / ``lse``."""
    o, m = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(m, part_lse)
    safe = torch.where(torch.isfinite(new), new, 0.0)
    a = torch.exp(m - safe)[..., None]
    c = torch.exp(part_lse - safe)[..., None]
    out[:, :, rows] = o * a + part * c
    lse[:, :, rows] = new


def _start_exchange(group, kv: torch.Tensor):
    """Start sending ``kv`` to the next rank and receiving the previous rank's; returns a
    function that waits for both and gives the received tensor."""
    w, r = group.world_size, group.rank
    pg = group.process_group
    host = _on_host(group)
    src = kv.cpu() if host else kv
    recv = torch.empty_like(src)
    ops = [
        dist.P2POp(dist.isend, src, dist.get_global_rank(pg, (r + 1) % w), group=pg),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(pg, (r - 1) % w), group=pg),
    ]
    reqs = dist.batch_isend_irecv(ops)

    def finish() -> torch.Tensor:
        for req in reqs:
            req.wait()
        return recv.to(kv.device) if host else recv

    return finish


def ring_attention(group, q, k, v, causal, cu_seqlens, scale):
    """``ring``: W steps; at step ``t`` this rank holds the K/V of rank ``rank - t`` and
    sends it on while it attends to it (see the module docstring)."""
    from .sp_attention import segment_ids

    w, r = group.world_size, group.rank
    b, h, s_loc, d = q.shape
    half = s_loc // 2
    out = torch.zeros(b, h, s_loc, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s_loc), float("-inf"), dtype=torch.float32, device=q.device)
    seg = None
    if cu_seqlens is not None:
        seg = segment_ids(cu_seqlens.to(q.device), w * s_loc)
    qpos = _positions(r, w, s_loc, causal, q.device)
    kv = torch.stack([k, v]).contiguous()
    with torch.no_grad():
        for t in range(w):
            c = (r - t) % w
            finish = _start_exchange(group, kv) if t + 1 < w else None
            kc, vc = _expand(kv[0], h), _expand(kv[1], h)
            if seg is not None:
                kpos = _positions(c, w, s_loc, causal, q.device)
                mask = _doc_mask(qpos, kpos, seg, causal)
                part, part_lse = _partial(q, kc, vc, scale, mask=mask)
                _merge(out, lse, part, part_lse)
            elif not causal:
                _merge(out, lse, *_partial(q, kc, vc, scale))
            else:
                for i, qc in enumerate((r, 2 * w - 1 - r)):
                    rows = slice(i * half, (i + 1) * half)
                    for j, kcid in enumerate((c, 2 * w - 1 - c)):
                        if kcid > qc:
                            continue  # every key after every query: fully masked
                        cols = slice(j * half, (j + 1) * half)
                        part, part_lse = _partial(
                            q[:, :, rows], kc[:, :, cols], vc[:, :, cols], scale,
                            causal_diag=kcid == qc,
                        )  # fmt: skip
                        _merge(out, lse, part, part_lse, rows)
            if finish is not None:
                kv = finish()
    return out.to(q.dtype)


__all__ = ["gather_attention", "ring_attention"]
