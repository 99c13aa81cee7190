"""Public ops: contexts that own their buffers and launch communication and compute."""

from .collectives import AllGather, AllReduce, ReduceScatter
from .gemm import AGGemm, GemmAR, GemmRS

__all__ = ["AGGemm", "AllGather", "AllReduce", "GemmAR", "GemmRS", "ReduceScatter"]
