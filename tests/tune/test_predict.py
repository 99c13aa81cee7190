"""The predictive wave-group search: the comm curve, the recurrence on synthetic curves,
partition enumeration and pruning, the exact search against brute force, the on-disk cache,
and ``best_partition`` / ``grade`` on a CPU world (all ranks agree, the cache is used)."""

from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import replace

import pytest

from interlace.errors import InterlaceValueError
from interlace.ops.signal_reorder import Layout
from interlace.tune import cache
from interlace.tune.search import (
    CommCurve,
    Model,
    best_partition,
    comm_time,
    enumerate_partitions,
    errors_without,
    exhaustive_candidates,
    grade,
    mean_abs_error,
    measure_model,
    predict,
)
from tests.conftest import get_world


# ----------------------------------------------------------------------------- the curve
def test_comm_curve_interpolates_and_extrapolates():
    c = CommCurve([100, 200, 400], [1.0, 1.5, 2.5])
    assert c.time_ms(50) == 1.0  # latency floor
    assert c.time_ms(100) == 1.0
    assert c.time_ms(150) == pytest.approx(1.25)
    assert c.time_ms(400) == pytest.approx(2.5)
    assert c.time_ms(800) == pytest.approx(4.5)  # last segment's bandwidth
    assert CommCurve.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert CommCurve([100], [2.0]).time_ms(300) == pytest.approx(6.0)
    for sizes, times in [([], []), ([1, 2], [1.0]), ([2, 1], [1.0, 1.0])]:
        with pytest.raises(InterlaceValueError):
            CommCurve(sizes, times)


# ----------------------------------------------------------------------------- recurrence
def test_recurrence_by_hand():
    # groups of 1, 2, 1 waves at 1 ms per wave; comm = 0.5 ms per byte
    comm = {1: 0.5, 2: 1.0, 6: 3.0}.get
    # t_p: 1, 3, 4; t_m: 1 + 0.5 = 1.5; max(3, 1.5) + 3 = 6; max(4, 6) + 0.5 = 6.5
    assert predict([1, 2, 1], [1, 6, 1], 1.0, comm) == pytest.approx(6.5)
    # communication bound: the tail is the sum of the comms after the first group
    assert predict([1, 1, 1], [6, 6, 6], 1.0, comm) == pytest.approx(1 + 9)
    # compute bound: the last group's comm is the tail
    assert predict([1, 1, 1], [1, 1, 1], 1.0, comm) == pytest.approx(3.5)
    # host terms: the GEMM starts at 0.5; group i is enqueued at 0.5 + 2 (i + 1)
    # t_p 1.5, 2.5, 3.5; t_m max(1.5, 2.5) + .5 = 3, max(2.5, 3, 4.5) + .5 = 5, 7
    assert predict([1, 1, 1], [1, 1, 1], 1.0, comm, 0.5, 2.0) == pytest.approx(7.0)


def test_comm_time_beside_the_gemm_then_alone():
    loaded, free = (lambda n: 4.0), (lambda n: 2.0)
    assert comm_time(1, 0.0, 10.0, loaded, free) == 4.0  # ends before the GEMM does
    assert comm_time(1, 12.0, 10.0, loaded, free) == 2.0  # starts after it
    # 2 ms beside the GEMM do half the work at the loaded pace, the rest goes at the free one
    assert comm_time(1, 8.0, 10.0, loaded, free) == pytest.approx(2.0 + 0.5 * 2.0)
    assert comm_time(1, 12.0, 10.0, loaded) == 4.0  # one curve: the loaded pace throughout
    ends = [t / 10 + comm_time(1, t / 10, 10.0, loaded, free) for t in range(0, 140)]
    assert all(b >= a - 1e-12 for a, b in zip(ends, ends[1:]))  # a later start never ends earlier
    # the recurrence: the GEMM ends at 2 ms; group 0 starts at 1 (a quarter done by 2,
    # then 0.75 * 2 ms), group 1 at 3.5 (free pace)
    assert predict([1, 1], [1, 1], 1.0, loaded, free_ms=free) == pytest.approx(5.5)
    assert predict([1, 1], [1, 1], 1.0, loaded) == pytest.approx(9.0)


def _compositions(n):
    for cuts in itertools.product([0, 1], repeat=n - 1):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield (*sizes, run)


@pytest.mark.parametrize("n", range(1, 10))
def test_enumeration_is_the_pruned_compositions(n):
    got = list(enumerate_partitions(n))
    assert len(got) == len(set(got))
    want = {p for p in _compositions(n) if p[0] <= 2 and p[-1] <= 4}
    assert set(got) == want
    assert all(sum(p) == n for p in got)
    assert set(enumerate_partitions(n, max_first=n, max_last=n)) == set(_compositions(n))


def _model(rng, n_waves, programs=7, world=2):
    tiles = programs * n_waves - rng.randrange(programs)  # a partial last wave
    lay = Layout("all_reduce", m=32 * tiles, n=32, world=world, block_m=32, block_n=32,
                 programs=programs)  # fmt: skip
    assert lay.n_waves == n_waves
    # a latency + bandwidth curve, sometimes comm bound, sometimes compute bound
    sizes = [1 << s for s in range(10, 22)]
    lat, bw = rng.uniform(0.01, 0.3), rng.uniform(2e4, 4e5)
    curve = CommCurve(sizes, [lat + s / bw for s in sizes])
    host = rng.choice([0.0, rng.uniform(0, 0.2)])  # sometimes the host is the bottleneck
    # mostly a faster curve for the collective alone (after the GEMM)
    speed = rng.uniform(1.0, 2.0)
    free = CommCurve(sizes, [lat / speed + s / (bw * speed) for s in sizes])
    return Model(lay, 2, rng.uniform(0.05, 0.5), curve, post_ms=rng.uniform(0, 0.1),
                 gemm_ms=rng.uniform(0.5, 5), host0_ms=2 * host, host_ms=host,
                 free_curve=free if rng.random() < 0.7 else None)  # fmt: skip


def test_search_is_exact_on_synthetic_curves():
    rng = random.Random(0)
    for trial in range(120):
        model = _model(rng, rng.randrange(1, 11))
        ranked = model.ranked()
        t, p = model.best_predicted()
        assert t == pytest.approx(ranked[0][0]), (trial, p, ranked[0])
        assert model.predict(p) == pytest.approx(t)
        assert sum(p) == model.layout.n_waves


def test_model_prediction_parts():
    rng = random.Random(1)
    model = _model(rng, 5)
    lay = model.layout
    assert model.free_curve is not None
    # a single group is cuBLAS + the whole collective, alone
    total = lay.n_tiles * lay.unit * 2
    assert model.group_bytes([5]) == [total]
    assert model.predict([5]) == pytest.approx(model.gemm_ms + model.free_curve.time_ms(total))
    # several: the recurrence plus the reorder; the last group holds the partial wave
    sizes = model.group_bytes([2, 2, 1])
    assert sum(sizes) == total and sizes[0] == 2 * lay.programs * lay.unit * 2
    want = predict([2, 2, 1], sizes, model.wave_ms, model.curve.time_ms, model.host0_ms,
                   model.host_ms, model.free_curve.time_ms) + model.post_ms  # fmt: skip
    assert model.predict([2, 2, 1]) == pytest.approx(want)
    one = predict([2, 2, 1], sizes, model.wave_ms, model.curve.time_ms, model.host0_ms,
                  model.host_ms) + model.post_ms  # fmt: skip
    assert want <= one  # the free pace is the faster one here


def test_errors_without_the_free_curve():
    model = _model(random.Random(1), 5)
    parts = [(5,), (2, 2, 1), (1, 3, 1)]
    rows = [{"partition": list(p), "measured_ms": model.predict(p)} for p in parts]
    errs = errors_without(model, rows)
    # the measurements are the model's own predictions: the ablation is off by what the
    # free curve changes
    one = replace(model, free_curve=None)
    want = sum(abs(one.predict(p) / model.predict(p) - 1) for p in parts) / 3
    assert errs == {"one_curve": pytest.approx(want)} and want > 0


def test_exhaustive_candidates():
    model = _model(random.Random(2), 9)
    all_ranked = [p for _, p in model.ranked()]
    assert len(all_ranked) == 181  # 180 pruned compositions + the single group
    cands = exhaustive_candidates(model, limit=20)
    assert len(cands) == 20 and len(set(cands)) == 20
    assert cands[:10] == all_ranked[:10]
    assert exhaustive_candidates(model, limit=500) == all_ranked
    rows = [{"predicted_ms": 1.0, "measured_ms": 2.0}, {"predicted_ms": 3.0, "measured_ms": 3.0}]
    assert mean_abs_error(rows) == pytest.approx(0.25)


# ----------------------------------------------------------------------------- cache
def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERLACE_CACHE_DIR", str(tmp_path))
    assert cache.cache_dir() == tmp_path
    key = cache.cache_key("partition", m=8192, n=4096, dtype="torch.bfloat16", world=4)
    assert key == cache.cache_key("partition", world=4, dtype="torch.bfloat16", n=4096, m=8192)
    other = cache.cache_key("partition", m=8192, n=4096, dtype="torch.bfloat16", world=2)
    assert key != other
    assert cache.load(key) is None
    path = cache.store(key, [1, 3, 3, 2])
    assert path.parent == tmp_path and path.name.startswith("partition-")
    assert cache.load(key) == [1, 3, 3, 2]
    assert cache.load(other) is None
    cache.store(key, {"a": 1.5})  # overwrite
    assert cache.load(key) == {"a": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left
    path.write_text("{not json")
    assert cache.load(key) is None
    monkeypatch.delenv("INTERLACE_CACHE_DIR")
    assert cache.cache_dir() == cache.Path.home() / ".cache" / "interlace"


# ----------------------------------------------------------------------------- on a world
def _tune_body(group, cache_dir):
    from interlace.ops.signal_reorder import SignalReorderGemmAR, SignalReorderGemmRS

    saved = os.environ.get("INTERLACE_CACHE_DIR")
    os.environ["INTERLACE_CACHE_DIR"] = cache_dir  # this rank process serves later tests too
    w = group.world_size
    out = {}
    ar = SignalReorderGemmAR(group, max_m=8 * 37, n=64, k=24)
    rs = SignalReorderGemmRS(group, max_m=8 * 37, n=40, k=24)
    try:
        m = 8 * 37
        p = best_partition(ar, m, iters=1, warmup=0)
        assert sum(p) == ar.waves(m) and tuple(p) == ar.partition_for(m)
        files = sorted(os.listdir(cache_dir)) if group.rank == 0 else None
        assert best_partition(ar, m, iters=1, warmup=0) == p  # from the cache
        if group.rank == 0:
            assert sorted(os.listdir(cache_dir)) == files
        model = measure_model(ar, m, iters=1, warmup=0)
        assert model.layout == ar.layout(m) and model.wave_ms > 0 and model.post_ms > 0
        rows = grade(ar, m, [p, [ar.waves(m)]], model=model, iters=1, warmup=0)
        assert [r["partition"] for r in rows] == [p, [ar.waves(m)]]
        assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
        assert rs.waves(37 * w) > 1
        q = best_partition(rs, 37 * w, mode="exhaustive", iters=1, warmup=0, limit=3,
                           use_cache=False)  # fmt: skip
        assert sum(q) == rs.waves(37 * w) and tuple(q) == rs.partition_for(37 * w)
        out = {"p": p, "q": q, "files": files}
    finally:
        ar.close()
        rs.close()
        if saved is None:
            os.environ.pop("INTERLACE_CACHE_DIR")
        else:
            os.environ["INTERLACE_CACHE_DIR"] = saved
    return out


def test_best_partition_on_cpu_world(tmp_path):
    results = get_world("cpu", 2).run(_tune_body, str(tmp_path))
    assert results[0]["p"] == results[1]["p"] and results[0]["q"] == results[1]["q"]
    kinds = {name.split("-")[0] for name in results[0]["files"]}
    assert kinds == {"comm_curve", "gemm_waves", "partition"}


def _curves_body(group):
    """The measured model: on a GPU a curve beside the GEMM and one alone, both
    non-decreasing; on the cpu backend one curve."""
    from interlace.ops.signal_reorder import SignalReorderGemmAR

    m = 8 * 37 if group.backend == "cpu" else 4096
    n, k = (64, 24) if group.backend == "cpu" else (4096, 512)
    ar = SignalReorderGemmAR(group, max_m=m, n=n, k=k)
    try:
        assert ar.waves(m) > 1  # the loaded curve needs a GEMM of several waves
        model = measure_model(ar, m, iters=2, warmup=1, use_cache=False)
        curves = [model.curve] + ([model.free_curve] if model.free_curve else [])
        assert (len(curves) == 2) == (group.backend == "cuda")
        for c in curves:
            assert all(t > 0 for t in c.times_ms)
            assert c.times_ms == sorted(c.times_ms)
            assert c.sizes[-1] >= model.layout.group_bytes(model.layout.n_tiles, 2)
        t, p = model.best_predicted()
        assert t > 0 and sum(p) == ar.waves(m)
    finally:
        ar.close()
    return True


@pytest.mark.own_gpu
def test_measure_model_curves(world):
    world.run(_curves_body)


def test_monotone_curve_drops_small_size_outliers():
    from interlace.tune.search import monotone

    assert monotone([2.5, 0.26, 0.27, 0.08, 0.09, 0.4]) == [0.08, 0.08, 0.08, 0.08, 0.09, 0.4]
    assert monotone([0.1, 0.2, 0.3]) == [0.1, 0.2, 0.3]
