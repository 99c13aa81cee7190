"""Symmetric buffers: peer views alias the peers' memory, the pointer table, zeroing,
dtypes and odd shapes, close(), and no leak over many allocations."""

from __future__ import annotations

import gc
import glob
import os

import pytest
import torch
import torch.distributed as dist

from interlace.errors import InterlaceError, InterlaceValueError
from interlace.runtime import Group, SignalPad, symm_empty, symm_zeros
from interlace.runtime import symmetric as symmetric_mod

DTYPES = ("bfloat16", "float16", "float32", "int32")
SHAPES = ((1,), (7,), (3, 5), (2, 3, 5), (13, 33))


def _sync(group) -> None:
    if group.backend == "cuda":
        torch.cuda.synchronize(group.device)


def _rank_data(seed: int, rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """What rank ``rank`` writes in round ``seed``: random, distinct per rank, on the CPU."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 8 + rank).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(dtype)


def _poison(dtype: torch.dtype):
    return float("nan") if dtype.is_floating_point else -123456789


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison never compares equal to data)."""
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


# --------------------------------------------------------------------------------------
# bodies (module level: they are pickled to the rank processes)
# --------------------------------------------------------------------------------------


def _alias_body(group, shape, dtype_name, seed):
    dtype = getattr(torch, dtype_name)
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    t = symm_empty(shape, dtype, group)
    try:
        assert t.local.shape == tuple(shape) and t.local.dtype == dtype
        assert t.local.device.type == group.device.type
        assert len(t.peers) == world and t.peers[rank] is t.local
        for p in t.peers:
            assert p.shape == tuple(shape) and p.dtype == dtype and p.is_contiguous()
        t.local.fill_(_poison(dtype))
        _sync(group)
        group.host_barrier()  # every rank is poisoned before anyone writes
        t.peers[right].copy_(_rank_data(seed, rank, shape, dtype).to(group.device))
        _sync(group)
        group.host_barrier()  # every write has landed
        mine = t.local.clone()
        _sync(group)
        assert _same(mine, _rank_data(seed, left, shape, dtype)), (
            f"rank {rank}: local does not hold what rank {left} wrote into peers[{rank}]"
        )
        # every peer view shows what that peer's left neighbour wrote
        for r in range(world):
            seen = t.peers[r].clone()
            _sync(group)
            assert _same(seen, _rank_data(seed, (r - 1) % world, shape, dtype)), (
                f"rank {rank}: peers[{r}] does not alias rank {r}'s memory"
            )
        group.host_barrier()  # nobody closes while a peer still reads
    finally:
        t.close()
    return True


def _ptrs_body(group, shape, dtype_name):
    dtype = getattr(torch, dtype_name)
    t = symm_empty(shape, dtype, group)
    try:
        assert t.ptrs.dtype == torch.int64
        assert t.ptrs.device.type == group.device.type
        assert tuple(t.ptrs.shape) == (group.world_size,)
        table = t.ptrs.tolist()
        assert table == [p.data_ptr() for p in t.peers]
        assert table[group.rank] == t.local.data_ptr()
        assert len(set(table)) == group.world_size
        assert all(a % 16 == 0 for a in table), table
        group.host_barrier()
    finally:
        t.close()
    return True


def _zeros_body(group, shapes, dtype_name):
    dtype = getattr(torch, dtype_name)
    for shape in shapes:
        # Dirty memory of the same size first, so a symm_zeros that skipped zeroing (and
        # got recycled memory) would show garbage.
        dirty = symm_empty(shape, dtype, group)
        dirty.local.fill_(_poison(dtype))
        _sync(group)
        group.host_barrier()
        dirty.close()
        z = symm_zeros(shape, dtype, group)
        try:
            assert z.local.shape == tuple(shape) and z.local.dtype == dtype
            for r in range(group.world_size):
                seen = z.peers[r].clone()
                _sync(group)
                assert _same(seen, torch.zeros(shape, dtype=dtype)), f"peers[{r}] is not zero"
            group.host_barrier()
        finally:
            z.close()
    return True


def _empty_shapes_body(group):
    t = symm_empty((0, 4), torch.float32, group)
    try:
        assert t.local.shape == (0, 4) and t.local.numel() == 0
        assert len(t.peers) == group.world_size
        # torch reports data_ptr() 0 for an empty view; the table still holds real bases
        table = t.ptrs.tolist()
        assert all(a != 0 and a % 16 == 0 for a in table) and len(set(table)) == len(table)
    finally:
        t.close()
    s = symm_empty(5, torch.int32, group)  # a bare int is a 1-D shape
    try:
        assert s.local.shape == (5,)
    finally:
        s.close()
    with pytest.raises(InterlaceValueError, match="non-negative"):
        symm_empty((2, -1), torch.float32, group)
    group.host_barrier()
    return True


def _close_body(group):
    t = symm_zeros((4, 3), torch.float32, group)
    t.check_open("probe")  # open: no error
    assert not t.closed
    group.host_barrier()
    t.close()
    assert t.closed
    assert t.local is None and t.peers == [] and t.ptrs is None
    with pytest.raises(InterlaceError, match="probe: used after close"):
        t.check_open("probe")
    t.close()  # idempotent
    assert t.closed
    assert t not in symmetric_mod._open_buffers
    pad = SignalPad(group, {"a": 3, "b": group.world_size})
    group.host_barrier()
    pad.close()
    pad.close()  # idempotent
    assert pad.buffer.closed
    with pytest.raises(InterlaceError):
        pad.buffer.check_open("pad")
    return True


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _alloc_round(group, nbytes):
    pad = SignalPad(group, {"data": 7, "barrier": group.world_size})
    buf = symm_empty((nbytes // 4,), torch.float32, group)
    buf.local.fill_(1.0)  # touch every page, so a leaked mapping shows in RSS
    pad.local("data").fill_(group.rank + 1)
    _sync(group)
    group.host_barrier()
    buf.close()
    pad.close()


def _leak_body(group, rounds, nbytes):
    for _ in range(3):  # warm-up: allocator pools, lazy imports, comm buffers
        _alloc_round(group, nbytes)
    gc.collect()
    group.host_barrier()
    baseline = len(symmetric_mod._open_buffers)
    if group.backend == "cuda":
        torch.cuda.synchronize(group.device)
        free_before = torch.cuda.mem_get_info(group.device)[0]
    rss_before = _rss_bytes()
    for _ in range(rounds):
        _alloc_round(group, nbytes)
    gc.collect()
    group.host_barrier()
    assert len(symmetric_mod._open_buffers) == baseline, (
        f"{len(symmetric_mod._open_buffers) - baseline} buffers still open after close()"
    )
    if group.backend == "cuda":
        torch.cuda.synchronize(group.device)
        free_after = torch.cuda.mem_get_info(group.device)[0]
        lost = free_before - free_after
        assert lost < 8 * 2**20, f"GPU memory fell by {lost / 2**20:.1f} MiB over {rounds} rounds"
    else:
        left = glob.glob(f"/dev/shm/{symmetric_mod.shm_prefix()}-*")
        assert not left, f"shared-memory files left behind: {left[:5]}"
        grown = _rss_bytes() - rss_before
        assert grown < 20 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over {rounds} rounds"
    return True


# --------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------


def test_group_needs_initialised_distributed():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(InterlaceError, match="not initialised"):
        Group()
    with pytest.raises(InterlaceError):
        Group.from_torch()


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_peers_alias_memory(world, dtype_name):
    seed = int(torch.randint(0, 2**20, ()).item())
    for shape in SHAPES:
        assert all(world.run(_alias_body, shape, dtype_name, seed))


@pytest.mark.parametrize("dtype_name", ("float16", "int32"))
def test_ptrs_table(world, dtype_name):
    for shape in ((1,), (3, 5), (257,)):
        assert all(world.run(_ptrs_body, shape, dtype_name))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_symm_zeros_is_zeroed(world, dtype_name):
    assert all(world.run(_zeros_body, ((5,), (3, 7), (64, 33)), dtype_name))


def test_empty_and_bad_shapes(world):
    assert all(world.run(_empty_shapes_body))


def test_close_is_idempotent_and_reuse_raises(world):
    assert all(world.run(_close_body))


@pytest.mark.own_gpu
def test_no_leak_over_many_allocations(world):
    # 100 rounds of a 512 KiB buffer: a leaked mapping would add ~50 MiB of RSS per rank.
    assert all(world.run(_leak_body, 100, 512 * 1024))


def test_a_stale_ipc_cache_entry_is_dropped_and_the_handle_reopened():
    """Ranks sharing a GPU open each other's buffers through CUDA IPC; torch's cache of
    opened storages is keyed by (block handle, offset), so a peer's new, larger buffer at
    the place of one still open here comes back too small. ``_open_ipc`` drops that cache
    entry and opens the handle again; any other error propagates."""
    from torch.multiprocessing import reductions

    args = [None] * 16
    args[7], args[9] = b"block", 512  # rebuild_cuda_tensor's storage_handle, _offset_bytes
    key = (b"block", 512)
    reductions.shared_cache[key] = "stale storage"
    calls = []

    def rebuild(*a):
        calls.append(key in reductions.shared_cache)
        if key in reductions.shared_cache:
            raise RuntimeError("Trying to resize storage that is not resizable")
        return "fresh tensor"

    try:
        assert symmetric_mod._open_ipc(rebuild, args) == "fresh tensor"
    finally:
        dict.pop(reductions.shared_cache, key, None)
    assert calls == [True, False]

    def broken(*a):
        raise RuntimeError("invalid device pointer")

    with pytest.raises(RuntimeError, match="invalid device pointer"):
        symmetric_mod._open_ipc(broken, args)
