"""Tensor-parallel mixture-of-experts block (Mixtral-style: softmax router, top-k experts,
gated expert MLPs): every rank holds a slice of every expert's intermediate features.

Sequence parallel (the default): each rank routes its own tokens, gathers every rank's
tokens and routing, runs its expert slices on them, and reduce-scatters the partial sums
back to its share of the tokens; without it, the tokens are the same on every rank and the
partial sums are all-reduced.

Two ways to run the experts (``strategy``):

* ``none``: ``all_gather`` of the tokens and routing, a per-expert loop of torch matmuls,
  ``reduce_scatter`` (or ``all_reduce``); differentiable op by op.
* ``fused`` (sequence parallel only): :class:`~interlace.ops.moe.AGMoE` (all-gather
  overlapped with the routing-driven grouped GEMM and SwiGLU) then
  :class:`~interlace.ops.moe.MoERS` (grouped GEMM, top-k weighted sum and reduce-scatter
  overlapped). Those ops have no autograd: :class:`_FusedExperts` runs them in the forward
  and, in the backward, recomputes the ``none`` path on the saved inputs and weights and
  takes its gradients, so training matches ``none`` at the cost of a second forward (its
  collectives included).
* ``auto``: ``fused`` where :class:`~interlace.ops.moe.MoERS`'s own ``auto`` runs fused (the
  CPU emulation; on GPUs only with ``moe_rs.AUTO_FUSED_ON_GPU``), for bfloat16 / float16
  weights, sequence parallel and outside ``torch.compile`` tracing; else ``none``.

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
from ..ops._context import ContextSet, KeptContext
from ..ops.moe import AGMoE, MoERS
from ..ops.moe import moe_rs as _moe_rs
from ..runtime import Group
from .linear import copy_to_parallel, shard, sync_sequence_parallel_grads

#: weight dtypes the fused MoE ops take
FUSED_DTYPES = (torch.bfloat16, torch.float16)


class _FusedExperts(torch.autograd.Function):
    """The experts of a sequence-parallel block by AGMoE + MoERS on this rank's tokens;
    the backward recomputes the block's ``none`` path (``MoEBlock._torch_experts``) under
    autograd on the saved tensors and returns its gradients."""

    @staticmethod
    def forward(ctx, block, x, weights, index, gate_up, down):
        ctx.block = block
        ctx.save_for_backward(x, weights, index, gate_up, down)
        ag, rs = block._fused_contexts(x.shape[0]).contexts
        h, routing = ag(x, index, weights, gate_up)
        return rs(h, routing, down)

    @staticmethod
    def backward(ctx, dy):
        x, weights, index, gate_up, down = ctx.saved_tensors
        _, nx, nw, _, ngu, nd = ctx.needs_input_grad
        leaves = [
            t.detach().requires_grad_(n)
            for t, n in zip((x, weights, gate_up, down), (nx, nw, ngu, nd))
        ]
        wanted = [t for t in leaves if t.requires_grad]
        with torch.enable_grad():
            y = ctx.block._torch_experts(leaves[0], leaves[1], index, leaves[2], leaves[3])
        grads = iter(torch.autograd.grad(y, wanted, dy, allow_unused=True))
        gx, gw, ggu, gd = (next(grads) if t.requires_grad else None for t in leaves)
        return None, gx, gw, None, ggu, gd


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
    needs ``sequence_parallel`` (the fused ops take each rank's own tokens; without it
    ``fused`` raises at construction and ``auto`` runs ``none``) and bfloat16 / float16
    weights (a float32 block raises on its first call). The fused path builds its own two
    op contexts on its first call, sized to the next power of two of the tokens per rank,
    and reuses them; they are rebuilt (at least twice as large) when a call has more
    tokens, and after a failed call. :meth:`close` frees them (collective: call it on every
    rank; a later fused call builds new ones).
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
        self._fused = KeptContext(self._build_fused)  # the fused path's AGMoE / MoERS
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
        """Free the fused path's op contexts (collective: call on every rank). Idempotent;
        the block stays usable (a later fused call builds new contexts)."""
        self._fused.close()

    def _fused_contexts(self, m: int) -> ContextSet:
        """The AGMoE / MoERS pair for ``m`` tokens per rank in the weights' dtype (kept,
        and rebuilt when outgrown or after a failed call: :class:`KeptContext`; every rank
        decides alike, since sequence-parallel shards have the same rows everywhere)."""
        return self._fused.get(m, self.gate_up.dtype)

    def _build_fused(self, cap: int, dtype: torch.dtype) -> ContextSet:
        w = self.group.world_size
        sizes = dict(
            max_tokens=cap * w, hidden=self.hidden_size, inter=self.intermediate_size // w,
            experts=self.num_experts, topk=self.top_k, dtype=dtype, strategy="fused",
            validate=not self.group.nccl,
        )  # fmt: skip
        # The ops' per-call checks (an expert-id read-back and a cross-rank all-reduce: two
        # host synchronisations per call on NCCL) run only in the CPU emulation: the
        # router's top-k ids are in range and the sequence-parallel shards have the same
        # rows on every rank by construction; a mismatch still shows in the call
        # fingerprints.
        ag = AGMoE(self.group, **sizes)
        try:
            rs = MoERS(self.group, **sizes)
        except BaseException:
            ag.close()
            raise
        return ContextSet(ag, rs)

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
        return (
            half and (_moe_rs.AUTO_FUSED_ON_GPU or not on_gpu) and not torch.compiler.is_compiling()
        )

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
            y = _FusedExperts.apply(
                self, x2.contiguous(), weights.contiguous(), index.contiguous(), self.gate_up,
                self.down,
            )  # fmt: skip
            return y.view(shape)
        self.last_strategy = "none"
        if self.sequence_parallel or self.group.world_size == 1:
            return self._torch_experts(x2, weights, index, self.gate_up, self.down).view(shape)
        weights = copy_to_parallel(weights, self.group)
        x2 = copy_to_parallel(x2, self.group)
        partial = self._experts(x2, weights, index, self.gate_up, self.down)
        return _ops.all_reduce(partial, self.handle).view(shape)


__all__ = ["MoEBlock"]
