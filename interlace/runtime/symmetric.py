"""Symmetric buffers: one allocation of the same size on every rank, readable and writable
by every other rank of the group.

``symm_empty(shape, dtype, group)`` returns a :class:`SymmetricTensor` with

* ``local``: this rank's tensor,
* ``peers``: one tensor per rank, ``peers[r]`` aliasing rank ``r``'s memory
  (``peers[group.rank] is local``),
* ``ptrs``: an int64 tensor on the group's device with every rank's base address, the
  table that device code turns into remote pointers.

The ``cuda`` backend allocates through torch symmetric memory (or, where several ranks share
one GPU, ``Group.shared_device``, through CUDA IPC handles, which torch symmetric memory
refuses on one device); the ``cpu`` backend maps a file in ``/dev/shm`` per rank into every
rank's address space. Allocation is collective: all ranks must allocate the same buffers in
the same order.
"""

from __future__ import annotations

import atexit
import math
import os
import warnings
import weakref

import torch

from ..errors import ContextClosedError, InterlaceTypeError, InterlaceValueError
from .group import Group

SHM_DIR = "/dev/shm"
_stale_cleaned: set[str] = set()
_open_buffers: weakref.WeakSet[SymmetricTensor] = weakref.WeakSet()
_symm_enabled_groups: set[str] = set()


def shm_prefix() -> str:
    """File-name prefix of this process's /dev/shm buffers (the test harness sets a
    unique one per world so it can remove what a crashed world left behind)."""
    return os.environ.get("INTERLACE_SHM_PREFIX", "interlace")


def _open_ipc(rebuild, args) -> torch.Tensor:
    """A peer's allocation from its CUDA IPC handle (``reduce_tensor``'s ``rebuild(*args)``).
    torch caches opened storages by (allocator block, offset), not by size: while a view of
    an earlier, smaller allocation at the same place is still open here, the cache hands
    that storage back and the larger tensor does not fit ("Trying to resize storage that is
    not resizable"). The stale entry is then dropped and the handle opened afresh (the same
    memory: torch keeps one mapping per block)."""
    try:
        return rebuild(*args)
    except RuntimeError as e:
        if "not resizable" not in str(e):
            raise
    from torch.multiprocessing import reductions

    handle, offset = args[7], args[9]  # rebuild_cuda_tensor's storage_handle, _offset_bytes
    reductions.shared_cache.pop((handle, offset), None)
    return rebuild(*args)


class SymmetricTensor:
    """A tensor allocated alike on every rank of ``group``; see the module docstring."""

    def __init__(self, shape, dtype: torch.dtype, group: Group):
        check_group("symm_empty", group)
        if not isinstance(dtype, torch.dtype):
            raise InterlaceTypeError(f"symm_empty: dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(s < 0 for s in shape):
            raise InterlaceValueError(f"symm_empty: shape must be non-negative, got {shape}")
        self.group, self.shape, self.dtype = group, shape, dtype
        self.numel = math.prod(shape)
        # Round up so every peer view is 16-byte aligned and non-empty.
        self.nbytes = max(16, -(-self.numel * dtype.itemsize // 16) * 16)
        self._handle = None
        if group.shared_device:
            raw = self._alloc_ipc()
        elif group.backend == "cuda":
            raw = self._alloc_cuda()
        else:
            raw = self._alloc_cpu()
        self.peers = [self._typed(r) for r in raw]
        self.local = self.peers[group.rank]
        bases = [r.data_ptr() for r in raw]
        self.ptrs = torch.tensor(bases, dtype=torch.int64, device=group.device)
        self._closed = False
        _open_buffers.add(self)

    def _typed(self, raw: torch.Tensor) -> torch.Tensor:
        return raw[: self.numel * self.dtype.itemsize].view(self.dtype).view(self.shape)

    def _alloc_cuda(self) -> list[torch.Tensor]:
        import torch.distributed._symmetric_memory as symm_mem

        pg = self.group.process_group
        name = pg.group_name
        if name not in _symm_enabled_groups and hasattr(symm_mem, "enable_symm_mem_for_group"):
            # Needed before torch 2.9; later releases deprecate it with a FutureWarning.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
            _symm_enabled_groups.add(name)
        local, why = None, ""
        try:
            local = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.group.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:  # agreed on below, collectively
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
        _agree(self.group, why, self.nbytes, "symmetric memory")
        self._handle = symm_mem.rendezvous(local, pg)
        raw = []
        for r in range(self.group.world_size):
            if r == self.group.rank:
                raw.append(local)
            else:
                raw.append(self._handle.get_buffer(r, (self.nbytes,), torch.uint8))
        return raw

    def _alloc_ipc(self) -> list[torch.Tensor]:
        """Ranks on one GPU (tests): each rank's allocation opened by the others through
        its CUDA IPC handle, the handles exchanged over the group's host collectives."""
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        local, why = None, ""
        try:
            local = torch.empty(self.nbytes, dtype=torch.uint8, device=self.group.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
        _agree(self.group, why, self.nbytes, "GPU memory")
        handles = [None] * self.group.world_size
        dist.all_gather_object(handles, reduce_tensor(local), group=self.group.process_group)
        return [
            local if r == self.group.rank else _open_ipc(rebuild, args)
            for r, (rebuild, args) in enumerate(handles)
        ]

    def _alloc_cpu(self) -> list[torch.Tensor]:
        g = self.group
        clean_stale_shm()
        seq = g.next_id()
        # Each file is named after its creator's pid, so that a later start can remove
        # what a killed run left behind (``clean_stale_shm``); the names are exchanged.
        mine = os.path.join(SHM_DIR, f"{shm_prefix()}-{g.uid}-{seq}-r{g.rank}-p{os.getpid()}")
        fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        why = ""
        free = _shm_free()
        if self.nbytes > free:  # (fallocate would fill /dev/shm before it fails)
            why = f"only {free / 2**20:.1f} MiB free in {SHM_DIR}"
        try:
            if why:
                raise OSError(why)
            # Reserve the pages now (a new file reads as zeros): a /dev/shm too small for
            # the buffer is an error here, not a bus error at the first touch.
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            why = why or f"{e.strerror or e} ({_shm_free() / 2**20:.1f} MiB free in {SHM_DIR})"
        finally:
            os.close(fd)
        try:
            _agree(g, why, self.nbytes, SHM_DIR)
        except InterlaceValueError:
            os.unlink(mine)
            raise
        paths = [None] * g.world_size
        import torch.distributed as dist

        dist.all_gather_object(paths, mine, group=g.process_group)
        try:
            raw = [
                torch.from_file(p, shared=True, size=self.nbytes, dtype=torch.uint8) for p in paths
            ]
        finally:
            g.host_barrier()  # every rank has mapped every file: the names can go
            os.unlink(mine)
        return raw

    def close(self) -> None:
        """Release this rank's references; memory is freed once no view of it is alive."""
        if self._closed:
            return
        self._closed = True
        self.peers = []
        self.local = None
        self.ptrs = None
        self._handle = None
        _open_buffers.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self, what: str) -> None:
        if self._closed:
            raise ContextClosedError(f"{what}: used after close()")

    def __repr__(self) -> str:
        return (
            f"SymmetricTensor(shape={self.shape}, dtype={self.dtype}, rank={self.group.rank}, "
            f"world_size={self.group.world_size}, backend={self.group.backend!r})"
        )


def check_group(what: str, group) -> None:
    """Every public constructor's first check: ``group`` is an interlace :class:`Group`."""
    if not isinstance(group, Group):
        raise InterlaceTypeError(
            f"{what}: group must be an interlace Group (interlace.Group.from_torch()), got "
            f"{type(group).__name__}"
        )


def _agree(group: Group, why: str, nbytes: int, where: str) -> None:
    """Collective: every rank learns whether every rank's allocation succeeded, and all
    raise the same :class:`InterlaceValueError` naming the first rank that failed (a rank
    failing alone would leave its peers blocked in the next collective)."""
    import torch.distributed as dist

    whys = [None] * group.world_size
    dist.all_gather_object(whys, why, group=group.process_group)
    for r, w in enumerate(whys):
        if w:
            raise InterlaceValueError(
                f"symm_empty: rank {r} could not allocate {nbytes / 2**20:.1f} MiB of {where} "
                f"for a symmetric buffer: {w}. Build the context with a smaller capacity "
                f"(max_m, max_numel, ...) or free memory"
            )


def _shm_free() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_shm(prefix: str | None = None) -> list[str]:
    """Remove the /dev/shm files of this library (``<prefix>-...-p<pid>``) whose creating
    process is gone: what a run killed between creating a buffer's file and unlinking it
    left behind. Runs once per prefix and process, at the first allocation; returns the
    removed paths."""
    prefix = prefix or shm_prefix()
    if prefix in _stale_cleaned:
        return []
    _stale_cleaned.add(prefix)
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix + "-") or name.startswith("interlace-")):
            continue
        head, sep, pid = name.rpartition("-p")
        if not sep or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def symm_empty(shape, dtype: torch.dtype, group: Group) -> SymmetricTensor:
    """Allocate an uninitialised symmetric tensor on every rank (collective)."""
    return SymmetricTensor(shape, dtype, group)


def symm_zeros(shape, dtype: torch.dtype, group: Group) -> SymmetricTensor:
    """Allocate a zeroed symmetric tensor; returns after every rank has zeroed its copy."""
    t = SymmetricTensor(shape, dtype, group)
    t.local.zero_()
    if group.backend == "cuda":
        torch.cuda.current_stream(group.device).synchronize()
    group.host_barrier()
    return t


@atexit.register
def _close_all() -> None:
    for buf in list(_open_buffers):
        buf.close()
