"""The sequence-parallel attention kernels against another version of their source, in one
process: each kernel (forward, dK / dV, dQ) of ``bench attention``'s per-rank problem
(rank 0 of W, every wait met, checked against float32) timed with the library's
``interlace/kernels/attention.py`` (A) and with the file given by ``--variant`` (B, e.g.
an earlier revision saved with ``git show REV:interlace/kernels/attention.py``), the two
interleaved (``bench.timing.paired_median_ms``), for each config of ``--configs``.

B's module is the variant file with its relative imports made absolute; the launches of
``ops.attention.sp_attention`` take it while B runs. Prints the times and B / A per
kernel, config and causal mode; ``--out FILE`` keeps them (JSON).

``--hopper``: the Hopper forward instead (``kernels/attention_hopper.py``; ``--variant``
optional, configs ignored); ``--set NAME=VALUE`` sets ``sp_attention``'s ``HOPPER_*``
constants while B runs (e.g. ``HOPPER_CONSUMER_REGS=232``).

    python benchmarks/probes/attention_ab.py --variant old_attention.py \\
        --configs dkdv:64,64,4,2,0,1 fwd:128,128,8,3,0,0 [--seqs 16384] [--out FILE]
    python benchmarks/probes/attention_ab.py --hopper --variant old_hopper.py
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path


def load_variant(path: str):
    """The kernels module from ``path``, its ``from ..x`` imports made ``interlace.x``."""
    src = Path(path).read_text()
    src = re.sub(r"from \.\.(\w)", r"from interlace.\1", src)
    src = re.sub(r"from \.(\w)", r"from interlace.kernels.\1", src)
    # Triton reads a kernel's source from its file: the rewritten module gets one
    tmp = Path(tempfile.mkdtemp()) / "attention_variant.py"
    tmp.write_text(src)
    spec = importlib.util.spec_from_file_location("attention_variant", tmp)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attention_variant"] = mod
    spec.loader.exec_module(mod)
    return mod


def parse_config(text: str):
    """``kernel:block_m,block_n,warps,stages,ws,fast_exp[,maxnreg]`` -> (kernel, cfg)."""
    from interlace.ops.attention.sp_attention import AttnConfig

    kernel, fields = text.split(":")
    v = [int(x) for x in fields.split(",")]
    return kernel, AttnConfig(v[0], v[1], v[2], v[3], bool(v[4]), v[5], *v[6:])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default=None, help="B: a version of the kernels' file")
    p.add_argument("--configs", nargs="*", default=[], help="kernel:fields (see above)")
    p.add_argument("--hopper", action="store_true", help="the Hopper forward (see above)")
    p.add_argument("--set", nargs="*", default=[], help="B's HOPPER_* constants, NAME=VALUE")
    p.add_argument("--seqs", nargs="*", type=int, default=[16384])
    p.add_argument("--causal", nargs="*", type=int, default=[0, 1])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from interlace.bench.attention import _PerRank
    from interlace.bench.timing import paired_median_ms
    from interlace.ops.attention import sp_attention as sp

    if args.hopper:
        return hopper_ab(args, sp)
    lib, variant = sp.K, load_variant(args.variant)

    def with_kernels(mod, fn):
        def run():
            sp.K = mod
            try:
                fn()
            finally:
                sp.K = lib

        return run

    rows = []
    for s in args.seqs:
        for causal in args.causal:
            per = _PerRank(s, bool(causal))
            for text in args.configs:
                kernel, cfg = parse_config(text)
                cfg_kw = {"fwd": "cfg", "dkdv": "cfg_dkdv", "dq": "cfg_dq"}[kernel]
                errs = {}
                for name, mod in (("A", lib), ("B", variant)):
                    errs[name] = _errors(per, mod, lib, sp, cfg_kw, cfg)
                fn = {"fwd": per.fwd, "dkdv": per.dkdv, "dq": per.dq_only}[kernel]
                per.flags_up()
                t_a, t_b = paired_median_ms(
                    None,
                    [with_kernels(lib, functools.partial(fn, cfg=cfg)),
                     with_kernels(variant, functools.partial(fn, cfg=cfg))],
                    iters=args.iters, warmup=3,
                )  # fmt: skip
                row = dict(
                    S=s, causal=bool(causal), kernel=kernel, config=text, t_a_ms=round(t_a, 4),
                    t_b_ms=round(t_b, 4), b_over_a=round(t_b / t_a, 4), errors=errs,
                )  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            del per
            torch.cuda.empty_cache()
    return _report(rows, args.out)


def _report(rows, out) -> int:
    """The table of A and B times; ``out``: the rows as JSON too."""
    print(f"{'S':>6} {'causal':<6} {'config':<28} {'A ms':>8} {'B ms':>8} {'B/A':>6}")
    for r in rows:
        print(f"{r['S']:>6} {r['causal']!s:<6} {r['config']:<28} {r['t_a_ms']:8.3f} "
              f"{r['t_b_ms']:8.3f} {r['b_over_a']:6.3f}")  # fmt: skip
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
    return 0


def hopper_ab(args, sp) -> int:
    """The Hopper forward, A (the library) against B (``--variant`` and ``--set``)."""
    import torch

    from interlace.bench.attention import _PerRank
    from interlace.bench.timing import paired_median_ms

    lib = sp.KH
    variant = load_variant(args.variant) if args.variant else lib
    sets = {k: int(v) for k, v in (x.split("=") for x in args.set)}

    def swap(mod, values):
        old = {k: getattr(sp, k) for k in values}
        sp.KH = mod
        for k, v in values.items():
            setattr(sp, k, v)
        return old

    def run_as(mod, values, fn):
        def run():
            old = swap(mod, values)
            try:
                return fn()
            finally:
                swap(lib, old)

        return run

    rows = []
    for s in args.seqs:
        for causal in args.causal:
            per = _PerRank(s, bool(causal))
            assert sp.hopper_forward(per.args, per.q)
            errs = {"A": per.check()["rel_err"]}
            errs["B"] = run_as(variant, sets, per.check)()["rel_err"]
            per.flags_up()
            t_a, t_b = paired_median_ms(
                None, [per.fwd, run_as(variant, sets, per.fwd)], iters=args.iters, warmup=3
            )
            row = dict(S=s, causal=bool(causal), kernel="hopper", config=" ".join(args.set),
                       t_a_ms=round(t_a, 4), t_b_ms=round(t_b, 4), b_over_a=round(t_b / t_a, 4),
                       errors={k: round(v, 5) for k, v in errs.items()})  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            del per
            torch.cuda.empty_cache()
    return _report(rows, args.out)


def _errors(per, mod, lib, sp, cfg_kw, cfg) -> dict:
    """``per.check`` with ``mod``'s kernels: the relative errors against float32."""
    sp.K = mod
    try:
        return {k: round(v, 5) for k, v in per.check(**{cfg_kw: cfg}).items()}
    finally:
        sp.K = lib


if __name__ == "__main__":
    sys.exit(main())
