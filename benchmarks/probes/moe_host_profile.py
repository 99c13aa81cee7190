"""Where the host time of an eager ``AGMoE`` / ``MoERS`` ``fused`` call goes.

Every rank (one GPU each; W = the GPUs, at least 2) builds both contexts at one of the
MoE benchmark's shapes, warms them up, then calls each half ``--calls`` times, every call
started with the ranks aligned (device idle, host barrier), as ``bench``'s ``host_us``
times them. Rank 0 runs its calls under ``cProfile`` and prints, per half, the median
host time of a call and the functions with the most own time and the most cumulative
time (per call).

    python benchmarks/probes/moe_host_profile.py [--shape 8192,2048,1536,32,2]
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import time

import torch
import torch.distributed as dist


def body(group, shape, calls, rows):
    from interlace.bench.timing import profile_text
    from interlace.ops.moe import AGMoE, MoERS

    tokens, hidden, inter, experts, k = shape
    w, rank, dev = group.world_size, group.rank, group.device
    m, i_loc, bf = tokens // w, inter // w, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(m, hidden, device=dev, generator=gen).to(bf)
    ids = torch.randint(0, experts, (m, k), device=dev, generator=gen)
    wts = torch.softmax(torch.randn(m, k, device=dev, generator=gen), -1)
    w1 = (torch.randn(experts, hidden, 2 * i_loc, device=dev, generator=gen) * 0.05).to(bf)
    w2 = (torch.randn(experts, i_loc, hidden, device=dev, generator=gen) * 0.05).to(bf)
    sizes = dict(max_tokens=tokens, hidden=hidden, inter=i_loc, experts=experts, topk=k,
                 validate=False)  # fmt: skip
    ag = AGMoE(group, strategy="fused", **sizes)
    rs = MoERS(group, strategy="fused", **sizes)
    h, rt = ag(x, ids, wts, w1)
    halves = {"ag_moe": lambda: ag(x, ids, wts, w1), "moe_rs": lambda: rs(h, rt, w2)}
    out = []
    for name, fn in halves.items():
        for _ in range(5):
            fn()
        prof = cProfile.Profile()
        samples = []
        for _ in range(calls):
            torch.cuda.synchronize()
            dist.barrier(group=group.process_group, device_ids=[dev.index])
            torch.cuda.synchronize()
            start = time.perf_counter()
            if rank == 0:
                prof.enable()
            fn()
            if rank == 0:
                prof.disable()
            samples.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
        if rank == 0:
            median = statistics.median(samples)
            out.append(f"== {name}: median host time {median:.0f} us per call "
                       f"(profiled; {calls} calls)\n{profile_text(prof, rows)}")  # fmt: skip
    ag.close()
    rs.close()
    return "\n".join(out)


def main() -> int:
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="8192,2048,1536,32,2",
                   help="tokens,hidden,inter (whole),experts,topk")  # fmt: skip
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    n = max(2, torch.cuda.device_count())
    with World(n, "cuda", timeout=300, share_device=torch.cuda.device_count() < 2) as world:
        print(world.run(body, shape, args.calls, args.rows)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
