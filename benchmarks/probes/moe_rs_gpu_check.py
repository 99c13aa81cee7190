"""One GPU, one process: is MoERS's reduce-mode grouped GEMM (and the owner's finish) right
at the benchmark's shapes, and which variant of the launch changes the answer?

The per-rank problem is the one ``python -m interlace bench moe`` times: rank 0 of a
world of ``W = 4``, 8192 tokens, every arrival flag preset, the routing kernels for all
``W`` source ranks, the reduce GEMM (``ops.moe._gemm.launch_gemm(reduce=True)``) into a
float32 accumulator of every token, then ``moe_finish_kernel`` over that accumulator and
``W - 1`` zero stand-ins. The activations ``h`` are fresh random bfloat16 rows per (token,
slot), placed in the routing's row order (padding rows and rows past ``offsets[E]`` hold
NaN: a read of them shows); the float32 reference is ``sum_j w[t, j] * h[t, j] @
w2[ids[t, j]]`` from the ids themselves, not from the routing's tables.

Per case (H, I per rank, E, top-k, routing), one line: for every variant, the relative
error of the accumulator over all tokens (``acc``: the GEMM alone) and of rank 0's output
(``y``: GEMM + finish). Variants, each isolating one hypothesis:

* ``default``: the op's config (``GPU_CONFIGS["reduce"]``), TMA weight reads.
* ``no_tma``: the same, weights through the pointer path (masked per expert).
* ``bn256``: 128 x 256 x 64, 8 warps, 3 stages (the sweep's fastest, which the bench
  recorded with rel err 0.26-0.43).
* ``bn64w4``: 128 x 64 x 64, 4 warps, 4 stages.
* ``stages1``: the default tile with no software pipelining.
* ``grid1``: one program runs every tile (no concurrent atomics to a row).
* ``acc_unal``: the accumulator's base 4 bytes off 16-byte alignment (scalar atomics
  instead of 4-wide vector atomics).
* ``n_odd``: ``H - 8`` columns (N not a multiple of 16: no divisibility hint on the row
  offsets, so scalar atomics; the TMA path stays).

Prints ``ALL OK`` or ``MISMATCH`` (exit status 1). ``--cpu``: the same in Triton's
interpreter with tiny shapes (sets ``TRITON_INTERPRET=1`` itself).

    python benchmarks/probes/moe_rs_gpu_check.py            # one GPU, < 60 s
    python benchmarks/probes/moe_rs_gpu_check.py --cpu      # no GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

TOL = 1e-2


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    inter: int  # per rank
    experts: int
    topk: int
    routing: str  # "balanced" or "skewed"


@dataclass(frozen=True)
class Variant:
    name: str
    cfg: object | None = None  # MoeGemmConfig; None: the op's default
    use_tma: bool | None = None
    grid1: bool = False
    acc_unaligned: bool = False
    n_minus: int = 0


def variants(cpu: bool):
    from interlace.ops.moe._gemm import MoeGemmConfig

    if cpu:
        return [
            Variant("default"),
            Variant("bn32", MoeGemmConfig(16, 32, 16, 4, 1)),
            Variant("grid1", grid1=True),
            Variant("acc_unal", acc_unaligned=True),
            Variant("n_odd", n_minus=3),
        ]
    return [
        Variant("default"),
        Variant("no_tma", use_tma=False),
        Variant("bn256", MoeGemmConfig(128, 256, 64, 8, 3)),
        Variant("bn64w4", MoeGemmConfig(128, 64, 64, 4, 4)),
        Variant("stages1", MoeGemmConfig(128, 128, 64, 8, 1)),
        Variant("grid1", grid1=True),
        Variant("acc_unal", acc_unaligned=True),
        Variant("n_odd", n_minus=8),
    ]


def cases(cpu: bool):
    if cpu:
        return [
            Case(48, 40, 24, 4, 2, "balanced"),
            Case(48, 40, 24, 8, 3, "skewed"),
            Case(40, 36, 20, 5, 2, "skewed"),
        ]
    out = []
    for hidden, inter in ((2048, 384), (4096, 512)):
        for experts in (8, 32):
            for k in (2, 5):
                for kind in ("balanced", "skewed"):
                    out.append(Case(8192, hidden, inter, experts, k, kind))
    return out


def rel(got, want):
    import torch

    got = got.float()
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


class Problem:
    """One case's inputs, routing and float32 reference (rank 0 of ``world``)."""

    def __init__(self, case: Case, world: int, block_m: int, dev, gen):
        import torch

        from interlace.bench.moe import routing_ids
        from interlace.ops.moe.routing import alloc_routing, launch_routing, pack_meta
        from interlace.runtime.signals import ERROR_WORDS

        t, k, e, hid, inter = case.tokens, case.topk, case.experts, case.hidden, case.inter
        kind = "balanced" if case.routing == "balanced" else "zipf"
        self.case, self.world, self.m, self.dev = case, world, t // world, dev
        ids_d = routing_ids(t, k, e, kind, gen[0]).to(dev)  # (a host generator)
        g = gen[1]  # on the device: the large tensors are drawn there
        wts_d = torch.softmax(torch.randn(t, k, generator=g, device=dev), -1)
        h_d = torch.randn(t, k, inter, generator=g, device=dev).to(torch.bfloat16)
        w2 = torch.randn(e, inter, hid, generator=g, device=dev) * 0.05
        self.w2 = w2.to(torch.bfloat16)
        # float32 reference from the ids: y[t] = sum_j w[t, j] * h[t, j] @ w2[ids[t, j]]
        ref = torch.zeros(t, hid, device=dev)
        for x in range(e):
            tok, slot = torch.nonzero(ids_d == x, as_tuple=True)
            if tok.numel():
                rows = h_d[tok, slot].float() @ self.w2[x].float()
                ref.index_add_(0, tok, rows * wts_d[tok, slot][:, None])
        self.ref = ref
        # the routing kernels for all W sources, arrival flags preset
        m = self.m
        i32 = dict(dtype=torch.int32, device=dev)
        meta = torch.empty(world, 2 * m * k, **i32)
        for s in range(world):
            pack_meta(meta[s], ids_d[s * m : (s + 1) * m], wts_d[s * m : (s + 1) * m])
        self.err = torch.zeros(ERROR_WORDS, **i32)
        work = alloc_routing(m, k, e, world, block_m, dev)
        launch_routing(
            work, meta, 2 * m * k, rank=0, sig=torch.ones(4 * world + 4, **i32), flag0=0,
            err=self.err.data_ptr(), max_spins=1 << 22, wait=True,
        )  # fmt: skip
        rt = self.rt = work.routing
        self.table_note = self._check_table(ids_d, wts_d)
        # h in the routing's row order; padding rows and unused rows poisoned
        used = int(rt.offsets[-1])
        tok = rt.token_ids[:used].long()
        live = tok >= 0
        offs = rt.offsets[:e].long()
        expert = torch.searchsorted(offs, torch.arange(used, device=dev), right=True) - 1
        slot = (ids_d[tok[live]] == expert[live][:, None]).int().argmax(1)
        hp = torch.full((rt.rows, inter), float("nan"), dtype=torch.bfloat16, device=dev)
        hp[:used][live] = h_d[tok[live], slot]
        self.hp = hp

    def _check_table(self, ids_d, wts_d) -> str:
        """'' if the tile table and rows are consistent, else what is wrong."""
        import torch

        rt, c = self.rt, self.case
        n = int(rt.tile_count[0])
        used = int(rt.offsets[-1])
        bm = rt.block_m
        if n * bm != used or n > rt.tiles.shape[0]:
            return f"tile_count {n} x {bm} != rows {used}"
        row0 = torch.sort(rt.tiles[:n, 0].long()).values
        if not torch.equal(row0, torch.arange(n, device=self.dev) * bm):
            return "tile table is not one entry per row tile"
        tok = rt.token_ids[:used].long()
        if int((tok >= 0).sum()) != c.tokens * c.topk:
            return f"{int((tok >= 0).sum())} live rows, want {c.tokens * c.topk}"
        return ""

    def run(self, v: Variant, backend: str):
        """(acc rel err, y rel err, note) of one variant."""
        import torch

        from interlace.ops.moe import _gemm

        dev, world, m = self.dev, self.world, self.m
        cfg = v.cfg or _gemm.config_for("reduce", backend)
        if cfg.block_m != self.rt.block_m:
            return float("nan"), float("nan"), "block_m differs from the routing's"
        n = self.case.hidden - v.n_minus
        w2 = self.w2 if not v.n_minus else self.w2[:, :, :n].contiguous()
        ref = self.ref if not v.n_minus else self.ref[:, :n]
        tokens = self.case.tokens
        if v.acc_unaligned:
            acc = torch.zeros(tokens * n + 1, device=dev)[1:].view(tokens, n)
        else:
            acc = torch.zeros(tokens, n, device=dev)
        peers = torch.zeros(tokens, n, device=dev)  # the other ranks' stand-ins
        table = torch.tensor([acc.data_ptr()] + [peers.data_ptr()] * (world - 1), device=dev)
        sig = torch.zeros(8, dtype=torch.int32, device=dev)
        sig_table = torch.tensor([sig.data_ptr()] * world, device=dev)
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        grid = 1 if v.grid1 else _gemm.programs(self.rt, n, cfg, dev, backend)
        err = self.err.data_ptr()
        _gemm.launch_gemm(
            a=self.hp, x_own=None, w=w2, out=None, routing=self.rt, n=n, up=0, cfg=cfg,
            grid=grid, gather=False, swiglu=False, reduce=True, acc_out=acc, sig=sig,
            sig_table=sig_table, err=err, rank=0, max_spins=1 << 22, done_slot=0,
            contrib_slot=1, world=world, use_tma=v.use_tma,
        )  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.synchronize()
        e_acc = rel(acc, ref)
        _gemm.launch_finish(table, 0, y, m, sig, 1, 2, err, 0, 1 << 22, world, dev, backend)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        e_y = rel(y, ref[:m])
        notes = []
        if int(self.err[0]):
            notes.append(f"wait fault {self.err.tolist()[:6]}")
        if sig.tolist() != [0] * 8:
            notes.append(f"signals left {sig.tolist()}")
        if acc[:m].abs().sum() != 0:
            notes.append("finish left rank 0's rows")
        return e_acc, e_y, "; ".join(notes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="Triton's interpreter, tiny shapes")
    ap.add_argument("--variants", nargs="*", help="only these variants (names above)")
    ap.add_argument("--world", type=int, default=4, help="ranks the per-rank problem is cut for")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is float32
    if args.cpu:
        dev, backend = torch.device("cpu"), "cpu"
    else:
        if not torch.cuda.is_available():
            print("needs a GPU (or --cpu)")
            return 2
        dev, backend = torch.device("cuda", torch.cuda.current_device()), "cuda"
        print(torch.cuda.get_device_name(dev), "triton", __import__("triton").__version__)
    from interlace.ops.moe import _gemm

    vs = [v for v in variants(args.cpu) if not args.variants or v.name in args.variants]
    block_m = _gemm.config_for("reduce", backend).block_m
    gen = (torch.Generator().manual_seed(0), torch.Generator(device=dev).manual_seed(0))
    bad = False
    t0 = time.time()
    for c in cases(args.cpu):
        pb = Problem(c, args.world, block_m, dev, gen)
        head = f"T{c.tokens} H{c.hidden} I{c.inter} E{c.experts} k{c.topk} {c.routing:8}"
        parts = []
        if pb.table_note:
            parts.append(f"TABLE: {pb.table_note}")
            bad = True
        for v in vs:
            e_acc, e_y, note = pb.run(v, backend)
            ok = e_acc < TOL and e_y < TOL and not note
            bad |= not ok
            parts.append(
                f"{v.name} acc {e_acc:.1e} y {e_y:.1e}{'' if ok else ' BAD'}"
                + (f" ({note})" if note else "")
            )
        print(f"{head} | " + " | ".join(parts), flush=True)
    print(f"{time.time() - t0:.1f} s")
    print("MISMATCH" if bad else "ALL OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
