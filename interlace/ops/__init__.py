"""Public ops: contexts that own their buffers and launch communication and compute."""

from .collectives import AllGather, AllReduce, ReduceScatter
from .gemm import AGGemm, GemmAR, GemmRS
from .p2p_ring import FuseAGLinear, FuseRSLinear, P2PRing, fuse_ag, fuse_rs

__all__ = [
    "AGGemm",
    "AllGather",
    "AllReduce",
    "FuseAGLinear",
    "FuseRSLinear",
    "GemmAR",
    "GemmRS",
    "P2PRing",
    "ReduceScatter",
    "fuse_ag",
    "fuse_rs",
]
