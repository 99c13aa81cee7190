"""Attention ops: sequence-parallel attention (prefill and training) and distributed
flash-decode. Importing this package registers the custom ops
``torch.ops.interlace.sp_attention`` / ``sp_attention_backward`` and
``torch.ops.interlace.flash_decode`` (:mod:`.library`)."""

from . import library
from .flash_decode import DecodeConfig, FlashDecode
from .layout import zigzag_shard, zigzag_unshard
from .sp_attention import SPAttention

__all__ = [
    "DecodeConfig",
    "FlashDecode",
    "SPAttention",
    "library",
    "zigzag_shard",
    "zigzag_unshard",
]
