"""Where the interlace stack's time differs from the plain model's at W = 1.

`bench model` times the Llama-3-8B-shaped stack made "parallel" over one rank against
the same stack unchanged. This probe profiles both (CUDA activity, ``--steps`` steps after
warm-up) in prefill and in a training step and prints, per GPU kernel name, the time of
each and the difference, the largest differences first; then the sum over kernels and
the wall time per step of each model.

    python benchmarks/probes/model_w1_diff.py [--tokens 2048] [--steps 5] [--rows 25]
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections import defaultdict

import torch


def kernel_times(fn, steps: int) -> tuple[dict, float]:
    """Per kernel name: GPU us per step; and the wall ms per step."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out: dict = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name[:90]] += ev.device_time / steps
    return out, wall


def main() -> int:
    import torch.distributed as dist

    import interlace
    from interlace.bench.model import DecoderConfig, _free_port, _step_fns, build_stack
    from interlace.nn import parallelize

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group = interlace.Group()
    dev = group.device
    c = DecoderConfig()
    plain = build_stack(c, torch.bfloat16, dev)
    ours = parallelize(copy.deepcopy(plain), group)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, args.tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    g = torch.randn(1, args.tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    for i, mode in enumerate(("prefill", "train")):
        t_plain, w_plain = kernel_times(_step_fns(plain, x, g)[i], args.steps)
        t_ours, w_ours = kernel_times(_step_fns(ours, x, g)[i], args.steps)
        names = sorted(set(t_plain) | set(t_ours),
                       key=lambda n: -abs(t_ours.get(n, 0) - t_plain.get(n, 0)))  # fmt: skip
        print(f"== {mode}, {args.tokens} tokens: GPU us per step (ours, plain, diff)")
        for n in names[: args.rows]:
            a, b = t_ours.get(n, 0.0), t_plain.get(n, 0.0)
            print(f"{a:10.1f} {b:10.1f} {a - b:+9.1f}  {n}")
        sa, sb = sum(t_ours.values()), sum(t_plain.values())
        print(f"{sa:10.1f} {sb:10.1f} {sa - sb:+9.1f}  (all kernels)")
        print(f"wall ms per step: ours {w_ours:.3f}, plain {w_plain:.3f}\n", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
