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
