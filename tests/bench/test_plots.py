"""The results figures: which yardstick each kind of record is drawn against, and one
figure per op (plus ``<op>-host`` for host times) written beside the JSON."""

from __future__ import annotations

import json

import pytest

from interlace.bench.plots import _series, plot_file

SEVERAL_GPU = [
    # MoE: time / bound, with the none baseline
    dict(op="ag_moe", strategy="fused", H=2048, t_ms=0.5, t_none_ms=1.0, t_bound_ms=0.25,
         host_us=300.0),
    # attention: time / this rank's kernels alone, with ring and none
    dict(op="sp_attention", strategy="fused", S=16384, t_ms=3.0, t_kernel_ms=2.0,
         t_ring_ms=6.0, t_none_ms=4.0),
    # the model: step time / torch TP, with the compiled and async-TP variants
    dict(op="model", strategy="auto", tokens=2048, mode="train", t_ms=20.0,
         t_torch_tp_ms=40.0, t_interlace_compiled_ms=16.0, t_torch_async_tp_ms=12.0),
    # EP: time / NCCL
    dict(op="ep_dispatch", strategy="symm", tokens=4096, t_ms=1.0, t_nccl_ms=2.0,
         host_us=50.0),
    # decode: time / none
    dict(op="flash_decode", strategy="fused", batch=1, t_ms=0.1, t_none_ms=0.5),
]  # fmt: skip


def _by(op):
    return [r for r in SEVERAL_GPU if r["op"] == op]


def test_each_record_kind_has_its_yardstick():
    title, s = _series(_by("ag_moe"))
    assert "bound" in title and s["fused"] == {"H=2048": 2.0}
    assert s["none (baseline)"] == {"H=2048": 4.0}
    title, s = _series(_by("sp_attention"))
    assert "kernels alone" in title
    assert (s["fused"]["S=16384"], s["ring"]["S=16384"], s["none (baseline)"]["S=16384"]) == (
        1.5, 3.0, 2.0
    )  # fmt: skip
    title, s = _series(_by("model"))
    assert "torch TP" in title
    assert s["interlace"] == {"tokens=2048 train": 0.5}
    assert s["interlace compiled"] == {"tokens=2048 train": 0.4}
    assert s["torch async TP"] == {"tokens=2048 train": 0.3}
    title, s = _series(_by("ep_dispatch"))
    assert title == "time / NCCL" and s["symm"] == {"tokens=4096": 0.5}
    title, s = _series(_by("flash_decode"))
    assert "none" in title and s["fused"] == {"batch=1": 0.2}
    title, s = _series(_by("ep_dispatch"), host=True)
    assert title.startswith("host") and s["symm"] == {"tokens=4096": 50.0}


def test_plot_file_draws_times_and_host_times(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "2026-01-01-h200-w4.json"
    doc = {"device": "NVIDIA H200", "world_size": 4, "date": "2026-01-01",
           "records": SEVERAL_GPU}  # fmt: skip
    path.write_text(json.dumps(doc))
    written = sorted(p.rsplit("-w4-", 1)[1] for p in plot_file(str(path)))
    assert written == sorted([
        "ag_moe.png", "ag_moe-host.png", "sp_attention.png", "model.png", "ep_dispatch.png",
        "ep_dispatch-host.png", "flash_decode.png",
    ])  # fmt: skip
