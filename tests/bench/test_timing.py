"""The timing protocol's interleaved form, on the CPU: CUDA events and the alignment are
replaced by a fake clock, so the test sees which call each timed interval holds."""

from __future__ import annotations

import pytest

from interlace.bench import timing


class _Clock:
    now = 0.0


class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = _Clock.now

    def elapsed_time(self, end):
        return end.t - self.t


def test_paired_median_interleaves_the_calls(monkeypatch):
    monkeypatch.setattr(timing.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_align", lambda group: None)
    order = []

    def call(name, cost):
        def fn():
            order.append(name)
            _Clock.now += cost  # the clock moves inside calls only

        return fn

    a, b = call("a", 2.0), call("b", 3.0)
    t_a, t_b = timing.paired_median_ms(None, [a, b], iters=4, warmup=2)
    assert (t_a, t_b) == (pytest.approx(2.0), pytest.approx(3.0))
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 4  # warm-up, then run by run


def test_host_us_is_per_call_in_batches_and_host_cold_us_a_lone_call(monkeypatch):
    """``host_us``: per call over batches of back-to-back calls, each batch after one
    alignment; ``host_cold_us``: every call right after an alignment. A fake host clock
    where a call right after an alignment costs 5 us and any other 1 us."""
    clock = {"now": 0.0, "fresh": False}
    aligned = []

    def align(group):
        aligned.append(group)
        clock["fresh"] = True

    def fn():
        clock["now"] += 5e-6 if clock["fresh"] else 1e-6
        clock["fresh"] = False

    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_align", align)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    assert timing.host_us(None, fn, iters=3, batch=4) == pytest.approx(2.0)  # (5+1+1+1)/4
    assert len(aligned) == 3
    assert timing.host_cold_us(None, fn, iters=3) == pytest.approx(5.0)
    assert len(aligned) == 6
