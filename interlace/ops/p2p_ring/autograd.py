"""Differentiable ``p2p_ring`` GEMMs and the tensor-parallel linear layers built on them.

The backward of each is the dual decomposition: the input gradient of the all-gather GEMM
is a GEMM + reduce-scatter, and that of the GEMM + reduce-scatter an all-gather GEMM, both
run by the same ring context. Weight gradients are computed too (from the gathered input
saved by the forward, or the gathered output gradient the backward's ring produces).
"""

from __future__ import annotations

import math

import torch

from .context import P2PRing


class _FuseAG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ring):
        need_w = ctx.needs_input_grad[1]
        if need_w:
            y, gathered = ring.ag_gemm(x, w, return_gathered=True)
        else:
            y, gathered = ring.ag_gemm(x, w), None
        ctx.ring = ring
        ctx.save_for_backward(w, gathered)
        return y

    @staticmethod
    def backward(ctx, gy):
        w, gathered = ctx.saved_tensors
        gy = gy.contiguous()
        gx = ctx.ring.gemm_rs(gy, w.t()) if ctx.needs_input_grad[0] else None
        gw = gathered.t() @ gy if ctx.needs_input_grad[1] else None
        return gx, gw, None


class _FuseRS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ring):
        ctx.ring = ring
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        return ring.gemm_rs(x, w)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gy = gy.contiguous()
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = gw = None
        if need_x and need_w:
            gx, g = ctx.ring.ag_gemm(gy, w.t(), return_gathered=True)
            gw = x.t() @ g
        elif need_x:
            gx = ctx.ring.ag_gemm(gy, w.t())
        elif need_w:
            _, g = ctx.ring.ag_gemm(gy, None, return_gathered=True)
            gw = x.t() @ g
        return gx, gw, None


def fuse_ag(x: torch.Tensor, w: torch.Tensor, ring: P2PRing) -> torch.Tensor:
    """Differentiable ``ring.ag_gemm(x, w)``: ``all_gather(x) @ w``."""
    return _FuseAG.apply(x.contiguous(), w, ring)


def fuse_rs(x: torch.Tensor, w: torch.Tensor, ring: P2PRing) -> torch.Tensor:
    """Differentiable ``ring.gemm_rs(x, w)``: ``reduce_scatter(x @ w)``."""
    return _FuseRS.apply(x.contiguous(), w, ring)


class _RingLinear(torch.nn.Module):
    def __init__(self, ring: P2PRing, in_features: int, out_features: int):
        super().__init__()
        self.ring, self.in_features, self.out_features = ring, in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=ring.dtype, device=ring.group.device)
        )
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as torch.nn.Linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


class FuseAGLinear(_RingLinear):
    """Column-parallel linear (QKV, MLP up/gate) on sequence-sharded input:
    ``all_gather(x) @ weight.T``. ``x`` [R, in] -> [W*R, out]; ``weight`` [out, in] is this
    rank's column shard. No bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fuse_ag(x, self.weight.t(), self.ring)


class FuseRSLinear(_RingLinear):
    """Row-parallel linear (attention output, MLP down) with sequence-sharded output:
    ``reduce_scatter(x @ weight.T)``. ``x`` [W*R, in] -> [R, out]; ``weight`` [out, in] is
    this rank's row shard. No bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fuse_rs(x, self.weight.t(), self.ring)
