"""``bench host``'s per-op step on the CPU (2 ranks): an op that raises an interlace error
(on every rank, as the ops do) is reported with ``host_us: None`` and its error, and the
suite goes on to the next op; one that works reports the worst rank's times (in a loop of
calls and alone). The host clocks are replaced by fixed values per rank."""

from __future__ import annotations

import contextlib

from tests.conftest import get_world


def _body(group):
    from interlace.bench import host
    from interlace.errors import InterlaceValueError

    host.host_us = lambda group, fn, iters: (fn(), 3.0 + group.rank)[1]
    host.host_cold_us = lambda group, fn, iters: (fn(), 7.0 + group.rank)[1]

    class Ctx(contextlib.AbstractContextManager):
        method = "m"

        def __init__(self, fail):
            self.fail, self.calls = fail, 0

        def __call__(self):
            self.calls += 1
            if self.fail and self.calls == 2:
                raise InterlaceValueError("gemm_rs: peer never arrived")

        def check(self):
            pass

        def __exit__(self, *exc):
            return None

    bad = host._timed(group, lambda: Ctx(True), lambda ctx: ctx(), iters=3, warmup=2)
    good = host._timed(group, lambda: Ctx(False), lambda ctx: ctx(), iters=3, warmup=2)
    return bad, good


def test_a_failed_op_is_reported_and_the_next_runs():
    for bad, good in get_world("cpu", 2).run(_body):
        assert bad["host_us"] is None and "peer never arrived" in bad["error"]
        assert good.pop("host_other_us") >= 0  # (no step of the call path to time apart)
        assert good == {"method": "m", "host_us": 4.0, "host_cold_us": 8.0}


def test_one_gpu_runs_a_one_rank_world_then_a_shared_one(monkeypatch, tmp_path):
    """On one GPU: the host path alone (one rank), then two ranks sharing the GPU, whose
    records say so; both written to the one-GPU file."""
    import json

    import interlace.testing
    from interlace.bench import host

    worlds = []

    class FakeWorld(contextlib.AbstractContextManager):
        def __init__(self, n, backend, share_device=False, timeout=None):
            worlds.append((n, share_device))

        def run(self, fn, iters):
            return [[{"op": "ag_gemm", "strategy": "fused", "model": "m", "M": 8, "as_world": 1,
                      "host_us": 5.0 * len(worlds)}]]  # fmt: skip

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(interlace.testing, "World", FakeWorld)
    monkeypatch.setattr(host.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(host.torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    assert host.main(["--out", str(tmp_path), "--iters", "2"]) == 0
    assert worlds == [(1, False), (2, True)]
    (path,) = tmp_path.glob("*.json")
    recs = json.loads(path.read_text())["records"]
    assert [(r["host_us"], r.get("shared_gpu", False)) for r in recs] == [(5.0, False),
                                                                        (10.0, True)]  # fmt: skip
    assert recs[1]["variant"] == "shared_gpu"


def test_step_clock_times_the_call_path_steps_and_restores_them():
    """Each step is timed once per call; a step called inside another counts to the outer
    one; the instance's methods are the class's again afterwards."""
    import time

    from interlace.bench import host

    class Ctx:
        def _begin(self):
            time.sleep(0.002)

        def _check_call(self):
            self._begin()  # nested: counted to check, once
            time.sleep(0.001)

        def _enqueue(self):
            time.sleep(0.004)

        def __call__(self):
            self._check_call()
            self._enqueue()
            time.sleep(0.001)  # other

    ctx = Ctx()
    got = host.step_times(ctx, lambda c: c(), iters=5)
    assert set(got) == {"host_check_us", "host_enqueue_us", "host_other_us"}, got
    assert 2900 < got["host_check_us"] < 6000 and 3900 < got["host_enqueue_us"] < 8000, got
    assert 900 < got["host_other_us"] < 4000, got
    assert "_begin" not in vars(ctx) and "_enqueue" not in vars(ctx)
