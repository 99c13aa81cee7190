"""Signal pads and error words: the host half of device-side synchronisation.

A :class:`SignalPad` is a zeroed symmetric int32 tensor cut into named regions, so that a
slot index recorded by a timed-out wait can be turned back into a readable name.

An :class:`ErrorWord` is four int32 words a kernel writes when a bounded wait gives up:
``[state, rank, slot, observed]`` (state 0 = fine, 1 = being written, 2 = written). On the
``cuda`` backend it lives in pinned host memory, which the GPU writes through unified
addressing, so the host can read it without synchronising the device.
"""

from __future__ import annotations

import ctypes
import os

import torch

from ..errors import WaitTimeoutError
from .group import Group
from .symmetric import symm_zeros

#: Spins before a device wait gives up. One spin is one system-scope atomic (about a
#: microsecond on a GPU, about 100 microseconds in the interpreter).
DEFAULT_SPINS = {"cuda": 1 << 25, "cpu": 1 << 19}
#: Mirrors ``language.primitives.REMOTE_SLOT`` (the runtime layer cannot import it).
REMOTE_SLOT = 1 << 16


def default_max_spins(group: Group) -> int:
    """Spin bound for device waits; ``INTERLACE_WAIT_SPINS`` overrides it."""
    env = os.environ.get("INTERLACE_WAIT_SPINS")
    return int(env) if env else DEFAULT_SPINS[group.backend]


class SignalPad:
    """A zeroed symmetric int32 tensor with named regions of slots."""

    def __init__(self, group: Group, regions: dict[str, int]):
        self.group = group
        self.regions: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in regions.items():
            self.regions[name] = (offset, int(size))
            offset += int(size)
        self.size = offset
        self.buffer = symm_zeros((max(offset, 1),), torch.int32, group)

    def offset(self, region: str) -> int:
        return self.regions[region][0]

    def local(self, region: str) -> torch.Tensor:
        self.buffer.check_open("signal pad")
        start, size = self.regions[region]
        return self.buffer.local[start : start + size]

    def peer(self, region: str, rank: int) -> torch.Tensor:
        self.buffer.check_open("signal pad")
        start, size = self.regions[region]
        return self.buffer.peers[rank][start : start + size]

    @property
    def ptrs(self) -> torch.Tensor:
        return self.buffer.ptrs

    def describe(self, slot: int) -> str:
        """Readable name of a slot recorded by a timed-out wait (``REMOTE_SLOT`` encoded
        slots live on another rank's pad)."""
        if slot >= REMOTE_SLOT:
            peer, slot = divmod(slot, REMOTE_SLOT)
            return f"{self.describe(slot)} on rank {peer - 1}"
        for name, (start, size) in self.regions.items():
            if start <= slot < start + size:
                return f"{name}[{slot - start}]"
        return f"slot {slot}"

    def close(self) -> None:
        self.buffer.close()


class ErrorWord:
    """Where a kernel's bounded wait reports a timeout; see the module docstring."""

    def __init__(self, group: Group):
        self.group = group
        pinned = group.backend == "cuda"
        self.tensor = torch.zeros(4, dtype=torch.int32, pin_memory=pinned)
        self.address = self.tensor.data_ptr()
        self._state = ctypes.c_int32.from_address(self.address)  # read on every call

    def raise_if_set(self, op: str, describe=str) -> None:
        """Raise :class:`WaitTimeoutError` if a kernel recorded a timeout (no device sync)."""
        if self._state.value == 0:  # the common case
            return
        state, rank, slot, seen = (int(v) for v in self.tensor.tolist())
        self.tensor.zero_()
        raise WaitTimeoutError(op, rank, describe(slot), seen)
