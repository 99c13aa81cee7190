"""`Group`: who the ranks are, where they run, and which backend moves their bytes.

Two backends share one interface:

* ``cuda``: one GPU per rank, symmetric memory from ``torch.distributed._symmetric_memory``,
  kernels compiled by Triton.
* ``cpu``: the emulation used by CI. One process per rank over gloo, every symmetric buffer a
  file in ``/dev/shm`` mapped by all ranks, kernels run by Triton's interpreter
  (``TRITON_INTERPRET=1``). The same kernel source runs on both.
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import InterlaceError, InterlaceValueError

BACKENDS = ("cuda", "cpu")


def interpreter_enabled() -> bool:
    """True when Triton kernels run in its CPU interpreter (the ``cpu`` backend)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(eq=False)
class Group:
    """A set of ranks that interlace ops run over, built on a torch ProcessGroup.

    ``Group.from_torch()`` (or ``Group()``) takes the default process group; pass
    ``process_group=`` for a sub-group. The backend is ``cuda`` when the process group
    moves CUDA tensors (NCCL) and ``cpu`` otherwise; ``backend="cuda"`` over a gloo group
    is what ``World(share_device=True)`` uses (several ranks on one GPU, for tests).
    """

    process_group: dist.ProcessGroup | None = None
    backend: str | None = None
    rank: int = field(init=False)
    world_size: int = field(init=False)
    local_rank: int = field(init=False)
    local_world_size: int = field(init=False)
    device: torch.device = field(init=False)
    uid: str = field(init=False)
    shared_device: bool = field(init=False)
    nccl: bool = field(init=False)

    def __post_init__(self) -> None:
        if not dist.is_initialized():
            raise InterlaceError(
                "torch.distributed is not initialised: call dist.init_process_group() "
                "(or use interlace.testing.World) before building a Group"
            )
        pg = self.process_group or dist.group.WORLD
        self.process_group = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank % self.local_world_size))
        if self.backend is None:
            self.backend = "cuda" if dist.get_backend(pg) == "nccl" else "cpu"
        if self.backend not in BACKENDS:
            raise InterlaceValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "cuda":
            if not torch.cuda.is_available():
                raise InterlaceError("backend 'cuda' needs a GPU, but torch sees none")
            if interpreter_enabled():
                raise InterlaceError("backend 'cuda' cannot run with TRITON_INTERPRET=1 set")
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            if not interpreter_enabled():
                raise InterlaceError(
                    "backend 'cpu' runs kernels in Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before triton is first imported"
                )
            self.device = torch.device("cpu")
        # Several ranks on one GPU (``World(share_device=True)``, for tests): the backend
        # is ``cuda`` over a gloo group, and symmetric buffers are CUDA IPC mappings.
        self.shared_device = self.backend == "cuda" and dist.get_backend(pg) != "nccl"
        # torch.distributed collectives over this group take CUDA tensors (NCCL) when true,
        # host tensors (gloo: the CPU emulation, ranks sharing a GPU) otherwise.
        self.nccl = self.backend == "cuda" and not self.shared_device
        # One id that every rank agrees on, to name shared files and key caches.
        box = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        self.uid = box[0]
        self._counter = itertools.count()

    @classmethod
    def from_torch(cls, process_group: dist.ProcessGroup | None = None) -> Group:
        """The Group of a torch ProcessGroup (the default group when None)."""
        return cls(process_group)

    def next_id(self) -> int:
        """A sequence number that advances alike on every rank (collective allocations)."""
        return next(self._counter)

    def host_barrier(self) -> None:
        """A host-side barrier over the group (used at set-up and tear-down only)."""
        if self.nccl:
            dist.barrier(group=self.process_group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.process_group)

    def __repr__(self) -> str:
        return (
            f"Group(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend!r}, device={self.device})"
        )
