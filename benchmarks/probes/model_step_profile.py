"""Where the host time of one step of `bench model`'s interlace stack goes.

Every GPU runs one rank (W = the GPUs; one GPU: W 1) of the Llama-3-8B-shaped stack made
tensor-parallel by ``interlace.nn.parallelize``, warms it up, then rank 0 records
``--steps`` prefill forwards or training steps under ``torch.profiler`` (CPU and CUDA)
and prints the ops with the most host (self CPU) time per step, and the wall time of a
step next to the GPU time the profiler saw. A step whose host time exceeds its GPU time
is host-bound (`bench model` saw step times that hardly grow from 2048 to 8192 tokens).

    python benchmarks/probes/model_step_profile.py [--mode train] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def body(group, mode, tokens, steps, rows):
    from torch.profiler import ProfilerActivity, profile

    from interlace.bench.model import DecoderConfig, _step_fns, build_stack
    from interlace.nn import parallelize

    c = DecoderConfig()
    dev = group.device
    model = parallelize(copy.deepcopy(build_stack(c, torch.bfloat16, dev)), group)
    gen = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(1, tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    g = torch.randn(1, tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    step = _step_fns(model, x, g)[0 if mode == "prefill" else 1]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    group.host_barrier()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        host_ms = (time.perf_counter() - start) * 1e3 / steps
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    if group.rank != 0:
        return None
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    head = (f"W={group.world_size} {mode} tokens {tokens}: host {host_ms:.2f} ms per step "
            f"(until the last launch returned), wall {wall_ms:.2f} ms per step")  # fmt: skip
    return f"{head}\n{table}"


def main() -> int:
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", choices=("prefill", "train"), default="train")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    n = max(1, torch.cuda.device_count())
    with World(n, "cuda", timeout=600) as world:
        print(world.run(body, args.mode, args.tokens, args.steps, args.rows)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
