"""The two baselines of sequence-parallel attention, written with torch ops only.

* ``gather_attention`` (strategy ``none``): all-gather K and V (NCCL), rebuild the whole
  sequence in position order, then torch SDPA on this rank's queries. Differentiable:
  the gather's backward sums dK / dV over ranks and keeps this rank's share.
* ``ring_attention`` (strategy ``ring``): ring attention. K/V travel round the ring, one
  send/recv per step, while SDPA runs on the chunk in hand; the partial outputs are merged
  by their log-sum-exp. Differentiable: the backward sends K/V round the ring again,
  recomputes each chunk's probabilities from the saved log-sum-exp (float32 torch ops),
  adds to dQ locally and passes each chunk's float32 dK/dV accumulator on with the chunk,
  so that it ends on the chunk's owner.

Layouts, ``cu_seqlens`` and shapes are those of :class:`SPAttention`. Where the ranks share
one GPU (a gloo group over CUDA tensors, tests) the transfers go through host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layout import positions, segment_ids, zigzag_unshard


def _on_host(group) -> bool:
    return not group.nccl


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
        qpos = positions(r, w, s_loc, causal, q.device)
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
@dataclass(frozen=True)
class _Block:
    """One block of a ring step: local query ``rows`` against the held chunk's key ``cols``
    under ``mask`` (``[rows, cols]`` bool, ``None``: no mask), with ``causal_diag`` adding
    the lower triangle (the query and key halves are the same chunk of the sequence)."""

    rows: slice
    cols: slice
    causal_diag: bool = False
    mask: torch.Tensor | None = None


def _blocks(rank, chunk, world, s_loc, causal, qpos, seg) -> list[_Block]:
    """The blocks of this rank's queries against the K/V of rank ``chunk`` that are not
    fully masked. Packed documents: one block under the document (and causal) mask. Causal
    without documents: the zigzag halves pairwise, skipping a key half that lies wholly
    after a query half."""
    every = slice(None)
    if seg is not None:
        kpos = positions(chunk, world, s_loc, causal, qpos.device)
        return [_Block(every, every, mask=_doc_mask(qpos, kpos, seg, causal))]
    if not causal:
        return [_Block(every, every)]
    half = s_loc // 2
    blocks = []
    for i, qc in enumerate((rank, 2 * world - 1 - rank)):
        for j, kc in enumerate((chunk, 2 * world - 1 - chunk)):
            if kc <= qc:  # a later key half is masked for every query of this half
                rows, cols = slice(i * half, (i + 1) * half), slice(j * half, (j + 1) * half)
                blocks.append(_Block(rows, cols, causal_diag=kc == qc))
    return blocks


def _logits(q, k, scale, causal_diag=False, mask=None):
    """float32 ``q k^T * scale`` with masked entries at ``-inf``."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal_diag:
        n = q.shape[2]
        tri = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask = tri if mask is None else mask & tri
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _partial(q, k, v, scale, causal_diag=False, mask=None):
    """Attention of ``q`` over ``k``/``v`` (same head counts) with its natural-log
    log-sum-exp ``[b, h, L]``: the flash kernel on a GPU where no mask is given, else in
    float32 with torch ops."""
    if q.is_cuda and mask is None:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal_diag, False, scale=scale
        )
        return res[0].float(), res[1]
    s = _logits(q, k, scale, causal_diag, mask)
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


def _block_grads(q, k, v, do, lse, delta, scale, blk: _Block):
    """float32 gradients of one block (K/V already expanded to the query heads) from the
    global ``lse`` and ``delta = rowsum(dO * O)`` of its query rows: ``P = exp(S - lse)``,
    ``dP = dO V^T``, ``dS = P (dP - delta)``; returns dQ of the rows, dK and dV of the
    columns."""
    q, do = q[:, :, blk.rows].float(), do[:, :, blk.rows].float()
    k, v = k[:, :, blk.cols].float(), v[:, :, blk.cols].float()
    p = torch.exp(_logits(q, k, scale, blk.causal_diag, blk.mask) - lse[:, :, blk.rows, None])
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - delta[:, :, blk.rows, None])
    dq = (ds @ k) * scale
    dk = (ds.transpose(-1, -2) @ q) * scale
    dv = p.transpose(-1, -2) @ do
    return dq, dk, dv


def _sum_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum a gradient over the query heads of each K/V head (the adjoint of ``_expand``)."""
    b, h, n, d = x.shape
    return x if h == kv_heads else x.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def _start_exchange(group, kv: torch.Tensor, tag: int = 0):
    """Start sending ``kv`` to the next rank and receiving the previous rank's; returns a
    function that waits for both and gives the received tensor. ``tag`` keeps two
    exchanges in flight at once apart (the backward's K/V and dK/dV; gloo matches by it)."""
    w, r = group.world_size, group.rank
    pg = group.process_group
    host = _on_host(group)
    src = kv.cpu() if host else kv
    recv = torch.empty_like(src)
    ops = [
        dist.P2POp(dist.isend, src, dist.get_global_rank(pg, (r + 1) % w), group=pg, tag=tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(pg, (r - 1) % w), group=pg, tag=tag),
    ]
    reqs = dist.batch_isend_irecv(ops)

    def finish() -> torch.Tensor:
        for req in reqs:
            req.wait()
        return recv.to(kv.device) if host else recv

    return finish


def _segments(cu_seqlens, total, device):
    return None if cu_seqlens is None else segment_ids(cu_seqlens.to(device), total)


def _ring_forward(group, q, k, v, causal, cu_seqlens, scale):
    """W steps; at step ``t`` this rank holds the K/V of rank ``rank - t`` and sends it on
    while it attends to it. Returns the float32 output and its log-sum-exp ``[b, h, L]``."""
    w, r = group.world_size, group.rank
    b, h, s_loc, d = q.shape
    out = torch.zeros(b, h, s_loc, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s_loc), float("-inf"), dtype=torch.float32, device=q.device)
    seg = _segments(cu_seqlens, w * s_loc, q.device)
    qpos = positions(r, w, s_loc, causal, q.device)
    kv = torch.stack([k, v]).contiguous()
    for t in range(w):
        c = (r - t) % w
        finish = _start_exchange(group, kv) if t + 1 < w else None
        kc, vc = _expand(kv[0], h), _expand(kv[1], h)
        for blk in _blocks(r, c, w, s_loc, causal, qpos, seg):
            part, part_lse = _partial(
                q[:, :, blk.rows], kc[:, :, blk.cols], vc[:, :, blk.cols], scale,
                causal_diag=blk.causal_diag, mask=blk.mask,
            )  # fmt: skip
            _merge(out, lse, part, part_lse, blk.rows)
        if finish is not None:
            kv = finish()
    return out, lse


def _ring_backward(group, q, k, v, out, lse, do, causal, cu_seqlens, scale):
    """W steps as in the forward: K/V travel round the ring again (the next chunk in
    flight while this one is computed). Each step adds this rank's queries' share to dQ
    and to the float32 dK/dV accumulator of the chunk in hand, which then travels on with
    it, one step behind the K/V; after the last step each accumulator has visited every
    rank and one more exchange lands it on its owner."""
    w, r = group.world_size, group.rank
    h, s_loc, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    seg = _segments(cu_seqlens, w * s_loc, q.device)
    qpos = positions(r, w, s_loc, causal, q.device)
    delta = (do.float() * out).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    finish_dkv = None  # receives the accumulator of the next step's chunk
    for t in range(w):
        c = (r - t) % w
        finish_kv = _start_exchange(group, kv) if t + 1 < w else None
        kc, vc = _expand(kv[0], h), _expand(kv[1], h)
        dk = torch.zeros(kc.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for blk in _blocks(r, c, w, s_loc, causal, qpos, seg):
            bq, bk, bv = _block_grads(q, kc, vc, do, lse, delta, scale, blk)
            dq[:, :, blk.rows] += bq
            dk[:, :, blk.cols] += bk
            dv[:, :, blk.cols] += bv
        dkv = torch.stack([_sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)])
        if finish_dkv is not None:
            dkv += finish_dkv()  # what the ranks before this one added to chunk ``c``
        finish_dkv = _start_exchange(group, dkv, tag=1) if w > 1 else None
        if finish_kv is not None:
            kv = finish_kv()
    dkv = finish_dkv() if finish_dkv is not None else dkv  # this rank's own chunk
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttentionFn(torch.autograd.Function):
    """Ring attention with its ring backward (see ``_ring_forward`` / ``_ring_backward``);
    saves this rank's q, k, v, the float32 output and its log-sum-exp."""

    @staticmethod
    def forward(fctx, group, q, k, v, causal, cu_seqlens, scale):
        out, lse = _ring_forward(group, q, k, v, causal, cu_seqlens, scale)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.group, fctx.causal, fctx.cu_seqlens, fctx.scale = group, causal, cu_seqlens, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx, do):
        q, k, v, out, lse = fctx.saved_tensors
        dq, dk, dv = _ring_backward(
            fctx.group, q, k, v, out, lse, do, fctx.causal, fctx.cu_seqlens, fctx.scale
        )
        return None, dq, dk, dv, None, None, None


def ring_attention(group, q, k, v, causal, cu_seqlens, scale):
    """``ring``: ring attention, differentiable (see the module docstring)."""
    return _RingAttentionFn.apply(group, q, k, v, causal, cu_seqlens, scale)


__all__ = ["gather_attention", "ring_attention"]
