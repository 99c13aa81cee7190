"""The trace suite's entry points and the check step of its overhead benchmark: ``python -m
interlace trace ...`` is ``bench trace ...``; the per-rank kernel with waits met, untraced
and traced, is correct on ragged and whole-tile shapes and again on a second check (the
chunk counters start from zero for each checked launch), and the traced launch writes one
tile-end event per tile."""

from __future__ import annotations

import pytest

from interlace import __main__ as cli
from interlace.bench import trace as trace_bench
from tests.bench._helpers import fake_suite
from tests.conftest import get_world


def test_trace_command_is_the_trace_suite(monkeypatch):
    seen = fake_suite(monkeypatch, "trace", 5)
    assert cli.main(["trace", "ag_gemm", "--cpu"]) == 5
    assert cli.main(["bench", "trace", "--quick"]) == 5
    assert seen == [["ag_gemm", "--cpu"], ["--quick"]]


def test_trace_suite_exists():
    assert cli.suite_main("trace") is trace_bench.main


#: (world, M, one_loop): ragged rows per rank (the op's loop choice), whole tiles (one loop)
SHAPES = [(2, 2 * 37, None), (3, 3 * 37, None), (2, 2 * 64, True)]


def _overhead_body(group, op):
    """On a one-rank world's device: each shape's case checked twice."""
    results = []
    for world, m, one_loop in SHAPES:
        case = trace_bench.OverheadCase(op, world, m, 40, 32, group.device, one_loop=one_loop)
        assert case.one_loop == bool(one_loop) or group.backend == "cuda"
        assert case.traced is not case.plain and case.traced.kwargs["TRACE"] is True
        checks = [case.check() for _ in range(2)]  # again: no counter left from the first
        assert case.kern.run.prepared is case.plain
        results.append((case.tiles, checks))
    return results


@pytest.mark.parametrize("op", list(trace_bench.OVERHEAD_CASES))
def test_overhead_case_is_checked(op):
    (results,) = get_world("cpu", 1).run(_overhead_body, op)
    assert len(results) == len(SHAPES)
    for tiles, checks in results:
        for err, written in checks:
            assert err < 1e-2
            assert written["tiles"] == tiles > 0
            assert written["waits"] > 0
