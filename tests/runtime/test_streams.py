"""Comm streams and copy-engine transfers: a copy into a peer followed by a stream-written
signal, seen by the peer's device wait together with the data."""

from __future__ import annotations

import torch

from interlace.language.primitives import wait_kernel
from interlace.runtime import (
    ErrorWord,
    SignalPad,
    comm_stream,
    copy_and_signal,
    default_max_spins,
    fork,
    join,
    stream_write_value32,
    symm_empty,
    use_stream,
)

N = 37  # elements per chunk: odd on purpose


def _sync(group) -> None:
    if group.backend == "cuda":
        torch.cuda.synchronize(group.device)


def _chunk(seed: int, rnd: int, rank: int, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(((seed * 31 + rnd) * 131 + rank) * 17 + k)
    return torch.randn(N, generator=gen) + 10 * rank + k


def _push_rounds_body(group, seed, rounds, chunks):
    """Every round each rank copies ``chunks`` chunks into its right neighbour's buffer,
    each followed by a stream write of 1 into that neighbour's slot; the neighbour consumes
    the slots with wait_kernel(RESET=True) and checks the data."""
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    pad = SignalPad(group, {"spare": 3, "arrive": chunks, "tail": 2})
    err = ErrorWord(group)
    buf = symm_empty((chunks, N), torch.float32, group)
    first = pad.offset("arrive")
    spins = default_max_spins(group)
    try:
        assert (comm_stream(group) is None) == (group.backend == "cpu")
        for rnd in range(rounds):
            buf.local.fill_(float("nan"))  # poison what the left neighbour will fill
            _sync(group)
            group.host_barrier()
            src = torch.stack([_chunk(seed, rnd, rank, k) for k in range(chunks)]).to(group.device)
            stream = fork(group)
            with use_stream(stream):
                for k in range(chunks):
                    copy_and_signal(buf.peers[right][k], src[k], pad.buffer.peers[right], first + k)
            join(group, stream)
            wait_kernel[(1,)](
                pad.buffer.local, first, chunks, 1, err.address, rank, spins, RESET=True
            )
            _sync(group)
            err.raise_if_set("test_streams.push", pad.describe)
            want = torch.stack([_chunk(seed, rnd, left, k) for k in range(chunks)])
            got = buf.local.cpu()
            assert torch.equal(got, want), f"round {rnd}: data from rank {left} is wrong"
            # consumed: back to 0, and no other slot was touched
            assert pad.buffer.local[: pad.size].cpu().tolist() == [0] * pad.size
        group.host_barrier()
        assert pad.buffer.local[: pad.size].cpu().tolist() == [0] * pad.size
    finally:
        group.host_barrier()
        buf.close()
        pad.close()
    return True


def _epoch_body(group, seed, rounds):
    """A monotonic epoch written by stream_write_value32 into the peer's pad and waited for
    with wait_kernel(RESET=False, >= epoch); the slot ends at the last epoch."""
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    pad = SignalPad(group, {"epoch": 1, "other": world})
    err = ErrorWord(group)
    buf = symm_empty((N,), torch.float32, group)
    spins = default_max_spins(group)
    try:
        for rnd in range(1, rounds + 1):
            buf.local.fill_(float("nan"))
            _sync(group)
            group.host_barrier()
            copy_and_signal(
                buf.peers[right],
                _chunk(seed, rnd, rank, 0).to(group.device),
                pad.buffer.peers[right],
                pad.offset("epoch"),
                rnd,
            )
            wait_kernel[(1,)](
                pad.buffer.local,
                pad.offset("epoch"),
                1,
                rnd,
                err.address,
                rank,
                spins,
                RESET=False,
            )
            _sync(group)
            err.raise_if_set("test_streams.epoch", pad.describe)
            assert torch.equal(buf.local.cpu(), _chunk(seed, rnd, left, 0))
            assert int(pad.local("epoch")[0]) == rnd
            assert pad.local("other").cpu().tolist() == [0] * world
        # a plain copy_and_signal with no signal only copies
        group.host_barrier()
        x = torch.arange(N, dtype=torch.float32, device=group.device) * (rank + 1)
        copy_and_signal(buf.local, x)
        stream_write_value32(pad.local("other"), rank, 7)  # a local write, any index
        _sync(group)
        assert torch.equal(buf.local.cpu(), x.cpu())
        assert pad.local("other").cpu().tolist() == [7 if r == rank else 0 for r in range(world)]
    finally:
        group.host_barrier()
        buf.close()
        pad.close()
    return True


def test_copy_and_signal_then_consume(world):
    seed = int(torch.randint(0, 2**20, ()).item())
    assert all(world.run(_push_rounds_body, seed, 5, 3))


def test_stream_written_epochs(world):
    seed = int(torch.randint(0, 2**20, ()).item())
    assert all(world.run(_epoch_body, seed, 5))
