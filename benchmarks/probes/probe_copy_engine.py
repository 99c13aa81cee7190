"""Does ``tensor.copy_`` into a peer's symmetric buffer need SMs on this machine?

A spinning kernel first fills the GPU (or leaves room), then a 64 MB copy into the peer
is enqueued on another stream. If the copy finishes while the spinner still runs, it did
not need an SM (copy engine); if it only finishes once the spinner is released, it did.
Run on a machine with 2+ GPUs:  python benchmarks/probes/probe_copy_engine.py
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from interlace.runtime import symm_empty
from interlace.testing import run_world


@triton.jit
def _spinner(flag_addr, max_spins):
    flag = flag_addr.to(tl.pointer_type(tl.int32))
    seen = tl.load(flag, volatile=True)
    spins = 0
    while (seen == 0) & (spins < max_spins):
        seen = tl.load(flag, volatile=True)
        spins += 1


def _body(group):
    results = []
    n = 32 << 20  # 64 MB of bf16
    buf = symm_empty((n,), torch.bfloat16, group)
    src = torch.randn(n, device=group.device).to(torch.bfloat16)
    peer = (group.rank + 1) % group.world_size
    sms = torch.cuda.get_device_properties(group.device).multi_processor_count
    side = torch.cuda.Stream()
    for label, grid, warps, dst in [
        ("peer copy, spinner 4 CTAs/SM x 8 warps", 4 * sms, 8, buf.peers[peer]),
        ("peer copy, spinner 1 CTA/SM x 4 warps", sms, 4, buf.peers[peer]),
        ("local copy, spinner 4 CTAs/SM x 8 warps", 4 * sms, 8, buf.local),
    ]:
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        torch.cuda.synchronize()
        group.host_barrier()
        _spinner[(grid,)](flag.data_ptr(), 1 << 28, num_warps=warps)
        with torch.cuda.stream(side):
            dst.copy_(src)
            done = torch.cuda.Event()
            done.record()
        start = time.perf_counter()
        while not done.query() and time.perf_counter() - start < 2.0:
            time.sleep(1e-4)
        finished_while_spinning = done.query()
        flag[0] = 1  # release the spinner
        torch.cuda.synchronize()
        results.append(
            (label, finished_while_spinning, round((time.perf_counter() - start) * 1e3, 2))
        )
    group.host_barrier()
    buf.close()
    return results


if __name__ == "__main__":
    for label, ok, ms in run_world(_body, 2, backend="cuda", timeout=120)[0]:
        print(f"{label:42s} finished while the spinner held the SMs: {ok}  ({ms} ms)")
