"""Per-tile timeline traces of the overlapped ops.

    with interlace.trace.record(group, label="ag_gemm") as rec:
        c = ctx(a, b)
    trace = rec.trace()                     # collective: every rank's events, aligned
    trace.save("traces/ag_gemm")            # .json (Perfetto), .png, -summary.json
    print(interlace.trace.format_summary(interlace.trace.summarize(trace)))

See ``docs/trace.md`` for how to read a trace, ``recorder`` for what is recorded and how
the clocks are aligned, ``summary`` for the overlap ratio and the wait chain.
"""

from .model import Trace, build_trace
from .recorder import Recorder, measure_clock, record
from .spans import Instant, Span
from .summary import exposed_spans, format_summary, summarize, wait_chain

__all__ = [
    "Instant",
    "Recorder",
    "Span",
    "Trace",
    "build_trace",
    "exposed_spans",
    "format_summary",
    "measure_clock",
    "record",
    "summarize",
    "wait_chain",
]
