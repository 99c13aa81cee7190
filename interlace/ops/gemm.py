"""Overlapped tensor-parallel GEMMs: AG+GEMM, GEMM+RS and GEMM+AR.

Each is a context built once for a capacity and called many times, on every rank::

    ag = interlace.AGGemm(group, max_m=8192, n=7168, k=8192)
    c = ag(a_shard, b)          # == all_gather(a_shard) @ b
    rs = interlace.GemmRS(group, max_m=8192, n=8192, k=7168)
    y = rs(a, b)                # == reduce_scatter(a @ b) along rows
    ar = interlace.GemmAR(group, max_m=8192, n=8192, k=7168)
    z = ar(a, b)                # == all_reduce(a @ b)

Strategies (``strategy=``):

* ``fused`` (the overlapped design; default through ``auto``):
  - AG+GEMM: every rank's copy engine pushes its shard to the peers, peer by peer in
    rank-rotated order, raising the peer's arrival flag per chunk from the stream; the
    persistent GEMM starts on its own shard (read in place, no copy) and then takes the
    chunks in arrival order, waiting per chunk.
  - GEMM+RS: every rank computes the row chunks in rank-rotated order (its own rows last);
    the GEMM's epilogue stores each finished partial tile straight into the owner's receive
    buffer and raises the owner's counter; the owner's own tiles, computed last, add the
    peers' partials in fp32 in their epilogue. No separate reduction pass, no tail.
  - GEMM+AR: the same, and the owner's epilogue writes each reduced tile into every rank's
    output (the all-gather half, spread over the whole GEMM).
* ``ce_scatter`` (GEMM+RS): the GEMM stores every partial tile locally (chunks for other
  ranks first) and counts each chunk's finished tiles; on the comm stream a one-program
  wait per chunk, then the copy engine ships it to its owner and raises the owner's flag;
  the owner's reduction kernel (fp32) adds the pieces as they land, after its GEMM. More
  launches than ``fused`` (slower eager), less work in the GEMM's epilogue (faster as a
  CUDA graph on 2 x H200).
* ``ce_fused`` (GEMM+RS, GEMM+AR): as ``fused``, but a partial tile is stored locally
  and the copy engine ships each finished chunk to its owner (a one-program wait per
  chunk on the comm stream, then the copy, which raises the owner's flag); the owner's own
  tiles add the landed partials in their epilogue. No reduction kernel. Reduce-scatter:
  own chunks last, no NVLink stores from the epilogue. All-reduce: in rounds, each own
  chunk reduced a round after the peers computed it, its sums sent to every rank by the
  epilogue (``gather="epilogue"``) or the copy engine (``gather="copy"``) while the GEMM
  goes on. Eager calls alternate buffer sets, so they need no barrier.
* ``ring`` (GEMM+RS): TileLink's in-kernel ring, as a kernel of ``comm_sms`` programs
  beside the GEMM: the GEMM stores partials owner by owner in ring order and counts each
  owner's finished tiles; the ring programs add what the left neighbour sent to this
  rank's partial and store the sum into the right neighbour, ``W - 1`` steps.
* ``sm_pull`` (AG+GEMM): ``comm_sms`` SMs pull the peers' shards with loads while the GEMM
  runs on the other SMs.
* ``signal_reorder`` (GEMM+RS, GEMM+AR): FlashOverlap, through
  :class:`~interlace.SignalReorderGemmRS` / ``...AR``: tiles land wave group by wave group
  in a reordered buffer and a stock ``torch.distributed`` collective runs per group. No
  symmetric memory: it works wherever the process group does (across nodes, over PCIe).
* ``none``: cuBLAS + NCCL back to back: the baseline, and the fallback.
* ``auto``: ``fused``, unless the cost model says overlap cannot pay for its extra
  synchronisation (small problems): then ``none``. ``last_strategy`` says which ran.

Eager calls (``eager_graphs``, on by default where the driver allows): each kind of call is
captured once into a CUDA graph and replayed with the call's own tensors
(``OpContext._enqueue``, ``runtime.graphs``), one launch instead of every kernel, copy and
signal write.

Results: AG+GEMM and GEMM+RS return a new tensor (or ``out``); GEMM+AR returns a view of
the context's symmetric output buffer, valid until the next call (pass ``out=`` to keep it).
Inputs: ``bfloat16`` or ``float16``, contiguous, any M, N, K (TMA is used when rows are
16-byte aligned, plain loads otherwise); ``bias`` (shape ``[n]``) is added once, after the
reduction. Every call is collective: all ranks call with the same shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import schedule
from ..errors import InterlaceValueError
from ..kernels.collective import pull_chunks_kernel
from ..runtime import (
    copy_and_signal,
    fork,
    fork_from_mark,
    fork_mark,
    join,
    symm_empty,
    use_stream,
)
from . import _gemm
from ._context import BUFFER_SETS, AlternatingSets, OpContext
from ._gemm import MAX_SPLIT, GemmConfig, Segment, tiles_of
from ._rs_variants import RING_MAX_PROGRAMS, ScatterVariants

AG_TEMPLATES = {
    "full_mesh": schedule.full_mesh_all_gather,
    "swizzled": schedule.swizzled_all_gather,
}

#: ``auto`` runs ``none`` when the smaller of the GEMM and communication times, estimated
#: from these rates (an H200 with NVLink: cuBLAS ~650 TFLOP/s on these shapes, NCCL ~200
#: GB/s per peer pair), is under the op's floor: what overlap must save to pay for its
#: extra host launches (eager) or its device-side synchronisation (CUDA-graph capture).
#: The floors come from the 2 x H200 results (benchmarks/results/2026-11-22-h200-w2.json):
#: with the prepared launches, eager ``fused`` beat cuBLAS + NCCL at M = 8192 (estimated
#: traffic ~170 us and up) for all three ops and lost at M = 2048; captured, it won at
#: M = 8192 everywhere and at M = 2048 for all three ops but one shape. Session 3 (copies
#: without a barrier, GEMM launched first): eager AG+GEMM ``fused`` beat cuBLAS + NCCL at
#: M = 2048 on 6 of 6 (shape, run) pairs (estimated traffic 40-70 us), so its eager floor
#: is 30 us; GEMM+RS / GEMM+AR ``fused`` won only 4 of 6 there and kept 150 us. Session 4
#: (host path through driver calls and direct launches: ~35 us per GEMM+RS / AR call, was
#: 50-120): at M = 2048 eager GEMM+RS ``fused`` beat cuBLAS + NCCL on 3 of 3 shapes and
#: GEMM+AR on 2 of 3 (the third a tie, 0.286 vs 0.289 ms), so their eager floor is 30 us.
EST_TFLOPS = 650.0
EST_LINK_GBPS = 200.0


class _OverlappedGemm(OpContext):
    STRATEGIES: tuple[str, ...] = ("auto", "fused", "none")
    MIN_OVERLAP_US = {"eager": 30.0, "graph": 15.0}  # see EST_TFLOPS
    WORLD_MIN_OVERLAP_US: dict[int, dict[str, float]] = {}  # a world size's own floors
    default_split = 1
    WORLD_SPLIT: dict[int, int] = {}  # a world size's own default split
    STRATEGY_SPLIT: dict[str, int] = {}  # a strategy's own default chunk split

    def __init__(
        self, group, max_m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
        strategy: str = "auto", split: int | None = None, comm_sms: int = 16,
        config: GemmConfig | None = None, max_spins=None, eager_graphs: bool | None = None,
    ):  # fmt: skip
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"{self.op_name}: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        _gemm.check_gemm_shape(self.op_name, max_m, n, k, dtype)
        if split is not None:
            split = int(split)
            if not 1 <= split <= MAX_SPLIT:
                raise InterlaceValueError(
                    f"{self.op_name}: split must be in 1..{MAX_SPLIT}, got {split}"
                )
        w = group.world_size
        super().__init__(group, dtype, int(max_m) * int(n), self._regions(w), max_spins)
        self.max_m, self.n, self.k = int(max_m), int(n), int(k)
        self._split_given = split
        self.strategy, self.comm_sms, self.config = strategy, comm_sms, config
        self.split = self._split_of(strategy)
        self.last_strategy: str | None = None
        self._plans: dict = {}  # eager plans; plans first built inside a capture are kept
        self._captured_plans: dict = {}  # apart: their tables fill only when a graph replays
        self._resolved: dict = {}  # (m, n, k, capturing) -> the strategy ``auto`` chose
        self._init_eager_graphs(eager_graphs)

    @staticmethod
    def _regions(world: int) -> dict[str, int]:
        return {}

    def _split_of(self, strategy: str) -> int:
        """Chunks per owner for ``strategy``: the context's ``split`` if given, else the
        strategy's own default, the world size's, or the op's."""
        if self._split_given is not None:
            return self._split_given
        return self.STRATEGY_SPLIT.get(
            strategy, self.WORLD_SPLIT.get(self.world_size, self.default_split)
        )

    # ------------------------------------------------------------------ strategy choice
    def _comm_bytes(self, m_total: int, n: int) -> int:
        raise NotImplementedError

    def _resolve(self, m_total: int, n: int, k: int) -> str:
        """The strategy of a call of this size: the context's own, or ``auto``'s choice
        (worked out once per size and capture state: eager calls pay for every step)."""
        if self.strategy != "auto":
            return self.strategy
        key = (m_total, n, k, self._capturing())
        found = self._resolved.get(key)
        if found is None:
            t_gemm = 2.0 * m_total * n * k / (EST_TFLOPS * 1e12) * 1e6
            t_comm = self._comm_bytes(m_total, n) / (EST_LINK_GBPS * 1e9) * 1e6
            floors = self.WORLD_MIN_OVERLAP_US.get(self.world_size, self.MIN_OVERLAP_US)
            floor = floors["graph" if key[-1] else "eager"]
            found = self._overlapped(t_gemm) if min(t_gemm, t_comm) >= floor else "none"
            self._resolved[key] = found
        return found

    def _overlapped(self, t_gemm_us: float) -> str:
        """The strategy ``auto`` overlaps with, for a GEMM estimated at ``t_gemm_us``."""
        return "fused"

    def _store_cfg(self, m: int, n: int, k: int) -> GemmConfig:
        """The tile config for an epilogue of plain stores."""
        return self.config or _gemm.gemm_config(m, n, k, self.group.backend)

    def _cfg(self, m: int, n: int, k: int) -> GemmConfig:
        return self._store_cfg(m, n, k)

    def _known_plan(self, key):
        """The plan for ``key``: an eager call never uses one built inside a capture (its
        device tables are only filled when the graph replays)."""
        if key in self._plans:
            return self._plans[key]
        return self._captured_plans.get(key) if self._capturing() else None

    def _keep_plan(self, key, plan):
        (self._captured_plans if self._capturing() else self._plans)[key] = plan
        return plan

    def _check_call(self, a, b, bias, a_rows_max: int):
        self._begin()
        if _gemm.operands_fit(self, a, b, bias, a_rows_max):
            return  # the common case, in one expression (eager calls pay for every check)
        _gemm.check_gemm_call(self, a, b, bias)
        if a.shape[0] > a_rows_max or a.shape[0] == 0:
            raise InterlaceValueError(
                f"{self.op_name}: a has {a.shape[0]} rows; this context takes 1 to "
                f"{a_rows_max} (max_m = {self.max_m})"
            )

    @property
    def _pg(self):
        return self.group.process_group


class AGGemm(AlternatingSets, _OverlappedGemm):
    """``all_gather(a_shard) @ b (+ bias)``: ``a_shard [m, k]`` on each rank, ``b [k, n]``
    (the rank's column shard of the weight); result ``[world * m, n]``."""

    op_name = "ag_gemm"
    STRATEGIES = ("auto", "fused", "sm_pull", "none")

    def __init__(
        self, group, max_m, n, k, dtype=torch.bfloat16, strategy="auto", schedule="full_mesh",
        **kw,
    ):  # fmt: skip
        if schedule not in AG_TEMPLATES:
            raise InterlaceValueError(
                f"{self.op_name}: schedule must be one of {tuple(AG_TEMPLATES)}, got {schedule!r}"
            )
        self.schedule = schedule
        super().__init__(group, max_m, n, k, dtype, strategy, **kw)
        if self.max_m % self.world_size:
            raise InterlaceValueError(
                f"{self.op_name}: max_m = {self.max_m} (gathered rows) must be a multiple of "
                f"the world size {self.world_size}"
            )
        if strategy != "none":
            # fused (and auto): the alternating buffer sets (``AlternatingSets``)
            sets = 1 if strategy == "sm_pull" else BUFFER_SETS
            self.gathered = self._track(symm_empty((sets, self.max_m, self.k), dtype, group))

    @staticmethod
    def _regions(world):
        # per buffer set: the arrival flags, then the GEMM's "go" and "done" slots
        return {"arrival": BUFFER_SETS * (world * MAX_SPLIT + 2)}

    def _set_slots(self) -> tuple[int, int]:
        """(first, count): the signal slots of one buffer set (see ``_regions``)."""
        count = self.world_size * MAX_SPLIT + 2
        return self.pad.offset("arrival"), count

    def _signal_launch_args(self, s: int = 0) -> dict:
        """The GEMM's signal arguments for buffer set ``s``: it clears that set's slots as
        it ends, and only those (a peer may already be filling the other eager set)."""
        first, count = self._set_slots()
        first += s * count
        return dict(
            sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
            max_spins=self.max_spins, world=self.world_size, go_slot=first + count - 2,
            clear=(first, count),
        )  # fmt: skip

    def _comm_bytes(self, m_total, n):
        return m_total * self.k * self.dtype.itemsize * (self.world_size - 1) // self.world_size

    def __call__(self, a_shard, b, bias=None, out=None):
        w = self.world_size
        self._check_call(a_shard, b, bias, self.max_m // w)
        m_loc, n = a_shard.shape[0], b.shape[1]
        if out is None:
            out = torch.empty(w * m_loc, n, dtype=self.dtype, device=self.group.device)
        else:
            self._check_out(out, (w * m_loc, n))
            _gemm.check_tma_aligned(self.op_name, out, names=("out",))
        strategy = self._resolve(w * m_loc, n, self.k)
        self._begin_call(M=w * m_loc, N=n, K=self.k, strategy=strategy, bias=bias is not None)
        if strategy == "none":
            self._baseline(a_shard, b, bias, out)
        elif strategy == "fused":
            run = lambda: self._fused(a_shard, b, bias, out)  # noqa: E731
            self._enqueue(strategy, run, a_shard, b, bias, out)
        else:
            self._sm_pull(a_shard, b, bias, out)
        self.last_strategy = strategy
        self._end()
        return out

    def _baseline(self, a_shard, b, bias, out):
        gathered = torch.empty(
            self.world_size * a_shard.shape[0], self.k, dtype=self.dtype, device=a_shard.device
        )
        dist.all_gather_into_tensor(gathered, a_shard, group=self._pg)
        if bias is None:
            torch.matmul(gathered, b, out=out)
        else:
            torch.addmm(bias, gathered, b, out=out)

    def _plan(self, m_loc: int, n: int, pull: bool, s: int = 0):
        """Segments in arrival order, and the transfers this rank issues (push) or the
        chunk table of the pull kernel, for buffer set ``s``; lowered from a checked
        schedule, once per shape and set."""
        key = (m_loc, n, pull, s)
        if (found := self._known_plan(key)) is not None:
            return found
        w, r = self.world_size, self.rank
        cfg = self._cfg(w * m_loc, n, self.k)
        split = self._split_of("sm_pull" if pull else "fused")
        sched = AG_TEMPLATES[self.schedule](
            w, m_loc, split, mode="pull" if pull else "push", backend="sm" if pull else "ce",
            align=cfg.block_m,
        )  # fmt: skip
        schedule.check(sched)
        first, count = self._set_slots()
        arrival = first + s * count
        expected = self._pull_programs() if pull else 1
        segments = []
        for chunk, slot in schedule.chunk_order(sched, r):
            if slot is None:  # own rows: read in place from the caller's shard
                segments.append(
                    Segment(
                        row0=chunk.lo, rows=chunk.rows, kind="store_own", owner=r,
                        out_row0=chunk.lo - r * m_loc,
                    )
                )  # fmt: skip
            else:
                segments.append(
                    Segment(
                        row0=chunk.lo, rows=chunk.rows, kind="store", owner=chunk.owner,
                        wait_first=arrival + slot, wait_count=1, wait_expected=expected,
                    )
                )  # fmt: skip
        table = _gemm.segment_table(segments, n, cfg, self.group.device)
        grid = _gemm.programs_for(
            _gemm.total_tiles(segments, n, cfg), self.group.device, self.group.backend,
            comm_sms=self.comm_sms if pull else 1,  # fused: one SM for the barrier
        )  # fmt: skip
        moves = schedule.transfers(sched, r)
        if pull:
            rows = [[t.lo, t.hi - t.lo, arrival + t.signal, t.src] for t in moves]
            comm = _gemm.to_device(torch.tensor(rows, dtype=torch.int32), self.group.device)
        else:
            comm = []
            for t in moves:  # issue order: peer by peer, rank-rotated
                lo, hi = t.lo - r * m_loc, t.hi - r * m_loc
                signal = self.pad.buffer.peers[t.dst].view(torch.uint32)
                comm.append(
                    (self.gathered.peers[t.dst][s, t.lo : t.hi], lo, hi, signal, arrival + t.signal)
                )
        one_loop = _gemm.one_loop_tables(
            segments, w * m_loc, n, self.k, cfg, self.dtype, self.group.device
        )
        plan = (cfg, table, len(segments), grid, comm, {}, s, self.gathered.local[s], one_loop)
        return self._keep_plan(key, plan)

    def _pull_programs(self) -> int:
        return self.comm_sms if self.group.backend == "cuda" else 2

    def _gemm(self, plan, a_shard, b, bias, out, m_loc):
        cfg, table, n_seg, grid, _, launchers, s, gathered, one_loop = plan
        run = launchers.get(bias is not None)
        if run is None:
            run = launchers[bias is not None] = _gemm.launcher(
                self.world_size * m_loc, b.shape[1], self.k, cfg, grid, table, n_seg,
                dtype=self.dtype, device=self.group.device, has_bias=bias is not None,
                own_a=True, own_rows=m_loc, one_loop=one_loop, **self._signal_launch_args(s),
            )  # fmt: skip
        run(gathered, b, out, bias, a_shard)

    def _fused(self, a_shard, b, bias, out):
        """A device barrier that checks the call fingerprints, then the consumer GEMM on
        the caller's stream, and on the comm stream the copies of this rank's shard into
        its peers' buffers of this call's buffer set (``AlternatingSets``). On a GPU the
        GEMM is launched before the copies: it
        starts on its own shard at once, so the host time before its launch is all an
        eager call exposes (a profiled eager call on 2 x H200, copies first: the GEMM began
        165 us after the call, 80 us after the copy), and it waits per chunk for the peers'
        copies. The comm stream's fork point is recorded before the GEMM (or the copies
        would wait for it) and its wait enqueued after the launch. The interpreter runs a
        launch to completion, so there the copies come first. The GEMM zeroes its set's
        flags as it ends and leaves an SM free for a captured call's barrier."""
        m_loc = a_shard.shape[0]
        s = self._buffer_set()
        plan = self._plan(m_loc, b.shape[1], pull=False, s=s)
        whole = a_shard.shape[0]
        consumer_first = self.group.backend == "cuda"
        # Every peer is in this same call (the barrier carries the call fingerprint: a
        # peer that called with other shapes is reported at once) and done with its
        # previous call (a captured call's set is rewritten by every replay). On the
        # caller's stream, before the GEMM: on the comm stream, beside a persistent GEMM
        # that holds the SMs and waits for the copies, the one-program barrier may never
        # be scheduled.
        self._barrier()
        fork_mark(self.group)  # the copies may start once the inputs are ready
        if consumer_first:
            self._gemm(plan, a_shard, b, bias, out, m_loc)
        stream = fork_from_mark(self.group)
        for dst, lo, hi, signal, slot in plan[4]:
            src = a_shard if hi - lo == whole else a_shard[lo:hi]
            copy_and_signal(dst, src, signal, slot, stream=stream)
        if not consumer_first:
            self._gemm(plan, a_shard, b, bias, out, m_loc)
        join(self.group, stream)

    def _sm_pull(self, a_shard, b, bias, out):
        r, m_loc = self.rank, a_shard.shape[0]
        plan = self._plan(m_loc, b.shape[1], pull=True)
        first, count = self._set_slots()  # set 0: one set, barriers around each call
        gathered = self.gathered.local[0]
        gathered[r * m_loc : (r + 1) * m_loc].copy_(a_shard)
        self._barrier(first, count)  # every shard is staged; my flags are zero
        stream = fork(self.group)
        with use_stream(stream):
            pull_chunks_kernel[(self._pull_programs(),)](
                gathered, self.gathered.ptrs, plan[4], plan[4].shape[0], self.k,
                self.pad.buffer.local, BLOCK_M=32, BLOCK_K=256,
            )  # fmt: skip
        self._gemm(plan, a_shard, b, bias, out, m_loc)
        join(self.group, stream)
        self._barrier()  # nobody still pulls from my staged shard


class _ScatterGemm(AlternatingSets, ScatterVariants, _OverlappedGemm):
    """Shared by GEMM+RS and GEMM+AR: the row chunks in rank-rotated order, partial tiles
    pushed to their owner from the epilogue, the owner's tiles reduced in theirs."""

    STRATEGIES = ("auto", "fused", "signal_reorder", "none")
    # Four ranks (4 x H200, session 6, runs 2 and 4): at M = 2048 ``fused`` lost to cuBLAS +
    # NCCL on LLaMA-7B / 8B (estimated traffic 63 µs, GEMM 71 / 92 µs), eager and
    # captured, for both ops; on 70B (traffic 126 µs) it came within -5 / +8 % of it.
    MIN_OVERLAP_US = {"eager": 100.0, "graph": 100.0}
    WORLD_MIN_OVERLAP_US = {2: {"eager": 30.0, "graph": 30.0}}
    BROADCAST = False
    gather = None  # GEMM+AR only
    # Two chunks per owner: a rank reaches its own chunk j only after every peer has
    # finished that chunk a whole chunk earlier (full-mesh order), so the owner's reduction
    # does not wait on a peer's last tile.
    default_split = 2

    def __init__(self, group, max_m, n, k, dtype=torch.bfloat16, strategy="auto", **kw):
        super().__init__(group, max_m, n, k, dtype, strategy, **kw)
        w = self.world_size
        if self.max_m % w:
            raise InterlaceValueError(
                f"{self.op_name}: max_m = {self.max_m} must be a multiple of the world size {w}"
            )
        self._signal_reorder = None
        self._chunk_waits: dict = {}  # (counter slot, tiles) -> prepared wait (ce_*)
        if strategy == "signal_reorder":
            from .signal_reorder import SignalReorderGemmAR, SignalReorderGemmRS

            cls = SignalReorderGemmAR if self.BROADCAST else SignalReorderGemmRS
            self._signal_reorder = cls(
                group, self.max_m, self.n, self.k, dtype, config=self.config,
                max_spins=self.max_spins, eager_graphs=kw.get("eager_graphs"),
            )  # fmt: skip
        elif strategy == "ce_fused" or self._auto_ce_fused():
            # a receive buffer per buffer set (AlternatingSets); ``fused`` uses the first
            shape = (BUFFER_SETS, w, self.max_m // w, self.n)
            self.recv = self._track(symm_empty(shape, dtype, group))
        elif strategy != "none":
            self.recv = self._track(symm_empty((w, self.max_m // w, self.n), dtype, group))
        if strategy in ("ce_scatter", "ring", "ce_fused") or self._auto_ce_fused():
            self.partials = torch.empty(self.max_m * self.n, dtype=dtype, device=group.device)
        if strategy == "ring" and not 1 <= self._ring_programs() <= RING_MAX_PROGRAMS:
            raise InterlaceValueError(
                f"{self.op_name}: comm_sms must be in 1..{RING_MAX_PROGRAMS} for the ring, "
                f"got {self.comm_sms}"
            )

    #: ``auto`` overlaps with ``ce_fused`` instead of ``fused`` when the GEMM is estimated
    #: (``EST_TFLOPS``) at this many µs or more; None: never. Per world size where
    #: ``WORLD_CE_FUSED_MIN_GEMM_US`` names it.
    CE_FUSED_MIN_GEMM_US: float | None = None
    WORLD_CE_FUSED_MIN_GEMM_US: dict[int, float | None] = {}

    @classmethod
    def ce_fused_floor(cls, world: int) -> float | None:
        """The estimated GEMM time (µs) from which ``auto`` runs ``ce_fused`` with
        ``world`` ranks (None: never)."""
        return cls.WORLD_CE_FUSED_MIN_GEMM_US.get(world, cls.CE_FUSED_MIN_GEMM_US)

    def _auto_ce_fused(self) -> bool:
        return self.strategy == "auto" and self.ce_fused_floor(self.world_size) is not None

    def _overlapped(self, t_gemm_us: float) -> str:
        if self._auto_ce_fused() and t_gemm_us >= self.ce_fused_floor(self.world_size):
            return "ce_fused"
        return "fused"

    def _switch_barrier(self, strategy: str) -> None:
        """``fused`` and ``ce_fused`` share receive buffers and signal slots, and neither
        waits for the other's last call: when ``auto`` switches between them, a device
        barrier first (every rank's previous call has finished)."""
        if strategy in ("fused", "ce_fused"):
            if self._last_overlapped not in (None, strategy):
                self._barrier()
            self._last_overlapped = strategy

    _last_overlapped: str | None = None

    @staticmethod
    def _regions(world):
        return {
            "partial": world * MAX_SPLIT * (world - 1), "broadcast": world * MAX_SPLIT,
            # ce_scatter: per (source, piece) arrivals and the reduction's finished-program
            # counter (its last slot); per chunk finished-tile counts
            "arrival": world * MAX_SPLIT + 1, "chunk_done": world * MAX_SPLIT,
            # ring: per (step, program) arrivals from the left neighbour
            "ring": world * RING_MAX_PROGRAMS,
            # GEMM+AR ce_scatter: a peer's reduced rows have landed
            "gathered": world,
            # "go" and "done": the GEMM's entry barrier and exit clearing (kernels.gemm)
            "go": 1, "done": 1,
            # ce_fused: per chunk its finished staged (all-reduce: or reduced) tiles; per
            # buffer set the arrival flags, "go" and "done" (``_cef_set_slots``); all-reduce:
            # per peer its last gathered chunk
            "ce_done": world * MAX_SPLIT,
            "ce_sets": BUFFER_SETS * ScatterVariants.cef_set_size(world), "ce_gathered": world,
        }  # fmt: skip

    def _signal_launch_args(self) -> dict:
        """The GEMM's signal arguments: every slot after the barrier's is the op's, and the
        launch leaves them zero as it ends (so no call clears them first)."""
        start, size = self.pad.regions["barrier"]
        first = start + size
        return dict(
            sig=self.pad.buffer.local, err=self.error.address, rank=self.rank,
            max_spins=self.max_spins, world=self.world_size, go_slot=self.pad.offset("go"),
            clear=(first, self.pad.size - first),
        )  # fmt: skip

    def _comm_bytes(self, m_total, n):
        """The reduce-scatter traffic (for all-reduce too: its floor accounts for the rest)."""
        return m_total * n * self.dtype.itemsize * (self.world_size - 1) // self.world_size

    def _cfg(self, m: int, n: int, k: int) -> GemmConfig:
        cfg = super()._cfg(m, n, k)
        if self.group.backend != "cuda":
            return cfg
        return _gemm.scatter_config(cfg, n, widen=self.config is None)

    def _plan(self, m: int, n: int):
        """Segments from a checked schedule: its chunks in the order this rank sends them
        (own rows last); counters: one per (chunk, source) on the owner, one broadcast
        counter per chunk on every rank (all-reduce)."""
        if (found := self._known_plan((m, n))) is not None:
            return found
        w, r = self.world_size, self.rank
        m_loc = m // w
        cfg = self._cfg(m, n, self.k)
        template = (
            schedule.partition_all_reduce if self.BROADCAST else (schedule.full_mesh_reduce_scatter)
        )
        sched = template(w, m_loc, self._split_of("fused"), backend="sm", align=cfg.block_m)
        schedule.check(sched)
        slot_of = {c.id: i for i, c in enumerate(sched.row_order)}
        partial, broadcast = self.pad.offset("partial"), self.pad.offset("broadcast")
        go = self.pad.offset("go")  # pushes wait for the entry barrier
        segments = []
        for chunk, _ in schedule.chunk_order(sched, r):
            o, cid = chunk.owner, slot_of[chunk.id]
            tiles = tiles_of(chunk.rows, n, cfg)
            common = dict(row0=chunk.lo, rows=chunk.rows, owner=o, out_row0=chunk.lo - o * m_loc)
            if o != r:
                src = (r - o - 1) % w  # the owner numbers its sources from o + 1
                segments.append(
                    Segment(
                        kind="push", notify=partial + cid * (w - 1) + src,
                        final_slot=broadcast + cid,
                        final_expected=tiles if self.BROADCAST else 0,
                        wait_first=go, wait_count=1, wait_expected=1, **common,
                    )
                )  # fmt: skip
            else:
                segments.append(
                    Segment(
                        kind="reduce", wait_first=partial + cid * (w - 1), wait_count=w - 1,
                        wait_expected=tiles, notify=broadcast + cid, **common,
                    )
                )  # fmt: skip
        table = _gemm.segment_table(segments, n, cfg, self.group.device)
        grid = _gemm.programs_for(
            _gemm.total_tiles(segments, n, cfg), self.group.device, self.group.backend,
            single=True,
        )  # fmt: skip
        plan = (cfg, table, len(segments), grid, {})
        return self._keep_plan((m, n), plan)

    def _fused(self, a, b, bias, c):
        """One GEMM launch: its program 0 runs the entry barrier, and it clears its
        counters as it ends."""
        m, n = a.shape[0], b.shape[1]
        cfg, table, n_seg, grid, launchers = self._plan(m, n)
        run = launchers.get(bias is not None)
        if run is None:
            run = launchers[bias is not None] = _gemm.launcher(
                m, n, self.k, cfg, grid, table, n_seg, dtype=self.dtype,
                device=self.group.device, has_bias=bias is not None, recv=self.recv.local,
                recv_table=self.recv.ptrs, recv_rows=self.max_m // self.world_size,
                out_table=getattr(self, "result", self.recv).ptrs, sig_table=self.pad.ptrs,
                push=True, broadcast=self.BROADCAST, bar_slot=self.pad.offset("barrier"),
                **self._signal_launch_args(),
            )  # fmt: skip
        run(a, b, c, bias)

    def close(self) -> None:
        if self._signal_reorder is not None:
            self._signal_reorder.close()
        super().close()

    def _rows_check(self, a):
        if a.shape[0] % self.world_size:
            raise InterlaceValueError(
                f"{self.op_name}: a has {a.shape[0]} rows, not a multiple of the world size "
                f"{self.world_size} (each rank gets an equal share of the rows)"
            )


class GemmRS(_ScatterGemm):
    """``reduce_scatter(a @ b) (+ bias)`` along rows: ``a [M, k]`` (the rank's column
    shard of the activations), ``b [k, n]``; rank ``r`` gets rows ``[r*M/W, (r+1)*M/W)``
    of the sum over ranks, ``[M / world, n]``."""

    op_name = "gemm_rs"
    STRATEGIES = ("auto", "fused", "ce_fused", "ce_scatter", "ring", "signal_reorder", "none")
    # One chunk per owner: captured, split 1 beat 2 and 4 on 5 of 6 shapes (2 x H200,
    # history/2026-11-22-h200-w2-gemm-rs-ce-scatter.json). ``ce_fused``: an owner's chunk
    # j waits for the peers' copies of chunk j, so chunks must be short enough for the
    # copy of one to hide behind the GEMM of the next: 2 beat 4 and 8 at M = 8192 on
    # 2 x H200 (session 5, run 1).
    STRATEGY_SPLIT = {"ce_scatter": 1, "ce_fused": 2}
    # 2 x H200, M = 8192, captured (session 5, run 1): ``ce_fused`` (split 2) T / bound
    # 1.07 / 1.03 / 1.05 against ``fused`` 1.13 / 1.13 / 1.13 (7B, 8B, 70B); eager equal
    # (1.19 / 1.22 / 1.07 against 1.20 / 1.23 / 1.08). At M = 2048 it won only on 70B
    # (estimated GEMM ~740 µs; 7B / 8B ~140-190 µs, where its per-chunk launches cost).
    # 4 x H200 (session 6, run 2), M = 8192: ``ce_fused`` beat ``fused`` on 3 of 3
    # shapes captured (graph T / bound 1.33 / 1.28 / 1.06 against 1.79 / 1.35 / 1.19) and
    # 2 of 3 eager; at M = 2048 it lost on 7B / 8B (estimated GEMM 71 / 92 µs) and tied
    # on 70B (370 µs). The copy engine's lead grows with the world size: each rank sends
    # (W - 1) / W of its partials, over a GEMM W times shorter.
    CE_FUSED_MIN_GEMM_US = 250.0
    WORLD_CE_FUSED_MIN_GEMM_US = {2: 400.0}
    # With two ranks one chunk per owner beat two for ``fused`` eager on 3 of 3 shapes at
    # M = 8192 (2 x H200, session 4: T / bound 1.18 / 1.15 / 1.04 against 1.25 / 1.21 /
    # 1.16); GEMM+AR showed no difference and keeps two.
    WORLD_SPLIT = {2: 1}

    def __call__(self, a, b, bias=None, out=None):
        w = self.world_size
        self._check_call(a, b, bias, self.max_m)
        self._rows_check(a)
        m, n = a.shape[0], b.shape[1]
        if out is None:
            out = torch.empty(m // w, n, dtype=self.dtype, device=self.group.device)
        else:
            self._check_out(out, (m // w, n))
            _gemm.check_tma_aligned(self.op_name, out, names=("out",))
        strategy = self._resolve(m, n, self.k)
        self._begin_call(M=m, N=n, K=self.k, strategy=strategy, bias=bias is not None)
        self._switch_barrier(strategy)
        if strategy == "none":
            c = torch.matmul(a, b)
            dist.reduce_scatter_tensor(out, c, group=self._pg)
            if bias is not None:
                out += bias
        elif strategy == "signal_reorder":
            out = self._signal_reorder(a, b, bias=bias, out=out)
        else:
            run = {"ce_scatter": self._ce_scatter, "ce_fused": self._ce_fused, "ring": self._ring}
            run = run.get(strategy, self._fused)
            self._enqueue(strategy, lambda: run(a, b, bias, out), a, b, bias, out)
        self.last_strategy = strategy
        self._end()
        return out


class GemmAR(_ScatterGemm):
    """``all_reduce(a @ b) (+ bias)``: ``a [M, k]``, ``b [k, n]``; result ``[M, n]`` on
    every rank (a view of the context's buffer unless ``out=`` is given)."""

    op_name = "gemm_ar"
    BROADCAST = True
    STRATEGIES = ("auto", "fused", "ce_fused", "ce_scatter", "signal_reorder", "none")
    # ``ce_fused``, 4 x H200, M = 8192, graph T / bound (7B / 8B / 70B):
    # * gather="copy" (session 6, run 4): split 2 1.55 / 1.60 / 1.30, split 4 1.93 /
    #   1.93 / 1.22, split 8 2.52 / 2.60 / 1.30; each chunk's wait and copies cost the comm
    #   stream ~10 µs beyond the copy, and the gather doubles the copies;
    # * gather="epilogue" (run 5): split 2 1.30 / 1.42 / 1.20, split 4 1.54 / 1.66 /
    #   1.27, against ``fused`` 1.51 / 1.54 / 1.26 and gather="copy" 1.54 / 1.80 / 1.26 in
    #   the same run; eager 1.37 / 1.51 / 1.24 against 1.63 / 1.65 / 1.28. At M = 2048 it
    #   beat ``fused`` on 70B only (estimated GEMM 370 µs; 7B / 8B fall back to ``none``).
    # Two ranks: not measured with rounds; ``fused`` there.
    STRATEGY_SPLIT = {"ce_scatter": 1, "ce_fused": 2}
    CE_FUSED_MIN_GEMM_US = 250.0
    WORLD_CE_FUSED_MIN_GEMM_US = {2: None}

    #: how ``ce_fused`` moves the reduced rows to the peers: ``"copy"`` (the copy engine,
    #: chunk by chunk) or ``"epilogue"`` (the owner's epilogue stores each reduced tile
    #: into every rank's result, as ``fused``)
    GATHERS = ("copy", "epilogue")

    def __init__(
        self, group, max_m, n, k, dtype=torch.bfloat16, strategy="auto", gather="epilogue",
        **kw,
    ):  # fmt: skip
        if gather not in self.GATHERS:
            raise InterlaceValueError(
                f"{self.op_name}: gather must be one of {self.GATHERS}, got {gather!r}"
            )
        self.gather = gather
        super().__init__(group, max_m, n, k, dtype, strategy, **kw)
        if strategy != "none":
            self.result = self._track(symm_empty((self.max_m, self.n), dtype, group))
        self._result_views: dict[tuple[int, int], torch.Tensor] = {}

    def _result_view(self, m: int, n: int) -> torch.Tensor:
        """The ``[m, n]`` view of the symmetric result buffer (made once per shape)."""
        view = self._result_views.get((m, n))
        if view is None:
            view = self._result_views[(m, n)] = self.result.local.view(-1)[: m * n].view(m, n)
        return view

    def _overlapped_call(self, strategy, a, b, bias, out):
        """The strategies that reduce into this context's symmetric result: that buffer's
        view, or ``out`` holding a copy of it."""
        result = self._result_view(a.shape[0], b.shape[1])
        run = {"ce_scatter": self._ce_all_reduce, "ce_fused": self._ce_fused}
        run = run.get(strategy, self._fused)

        def enqueue():
            run(a, b, bias, result)
            if out is not None:
                out.copy_(result)

        self._enqueue(strategy, enqueue, a, b, bias, out)
        return result if out is None else out

    def __call__(self, a, b, bias=None, out=None):
        self._check_call(a, b, bias, self.max_m)
        self._rows_check(a)
        m, n = a.shape[0], b.shape[1]
        out = self._check_out(out, (m, n))
        strategy = self._resolve(m, n, self.k)
        self._begin_call(M=m, N=n, K=self.k, strategy=strategy, bias=bias is not None)
        self._switch_barrier(strategy)
        if strategy == "none":
            result = torch.matmul(a, b, out=out) if out is not None else torch.matmul(a, b)
            dist.all_reduce(result, group=self._pg)
            if bias is not None:
                result += bias
        elif strategy == "signal_reorder":
            result = self._signal_reorder(a, b, bias=bias, out=out)
        else:
            result = self._overlapped_call(strategy, a, b, bias, out)
        self.last_strategy = strategy
        self._end()
        return result


__all__ = ["AGGemm", "GemmAR", "GemmRS"]
