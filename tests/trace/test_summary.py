"""The summary's arithmetic on a hand-made two-rank trace: overlap ratio (TileLink's
definition), exposed communication, waits per program, the longest wait chain, and the
Chrome export's times."""

from __future__ import annotations

import pytest

from interlace.trace import Instant, Span, Trace, exposed_spans, summarize, wait_chain

US = 1_000  # ns


def _trace() -> Trace:
    s = [
        # rank 0: program 0 computes, waits on rank 1's chunk, computes; its copy to rank 1
        Span(0, 0, "p0", "program", 0, 20 * US, {"launch": 0}),
        Span(0, 0, "tile 0", "compute", 0, 10 * US, {"launch": 0, "tile": 0, "segment": 0}),
        Span(0, 0, "wait chunk 1", "wait", 10 * US, 15 * US, {"peer": 1, "segment": 1}),
        Span(0, 0, "tile 2", "compute", 15 * US, 20 * US, {"launch": 0, "tile": 2, "segment": 1}),
        Span(0, 100_000, "copy to rank 1", "copy", 0, 8 * US, {"peer": 1, "bytes": 64}),
        # rank 1: waits for rank 0's notify, which came after rank 0's own wait
        Span(1, 0, "p0", "program", 0, 20 * US, {"launch": 0}),
        Span(1, 0, "wait chunk 0", "wait", 1 * US, 16 * US, {"peer": 0, "segment": 0}),
        Span(1, 0, "tile 1", "compute", 16 * US, 20 * US, {"launch": 0, "tile": 1, "segment": 0}),
        Span(1, 100_000, "copy to rank 0", "copy", 2 * US, 12 * US, {"peer": 0, "bytes": 64}),
    ]
    notes = [Instant(0, 0, "notify rank 1", "notify", 16 * US, {"dest": 1})]
    tracks = {(0, 0): "program 0", (1, 0): "program 0", (0, 100_000): "s", (1, 100_000): "s"}
    return Trace(2, s, notes, tracks, {"method": "test"}, "synthetic")


def test_overlap_ratio_and_exposed():
    tr = _trace()
    assert [(x.t0, x.t1) for x in exposed_spans(tr, 0)] == [(10 * US, 15 * US)]
    assert [(x.t0, x.t1) for x in exposed_spans(tr, 1)] == [(1 * US, 16 * US)]
    s = summarize(tr)
    r0 = s["ranks"][0]
    # comp 15 us (busiest program), comm 8 us, T 20 us: (15 + 8 - 20) / 8
    assert r0["comp_ms"] == pytest.approx(0.015)
    assert r0["comm_ms"] == pytest.approx(0.008)
    assert r0["overlap_ratio"] == pytest.approx(0.375)
    assert r0["wait_ms_per_program"] == {"0": 0.005}
    # op: T over ranks 20 us, comp 15 (rank 0), comm 10 (rank 1): (15 + 10 - 20) / 10
    assert s["op"]["overlap_ratio"] == pytest.approx(0.5)


def test_longest_wait_chain_follows_the_releasing_signal():
    tr = _trace()
    chain = wait_chain(tr)
    # rank 1's wait (15 us) was released by rank 0's notify at 16 us, which came after
    # rank 0's wait (5 us): a chain of 20 us
    assert [(c["rank"], c["wait_us"]) for c in chain] == [(0, 5.0), (1, 15.0)]


def test_chrome_times_are_microseconds_from_the_first_event():
    doc = _trace().to_chrome()
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    wait = next(e for e in spans if e["name"] == "wait chunk 0")
    assert (wait["ts"], wait["dur"], wait["pid"], wait["tid"]) == (1.0, 15.0, 1, 0)


def test_a_timer_jump_is_printed():
    from interlace.trace.summary import format_summary

    s = summarize(_trace())
    assert "jumped" not in format_summary(s)
    s["clock"]["timer_jump_ns"] = [0, 1_040_000_000]
    assert "GPU timer jumped while recording (ms, per rank): 0.000 1040.000" in format_summary(s)


def test_clocks_that_disagree_are_flagged():
    from dataclasses import replace

    from interlace.trace.summary import clock_gap_ns, format_summary

    tr = _trace()
    assert [clock_gap_ns(tr, r) for r in (0, 1)] == [0, 0]
    assert "clocks disagree" not in format_summary(summarize(tr))
    # rank 1's copy span a second before its kernels (as on four H200s)
    spans = [replace(s, t0=s.t0 - 10**9, t1=s.t1 - 10**9) if s.rank == 1 and s.cat == "copy"
             else s for s in tr.spans]  # fmt: skip
    shifted = Trace(2, spans, tr.instants, tr.tracks, tr.clock, tr.label)
    assert clock_gap_ns(shifted, 0) == 0
    assert clock_gap_ns(shifted, 1) == 10**9 - 12 * US  # kernels from 0, copy ends at 12 us
    text = format_summary(summarize(shifted))
    assert "clocks disagree" in text and "on rank 1" in text and "on rank 0" not in text
