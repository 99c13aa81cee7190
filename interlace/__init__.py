"""interlace: overlap inter-GPU communication with computation at tile granularity,
on stock PyTorch and stock Triton."""

from .errors import InterlaceError, InterlaceTypeError, InterlaceValueError, WaitTimeoutError
from .ops import AGGemm, AllGather, AllReduce, GemmAR, GemmRS, ReduceScatter
from .runtime import Group, SymmetricTensor, symm_empty, symm_zeros

__version__ = "0.1.0"

__all__ = [
    "AGGemm",
    "AllGather",
    "AllReduce",
    "GemmAR",
    "GemmRS",
    "Group",
    "InterlaceError",
    "InterlaceTypeError",
    "InterlaceValueError",
    "ReduceScatter",
    "SymmetricTensor",
    "WaitTimeoutError",
    "__version__",
    "symm_empty",
    "symm_zeros",
]
