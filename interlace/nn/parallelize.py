"""``parallelize(model, group)``: a transformers Llama-, Qwen2- or Mixtral-style decoder
made tensor-parallel with interlace layers, in place.

Each decoder layer's attention becomes a :class:`~interlace.nn.ParallelAttention` (QKV
AG+GEMM, output GEMM+RS), its MLP a :class:`~interlace.nn.ParallelMLP` (gate/up AG+GEMM,
down GEMM+RS) or, for a sparse MoE block, a :class:`~interlace.nn.MoEBlock`. With sequence
parallelism (the default) the hidden states between the blocks are each rank's share of
the sequence (``[B, ceil(S / W), H]``, zero-padded): the first layer takes its share of the
embeddings, norms and residual adds run on that share, and the last layer's output is
gathered back to the whole sequence for the final norm and the LM head (replicated). The
weights applied to a rank's share only (the layers' norms, a MoE router) get a hook that
all-reduces their gradients, so every rank holds the same gradients a single device would.

The model is found by duck typing, so any module tree shaped like transformers' decoders
works: ``model.model.layers`` (or ``model.layers``), each layer with ``self_attn``
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``head_dim``) and ``mlp`` (``gate_proj``,
``up_proj``, ``down_proj``, ``act_fn``; or ``gate`` and ``experts``), called with the
hidden states first and ``position_embeddings=(cos, sin)`` of the whole sequence.
transformers itself is not imported here (an optional extra: ``pip install interlace[hf]``).
Prefill and training only: no KV cache (``config.use_cache`` is set to False).
"""

from __future__ import annotations

from torch import nn

from ..errors import InterlaceTypeError, InterlaceValueError
from ..runtime import Group
from .attention import ParallelAttention
from .linear import gather_from_sequence, scatter_to_sequence, sync_sequence_parallel_grads
from .mlp import ParallelMLP
from .moe import MoEBlock


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers-style model."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers
    raise InterlaceValueError(
        "parallelize: found no decoder layers (model.model.layers or model.layers)"
    )


def _parallel_mlp(mlp: nn.Module, group: Group, strategy: str, moe_strategy: str,
                  sp: bool) -> nn.Module:  # fmt: skip
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return ParallelMLP.from_module(mlp, group, strategy=strategy, sequence_parallel=sp)
    if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
        return MoEBlock.from_module(mlp, group, strategy=moe_strategy, sequence_parallel=sp)
    raise InterlaceValueError(
        f"parallelize: cannot parallelize the MLP {type(mlp).__name__} (expected gate_proj / "
        "up_proj / down_proj, or a sparse MoE block with gate and experts)"
    )


def _hidden_and_rest(args, kwargs):
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), (), kwargs


def _scatter_hook(group: Group):
    def hook(module, args, kwargs):
        hidden, rest, kwargs = _hidden_and_rest(args, kwargs)
        return (scatter_to_sequence(hidden, group, dim=1), *rest), kwargs

    return hook


def _gather_hook(group: Group):
    def hook(module, args, kwargs, output):
        pos = kwargs.get("position_embeddings")
        length = None if pos is None else pos[0].shape[-2]
        if isinstance(output, tuple):
            return (gather_from_sequence(output[0], group, 1, length), *output[1:])
        return gather_from_sequence(output, group, 1, length)

    return hook


def parallelize(model: nn.Module, group: Group, *, strategy: str = "auto",
                moe_strategy: str = "auto",
                sequence_parallel: bool = True) -> nn.Module:  # fmt: skip
    """Make ``model`` tensor-parallel over ``group`` in place and return it (see the module
    docstring). Every rank calls it on a model with the same weights (built from one
    config and seed, or loaded); each keeps its slices. ``strategy`` goes to every fused
    GEMM (``auto``: interlace picks per call; ``none``: cuBLAS + NCCL); ``moe_strategy`` to
    every :class:`MoEBlock` (``auto``, ``fused``, ``none``)."""
    if not isinstance(group, Group):
        raise InterlaceTypeError(
            f"parallelize: group must be an interlace Group, got {type(group)}"
        )
    layers = decoder_layers(model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            raise InterlaceValueError(
                f"parallelize: decoder layer {type(layer).__name__} has no self_attn / mlp"
            )
        layer.self_attn = ParallelAttention.from_module(
            attn, group, strategy=strategy, sequence_parallel=sequence_parallel
        )
        layer.mlp = _parallel_mlp(mlp, group, strategy, moe_strategy, sequence_parallel)
        if sequence_parallel:
            replicated = [p for p in layer.parameters() if not getattr(p, "_interlace_tp", False)]
            sync_sequence_parallel_grads(replicated, group)
    model.to(group.device)  # (the replaced modules are already there, and smaller)
    if sequence_parallel and group.world_size > 1:
        layers[0].register_forward_pre_hook(_scatter_hook(group), with_kwargs=True)
        layers[-1].register_forward_hook(_gather_hook(group), with_kwargs=True)
    model.interlace_group = group
    return model


__all__ = ["decoder_layers", "parallelize"]
