"""``python -m interlace``: suite dispatch, the default suites per machine, the numpy check
of the CPU emulation, ``plot``, and the kernel suite's record format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from interlace import __main__ as cli
from interlace.bench import kernels
from interlace.bench.cli import numpy_problem
from tests.bench._helpers import fake_suite


def test_every_suite_dispatches_to_its_module(monkeypatch):
    seen = fake_suite(monkeypatch, "kernels", 3)
    assert cli.main(["bench", "kernels", "--quick", "--out", "x"]) == 3
    assert seen == [["--quick", "--out", "x"]]
    assert cli.main(["bench", "--suite", "kernels", "--iters", "2"]) == 3  # older spelling
    assert seen[-1] == ["--iters", "2"]


def test_a_missing_suite_says_so(capsys):
    if cli.suite_main("trace") is None:  # (until the trace suite exists)
        assert cli.main(["bench", "trace"]) == 2
        assert "bench trace: not available in this version" in capsys.readouterr().out
    assert cli.main(["bench", "no_such_suite"]) == 2
    assert "unknown suite" in capsys.readouterr().err


def test_the_suites_that_exist_have_a_main():
    for name in ("dense", "collectives", "p2p_ring", "signal_reorder", "shared", "kernels",
                 "host"):  # fmt: skip
        assert callable(cli.suite_main(name)), name


def test_default_suites_per_machine():
    assert cli.default_suites(0) == ("collectives", "dense")  # the CPU emulation
    assert cli.default_suites(1) == ("shared", "kernels", "host")
    assert cli.default_suites(8) == ("collectives", "dense")


def test_one_gpu_default_says_what_it_cannot_show(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(cli, "run_suite", lambda name, argv: ran.append((name, argv)) or 0)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert cli.main(["bench", "--quick"]) == 0
    assert ran == [(s, ["--quick"]) for s in ("shared", "kernels", "host")]
    assert capsys.readouterr().out.strip().endswith("cross-GPU overlap needs two or more GPUs")


def test_numpy_check():
    assert numpy_problem("2.2.6") is None
    assert numpy_problem("1.26.4") is None
    message = numpy_problem("2.3.0")
    assert message and 'pip install "numpy<2.3"' in message
    assert numpy_problem("2.4.1rc1")


def test_emulation_refuses_a_bad_numpy(monkeypatch, capsys):
    import numpy

    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    assert cli.main(["bench", "--cpu"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "numpy<2.3"' in err and "Traceback" not in err


def test_usage_and_plot_errors(tmp_path, capsys):
    assert cli.main([]) == 2
    assert "usage" in capsys.readouterr().out
    doc = {"device": "d", "world_size": 1, "date": "2026-01-01", "records": []}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert cli.main(["plot", str(path)]) == 2
        assert "matplotlib" in capsys.readouterr().err
    else:
        assert cli.main(["plot", str(path)]) == 0


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "interlace"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stdout


def test_kernel_cases_and_record_format():
    todo = kernels.cases(["llama-7b"], [2048], [2, 4])
    assert {(c[0], c[1]) for c in todo} == {(op, s) for op, s, _ in kernels.KERNELS} | {
        ("ag_gemm", "plain"),
        ("gemm_rs", "plain"),
    }
    ag = next(c for c in todo if c[0] == "ag_gemm" and c[7] == 4)
    assert ag[4:7] == (2048, 11008 // 4, 4096)  # M, I / W, H: the GEMM of one rank
    rs = next(c for c in todo if c[0] == "gemm_rs" and c[7] == 2)
    assert rs[4:7] == (2048, 4096, 11008 // 2)
    plain = [c for c in todo if c[1] == "plain"]
    assert len(plain) == len({c[3:] for c in plain}) == 4  # each per-rank shape once
    # named after the op whose per-rank GEMM it is (AG+GEMM's: I / W columns)
    assert {(c[0], c[5]) for c in plain} == {("ag_gemm", 11008 // 2), ("ag_gemm", 11008 // 4),
                                             ("gemm_rs", 4096)}  # fmt: skip
    rec = kernels.record("gemm_rs", "fused", "llama-7b", 2048, 4096, 5504, 2, 0.31, 0.25, 1e-3)
    for key, value in {"as_world": 2, "waits_met": True, "ref": "cublas", "t_ms": 0.31,
                       "t_ref_ms": 0.25, "ok": True}.items():  # fmt: skip
        assert rec[key] == value, key
    assert not kernels.record("gemm_rs", "plain", "m", 1, 1, 1, 2, None, None, None)["ok"]


def _kernels_body(group):
    return kernels.run_cases(
        group, [("gemm_ar", "fused", "ar_fused", "tiny", 74, 40, 24, 2),
                ("gemm_ar", "signal_reorder", None, "tiny", 74, 40, 24, 2)], timed=False,
    )  # fmt: skip


def test_kernel_suite_checks_on_the_interpreter():
    from tests.conftest import get_world

    (records,) = get_world("cpu", 1).run(_kernels_body)
    assert [r["strategy"] for r in records] == ["fused", "signal_reorder"]
    assert all(r["ok"] and r["t_ms"] is None and r["waits_met"] for r in records), records


@pytest.mark.parametrize("name", ["shared", "host"])
def test_gpu_only_suites_skip_without_a_gpu(name, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    assert cli.main(["bench", name]) == 0
    assert "needs a GPU" in capsys.readouterr().out


@pytest.mark.parametrize("suite", ["moe", "ep", "attention", "decode", "model"])
def test_several_only_is_accepted_by_every_several_gpu_suite(suite):
    """``gpu_suite.sh`` passes its extra arguments to every suite: each several-GPU suite
    must parse ``--several-only``, and it skips the one-GPU part only on 2+ GPUs."""
    import argparse
    import importlib

    from interlace.bench.cli import add_several_only, runs_one_gpu

    source = importlib.import_module(f"interlace.bench.{suite}").main.__code__.co_names
    assert "add_several_only" in source
    p = argparse.ArgumentParser()
    add_several_only(p)
    on, off = p.parse_args(["--several-only"]), p.parse_args([])
    assert runs_one_gpu(off, 4) and runs_one_gpu(off, 1) and runs_one_gpu(on, 1)
    assert not runs_one_gpu(on, 2)
