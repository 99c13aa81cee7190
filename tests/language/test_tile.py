"""TileLink tile layer: host mappings (pure logic) and the device protocol on real ranks.

The multi-rank bodies run an all-gather shaped exchange: every rank produces its rows of
a symmetric tensor channel by channel and pushes them to (or lets peers pull them from)
every peer; a consumer kernel whose tiles are not aligned with the channels waits on the
channels each tile overlaps and copies the tile to an output.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from interlace.errors import InterlaceValueError, WaitTimeoutError
from interlace.language import primitives as P
from interlace.language import tile as T

SCALE = 2.0  # producer: y = x * SCALE + 1
OUT_SCALE = 3.0  # consumer: out = y * OUT_SCALE
PROD_BM = 2  # producer row block (channels are longer: it loops)
BLOCK_N = 8
LATE_S = 0.2  # how late the late rank starts producing

# --------------------------------------------------------------------------------------
# Pure logic: host mappings
# --------------------------------------------------------------------------------------


def _brute_channels(bounds, lo, hi):
    """Channel ids overlapping rows [lo, hi), in row order."""
    hits = [c for c, (s, e, _) in enumerate(bounds) if s < hi and lo < e]
    return sorted(hits, key=lambda c: bounds[c][0])


@pytest.mark.parametrize(
    "world,rows,cpr,block_m",
    [(2, 7, 2, 4), (3, 5, 5, 2), (4, 13, 3, 8), (4, 3, 2, 16), (1, 9, 4, 3), (3, 64, 4, 128)],
)
def test_static_host_matches_brute_force(world, rows, cpr, block_m):
    m = world * rows
    bounds = T.static_channel_bounds(world, rows, cpr)
    assert len(bounds) == world * cpr
    assert all(s < e for s, e, _ in bounds)  # no empty channel
    assert [b[2] for b in bounds] == [c // cpr for c in range(world * cpr)]
    for tile in range(-(-m // block_m)):
        lo, hi = tile * block_m, min((tile + 1) * block_m, m)
        first, count = T.static_tile_channels_host(tile, block_m, rows, cpr, m)
        assert list(range(first, first + count)) == _brute_channels(bounds, lo, hi)


def test_tiles_straddle_channels_and_ranks():
    # 3 ranks x 5 rows, 2 channels each ([0,2) [2,5)), tiles of 4 rows.
    mapping = T.TileMapping.static(3, 5, 2, 4)
    assert mapping.m == 15 and mapping.num_tiles == 4
    assert [mapping.tile_channels(t) for t in range(4)] == [[0, 1], [1, 2, 3], [3, 4], [5]]
    ranks = [{mapping.channels[c][2] for c in mapping.tile_channels(t)} for t in range(4)]
    assert ranks == [{0}, {0, 1}, {1, 2}, {2}]
    # A tile larger than a rank's rows spans whole ranks.
    big = T.TileMapping.static(4, 3, 2, 8)
    assert big.tile_channels(0) == [0, 1, 2, 3, 4, 5]
    assert big.tile_channels(1) == [5, 6, 7]


@pytest.mark.parametrize(
    "world,rows,cpr,block_m", [(2, 7, 2, 4), (4, 13, 3, 8), (3, 5, 5, 2), (2, 10, 1, 3)]
)
def test_static_equals_dynamic_for_affine_layout(world, rows, cpr, block_m):
    mapping = T.TileMapping.static(world, rows, cpr, block_m)
    assert mapping.order == list(range(world * cpr))  # ids are in row order
    for tile in range(mapping.num_tiles):
        assert (mapping.first_channel[tile], mapping.num_channels[tile]) == (
            T.static_tile_channels_host(tile, block_m, rows, cpr, world * rows)
        )
    tables = mapping.tables("cpu")
    assert tables.first_channel.dtype == torch.int32
    assert tables.first_channel.tolist() == mapping.first_channel
    assert tables.channel_rank.tolist() == [c // cpr for c in range(world * cpr)]


def test_ragged_channels_in_any_order():
    channels = [(10, 17, 1), (0, 3, 0), (3, 10, 0), (17, 18, 1), (18, 30, 2), (30, 30, 2)]
    shuffled = [channels[i] for i in (4, 5, 0, 3, 1, 2)]  # ids now differ from row order
    mapping = T.TileMapping(shuffled, 8)
    assert mapping.m == 30 and mapping.num_tiles == 4
    ids = {ch: c for c, ch in enumerate(shuffled)}
    want = [
        [(0, 3, 0), (3, 10, 0)],
        [(3, 10, 0), (10, 17, 1)],
        [(10, 17, 1), (17, 18, 1), (18, 30, 2)],
        [(18, 30, 2)],
    ]
    for tile, chans in enumerate(want):
        assert mapping.tile_channels(tile) == [ids[ch] for ch in chans]
    assert mapping.order[-1] == ids[(30, 30, 2)]  # empty channel last, never waited on
    tables = mapping.tables("cpu")
    for tile in range(mapping.num_tiles):
        first, count = tables.first_channel[tile].item(), tables.num_channels[tile].item()
        assert tables.order[first : first + count].tolist() == mapping.tile_channels(tile)
    assert tables.channel_rank.tolist() == [ch[2] for ch in shuffled]
    assert tables.channel_start.tolist() == [ch[0] for ch in shuffled]
    assert tables.channel_stop.tolist() == [ch[1] for ch in shuffled]
    assert mapping.rank_channels(1) == [ids[(10, 17, 1)], ids[(17, 18, 1)]]


def test_random_ragged_mappings_match_brute_force():
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(0, 12)))
        edges = [0, *cuts, 60]
        chans = [(s, e, i % 3) for i, (s, e) in enumerate(zip(edges, edges[1:], strict=False))]
        rng.shuffle(chans)
        block_m = rng.randint(1, 20)
        mapping = T.TileMapping(chans, block_m)
        for tile in range(mapping.num_tiles):
            lo, hi = tile * block_m, min((tile + 1) * block_m, 60)
            assert mapping.tile_channels(tile) == _brute_channels(chans, lo, hi)


@pytest.mark.parametrize(
    "channels,block_m,match",
    [
        ([(0, 4, 0), (3, 8, 1)], 4, "overlaps"),
        ([(0, 4, 0), (5, 8, 1)], 4, r"rows \[4, 5\) are in no channel"),
        ([(1, 4, 0)], 4, r"rows \[0, 1\)"),
        ([(0, 4, 0)], 0, "block_m"),
        ([(4, 2, 0)], 4, "start <= stop"),
        ([], 4, "at least one"),
    ],
)
def test_bad_channels_raise(channels, block_m, match):
    with pytest.raises(InterlaceValueError, match=match):
        T.TileMapping(channels, block_m)


def test_bad_static_layout_raises():
    with pytest.raises(InterlaceValueError, match="channels_per_rank"):
        T.static_channel_bounds(2, 3, 4)
    with pytest.raises(ValueError):
        T.static_tile_channels_host(0, 4, 3, 0, 6)


# --------------------------------------------------------------------------------------
# Kernels used by the multi-rank bodies
# --------------------------------------------------------------------------------------


@triton.jit
def _static_map_kernel(out, rows_per_rank, channels_per_rank, M, BLOCK_M: tl.constexpr):
    tile = tl.program_id(0)
    first, count = T.static_tile_channels(tile, BLOCK_M, rows_per_rank, channels_per_rank, M)
    start, stop = T.static_channel_rows(first, rows_per_rank, channels_per_rank)
    tl.store(out + tile * 5 + 0, first)
    tl.store(out + tile * 5 + 1, count)
    tl.store(out + tile * 5 + 2, T.static_channel_rank(first, channels_per_rank))
    tl.store(out + tile * 5 + 3, start)
    tl.store(out + tile * 5 + 4, stop)


@triton.jit
def _produce_kernel(
    x,
    buf,
    buf_table,
    sig,
    sig_table,
    local_off,
    peer_off,
    my_channels,
    ch_start,
    ch_stop,
    rank,
    world,
    row_base,
    rows_per_rank,
    channels_per_rank,
    n_cols,
    scale,
    PUSH: tl.constexpr,
    DYNAMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per channel this rank owns: y = x * scale + 1 into the local buffer,
    raise its own slot ``local_off + ch``, then push to every peer and raise the peer's
    slot ``peer_off + ch`` (PUSH), or only raise it: the peer pulls."""
    pid = tl.program_id(0)
    if DYNAMIC:
        ch = tl.load(my_channels + pid)
        start, stop = T.dynamic_channel_rows(ch_start, ch_stop, ch)
    else:
        ch = rank * channels_per_rank + pid
        start, stop = T.static_channel_rows(ch, rows_per_rank, channels_per_rank)
    for r0 in range(start, stop, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < stop) & (cols[None, :] < n_cols)
            v = tl.load(x + (rows[:, None] - row_base) * n_cols + cols[None, :], mask=mask)
            tl.store(buf + rows[:, None] * n_cols + cols[None, :], v * scale + 1.0, mask=mask)
    T.producer_tile_notify(sig, local_off + ch)
    for i in range(1, world):
        peer = (rank + i) % world
        if PUSH:
            T.tile_push_data(buf, buf_table, peer, start, stop, n_cols, n_cols, BLOCK_M, BLOCK_N)
        T.peer_tile_notify(sig_table, peer, peer_off + ch)


@triton.jit
def _pull_kernel(
    buf,
    buf_table,
    sig,
    ready_off,
    arrived_off,
    expected,
    err,
    rank,
    max_spins,
    rows_per_rank,
    channels_per_rank,
    n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per global channel of a peer: wait until the owner says it is ready,
    pull it into the local buffer, mark it arrived."""
    ch = tl.program_id(0)
    owner = T.static_channel_rank(ch, channels_per_rank)
    if owner != rank:
        start, stop = T.static_channel_rows(ch, rows_per_rank, channels_per_rank)
        token = T.peer_tile_wait(sig, ready_off + ch, expected, err, rank, max_spins)
        T.tile_pull_data(
            buf, buf_table, owner, start, stop, n_cols, n_cols, token, expected, BLOCK_M, BLOCK_N
        )
        T.producer_tile_notify(sig, arrived_off + ch)


@triton.jit
def _consume_kernel(
    buf,
    out,
    sig,
    sig_off,
    expected,
    err,
    rank,
    max_spins,
    M,
    n_cols,
    rows_per_rank,
    channels_per_rank,
    t_first,
    t_count,
    order,
    out_scale,
    DYNAMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per BLOCK_M-row tile: wait for the channels it overlaps, then
    out = buf * out_scale on its rows (guarded by the wait's token)."""
    tile = tl.program_id(0)
    if DYNAMIC:
        first, count = T.dynamic_tile_channels(t_first, t_count, tile)
        token = T.consumer_tile_wait_table(
            sig, sig_off, order, first, count, expected, err, rank, max_spins
        )
    else:
        first, count = T.static_tile_channels(tile, BLOCK_M, rows_per_rank, channels_per_rank, M)
        token = T.consumer_tile_wait(sig, sig_off + first, count, expected, err, rank, max_spins)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        offs = rows[:, None] * n_cols + cols[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < n_cols)
        mask = P.guard(mask, token, expected)
        tl.store(out + offs, tl.load(buf + offs, mask=mask) * out_scale, mask=mask)


# --------------------------------------------------------------------------------------
# Multi-rank bodies
# --------------------------------------------------------------------------------------


def _sync(group):
    if group.backend == "cuda":
        torch.cuda.synchronize()


def _check_gather(what, err, pad, xs, buf, out):
    err.raise_if_set(what, pad.describe)
    gathered = torch.cat([x * SCALE + 1.0 for x in xs])
    assert not out.isnan().any(), f"{what}: rows left unwritten"
    torch.testing.assert_close(buf, gathered)
    torch.testing.assert_close(out, gathered * OUT_SCALE)


def _agree(group, check, *args):
    """Run ``check(*args)`` on every rank, then fail on every rank if it failed on any, so
    that no rank goes on to wait for one that has left (a hang instead of a failure)."""
    try:
        check(*args)
        failure = None
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        failure = exc
    everyone = [None] * group.world_size
    dist.all_gather_object(
        everyone, None if failure is None else repr(failure), group.process_group
    )
    if failure is not None:
        raise failure
    failed = {r: f for r, f in enumerate(everyone) if f is not None}
    if failed:
        raise AssertionError(f"rank {group.rank}: peers failed: {failed}")


def _inputs(seed, rows, n_cols, device):
    """Every rank's input shard, generated alike on every rank (for the reference)."""
    xs = []
    for r, n in enumerate(rows):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        xs.append(torch.randn(n, n_cols, generator=g).to(device))
    return xs


def _ragged_channels(rows, seed):
    """Ragged channels of every rank (1 to 3 per rank, some of one row), ids permuted."""
    rng = random.Random(seed)
    chans, base = [], 0
    for r, n in enumerate(rows):
        k = min(n, 1 + (r + seed) % 3)
        cuts = sorted(rng.sample(range(1, n), k - 1)) if k > 1 else []
        edges = [0, *cuts, n]
        chans += [(base + s, base + e, r) for s, e in zip(edges, edges[1:], strict=False)]
        base += n
    rng.shuffle(chans)
    return chans


def _allgather_body(group, mode, rows_per_rank, cpr, block_m, n_cols, calls, seed):
    """mode: 'static' (push), 'dynamic' (push, ragged rows per rank, permuted channel ids)
    or 'pull' (static). Returns the signal values after the last call."""
    from interlace.runtime import ErrorWord, SignalPad, default_max_spins, symm_empty

    w, rank, dev = group.world_size, group.rank, group.device
    if mode == "dynamic":
        rows = [rows_per_rank + (3 * r) % 5 for r in range(w)]
        mapping = T.TileMapping(_ragged_channels(rows, seed), block_m)
    else:
        rows = [rows_per_rank] * w
        mapping = T.TileMapping.static(w, rows_per_rank, cpr, block_m)
    m, n_ch = sum(rows), len(mapping.channels)
    tables = mapping.tables(dev)
    mine = mapping.rank_channels(rank)
    my_channels = torch.tensor(mine, dtype=torch.int32, device=dev)
    row_base = sum(rows[:rank])
    pad = SignalPad(group, {"barrier": w, "ready": n_ch, "arrived": n_ch})
    err = ErrorWord(group)
    spins = default_max_spins(group)
    buf = symm_empty((m, n_cols), torch.float32, group)
    push, dynamic = mode != "pull", mode == "dynamic"
    # Push: producers raise "arrived" here and on the peers. Pull: they raise "arrived"
    # here and "ready" on the peers, whose pull kernels then raise their "arrived".
    arrived_off = pad.offset("arrived")
    peer_off = arrived_off if push else pad.offset("ready")
    for call in range(1, calls + 1):
        xs = _inputs(seed + call, rows, n_cols, dev)
        out = torch.full((m, n_cols), float("nan"), device=dev)
        # Poison the buffer while nobody touches it: pushing peers write into it after the
        # barrier, pulling peers read from it until they reach the barrier.
        if push:
            buf.local.fill_(float("nan"))
        P.barrier_kernel[(1,)](pad.ptrs, pad.offset("barrier"), rank, w, err.address, spins)
        if not push:
            buf.local.fill_(float("nan"))
        if rank == call % w:
            time.sleep(LATE_S)  # one late rank: consumers elsewhere must really wait
        _produce_kernel[(len(mine),)](
            xs[rank], buf.local, buf.ptrs, pad.buffer.local, pad.ptrs, arrived_off, peer_off,
            my_channels, tables.channel_start, tables.channel_stop, rank, w, row_base,
            rows_per_rank, cpr, n_cols, SCALE,
            PUSH=push, DYNAMIC=dynamic, BLOCK_M=PROD_BM, BLOCK_N=BLOCK_N,
        )  # fmt: skip
        if not push:
            _pull_kernel[(n_ch,)](
                buf.local, buf.ptrs, pad.buffer.local, pad.offset("ready"),
                pad.offset("arrived"), call, err.address, rank, spins, rows_per_rank, cpr,
                n_cols, BLOCK_M=PROD_BM, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        _consume_kernel[(mapping.num_tiles,)](
            buf.local, out, pad.buffer.local, pad.offset("arrived"), call, err.address, rank,
            spins, m, n_cols, rows_per_rank, cpr, tables.first_channel, tables.num_channels,
            tables.order, OUT_SCALE, DYNAMIC=dynamic, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        )  # fmt: skip
        _sync(group)

        what = f"allgather[{mode}] rank {rank} call {call}"
        # _agree is also a barrier: every rank's kernels of this call are done after it.
        _agree(group, _check_gather, what, err, pad, xs, buf.local, out)
    arrived = pad.local("arrived").tolist()
    ready = pad.local("ready").tolist()

    def check_signals():  # no signal leaked: every slot was raised exactly once per call
        assert arrived == [calls] * n_ch, arrived
        if not push:
            assert ready == [calls if c not in mine else 0 for c in range(n_ch)], ready
        assert pad.local("barrier").tolist() == [0] * w  # the device barrier resets itself

    _agree(group, check_signals)
    pad.close()
    buf.close()
    return arrived


def test_static_mapping_in_kernel_matches_host(world):
    world.run(_static_map_body, 2, 7, 2, 4)
    world.run(_static_map_body, 4, 13, 3, 8)


def _static_map_body(group, world_size, rows, cpr, block_m):
    m = world_size * rows
    tiles = -(-m // block_m)
    out = torch.full((tiles, 5), -1, dtype=torch.int32, device=group.device)
    _static_map_kernel[(tiles,)](out, rows, cpr, m, BLOCK_M=block_m)
    _sync(group)
    bounds = T.static_channel_bounds(world_size, rows, cpr)
    for tile, (first, count, owner, start, stop) in enumerate(out.tolist()):
        assert (first, count) == T.static_tile_channels_host(tile, block_m, rows, cpr, m)
        assert (start, stop, owner) == bounds[first]


# rows_per_rank, channels per rank, consumer BLOCK_M, columns: M/W not a multiple of the
# tile, channels (3 and 4 rows) not multiples of the tile either; ragged columns too.
SHAPE = (7, 2, 4, 12)


def test_push_static_mapping(world):
    world.run(_allgather_body, "static", *SHAPE, 1, 11)


def test_push_dynamic_mapping(world):
    world.run(_allgather_body, "dynamic", 5, 0, 4, 12, 1, 12)


def test_pull_static_mapping(world):
    world.run(_allgather_body, "pull", 5, 3, 4, 12, 1, 13)


def test_repeated_calls_do_not_leak_signals(world):
    results = world.run(_allgather_body, "static", 5, 2, 8, 9, 3, 14)
    assert all(r == [3] * (2 * world.world_size) for r in results)
    results = world.run(_allgather_body, "pull", 6, 4, 4, 5, 2, 15)
    assert all(r == [2] * (4 * world.world_size) for r in results)


def _timeout_body(group, dynamic):
    """Channels 0 to 2 arrive, 3 never does: the tile that needs it times out (although
    its other channel arrived), stays poisoned, and the host raises WaitTimeoutError
    naming this rank and the missing slot."""
    from interlace.runtime import ErrorWord, SignalPad, symm_empty

    rows, cpr, block_m, n_cols = 8, 4, 4, 8  # channels of 2 rows, tiles of 4 (2 channels)
    dev = group.device
    pad = SignalPad(group, {"other": 3, "chan": cpr})
    err = ErrorWord(group)
    tables = T.TileMapping.static(1, rows, cpr, block_m).tables(dev)
    src = torch.randn(rows, n_cols).to(dev)
    out = torch.full((rows, n_cols), float("nan"), device=dev)
    pad.local("chan")[:3].fill_(1)
    _consume_kernel[(2,)](
        src, out, pad.buffer.local, pad.offset("chan"), 1, err.address, group.rank, 16, rows,
        n_cols, rows, cpr, tables.first_channel, tables.num_channels, tables.order, 1.0,
        DYNAMIC=dynamic, BLOCK_M=block_m, BLOCK_N=8,
    )  # fmt: skip
    _sync(group)
    torch.testing.assert_close(out[:4], src[:4])  # tile 0: channels 0, 1 arrived
    assert out[4:].isnan().all()  # tile 1: its guarded loads and stores were masked off
    with pytest.raises(WaitTimeoutError) as info:
        err.raise_if_set("tile_timeout", pad.describe)
    e = info.value
    assert (e.rank, e.signal, e.observed) == (group.rank, "chan[3]", 0)
    assert f"rank {group.rank}" in str(e) and "chan[3]" in str(e)
    err.raise_if_set("tile_timeout", pad.describe)  # reported once, then cleared

    # A pull whose "ready" never comes copies nothing: peers' rows stay poisoned here.
    w, rank = group.world_size, group.rank
    ready = SignalPad(group, {"ready": w, "arrived": w})
    buf = symm_empty((2 * w, n_cols), torch.float32, group)
    buf.local.fill_(float("nan"))
    buf.local[2 * rank : 2 * rank + 2].copy_(src[:2])
    _sync(group)
    group.host_barrier()
    _pull_kernel[(w,)](
        buf.local, buf.ptrs, ready.buffer.local, ready.offset("ready"), ready.offset("arrived"),
        1, err.address, rank, 16, 2, 1, n_cols, BLOCK_M=2, BLOCK_N=8,
    )  # fmt: skip
    _sync(group)
    mine = torch.zeros(2 * w, dtype=torch.bool)
    mine[2 * rank : 2 * rank + 2] = True
    assert buf.local[~mine.to(dev)].isnan().all()
    torch.testing.assert_close(buf.local[mine.to(dev)], src[:2])
    with pytest.raises(WaitTimeoutError) as info:
        err.raise_if_set("pull_timeout", ready.describe)
    assert info.value.rank == rank
    assert info.value.signal in {f"ready[{r}]" for r in range(w) if r != rank}
    group.host_barrier()  # no rank frees its buffer while a peer may still read it
    pad.close()
    ready.close()
    buf.close()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_wait_timeout_raises(world, dynamic):
    world.run(_timeout_body, dynamic)
