"""Public ops: contexts that own their buffers and launch communication and compute."""

from .collectives import AllGather, AllReduce, ReduceScatter

__all__ = ["AllGather", "AllReduce", "ReduceScatter"]
