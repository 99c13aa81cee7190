"""Whether a CUDA-graph capture survives torch's CUDA IPC limbo, in a world of ranks
sharing one GPU (where symmetric buffers are shared through CUDA IPC handles).

A rank that frees a tensor it shared through ``reduce_tensor`` while a peer still maps it
keeps the block in torch's IPC limbo until a collect; a collect runs, among other times,
when the caching allocator misses a pool, which can happen inside a capture. Each trial:
every rank allocates a symmetric buffer, rank 0 closes its buffer first, a host barrier,
the others close theirs, a host barrier, then (``collect``) ``torch.cuda.ipc_collect()``;
then each rank captures a graph whose allocation misses the graph's pool (a fresh 256 MB
tensor) and reports whether the capture and a replay succeeded.

    python benchmarks/probes/ipc_limbo_capture.py [--world 2] [--trials 3]
"""

from __future__ import annotations

import argparse


def body(group, trials: int):
    import torch

    from interlace.runtime import symm_empty

    dev = group.device
    lines = []
    for collect in (False, True):
        for t in range(trials):
            buf = symm_empty((8 << 20,), torch.uint8, group)
            buf.local.fill_(1)
            torch.cuda.synchronize()
            if group.rank == 0:
                buf.close()
            group.host_barrier()
            if group.rank != 0:
                buf.close()
            group.host_barrier()
            if collect:
                torch.cuda.ipc_collect()
            x = torch.ones(4, device=dev)
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    y = x.new_empty((64 << 20,)).fill_(2.0)  # a miss in the graph's pool
                    z = y[:4] + x
                g.replay()
                torch.cuda.synchronize()
                ok = f"ok ({float(z.sum()):.0f})"
            except Exception as e:  # noqa: BLE001 - reported, not raised
                ok = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                torch.cuda.synchronize()
            lines.append(f"rank {group.rank} collect={collect} trial {t}: {ok}")
            del g
            group.host_barrier()
    return "\n".join(lines)


def main() -> int:
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    with World(args.world, "cuda", timeout=300, share_device=True) as world:
        print("\n".join(world.run(body, args.trials)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
