"""``auto``'s policy for the overlapped GEMMs (AG+GEMM, GEMM+RS, GEMM+AR), in one table.

``auto`` estimates a call's GEMM time and communication time from two rates
(:data:`EST_TFLOPS`, :data:`EST_LINK_GBPS`) and runs ``none`` (cuBLAS + NCCL back to back)
when the smaller of the two is under the op's floor: what overlap must save to pay for its
extra host launches (eager) or its device-side synchronisation (CUDA-graph capture).
Above the floor it overlaps with ``fused``, or with ``ce_fused`` (GEMM+RS / GEMM+AR) once
the estimated GEMM reaches ``ce_fused_min_gemm_us``. The table also holds the chunk split
each strategy uses by default.

Every entry names the results that back it (files under ``benchmarks/results/``; the
ratios are time / bound, where bound = max(GEMM alone, communication alone)). The table is
data only: this module imports nothing from interlace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

#: Rates ``auto`` estimates with: cuBLAS on the public shapes (~650 TFLOP/s on an H200)
#: and NCCL per peer pair over NVLink (~200 GB/s on 2 x H200),
#: ``benchmarks/results/2026-11-22-h200-w2.json``.
EST_TFLOPS = 650.0
EST_LINK_GBPS = 200.0


def _frozen(d: dict) -> MappingProxyType:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class OverlapPolicy:
    """What ``auto`` and the default chunk split of one op at one world size are.

    * ``min_overlap_eager_us`` / ``min_overlap_graph_us``: overlap only when both the GEMM
      and the communication are estimated at this many µs or more (eager call / call
      captured into a CUDA graph);
    * ``split``: chunks per owner of the ``fused`` (and ``sm_pull``) schedule;
    * ``strategy_split``: a strategy's own chunks per owner, where it differs;
    * ``ce_fused_min_gemm_us``: overlap with ``ce_fused`` instead of ``fused`` from this
      estimated GEMM time (µs); None: never.
    """

    min_overlap_eager_us: float
    min_overlap_graph_us: float
    split: int = 1
    strategy_split: MappingProxyType = field(default_factory=lambda: _frozen({}))
    ce_fused_min_gemm_us: float | None = None

    def floor_us(self, captured: bool) -> float:
        return self.min_overlap_graph_us if captured else self.min_overlap_eager_us

    def split_of(self, strategy: str) -> int:
        return self.strategy_split.get(strategy, self.split)


# GEMM+RS / GEMM+AR ``ce_scatter`` and ``ce_fused`` chunks per owner. ``ce_scatter``: one
# chunk per owner beat 2 and 4 on 5 of 6 shapes captured (2 x H200,
# history/2026-11-22-h200-w2-gemm-rs-ce-scatter.json). ``ce_fused``: an owner's chunk j
# waits for the peers' copies of chunk j, so a chunk must be short enough for its copy to
# hide behind the GEMM of the next: 2 beat 4 and 8 at M = 8192 on 2 x H200
# (history/2026-11-22-h200-w2-18.json).
_CE_SPLIT = _frozen({"ce_scatter": 1, "ce_fused": 2})

#: ``(op, world size)`` -> policy; ``(op, None)`` is the op's default for other sizes.
POLICY: dict[tuple[str, int | None], OverlapPolicy] = {
    # AG+GEMM. Eager ``fused`` beat cuBLAS + NCCL at M = 2048 on 6 of 6 (shape, run) pairs
    # with estimated traffic of 40-70 µs (2 x H200, history/2026-11-22-h200-w2-05-runs.json),
    # so the eager floor is 30 µs; captured, it won at M = 2048 on all but one shape
    # (benchmarks/results/2026-11-22-h200-w2.json): 15 µs. One chunk per owner.
    ("ag_gemm", None): OverlapPolicy(30.0, 15.0, split=1),
    # GEMM+RS, four ranks and more. At M = 2048 ``fused`` lost to cuBLAS + NCCL on
    # LLaMA-7B / 8B (estimated traffic 63 µs, GEMM 71 / 92 µs), eager and captured, and
    # came within -5 / +8 % on 70B (traffic 126 µs): floor 100 µs (4 x H200,
    # history/2026-11-22-h200-w4-01.json, -02.json). ``ce_fused`` from an estimated GEMM
    # of 250 µs: at M = 8192 it beat ``fused`` on 3 of 3 shapes captured (1.33 / 1.28 /
    # 1.06 against 1.79 / 1.35 / 1.19) and 2 of 3 eager; at M = 2048 it lost on 7B / 8B
    # (estimated GEMM 71 / 92 µs) and tied on 70B (370 µs), history/2026-11-22-h200-w4-01.json.
    # Two chunks per owner for ``fused``: a rank reaches its own chunk j only after every
    # peer finished that chunk a whole chunk earlier, so the owner's reduction does not
    # wait on a peer's last tile.
    ("gemm_rs", None): OverlapPolicy(
        100.0, 100.0, split=2, strategy_split=_CE_SPLIT, ce_fused_min_gemm_us=250.0
    ),
    # GEMM+RS, two ranks. Eager ``fused`` beat cuBLAS + NCCL at M = 2048 on 3 of 3 shapes
    # once the host path went through driver calls and direct launches (~35 µs a call):
    # floor 30 µs (history/2026-11-22-h200-w2-14-final.json). One chunk per owner beat
    # two for eager ``fused`` at M = 8192 on 3 of 3 shapes (1.18 / 1.15 / 1.04 against
    # 1.25 / 1.21 / 1.16, same file). ``ce_fused`` (split 2) at M = 8192, captured, 1.07 /
    # 1.03 / 1.05 against ``fused`` 1.13 / 1.13 / 1.13 (7B, 8B, 70B), eager equal; at
    # M = 2048 it won only on 70B (estimated GEMM ~740 µs; 7B / 8B ~140-190 µs, where its
    # per-chunk launches cost): from 400 µs (history/2026-11-22-h200-w2-18.json).
    ("gemm_rs", 2): OverlapPolicy(
        30.0, 30.0, split=1, strategy_split=_CE_SPLIT, ce_fused_min_gemm_us=400.0
    ),
    # GEMM+AR, four ranks and more: the floors of GEMM+RS (same files). ``ce_fused``
    # (gather="epilogue", split 2) at M = 8192, captured: 1.30 / 1.42 / 1.20 against
    # ``fused`` 1.51 / 1.54 / 1.26; eager 1.37 / 1.51 / 1.24 against 1.63 / 1.65 / 1.28;
    # split 4 1.54 / 1.66 / 1.27 (history/2026-11-22-h200-w4-03.json). At M = 2048 it beat
    # ``fused`` on 70B only (estimated GEMM 370 µs): from 250 µs.
    ("gemm_ar", None): OverlapPolicy(
        100.0, 100.0, split=2, strategy_split=_CE_SPLIT, ce_fused_min_gemm_us=250.0
    ),
    # GEMM+AR, two ranks: eager ``fused`` beat cuBLAS + NCCL at M = 2048 on 2 of 3 shapes,
    # the third a tie (0.286 vs 0.289 ms): floor 30 µs
    # (history/2026-11-22-h200-w2-14-final.json); one chunk per owner against two showed
    # no difference, so it keeps two; ``ce_fused`` not measured there: never.
    ("gemm_ar", 2): OverlapPolicy(30.0, 30.0, split=2, strategy_split=_CE_SPLIT),
}


def lookup(op: str, world: int) -> OverlapPolicy:
    """The policy of ``op`` (``"ag_gemm"``, ``"gemm_rs"``, ``"gemm_ar"``) with ``world``
    ranks."""
    found = POLICY.get((op, world))
    return found if found is not None else POLICY[(op, None)]


def estimate_us(flops: float, comm_bytes: float) -> tuple[float, float]:
    """``(GEMM µs, communication µs)`` estimated from :data:`EST_TFLOPS` and
    :data:`EST_LINK_GBPS`."""
    return flops / (EST_TFLOPS * 1e12) * 1e6, comm_bytes / (EST_LINK_GBPS * 1e9) * 1e6
