"""One rank's GEMM+RS / GEMM+AR ``ce_fused`` kernel on one device, its waits met in
advance: the peers' partials lie in a local receive buffer and their arrival flags are
raised before the launch, the all-reduce's broadcast stores go to ``world`` local result
buffers. What ``python -m interlace bench kernels`` times on a GPU (the kernel's own work,
no communication) and what the CPU tests check under Triton's interpreter."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..ops import segment_gemm as _gemm
from ..ops.gemm_rs import cef_layout

SPINS = 1 << 22  # every wait is met before the launch; bounded all the same
ARRIVAL, DONE, PAD = 64, 8, 4096  # signal slots (any layout that does not overlap)


class Emulated:
    """One rank's ``ce_fused`` kernel on one GPU, its waits met in advance."""

    MODES = ("plain", "stage", "rs", "ar")

    def __init__(
        self, world, rank, m, n, k, mode, split=2, kernel=None, device=None, one_loop=False,
        cfg=None,
    ):  # fmt: skip
        """``mode``: ``rs`` / ``ar``: the GEMM+RS / GEMM+AR (``gather="epilogue"``) layout;
        ``stage``: every chunk staged (no reduction); ``plain``: the same chunks as plain
        store segments (no push epilogue, no signals). ``split``: chunks per owner (the
        op's default for ``ce_fused`` is 2). ``one_loop``: the kernel's one-loop mode.
        ``cfg``: a tile config instead of the op's (given as for plain stores, kept as
        given but for the epilogue's room)."""
        dev = device or torch.device("cuda", torch.cuda.current_device())
        backend = "cuda" if dev.type == "cuda" else "cpu"  # cpu: Triton's interpreter
        all_reduce = mode == "ar"
        self.world, self.rank, self.m, self.n, self.mode = world, rank, m, n, mode
        self.all_reduce = all_reduce
        m_loc = m // world
        self.cfg = cfg or _gemm.gemm_config(m, n, k, backend)
        if backend == "cuda" and mode != "plain":  # as the op's (``widen``: no config given)
            self.cfg = _gemm.scatter_config(self.cfg, n, widen=cfg is None)
        layout = cef_layout(
            world, rank, m, n, self.cfg, split, all_reduce=all_reduce,
            gather_epilogue=all_reduce, arrival=ARRIVAL, done=DONE,
        )  # fmt: skip
        self.chunks, self.slot_of = layout.chunks, layout.slot_of
        segments = layout.segments
        if mode in ("stage", "plain"):
            kind = "push" if mode == "stage" else "store"
            segments = [replace(s, kind=kind, wait_count=0, final_expected=0) for s in segments]
        tables = None
        if one_loop:
            tables = _gemm.one_loop_tables(segments, m, n, k, self.cfg, torch.bfloat16, dev)
            assert tables is not None, "layout not eligible for the one-loop mode"
        self.unit = _gemm.count_unit(tables, self.cfg)  # a tile's count in its counter
        segments = [replace(s, final_expected=s.final_expected * self.unit) for s in segments]
        self.segments = segments
        gen = torch.Generator(device=dev).manual_seed(1234 + rank)
        self.backend = backend
        self.a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
        self.recv = torch.randn(world, m_loc, n, device=dev, dtype=torch.bfloat16, generator=gen)
        self.stage = torch.empty(m * n, device=dev, dtype=torch.bfloat16)
        self.pads = [torch.zeros(PAD, device=dev, dtype=torch.int32) for _ in range(world)]
        sig = self.pads[rank]
        for s in segments:  # the peers' copies and broadcasts have all landed
            if s.kind == "reduce":
                sig[s.wait_first : s.wait_first + s.wait_count] = s.wait_expected
            if s.final_expected:
                sig[s.final_slot] = s.final_expected
        self.results = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(world)]
        own_rows = m if mode == "plain" else m_loc  # plain: every row into one output
        own_out = torch.empty(own_rows, n, device=dev, dtype=torch.bfloat16)
        self.out = self.results[rank] if all_reduce else own_out
        self.err = torch.zeros(4, dtype=torch.int32, device=dev)  # read after the launch
        tiles = _gemm.plan_tiles(
            segments, m, n, self.cfg, dev, backend, comm_sms=1, one_loop=tables
        )
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)  # noqa: E731
        self._keep = (ptrs(self.pads), ptrs(self.results), ptrs([self.recv] * world))
        signals = _gemm.Signals(
            sig=sig, err=self.err.data_ptr(), rank=rank, max_spins=SPINS, world=world,
            sig_table=None if mode == "plain" else self._keep[0],
        )  # fmt: skip
        peers = None
        if mode != "plain":
            peers = _gemm.PeerStores(
                push=True, broadcast=all_reduce, recv=self.recv, recv_rows=m_loc,
                recv_table=self._keep[2], stage=self.stage,
                out_table=self._keep[1] if all_reduce else None,
            )  # fmt: skip
        previous = _gemm.gemm_segments_kernel
        if kernel is not None:  # the launcher takes the module's kernel when it is made
            _gemm.gemm_segments_kernel = kernel
        try:
            self.run = _gemm.launcher(
                m, n, k, tiles, dtype=torch.bfloat16, device=dev, signals=signals, peers=peers
            )
        finally:
            _gemm.gemm_segments_kernel = previous

    def __call__(self):
        self.run(self.a, self.b, self.out, None)

    def check(self) -> float:
        """Largest relative error (vs float32) over what the launch wrote."""
        for t in (self.stage, self.out, *self.results):
            t.fill_(float("nan"))
        self()
        if self.backend == "cuda":
            torch.cuda.synchronize()
        if int(self.err[0]):
            raise RuntimeError(f"a wait timed out: {self.err.tolist()}")
        m_loc, n, r = self.m // self.world, self.n, self.rank
        if self.mode != "plain":  # each staged chunk's counter, after one launch
            sig = self.pads[r].tolist()
            for c in self.chunks:
                if c.owner == r:  # (own rows: reduced, or in ``stage`` mode counted apart)
                    continue
                want = _gemm.tiles_of(c.rows, n, self.cfg) * self.unit
                got = sig[DONE + self.slot_of[c.id]]
                if got != want:
                    raise RuntimeError(f"chunk {c.id}: counter {got}, expected {want}")
        if self.mode == "ar":  # each own chunk's broadcast counter on every peer
            for s in self.segments:
                want = _gemm.tiles_of(s.rows, n, self.cfg) * self.unit
                for q in range(self.world) if s.kind == "reduce" else ():
                    got = int(self.pads[q][s.notify]) if q != r else want
                    if got != want:
                        raise RuntimeError(f"rank {q} broadcast slot {s.notify}: {got} != {want}")
        full = self.a.float() @ self.b.float()
        staged = self.stage.view(self.m, n)
        worst = 0.0
        for c in self.chunks:  # what each chunk's rows must hold
            lo, hi = c.lo, c.lo + c.rows
            kind = {"plain": "store", "stage": "push"}.get(self.mode)
            kind = kind or ("push" if c.owner != r else "reduce")
            if kind == "store":
                got, ref = self.out[lo:hi].float(), full[lo:hi]
            elif kind == "push":
                got, ref = staged[lo:hi].float(), full[lo:hi]
            else:
                ref = full[lo:hi] + sum(
                    self.recv[p, lo - r * m_loc : hi - r * m_loc].float()
                    for p in range(self.world) if p != r
                )  # fmt: skip
                outs = self.results if self.all_reduce else [self.out]
                row0 = lo if self.all_reduce else lo - r * m_loc
                for o in outs:
                    got = o[row0 : row0 + c.rows].float()
                    worst = max(worst, rel_err(got, ref))
                continue
            worst = max(worst, rel_err(got, ref))
        return worst


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``y`` against ``ref`` (inf where ``y`` has NaNs)."""
    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12))
    return err if math.isfinite(err) else float("inf")
