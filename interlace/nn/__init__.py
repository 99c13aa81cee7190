"""Tensor-parallel layers over interlace's fused ops, and ``parallelize(model, group)``
for transformers-style decoders.

    model = transformers.AutoModelForCausalLM.from_config(config)   # same seed everywhere
    interlace.nn.parallelize(model, interlace.Group())
    logits = model(input_ids).logits                                  # as on one device
"""

from .attention import ParallelAttention
from .context_attention import (
    ContextParallelAttention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from .linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_parallel,
    gather_from_sequence,
    scatter_to_sequence,
    shard,
    sync_sequence_parallel_grads,
)
from .mlp import ParallelMLP
from .moe import MoEBlock
from .parallelize import decoder_layers, parallelize

__all__ = [
    "ColumnParallelLinear",
    "ContextParallelAttention",
    "MoEBlock",
    "ParallelAttention",
    "ParallelMLP",
    "RowParallelLinear",
    "copy_to_parallel",
    "decoder_layers",
    "gather_from_sequence",
    "parallelize",
    "scatter_to_sequence",
    "sequence_positions",
    "shard",
    "shard_sequence",
    "sync_sequence_parallel_grads",
    "unshard_sequence",
]
