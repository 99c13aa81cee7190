"""The dense-op benchmark: its shape table, record math and merge keys, and the CPU check
(baselines against the fp32 reference; every strategy of each op that exists)."""

from __future__ import annotations

import json

import pytest
import torch

import interlace
from interlace.__main__ import main
from interlace.bench import dense
from interlace.bench.records import record_key
from interlace.bench.records import write_records as write_results
from interlace.testing.world import WorldError
from tests.conftest import get_world


# ----------------------------------------------------------------------------- shape table
@pytest.mark.parametrize("world", [2, 4, 8])
def test_shape_table_n_k_per_op(world):
    for model, (hidden, inter) in dense.MODELS.items():
        for m in dense.MS:
            ag = dense.model_shape("ag_gemm", model, m, world)
            assert (ag.M, ag.N, ag.K) == (m, inter // world, hidden)
            for op in ("gemm_rs", "gemm_ar"):
                s = dense.model_shape(op, model, m, world)
                assert (s.M, s.N, s.K) == (m, hidden, inter // world)


def test_shape_table_contents():
    table = dense.shape_table(list(dense.OPS), list(dense.MODELS), list(dense.MS), 4)
    assert len(table) == 3 * 3 * 2
    assert {s.model for s in table} == {"llama-7b", "llama3-8b", "llama3-70b"}
    assert {s.M for s in table} == {2048, 8192}
    s = dense.model_shape("ag_gemm", "llama3-70b", 8192, 4)
    assert (s.N, s.K) == (7168, 8192)  # the docs/design.md example record


def test_shape_table_rejects_bad_input():
    with pytest.raises(ValueError, match="divisible"):
        dense.model_shape("gemm_rs", "llama-7b", 2048, 3)
    with pytest.raises(ValueError, match="unknown model"):
        dense.model_shape("gemm_rs", "gpt-2", 2048, 2)
    with pytest.raises(ValueError, match="unknown op"):
        dense.model_shape("gemm_xx", "llama-7b", 2048, 2)


def test_cpu_shapes_are_ragged():
    for w in (2, 3, 4):
        for s in dense.cpu_shapes(list(dense.OPS), w):
            assert s.M % w == 0 and (s.M // w) % 16 and s.N % 16 and s.K % 16


# ----------------------------------------------------------------------------- records
SHAPE = dense.Shape("gemm_rs", "llama3-8b", 8192, 4096, 3584)
TIMES = {"t_ms": 1.25, "t_graph_ms": 1.1, "t_none_ms": 1.5, "t_torch_ms": None,
         "t_gemm_ms": 1.0, "t_comm_ms": 0.4}  # fmt: skip


def test_record_bound_and_efficiency():
    r = dense.make_record(SHAPE, "fused", "bfloat16", TIMES, 3e-3, "fused")
    assert r["bound_ms"] == 1.0
    assert r["efficiency"] == 0.8
    assert r["graph_efficiency"] == round(1.0 / 1.1, 3)
    assert r["t_torch_ms"] is None and r["ok"] and r["last_strategy"] == "fused"
    assert (r["op"], r["model"], r["M"], r["N"], r["K"]) == (
        "gemm_rs",
        "llama3-8b",
        8192,
        4096,
        3584,
    )
    assert "note" not in r
    comm_bound = dense.make_record(SHAPE, "fused", "bfloat16", {**TIMES, "t_comm_ms": 2.5}, 0.0)
    assert comm_bound["bound_ms"] == 2.5 and comm_bound["efficiency"] == 2.0


def test_record_unmeasured_and_failed():
    r = dense.make_record(SHAPE, "auto", "bfloat16", {}, 0.0)
    assert r["bound_ms"] is None and r["efficiency"] is None and r["graph_efficiency"] is None
    assert all(r[k] is None for k in dense.TIME_KEYS)
    bad = dense.make_record(SHAPE, "auto", "bfloat16", TIMES, 3e-2, notes=["a", "b"])
    assert not bad["ok"] and bad["note"] == "a; b"
    assert not dense.make_record(SHAPE, "auto", "bfloat16", TIMES, None)["ok"]
    assert dense.make_record(SHAPE, "auto", "bfloat16", TIMES, dense.MAX_REL_ERR)["ok"]


def test_merge_keys():
    r = dense.make_record(SHAPE, "fused", "bfloat16", TIMES, 0.0)
    assert record_key(r) == record_key({**r, "t_ms": 0.1})  # what it measured, not how fast
    assert record_key(r) != record_key({**r, "K": 7168})
    assert record_key(r) != record_key({**r, "strategy": "none"})
    coll = {"op": "all_gather", "strategy": "ce_pull", "bytes_per_rank": 1 << 20}
    assert record_key(coll) != record_key({**coll, "bytes_per_rank": 2 << 20})


def test_write_results_merges(tmp_path):
    old = dense.make_record(SHAPE, "fused", "bfloat16", TIMES, 0.0)
    other = dense.make_record(SHAPE, "none", "bfloat16", TIMES, 0.0)
    coll = {"op": "all_gather", "strategy": "ce_pull", "bytes_per_rank": 1 << 20, "t_ms": 1.0}
    path = write_results(str(tmp_path), "NVIDIA H200", 4, [old, other, coll], plot=False)
    assert path.endswith("-h200-w4.json")
    new = {**old, "t_ms": 0.9}
    path2 = write_results(str(tmp_path), "NVIDIA H200", 4, [new, {**coll, "t_ms": 0.5}], plot=False)
    assert path2 == path
    doc = json.load(open(path))
    assert doc["device"] == "NVIDIA H200" and doc["world_size"] == 4
    assert len(doc["records"]) == 3
    by_strategy = {r["strategy"]: r["t_ms"] for r in doc["records"]}
    assert by_strategy == {"fused": 0.9, "none": 1.25, "ce_pull": 0.5}


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        main(["bench", "dense", "--models", "gpt-2"])
    with pytest.raises(SystemExit):
        main(["bench", "dense", "--ops", "gemm_xx"])
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "dense", "--dense-ops", "gemm_xx"])


# ----------------------------------------------------------------------------- CPU check
def _max_body(group):
    r = group.rank
    return dense.max_over_ranks(group, {"x": None if r == 0 else 2.0, "y": float(r)})


def test_max_over_ranks_keeps_unmeasured():
    world = get_world("cpu", 2)
    assert world.run(_max_body) == [{"x": None, "y": 1.0}] * 2


def _shape_body(group, op, strategies):
    (shape,) = dense.cpu_shapes([op], group.world_size)
    return dense.run_shape(group, shape, strategies, timed=False)


@pytest.mark.parametrize("op", list(dense.OPS))
def test_baselines_match_reference(op):
    # no strategies: only the cuBLAS + NCCL sequence against the fp32 reference
    assert get_world("cpu", 2).run(_shape_body, op, []) == [[], []]


@pytest.mark.parametrize("op", list(dense.OPS))
def test_every_strategy_matches_reference(op):
    if dense.op_class(op) is None:
        pytest.skip(f"interlace.{dense.OPS[op]} does not exist yet")
    strategies = dense.strategies_of(op)
    per_rank = get_world("cpu", 2).run(_shape_body, op, strategies)
    assert per_rank[0] == per_rank[1]
    assert [r["strategy"] for r in per_rank[0]] == strategies
    for r in per_rank[0]:
        assert r["ok"], r
        assert r["t_ms"] is None and r["rel_err"] <= dense.MAX_REL_ERR


class _FakeOp:
    """Stands in for an op context: the baseline sequence, or a wrong result ('broken')."""

    STRATEGIES = ("auto", "none", "broken")
    op = ""

    def __init__(self, group, max_m, n, k, dtype=torch.bfloat16, strategy="auto"):
        self.group, self.strategy, self.last_strategy = group, strategy, None

    def __call__(self, a, b, bias=None, out=None):
        *_, none, result = dense.baselines(self.group, self.op, a, b)
        none()
        self.last_strategy = "none"
        if self.strategy == "broken":
            result = result * 1.1
        return out.copy_(result) if out is not None else result

    def close(self):
        pass


def _fake_body(group, op, strategies):
    name = dense.OPS[op]
    saved = getattr(interlace, name, None)
    setattr(interlace, name, type(name, (_FakeOp,), {"op": op}))
    try:
        return _shape_body(group, op, strategies)
    finally:
        setattr(interlace, name, saved)


@pytest.mark.parametrize("op", list(dense.OPS))
def test_strategy_path_with_a_fake_op(op):
    world = get_world("cpu", 2)
    rows = world.run(_fake_body, op, ["auto", "none"])[0]
    assert [r["strategy"] for r in rows] == ["auto", "none"]
    assert all(r["ok"] and r["last_strategy"] == "none" for r in rows)
    with pytest.raises(WorldError, match="broken: relative error"):
        world.run(_fake_body, op, ["broken"])


def test_cli_dense_cpu(capsys):
    rc = main(["bench", "dense", "--cpu", "--world-size", "2", "--ops", "gemm_ar",
               "--strategies", "none"])  # fmt: skip
    assert rc == 0
    assert "match their references" in capsys.readouterr().out


def test_strategy_variants_for_the_ablation():
    from interlace.bench.dense import split_variant, strategies_of

    assert split_variant("fused") == ("fused", {})
    assert split_variant("sm_pull:comm_sms=8+split=2") == ("sm_pull", {"comm_sms": 8, "split": 2})
    assert split_variant("auto:eager_graphs=1") == ("auto", {"eager_graphs": 1})
    with pytest.raises(ValueError, match="options are"):
        split_variant("fused:warps=4")
    with pytest.raises(ValueError, match="options are"):
        split_variant("fused:split=x")
    # variants are kept for the ops whose strategy they name
    assert strategies_of("ag_gemm", ["fused:split=4", "sm_pull:comm_sms=8", "signal_reorder"]) == [
        "fused:split=4",
        "sm_pull:comm_sms=8",
    ]
    assert strategies_of("gemm_rs", ["sm_pull:comm_sms=8", "fused:split=1"]) == ["fused:split=1"]
    # how GEMM+AR ce_fused gathers: an option of GEMM+AR alone
    assert split_variant("ce_fused:gather=epilogue") == ("ce_fused", {"gather": "epilogue"})
    with pytest.raises(ValueError, match="options are"):
        split_variant("ce_fused:gather=nccl")
    both = ["ce_fused:gather=epilogue", "ce_fused:split=2"]
    assert strategies_of("gemm_ar", both) == both
    assert strategies_of("gemm_rs", both) == ["ce_fused:split=2"]


def test_write_results_completes_and_refuses_records(tmp_path):
    """Every written record has op, strategy and t_ms (None where no time was measured);
    a record without op or strategy is refused."""
    host = {"op": "x", "strategy": "s", "host_us": 3.0}
    path = write_results(str(tmp_path), "cpu", 1, [host], plot=False)
    (rec,) = json.load(open(path))["records"]
    assert rec["t_ms"] is None and rec["host_us"] == 3.0
    with pytest.raises(ValueError, match="strategy"):
        write_results(str(tmp_path), "cpu", 1, [{"op": "x", "t_ms": 1.0}], plot=False)
