"""One GPU, one process: does the first comm-path operation of a process (a device-to-device
copy and a stream write on a side stream, through ``runtime.streams``) run while a kernel
of the same process spins on another stream waiting for it?

A Triton kernel on the current stream spins (bounded) until a flag is set; the side
stream then copies ``--mb`` MB device to device and writes the flag. Printed: whether the
kernel saw the flag, after how many polls, and the wall time. ``--warm 1`` does one copy
and stream write before the spinning kernel (what any earlier call would have done).
Run once per process: the first use is the question.

    python benchmarks/probes/probe_first_copy.py --warm 0
    python benchmarks/probes/probe_first_copy.py --warm 1
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

from interlace.runtime import comm_stream
from interlace.runtime.streams import copy_and_signal


@triton.jit
def _spin(flag, polls, max_polls):
    seen = tl.load(flag, volatile=True)
    n = 0
    while (seen == 0) & (n < max_polls):
        seen = tl.load(flag, volatile=True)
        n += 1
    tl.store(polls, n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm", type=int, default=0)
    p.add_argument("--mb", type=int, default=8)
    p.add_argument("--max-polls", type=int, default=1 << 26)
    args = p.parse_args()

    class _G:  # what comm_stream reads of a Group
        backend, device = "cuda", torch.device("cuda", 0)

    dev = _G.device
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    polls = torch.zeros(1, dtype=torch.int32, device=dev)
    src = torch.randn(args.mb << 18, device=dev)
    dst = torch.empty_like(src)
    _spin[(1,)](flag, polls, 1)  # compiled and loaded before the measured launch
    torch.cuda.synchronize()
    side = comm_stream(_G)
    if args.warm:
        spare = torch.zeros(1, dtype=torch.int32, device=dev)
        copy_and_signal(dst, src, spare.view(torch.uint32), 0, 1, stream=side)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    _spin[(1,)](flag, polls, args.max_polls)
    copy_and_signal(dst, src, flag.view(torch.uint32), 0, 1, stream=side)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = int(polls.item())
    ok = torch.equal(dst, src)
    print(
        f"warm={args.warm}: flag seen={n < args.max_polls} after {n} polls "
        f"(max {args.max_polls}), {dt * 1e3:.1f} ms, copy correct={ok}"
    )


if __name__ == "__main__":
    main()
