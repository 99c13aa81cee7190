"""One rank's fused GEMM kernel on one device, its waits met in advance: what
``python -m interlace bench kernels`` times on a GPU (the kernel's own work, with no
communication and no synchronisation) and what the CPU tests check under Triton's
interpreter.

The kernel runs the segments the op would run as rank ``rank`` of ``world`` (the op's own
layout functions build them), with every flag it waits for already raised. The peers'
partials lie in a local receive buffer; stores meant for other ranks (pushed partial
tiles, the all-reduce's broadcast of reduced tiles) land in local stand-ins for their
buffers. The entry barrier and the exit clearing of the op's launch are left out (they
synchronise with the peers), so the kernel can be launched again and again.

Modes:

* ``plain``: the segment GEMM with the ``ce_fused`` chunks as plain store segments (no
  signals); ``stage``: every ``ce_fused`` chunk staged (no reduction);
* ``rs`` / ``ar``: GEMM+RS / GEMM+AR ``ce_fused`` (all-reduce with ``gather="epilogue"``);
* ``rs_fused`` / ``ar_fused``: GEMM+RS / GEMM+AR ``fused`` (partial tiles pushed to the
  owner from the epilogue);
* ``ag``: AG+GEMM ``fused``'s consumer: its own rows read in place, each peer's chunk after
  its arrival flag (``m`` is the gathered rows).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..ops import segment_gemm as _gemm
from ..ops.ag_gemm import ag_layout
from ..ops.gemm_rs import cef_layout
from ..ops.gemm_rs.fused import fused_segments
from ..ops.policy import lookup
from ..runtime.signals import ERROR_WORDS

SPINS = 1 << 22  # every wait is met before the launch; bounded all the same
GO, DONE, ARRIVAL, PAD = 4, 8, 64, 4096  # signal slots (any layout that does not overlap)
MODES = ("plain", "stage", "rs", "ar", "rs_fused", "ar_fused", "ag")
#: the op and strategy each mode stands for
OP_OF = {
    "rs": ("gemm_rs", "ce_fused"), "ar": ("gemm_ar", "ce_fused"),
    "rs_fused": ("gemm_rs", "fused"), "ar_fused": ("gemm_ar", "fused"),
    "ag": ("ag_gemm", "fused"), "plain": ("gemm", "plain"), "stage": ("gemm_rs", "stage"),
}  # fmt: skip


def op_split(mode: str, world: int) -> int:
    """The chunks per owner the op uses by default for this mode's strategy."""
    op, strategy = OP_OF[mode]
    if op == "gemm":
        op, strategy = "gemm_rs", "ce_fused"
    return lookup(op, world).split_of(strategy)


class Emulated:
    """One rank's fused kernel on one device, its waits met in advance (see the module)."""

    MODES = MODES

    def __init__(
        self, world, rank, m, n, k, mode, split=None, kernel=None, device=None, one_loop=False,
        cfg=None,
    ):  # fmt: skip
        """``split``: chunks per owner (default: the op's). ``one_loop``: the kernel's
        one-loop mode (True: required; None: where the op would take it, on a GPU).
        ``cfg``: a tile config instead of the op's (given as for plain stores, kept as
        given but for the epilogue's room). ``kernel``: a variant of the segment GEMM."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        dev = device or torch.device("cuda", torch.cuda.current_device())
        backend = "cuda" if dev.type == "cuda" else "cpu"  # cpu: Triton's interpreter
        self.world, self.rank, self.m, self.n, self.k, self.mode = world, rank, m, n, k, mode
        self.backend, self.all_reduce = backend, mode in ("ar", "ar_fused")
        split = split or op_split(mode, world)
        m_loc = m // world
        self.cfg = cfg or _gemm.gemm_config(m, n, k, backend)
        scatter = mode not in ("plain", "ag")
        if backend == "cuda" and scatter:  # as the op's (``widen``: no config given)
            self.cfg = _gemm.scatter_config(self.cfg, n, widen=cfg is None)
        self.chunks, self.slot_of = None, None
        if mode == "ag":
            _, segments = ag_layout(world, rank, m_loc, self.cfg, split, arrival=ARRIVAL)
        elif mode in ("rs_fused", "ar_fused"):
            segments = fused_segments(
                world, rank, m, n, self.cfg, split, all_reduce=self.all_reduce,
                partial=ARRIVAL, broadcast=ARRIVAL + world * _gemm.MAX_SPLIT * (world - 1),
                go=GO,
            )  # fmt: skip
        else:
            layout = cef_layout(
                world, rank, m, n, self.cfg, split, all_reduce=self.all_reduce,
                gather_epilogue=self.all_reduce, arrival=ARRIVAL, done=DONE,
            )  # fmt: skip
            self.chunks, self.slot_of = layout.chunks, layout.slot_of
            segments = layout.segments
            if mode in ("stage", "plain"):
                kind = "push" if mode == "stage" else "store"
                segments = [replace(s, kind=kind, wait_count=0, final_expected=0) for s in segments]
        tables = None
        staged = mode in ("stage", "rs", "ar")
        if one_loop or (one_loop is None and backend == "cuda" and (staged or mode == "ag")):
            tables = _gemm.one_loop_tables(segments, m, n, k, self.cfg, torch.bfloat16, dev)
            if one_loop:
                assert tables is not None, "layout not eligible for the one-loop mode"
        self.unit = _gemm.count_unit(tables, self.cfg)  # a tile's count in its counter
        segments = [replace(s, final_expected=s.final_expected * self.unit) for s in segments]
        self.segments = segments

        gen = torch.Generator(device=dev).manual_seed(1234 + rank)
        self.a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
        self.a_own = self.a[rank * m_loc : (rank + 1) * m_loc].clone() if mode == "ag" else None
        self.recv = torch.randn(world, m_loc, n, device=dev, dtype=torch.bfloat16, generator=gen)
        self.peer_recv = torch.empty_like(self.recv)  # where pushed partials land
        self.stage = torch.empty(m * n, device=dev, dtype=torch.bfloat16)
        self.pads = [torch.zeros(PAD, device=dev, dtype=torch.int32) for _ in range(world)]
        sig = self.pads[rank]
        sig[GO] = 1  # ``fused``: the entry barrier has passed
        for s in segments:  # the peers' copies and broadcasts have all landed
            if s.kind != "push" and s.wait_count:
                sig[s.wait_first : s.wait_first + s.wait_count] = s.wait_expected
            if s.final_expected:
                sig[s.final_slot] = s.final_expected
        self.results = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(world)]
        own_rows = m if mode in ("plain", "ag") else m_loc  # every row into one output
        own_out = torch.empty(own_rows, n, device=dev, dtype=torch.bfloat16)
        self.out = self.results[rank] if self.all_reduce else own_out
        # a whole error word (zeros: no group fault word, no call slot), read after the launch
        self.err = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev)
        tiles = _gemm.plan_tiles(
            segments, m, n, self.cfg, dev, backend, comm_sms=1, one_loop=tables,
            single=mode in ("rs_fused", "ar_fused"),
        )  # fmt: skip
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)  # noqa: E731
        # ``fused`` pushes a partial to owner ``q`` through the receive buffers' pointer
        # table, at ``recv + (table[q] - table[rank])``: the peers' entries are the
        # stand-in and this rank's is ``recv`` itself, so that pushes land in the stand-in
        # (the stand-in in this rank's entry too would put them in ``recv``'s own slot)
        pushed_to = self.peer_recv if mode in ("rs_fused", "ar_fused") else self.recv
        recv_table = [self.recv if q == rank else pushed_to for q in range(world)]
        self._keep = (ptrs(self.pads), ptrs(self.results), ptrs(recv_table))
        signals = _gemm.Signals(
            sig=sig, err=self.err.data_ptr(), rank=rank, max_spins=SPINS, world=world,
            sig_table=None if mode in ("plain", "ag") else self._keep[0],
        )  # fmt: skip
        peers = None
        if scatter:
            peers = _gemm.PeerStores(
                push=True, broadcast=self.all_reduce, recv=self.recv, recv_rows=m_loc,
                recv_table=self._keep[2], stage=self.stage if staged else None,
                out_table=self._keep[1] if self.all_reduce else None,
            )  # fmt: skip
        previous = _gemm.gemm_segments_kernel
        if kernel is not None:  # the launcher takes the module's kernel when it is made
            _gemm.gemm_segments_kernel = kernel
        try:
            self.run = _gemm.launcher(
                m, n, k, tiles, dtype=torch.bfloat16, device=dev, signals=signals, peers=peers,
                own_rows=m_loc if mode == "ag" else 0,
            )  # fmt: skip
        finally:
            _gemm.gemm_segments_kernel = previous

    def __call__(self):
        self.run(self.a, self.b, self.out, None, self.a_own)

    def check(self) -> float:
        """Largest relative error (vs float32) over what the launch wrote."""
        for t in (self.stage, self.out, *self.results):
            t.fill_(float("nan"))
        self.pads[self.rank][DONE:ARRIVAL] = 0  # the counters this launch must raise
        for q, pad in enumerate(self.pads):
            if q != self.rank:
                pad.zero_()
        self()
        if self.backend == "cuda":
            torch.cuda.synchronize()
        if int(self.err[0]):
            raise RuntimeError(f"a wait timed out: {self.err.tolist()}")
        m_loc, n, r = self.m // self.world, self.n, self.rank
        full = self.a.float() @ self.b.float()
        if self.mode in ("plain", "ag"):
            return rel_err(self.out, full)
        if self.mode in ("stage", "rs", "ar"):
            self._check_counters()
        worst = 0.0
        for s in self.segments:  # what each chunk's rows must hold
            lo, hi = s.row0, s.row0 + s.rows
            if self.mode == "stage" or s.kind == "push":
                if self.mode in ("rs_fused", "ar_fused"):
                    continue  # pushed into stand-ins of the owners' buffers
                got = self.stage.view(self.m, n)[lo:hi]
                worst = max(worst, rel_err(got, full[lo:hi]))
                continue
            ref = full[lo:hi] + sum(
                self.recv[p, lo - r * m_loc : hi - r * m_loc].float()
                for p in range(self.world) if p != r
            )  # fmt: skip
            outs = self.results if self.all_reduce else [self.out]
            row0 = lo if self.all_reduce else lo - r * m_loc
            for o in outs:
                worst = max(worst, rel_err(o[row0 : row0 + s.rows], ref))
        return worst

    def _check_counters(self) -> None:
        """``ce_fused``: each staged chunk's counter after one launch; all-reduce: each own
        chunk's broadcast counter on every peer."""
        n, r = self.n, self.rank
        sig = self.pads[r].tolist()
        for c in self.chunks:
            if c.owner == r:  # (own rows: reduced, or in ``stage`` mode counted apart)
                continue
            want = _gemm.tiles_of(c.rows, n, self.cfg) * self.unit
            got = sig[DONE + self.slot_of[c.id]]
            if got != want:
                raise RuntimeError(f"chunk {c.id}: counter {got}, expected {want}")
        if self.mode == "ar":
            for s in self.segments:
                want = _gemm.tiles_of(s.rows, n, self.cfg) * self.unit
                for q in range(self.world) if s.kind == "reduce" else ():
                    got = int(self.pads[q][s.notify]) if q != r else want
                    if got != want:
                        raise RuntimeError(f"rank {q} broadcast slot {s.notify}: {got} != {want}")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``y`` against ``ref`` (inf where ``y`` has NaNs)."""
    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12))
    return err if math.isfinite(err) else float("inf")
