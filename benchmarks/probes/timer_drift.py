"""Whether the GPU's global timer (what kernels' trace events read) keeps pace with CUDA
events (what a trace's copy spans are timed with) across idle gaps.

On every GPU (one process each, at once), pairs of anchors (a timer read, an event, a
timer read, as ``interlace.trace`` takes them) are taken with the device left idle
between them for each gap in ``--gaps`` (seconds), the host spinning or sleeping; for each
pair it prints the timer's advance, the events' time apart and their difference, and
``timer_jump`` 's verdict. A difference of about a second, as the four-H200 traces' copy
spans showed, would be the timer jumping.

    python benchmarks/probes/timer_drift.py [--gaps 0 0.01 0.1 1 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def body(group, gaps):
    from interlace.kernels.trace import clock_kernel
    from interlace.trace.recorder import tightest_bracket, timer_jump

    dev = group.device

    def anchor():
        clock = torch.zeros(2 * 8, dtype=torch.int64, device=dev)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
        for i, event in enumerate(events):
            clock_kernel[(1,)](clock, 2 * i)
            event.record()
            clock_kernel[(1,)](clock, 2 * i + 1)
        torch.cuda.synchronize(dev)
        i, ns, window = tightest_bracket(clock.cpu().tolist())
        return ns, window, events[i]

    anchor()  # compiled and loaded
    lines = []
    for gap in gaps:
        for mode in ("sleep", "spin"):
            a_ns, a_w, a_ev = anchor()
            end = time.perf_counter() + gap
            if mode == "sleep":
                time.sleep(gap)
            else:
                while time.perf_counter() < end:
                    pass
            b_ns, b_w, b_ev = anchor()
            events_ns = round(a_ev.elapsed_time(b_ev) * 1e6)
            jump = timer_jump(a_ns, b_ns, events_ns, a_w + b_w)
            lines.append(
                f"rank {group.rank} gap {gap:5.2f} s ({mode}): timer {b_ns - a_ns:14d} ns, "
                f"events {events_ns:14d} ns, difference {b_ns - a_ns - events_ns:12d} ns, "
                f"jump {jump}"
            )
    return "\n".join(lines)


def main() -> int:
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gaps", type=float, nargs="*", default=[0.0, 0.01, 0.1, 1.0, 2.0])
    args = p.parse_args()
    n = max(1, torch.cuda.device_count())
    with World(n, "cuda", timeout=120) as world:
        for text in world.run(body, args.gaps):
            print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
