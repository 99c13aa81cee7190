"""interlace: overlap inter-GPU communication with computation at tile granularity,
on stock PyTorch and stock Triton."""

from . import trace, tune
from .errors import InterlaceError, InterlaceTypeError, InterlaceValueError, WaitTimeoutError
from .ops import (
    AGGemm,
    AllGather,
    AllReduce,
    FuseAGLinear,
    FuseRSLinear,
    GemmAR,
    GemmRS,
    P2PRing,
    ReduceScatter,
    SignalReorderGemmA2A,
    SignalReorderGemmAR,
    SignalReorderGemmRS,
    fuse_ag,
    fuse_rs,
)
from .runtime import Group, SymmetricTensor, symm_empty, symm_zeros

__version__ = "0.1.0"

__all__ = [
    "AGGemm",
    "AllGather",
    "AllReduce",
    "FuseAGLinear",
    "FuseRSLinear",
    "GemmAR",
    "GemmRS",
    "Group",
    "InterlaceError",
    "InterlaceTypeError",
    "InterlaceValueError",
    "P2PRing",
    "ReduceScatter",
    "SignalReorderGemmA2A",
    "SignalReorderGemmAR",
    "SignalReorderGemmRS",
    "SymmetricTensor",
    "WaitTimeoutError",
    "__version__",
    "fuse_ag",
    "fuse_rs",
    "symm_empty",
    "symm_zeros",
    "trace",
    "tune",
]
