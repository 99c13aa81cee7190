"""Results files: ``merge`` brings a GPU machine's file into the results folder."""

from __future__ import annotations

import json

from interlace.__main__ import main
from interlace.bench.records import merge_file, write_records


def _doc(torch_version, records, date="2026-11-28"):
    return {"device": "NVIDIA H200", "world_size": 1, "torch": torch_version,
            "triton": "3.6.0", "date": date, "records": records}  # fmt: skip


def _rec(op, t, **extra):
    return {"op": op, "strategy": "fused", "M": 2048, "as_world": 2, "t_ms": t, **extra}


def test_merge_keeps_the_measured_versions_and_replaces_by_identity(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    dest = out / "2026-11-28-h200-w1.json"
    dest.write_text(json.dumps(_doc("2.10.0", [_rec("gemm_rs", 1.0), _rec("ag_gemm", 2.0)])))
    src = tmp_path / "from-gpu.json"
    src.write_text(json.dumps(_doc("2.11.0", [_rec("gemm_rs", 0.5), _rec("gemm_ar", 3.0)])))
    assert merge_file(str(src), str(out), plot=False) == str(dest)
    doc = json.loads(dest.read_text())
    assert (doc["torch"], doc["date"]) == ("2.11.0", "2026-11-28")  # the source's, not ours
    assert sorted((r["op"], r["t_ms"]) for r in doc["records"]) == [
        ("ag_gemm", 2.0), ("gemm_ar", 3.0), ("gemm_rs", 0.5)]  # fmt: skip
    assert "torch 2.10.0" in capsys.readouterr().out  # the versions changed: said


def test_merge_of_another_day_makes_that_days_file(tmp_path):
    src = tmp_path / "a.json"
    src.write_text(json.dumps(_doc("2.11.0", [_rec("gemm_rs", 0.5)], date="2026-11-20")))
    assert main(["merge", str(src), "--out", str(tmp_path / "r"), "--no-plot"]) == 0
    assert (tmp_path / "r" / "2026-11-20-h200-w1.json").exists()


def test_merge_refuses_what_is_not_a_results_file(tmp_path, capsys):
    src = tmp_path / "b.json"
    src.write_text(json.dumps({"records": []}))
    assert main(["merge", str(src), "--out", str(tmp_path), "--no-plot"]) == 2
    assert "not a results file" in capsys.readouterr().err


def test_write_records_names_the_given_versions(tmp_path):
    versions = {"torch": "2.11.0", "triton": "3.6.0"}
    recs = [_rec("gemm_rs", 1.0)]
    path = write_records(str(tmp_path), "NVIDIA H200", 2, recs, False, versions, "2026-11-01")
    doc = json.loads(open(path).read())
    assert path.endswith("2026-11-01-h200-w2.json") and doc["torch"] == "2.11.0"
