"""An expert-parallel MoE layer: dispatch, one linear map per local expert, combine::

    moe = interlace.EPMoE(group, max_tokens=4096, hidden=7168, experts=256, topk=8)
    y = moe(x, topk_idx, topk_weights, weight)   # weight [local experts, hidden, hidden]

Strategies:

* ``fused`` (overlapped): the :class:`~interlace.ops.ep.dispatch.EPAllToAll` dispatch
  kernels run on the current stream and expand the received rows into a *source-major*
  layout (source rank ``s``'s rows in a region of fixed size, grouped by local expert
  there), raising a local flag per source once its rows are stored. A second stream
  runs, per source in arrival order (own rank first, then rank-rotated): a one-program
  wait on that source's flag, ``torch._grouped_mm`` over the source's region (its
  ``offs`` written by the expansion, so no host synchronisation), and the combine send
  of that source's tokens back to their home rank. The grouped GEMM of the first source
  thus runs while later sources' rows are still landing, and each source's results are
  on their way home while the next source's GEMM runs. The home-side sum follows the
  join. torch's grouped GEMM per source segment rather than a persistent Triton grouped
  GEMM waiting per tile: it keeps the library's grouped-GEMM speed (``torch._grouped_mm``
  ran at 300-630 TFLOP/s on one H100 at the TP MoE shapes, a Triton grouped GEMM of this
  project at about half that), and nothing spins on an SM while waiting but one
  single-program wait kernel per source.
* ``serial``: the same dispatch into the expert-major layout, one ``torch._grouped_mm``
  over all rows after the whole dispatch, then the combine.
* ``none``: ``all_to_all_single`` (split sizes read back to the host) +
  ``torch._grouped_mm`` + ``all_to_all_single`` (:mod:`.baseline`).
"""

from __future__ import annotations

import torch

from ...errors import InterlaceTypeError, InterlaceValueError
from ...language.primitives import wait_kernel
from ...runtime import fork_from_mark, fork_mark, join, use_stream
from ...runtime.symmetric import check_group
from .._launch import launch
from . import combine as _combine
from .baseline import a2a_combine, a2a_dispatch
from .dispatch import EPAllToAll
from .layout import check_routing_args

#: Index of the comm stream the overlapped path runs its per-source GEMMs on.
_STREAM = 3


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
    """``rows[segment e] @ weight[e]`` for each expert segment (``offsets``: inclusive
    prefix sums of the segment sizes, int32, on the device)."""
    return torch._grouped_mm(rows, weight, offs=offsets)


class EPMoE:
    """See the module docstring. Collective: every rank calls with its own tokens."""

    STRATEGIES = ("fused", "serial", "none")
    op_name = "ep_moe"

    def __init__(
        self, group, max_tokens: int, hidden: int, experts: int, topk: int,
        dtype: torch.dtype = torch.bfloat16, strategy: str = "fused",
        capacity: int | None = None, **options,
    ):  # fmt: skip
        check_group(self.op_name, group)  # first, as every context's constructor
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"{self.op_name}: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        self.group, self.strategy, self.dtype = group, strategy, dtype
        self.hidden, self.experts, self.topk = int(hidden), int(experts), int(topk)
        self.e_loc = self.experts // group.world_size
        self.a2a = EPAllToAll(
            group, max_tokens, hidden, experts, topk, dtype, capacity=capacity, **options
        )
        # source-major regions: a source sends at most max_tokens * topk rows
        self.cap_s = self.a2a.max_tokens * self.topk
        self._src_recv = None

    def _check_weight(self, weight) -> None:
        if not isinstance(weight, torch.Tensor):
            raise InterlaceTypeError(f"{self.op_name}: weight must be a torch.Tensor")
        want = (self.e_loc, self.hidden, self.hidden)
        if weight.dtype != self.dtype:
            raise InterlaceTypeError(
                f"{self.op_name}: weight has dtype {weight.dtype}, expected {self.dtype}"
            )
        if tuple(weight.shape) != want:
            raise InterlaceValueError(
                f"{self.op_name}: weight must be {list(want)} of {self.dtype}, got "
                f"{tuple(weight.shape)} of {weight.dtype}"
            )
        if weight.device != self.group.device:
            raise InterlaceValueError(
                f"{self.op_name}: weight is on {weight.device}, expected {self.group.device}"
            )

    def __call__(self, x, topk_idx, topk_weights, weight) -> torch.Tensor:
        self._check_weight(weight)
        if self.strategy == "none":
            check_routing_args(self.op_name, x, topk_idx, topk_weights, self.a2a)
            rows, _, offsets, state = a2a_dispatch(
                self.group, x, topk_idx, topk_weights, self.experts
            )
            return a2a_combine(self.group, grouped_linear(rows, weight, offsets), state)
        if self.strategy == "serial" or self.a2a.fp8:
            handle = self.a2a.dispatch(x, topk_idx, topk_weights)
            rows = grouped_linear(handle.recv_x, weight, handle.expert_offsets)
            return self.a2a.combine(rows, handle)
        return self._overlapped(x, topk_idx, topk_weights, weight)

    def _overlapped(self, x, topk_idx, topk_weights, weight) -> torch.Tensor:
        a2a, group = self.a2a, self.group
        a2a._begin()
        check_routing_args(self.op_name, x, topk_idx, topk_weights, a2a)
        a2a._fingerprint()
        n, w = x.shape[0], group.world_size
        if self._src_recv is None:
            self._src_recv = torch.empty(w * self.cap_s, self.hidden, dtype=self.dtype,
                                         device=group.device)  # fmt: skip
            self._src_offs = torch.zeros(w, self.e_loc, dtype=torch.int32, device=group.device)
        if n == 0:  # no tokens on this rank: _dispatch passes placeholders
            x = topk_idx = topk_weights = None
        out = torch.empty(n, self.hidden, dtype=self.dtype, device=group.device)
        fork_mark(group, _STREAM)
        side = fork_from_mark(group, _STREAM)
        a2a._dispatch(n, x, topk_idx, topk_weights, (self._src_recv, self._src_offs, self.cap_s))
        a2a._calls += 1
        a2a._dispatched = (a2a._calls, n)
        done, sig = a2a.pad.offset("src_done"), a2a.pad.buffer.local
        with use_stream(side):
            for i in range(w):
                s = (group.rank + i) % w
                launch(
                    wait_kernel, 1, sig, done + s, 1, a2a.cfg.programs, a2a.error.address,
                    group.rank, a2a.max_spins, RESET=True,
                )  # fmt: skip
                region = self._src_recv[s * self.cap_s : (s + 1) * self.cap_s]
                rows = grouped_linear(region, weight, self._src_offs[s])
                _combine.send_rows(a2a, rows, only_src=s)
        join(group, side, _STREAM)
        _combine.recv_sum(a2a, n, out)
        a2a._end()
        return out

    def check(self) -> None:
        self.a2a.check()

    def close(self) -> None:
        self.a2a.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
