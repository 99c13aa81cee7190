"""Where the host time of an eager EP dispatch / combine goes (normal and low-latency).

A one-rank world on one GPU builds ``EPAllToAll`` and ``EPLowLatency`` (both protocols)
at ``bench ep``'s decode shape, warms them up, then times ``--calls`` back-to-back calls
of each (per call, as ``bench.timing.host_us`` does) with the short path of a call like
an earlier one (``OpContext._armed``) off and on, and runs as many again under
``cProfile``, printing the functions with the most own and cumulative time per call.
Then the short path's pieces alone: the key (``replay_key``), the armed lookup, the
graph's launch, and ``torch.empty`` of combine's output, ``torch.mm`` beside them.

    python benchmarks/probes/ep_host_profile.py [--shape 128,7168,8,256] [--calls 400]
"""

from __future__ import annotations

import argparse
import cProfile
import time

import torch


def _per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def body(group, shape, calls, rows):
    from interlace.bench.timing import profile_text
    from interlace.ops.ep import EPAllToAll, EPLowLatency

    tokens, hidden, topk, experts = shape
    dev = group.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(dev)
    wts = torch.softmax(torch.rand(tokens, topk, generator=gen), -1).to(dev)
    out = []
    contexts = [("normal", EPAllToAll(group, tokens, hidden, experts, topk))] + [
        (f"low_latency {p}", EPLowLatency(group, tokens, hidden, experts, topk, protocol=p))
        for p in ("token_flag", "flag_in_data")
    ]
    for name, ctx in contexts:
        h = ctx.dispatch(x, idx, wts)
        shape_eo = (ctx.capacity, hidden) if name == "normal" else tuple(ctx.recv_x.shape)
        eo = torch.randn(*shape_eo, device=dev).to(torch.bfloat16)
        for what in ("dispatch", "combine"):
            if what == "dispatch":
                fn = lambda ctx=ctx: ctx.dispatch(x, idx, wts)  # noqa: E731
            else:  # (a handle is valid until the next dispatch)
                h = ctx.dispatch(x, idx, wts)
                fn = lambda ctx=ctx, h=h, eo=eo: ctx.combine(eo, h)  # noqa: E731
            replays, ctx._replays = ctx._replays, None  # the short path off
            for _ in range(20):
                fn()
            full = min(_per_call_us(fn, calls // 4) for _ in range(4))
            ctx._replays = replays
            for _ in range(20):
                fn()
            plain = min(_per_call_us(fn, calls // 4) for _ in range(4))
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            out.append(f"== {name} {what}: {plain:.1f} us per call back to back, "
                       f"{full:.1f} the whole way (best of 4 loops of {calls // 4}); "
                       f"profile of {calls} calls:\n{profile_text(prof, rows)}")  # fmt: skip
        out.append(_pieces(ctx, x, idx, wts, calls))
        ctx.check()
        ctx.close()
    return "\n".join(out)


def _pieces(ctx, x, idx, wts, calls) -> str:
    """The short path's pieces alone, per call back to back (a dispatch's)."""
    from interlace.ops._context import replay_key

    operands = (x, idx, wts)
    key, ptrs = replay_key("dispatch", operands)
    armed = ctx._armed(key)
    stand_in = torch.empty(1, 1, dtype=ctx.dtype, device=x.device).expand(x.shape[0], ctx.hidden)
    a = torch.randn(2048, 4096, device=x.device, dtype=torch.bfloat16)
    b = torch.randn(4096, 2048, device=x.device, dtype=torch.bfloat16)
    pieces = {
        "replay_key": lambda: replay_key("dispatch", operands),
        "_armed": lambda: ctx._armed(key),
        "graph.launch": lambda: armed.graph.launch(operands, ptrs),
        "torch.empty": lambda: torch.empty(
            x.shape[0], ctx.hidden, dtype=ctx.dtype, device=x.device
        ),  # fmt: skip
        "empty_like(expanded)": lambda: torch.empty_like(stand_in),
        "is_capturing": torch._C._cuda_isCurrentStreamCapturing,
        "fault_pending": ctx.error.fault_pending,
        "torch.mm": lambda: torch.mm(a, b),
    }
    got = {k: min(_per_call_us(fn, calls // 4) for _ in range(4)) for k, fn in pieces.items()}
    return "   pieces (us): " + ", ".join(f"{k} {v:.2f}" for k, v in got.items())


def main() -> int:
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="128,7168,8,256", help="tokens,hidden,topk,experts")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    with World(1, "cuda", timeout=300) as world:
        print(world.run(body, shape, args.calls, args.rows)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
