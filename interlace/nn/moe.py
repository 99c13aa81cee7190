"""Tensor-parallel mixture-of-experts block (Mixtral-style: softmax router, top-k experts,
gated expert MLPs): every rank holds a slice of every expert's intermediate features.

Sequence parallel (the default): each rank routes its own tokens, gathers every rank's
tokens and routing, runs its expert slices on them, and reduce-scatters the partial sums
back to its share of the tokens; without it, the tokens are the same on every rank and the
partial sums are all-reduced.

Two ways to run the experts (``strategy``):

* ``none``: ``all_gather`` of the tokens and routing, a per-expert loop of torch matmuls,
  ``reduce_scatter`` (or ``all_reduce``); differentiable op by op.
* ``fused`` (sequence parallel, SiLU-gated experts only): the custom op
  ``torch.ops.interlace.moe_experts`` (:mod:`interlace.ops.moe.library`), eager and under
  ``torch.compile`` alike: :class:`~interlace.ops.moe.AGMoE` (all-gather overlapped with
  the routing-driven grouped GEMM and SwiGLU) then :class:`~interlace.ops.moe.MoERS`
  (grouped GEMM, top-k weighted sum and reduce-scatter overlapped). Its backward
  (``moe_experts_backward``) recomputes the ``none`` path on the saved inputs and weights
  (in float32) and returns its gradients, so training matches ``none`` at the cost of a
  second forward (its all-gathers included).
* ``auto``: ``fused`` where :class:`~interlace.ops.moe.MoERS`'s own ``auto`` runs fused (the
  CPU emulation; on GPUs where ``moe_rs.AUTO_FUSED_ON_GPU``, the default), for bfloat16 / float16
  weights, sequence parallel and a SiLU activation, in eager calls and under
  ``torch.compile`` alike; else ``none``.

The router is plain torch in every strategy. The expert weights are stored as the fused
ops read them, and the ``none`` path reads the same tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InterlaceTypeError, InterlaceValueError
from ..ops import autograd as _ops
from ..ops import library as _library
from ..ops.moe import library as _moe_library
from ..ops.moe import moe_rs as _moe_rs
from ..runtime import Group
from .linear import copy_to_parallel, shard, sync_sequence_parallel_grads

#: weight dtypes the fused MoE ops take
FUSED_DTYPES = (torch.bfloat16, torch.float16)


def _computes_silu(act) -> bool:
    """``act`` is SiLU, the gate activation of the fused ops' SwiGLU (``F.silu``, or any
    callable that matches it on a few probe values: ``nn.SiLU``, transformers'
    ``SiLUActivation``)."""
    if act is F.silu:
        return True
    probe = torch.linspace(-6.0, 6.0, 13)
    out = act(probe)
    return (
        isinstance(out, torch.Tensor)
        and out.shape == probe.shape
        and bool(torch.allclose(out, F.silu(probe), rtol=1e-5, atol=1e-6))
    )


class MoEBlock(nn.Module):
    """``num_experts`` gated MLPs (``hidden_size`` -> ``intermediate_size``), ``top_k`` per
    token from a softmax router (weights renormalised over the top k when ``normalize``).
    ``x``: ``[..., H]``, this rank's tokens (sequence parallel) or all of them.

    Parameters: ``router [E, H]`` (replicated), ``gate_up [E, H, 2 * I / W]`` (this rank's
    gate columns, then its up columns) and ``down [E, I / W, H]``: the layouts of
    :class:`~interlace.ops.moe.AGMoE` / :class:`~interlace.ops.moe.MoERS`
    (:meth:`shard_gate_up` / :meth:`shard_down` cut them from full ``nn.Linear``-layout
    tensors).

    ``strategy``: ``none``, ``fused`` or ``auto`` (see the module docstring). ``fused``
    needs ``sequence_parallel`` (the fused ops take each rank's own tokens) and a SiLU
    ``act`` (the fused ops' SwiGLU): without either, ``fused`` raises at construction and
    ``auto`` runs ``none``; it also needs bfloat16 / float16 weights (a float32 block raises
    on its first call). The fused path runs ``torch.ops.interlace.moe_experts``, whose op
    contexts live in :mod:`interlace.ops.library`'s cache (shared by every block of one
    group and shape): built on the first call, sized to the next power of two of the
    tokens per rank, rebuilt (at least twice as large) when a call has more tokens and
    after a failed call. :meth:`close` frees them (collective: call it on every rank; a
    later fused call builds new ones).
    ``last_strategy``: what the last call ran."""

    STRATEGIES = ("auto", "none", "fused")

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 group: Group, *, act=F.silu, normalize: bool = True, strategy: str = "auto",
                 sequence_parallel: bool = True, dtype=None, device=None):  # fmt: skip
        super().__init__()
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"MoEBlock: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        if strategy == "fused" and not sequence_parallel:
            raise InterlaceValueError(
                "MoEBlock: strategy 'fused' needs sequence_parallel=True (the fused MoE ops "
                "take each rank's own tokens); use 'none' or 'auto' without it"
            )
        self._silu = _computes_silu(act)
        if strategy == "fused" and not self._silu:
            raise InterlaceValueError(
                f"MoEBlock: strategy 'fused' needs a SiLU activation (the fused MoE ops apply "
                f"SwiGLU), got {act!r}; use 'none' or 'auto' with it"
            )
        w = group.world_size
        if intermediate_size % w:
            raise InterlaceValueError(
                f"MoEBlock: intermediate_size {intermediate_size} must split over {w} ranks"
            )
        self.group, self.handle = group, _library.register_group(group)
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.num_experts, self.top_k, self.act = int(num_experts), int(top_k), act
        self.normalize, self.strategy = bool(normalize), strategy
        self.sequence_parallel = bool(sequence_parallel)
        self.last_strategy: str | None = None
        kw = dict(dtype=dtype, device=group.device if device is None else device)
        i_loc = self.intermediate_size // w
        self.router = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.gate_up = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * i_loc, **kw))
        self.down = nn.Parameter(torch.empty(num_experts, i_loc, hidden_size, **kw))
        for p in (self.router, self.gate_up, self.down):
            nn.init.normal_(p, std=hidden_size**-0.5)
        self.gate_up._interlace_tp = self.down._interlace_tp = True
        if self.sequence_parallel:  # the router sees this rank's tokens only
            sync_sequence_parallel_grads([self.router], group)

    def shard_gate_up(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``[E, 2 * I, H]`` (gate rows, then up rows) tensor
        (a weight or its gradient), in ``gate_up``'s layout ``[E, H, 2 * I / W]``."""
        i = self.intermediate_size
        part = shard(full, self.group.rank, self.group.world_size, 1, [i, i])
        return part.transpose(1, 2).contiguous()

    def shard_down(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``[E, H, I]`` tensor, in ``down``'s layout
        ``[E, I / W, H]``."""
        part = shard(full, self.group.rank, self.group.world_size, 2)
        return part.transpose(1, 2).contiguous()

    @classmethod
    def from_weights(cls, router, gate_up, down, top_k: int, group: Group, **kw):
        """From full weights: ``router [E, H]``, ``gate_up [E, 2 * I, H]`` (gate rows
        first), ``down [E, H, I]``."""
        kw.setdefault("dtype", gate_up.dtype)
        e, h, i = down.shape
        block = cls(h, i, e, top_k, group, **kw)
        with torch.no_grad():
            block.router.copy_(router)
            block.gate_up.copy_(block.shard_gate_up(gate_up))
            block.down.copy_(block.shard_down(down))
        return block

    @classmethod
    def from_module(cls, moe: nn.Module, group: Group, **kw):
        """From a transformers Mixtral-style sparse MoE block: ``gate`` (a router with a
        ``weight`` ``[E, H]``) and ``experts`` holding ``gate_up_proj`` / ``down_proj``
        tensors (transformers 5) or a list of ``w1`` / ``w3`` / ``w2`` linears (4.x)."""
        experts = moe.experts
        top_k = getattr(moe, "top_k", None) or getattr(moe.gate, "top_k", None)
        if hasattr(experts, "gate_up_proj"):
            gate_up, down = experts.gate_up_proj, experts.down_proj
        else:
            gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            down = torch.stack([e.w2.weight for e in experts])
        kw.setdefault("act", getattr(experts, "act_fn", None) or experts[0].act_fn)
        kw.setdefault("normalize", bool(getattr(moe, "norm_topk_prob", True)))
        return cls.from_weights(moe.gate.weight, gate_up, down, top_k, group, **kw)

    def close(self) -> None:
        """Free the fused path's cached op contexts of this block's group (shared with the
        group's other blocks; collective: call on every rank). Idempotent; the block stays
        usable (a later fused call builds new contexts)."""
        _moe_library.close_contexts(self.handle)

    def _use_fused(self, rows: int) -> bool:
        if self.strategy == "none" or not self.sequence_parallel or rows == 0:
            return False
        half = self.gate_up.dtype in FUSED_DTYPES
        if self.strategy == "fused":
            if not half:
                raise InterlaceTypeError(
                    f"MoEBlock: strategy 'fused' needs {FUSED_DTYPES} weights, got "
                    f"{self.gate_up.dtype}"
                )
            return True
        on_gpu = self.group.backend == "cuda"
        return half and self._silu and (_moe_rs.AUTO_FUSED_ON_GPU or not on_gpu)

    def _route(self, x):
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index

    def _experts(self, x, weights, index, gate_up, down):
        """This rank's slice of every expert on tokens ``x`` [T, H]: the partial sums."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = (x[token] @ gate_up[e]).chunk(2, dim=-1)
            y = ((self.act(gate) * up) @ down[e]) * weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out

    def _torch_experts(self, x, weights, index, gate_up, down):
        """The ``none`` path of a sequence-parallel block after the router, on this rank's
        tokens ``x [m, H]``: gather every rank's tokens and routing, run this rank's expert
        slices, reduce-scatter the partial sums (``[m, H]``)."""
        if self.group.world_size == 1:
            return self._experts(x, weights, index, gate_up, down)
        h = self.handle
        xs = _ops.all_gather(x, h)
        ws = _ops.all_gather(weights, h)
        # the indices travel bit for bit as float32 words
        index = _ops.all_gather(index.to(torch.int32).view(torch.float32), h)
        index = index.view(torch.int32).long()
        return _ops.reduce_scatter(self._experts(xs, ws, index, gate_up, down), h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, index = self._route(x2)
        if self._use_fused(x2.shape[0]):
            self.last_strategy = "fused"
            y = torch.ops.interlace.moe_experts(
                x2, weights, index, self.gate_up, self.down, self.handle, "fused"
            )
            return y.view(shape)
        self.last_strategy = "none"
        if self.sequence_parallel or self.group.world_size == 1:
            return self._torch_experts(x2, weights, index, self.gate_up, self.down).view(shape)
        weights = copy_to_parallel(weights, self.group)
        x2 = copy_to_parallel(x2, self.group)
        partial = self._experts(x2, weights, index, self.gate_up, self.down)
        return _ops.all_reduce(partial, self.handle).view(shape)


__all__ = ["MoEBlock"]
