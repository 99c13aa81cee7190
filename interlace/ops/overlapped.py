"""The base of the overlapped tensor-parallel GEMMs: AG+GEMM (:mod:`.ag_gemm`), GEMM+RS
(:mod:`.gemm_rs`) and GEMM+AR (:mod:`.gemm_ar`).

Each op is a context built once for a capacity and called many times, on every rank::

    ag = interlace.AGGemm(group, max_m=8192, n=7168, k=8192)
    c = ag(a_shard, b)          # == all_gather(a_shard) @ b
    rs = interlace.GemmRS(group, max_m=8192, n=8192, k=7168)
    y = rs(a, b)                # == reduce_scatter(a @ b) along rows
    ar = interlace.GemmAR(group, max_m=8192, n=8192, k=7168)
    z = ar(a, b)                # == all_reduce(a @ b)

Strategies common to the three (``strategy=``; each op's module lists its own):

* ``none``: cuBLAS + NCCL back to back: the baseline, and the fallback.
* ``auto``: ``fused`` (GEMM+RS / GEMM+AR on large problems: ``ce_fused``), unless the
  cost model says overlap cannot pay for its extra synchronisation (small problems): then
  ``none``. The thresholds are one table, :mod:`interlace.ops.policy`. ``last_strategy``
  says which ran.

Eager calls (``eager_graphs``, on by default where the driver allows): each kind of call is
captured once into a CUDA graph and replayed with the call's own tensors
(``OpContext._enqueue``, ``runtime.graphs``), one launch instead of every kernel, copy and
signal write.

Inputs: ``bfloat16`` or ``float16``, contiguous, any M, N, K (TMA is used when rows are
16-byte aligned, plain loads otherwise); ``bias`` (shape ``[n]``) is added once, after the
reduction. Every call is collective: all ranks call with the same shapes.
"""

from __future__ import annotations

import torch

from ..errors import InterlaceValueError
from . import segment_gemm
from ._context import OpContext, replay_key
from .policy import OverlapPolicy, estimate_us, lookup
from .segment_gemm import MAX_SPLIT, GemmConfig


class OverlappedGemm(OpContext):
    """Shared by AG+GEMM, GEMM+RS and GEMM+AR: the capacity checks, the strategy a call
    runs (``auto``: :mod:`interlace.ops.policy`), the tile config, the plan caches and
    the call checks. ``policy`` overrides the table's entry for this op and world size."""

    STRATEGIES: tuple[str, ...] = ("auto", "fused", "none")

    def __init__(
        self, group, max_m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
        strategy: str = "auto", split: int | None = None, comm_sms: int = 16,
        config: GemmConfig | None = None, max_spins=None, eager_graphs: bool | None = None,
        policy: OverlapPolicy | None = None,
    ):  # fmt: skip
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"{self.op_name}: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        segment_gemm.check_gemm_shape(self.op_name, max_m, n, k, dtype)
        if split is not None:
            split = int(split)
            if not 1 <= split <= MAX_SPLIT:
                raise InterlaceValueError(
                    f"{self.op_name}: split must be in 1..{MAX_SPLIT}, got {split}"
                )
        w = group.world_size
        self.policy = policy if policy is not None else lookup(self.op_name, w)
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
        policy's for that strategy."""
        if self._split_given is not None:
            return self._split_given
        return self.policy.split_of(strategy)

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
            t_gemm, t_comm = estimate_us(2.0 * m_total * n * k, self._comm_bytes(m_total, n))
            floor = self.policy.floor_us(captured=key[-1])
            found = self._overlapped(t_gemm) if min(t_gemm, t_comm) >= floor else "none"
            self._resolved[key] = found
        return found

    def _overlapped(self, t_gemm_us: float) -> str:
        """The strategy ``auto`` overlaps with, for a GEMM estimated at ``t_gemm_us``."""
        return "fused"

    def _store_cfg(self, m: int, n: int, k: int) -> GemmConfig:
        """The tile config for an epilogue of plain stores."""
        return self.config or segment_gemm.gemm_config(m, n, k, self.group.backend)

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

    # ------------------------------------------------------------------ replayed calls
    def _replayed(self, a, b, bias, rows: tuple[int, int] | None, out=None):
        """The short path of an eager call (``OpContext._armed``): a call like one that went
        the whole way replays its graph at once, into ``out`` where given, else into a
        fresh output of ``a``'s rows times ``rows[0] / rows[1]`` (None: the op's own
        result buffer, kept in the armed note). Returns ``(key, result)``: ``result`` None
        where the call must go the whole way, which then arms ``key`` (:meth:`_arm_call`).
        The key holds ``out``'s dtype, shape, strides, device and alignment: all that the
        checks of ``out`` read."""
        operands = (a, b) if bias is None else (a, b, bias)
        if out is not None:
            operands += (out,)
        key, ptrs = replay_key((self._next_set, bias is not None), operands)
        armed = self._armed(key)
        if armed is None or self._switches(armed.note[0]):
            return key, None
        strategy, result = armed.note
        p_out = None
        if out is not None:
            result, p_out = out, ptrs[-1]
        elif rows is not None:
            m = a.shape[0] * rows[0] // rows[1]
            out = result = torch.empty(m, b.shape[1], dtype=self.dtype, device=self.group.device)
            p_out = out.data_ptr()
        p_bias = None if bias is None else ptrs[2]
        self._replay(armed, (a, b, bias, out), (ptrs[0], ptrs[1], p_bias, p_out))
        self.last_strategy = strategy
        return key, result

    def _arm_call(self, key, strategy: str, result=None) -> None:
        """After a call that went the whole way: ``_arm`` its key, noting the strategy it
        ran and (``result``, for a call without ``out``) the op's own result buffer it
        returned."""
        self._arm(key, (strategy, result))

    def _switches(self, strategy: str) -> bool:
        """Whether a call of ``strategy`` must first run the device barrier of a strategy
        switch (it then goes the whole way); GEMM+RS / GEMM+AR override."""
        return False

    def _check_call(self, a, b, bias, a_rows_max: int):
        self._begin()
        if segment_gemm.operands_fit(self, a, b, bias, a_rows_max):
            return  # the common case, in one expression (eager calls pay for every check)
        segment_gemm.check_gemm_call(self, a, b, bias)
        if a.shape[0] > a_rows_max or a.shape[0] == 0:
            raise InterlaceValueError(
                f"{self.op_name}: a has {a.shape[0]} rows; this context takes 1 to "
                f"{a_rows_max} (max_m = {self.max_m})"
            )

    @property
    def _pg(self):
        return self.group.process_group
