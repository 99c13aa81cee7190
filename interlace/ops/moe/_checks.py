"""Argument checks of the MoE ops that raise on every rank.

A rank's own arguments are checked locally (types, shapes, dtypes, devices and, on the
host, the expert ids' range); then, when the context validates (eager calls with
``validate=True``), the ranks exchange one small tensor: an error flag and the shape
fields each rank was called with. Every rank then raises (its own message, or one that
names the rank whose arguments were wrong) before anything is launched. A CUDA-graph
capture cannot synchronise: it runs the local checks but not the id range or the
exchange, and the kernels drop ids out of range.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import InterlaceTypeError, InterlaceValueError


class ArgError:
    """A failed local check: the exception class and its message."""

    def __init__(self, cls, message):
        self.cls, self.message = cls, message


def tensor_error(op, name, t, *, dtype=None, dtypes=None, dims=None, device=None):
    """An ``ArgError`` if ``t`` is not a contiguous tensor of the given kind, else None."""
    if not isinstance(t, torch.Tensor):
        return ArgError(InterlaceTypeError, f"{op}: {name} must be a torch.Tensor, got "
                        f"{type(t).__name__}")  # fmt: skip
    if dtype is not None and t.dtype != dtype:
        return ArgError(InterlaceTypeError, f"{op}: {name} has dtype {t.dtype}, expected {dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        return ArgError(
            InterlaceTypeError, f"{op}: {name} has dtype {t.dtype}, expected one of {dtypes}"
        )
    if dims is not None and t.dim() != dims:
        return ArgError(
            InterlaceValueError, f"{op}: {name} must be {dims}-D, got shape {tuple(t.shape)}"
        )
    if device is not None and t.device != device:
        return ArgError(InterlaceValueError, f"{op}: {name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        return ArgError(InterlaceValueError, f"{op}: {name} must be contiguous")
    return None


def shape_error(op, name, t, expected):
    """An ``ArgError`` if ``t.shape`` differs from ``expected`` (None entries: any)."""
    shape = tuple(t.shape)
    if len(shape) != len(expected) or any(
        e is not None and s != e for s, e in zip(shape, expected)
    ):
        want = tuple("*" if e is None else e for e in expected)
        return ArgError(InterlaceValueError, f"{op}: {name} has shape {shape}, expected {want}")
    return None


def ids_error(op, ids, experts):
    """An ``ArgError`` if an expert id lies outside ``[0, experts)`` (reads the ids: a
    device synchronisation on a GPU)."""
    if ids.numel() == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= experts:
        return ArgError(
            InterlaceValueError,
            f"{op}: topk_ids must lie in [0, {experts}), got values from {lo} to {hi}",
        )
    return None


def agree(ctx, error: ArgError | None, fields: tuple[int, ...], exchange: bool) -> None:
    """Raise on every rank if any rank's arguments failed (``error``) or the ranks'
    ``fields`` (shape values every rank must share) differ; with ``exchange`` False, only
    the local ``error``."""
    if exchange and ctx.world_size > 1:
        group = ctx.group
        vals = [1 if error else 0, *fields, *(-f for f in fields)]
        t = torch.tensor(vals, dtype=torch.int64, device=group.device if group.nccl else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.process_group)
        got = t.tolist()
        n = len(fields)
        if error is None and got[0]:
            raise InterlaceValueError(
                f"{ctx.op_name}: another rank was called with invalid arguments (see its error)"
            )
        if error is None:
            hi, lo = got[1 : 1 + n], [-v for v in got[1 + n :]]
            if hi != lo:
                raise InterlaceValueError(
                    f"{ctx.op_name}: ranks were called with different shapes "
                    f"({list(fields)} here; largest {hi}, smallest {lo}); every rank must "
                    "call with the same shapes"
                )
    if error is not None:
        raise error.cls(error.message)
