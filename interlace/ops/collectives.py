"""Standalone collectives over symmetric memory: all-gather, reduce-scatter, all-reduce.

They prove the runtime and the device primitives, and they are the communication halves
that the overlapped ops reuse. Each is a context that owns its symmetric buffers, built
once for a capacity and called many times::

    ag = interlace.AllGather(group, max_numel=n, dtype=torch.bfloat16, method="ce_push")
    y = ag(x)          # == torch.distributed.all_gather_into_tensor(y, x)
    ag.close()

Tensors are gathered / scattered along dim 0. Results equal torch.distributed's: all-gather
bit for bit; reductions accumulate in fp32 (in rank order for all-reduce, so every rank gets
the same bits). Every call is collective: all ranks call with the same shapes.

Without ``out=`` a call may return a view of the context's symmetric buffer (zero copy):
it stays valid until the next call on the same context.

The copy-engine methods (``AllGather`` ``ce_push``, ``ReduceScatter`` ``ce_scatter``) need
no device barrier in an eager call: consecutive calls alternate between two sets of
receive buffers and flags (``_context.AlternatingSets``; a call captured in a CUDA graph
uses a third set behind a barrier). The cost is three receive buffers instead of one.
Their copies raise each arrival flag to the call's ``call_flag`` (its fingerprint's
op-and-arguments part), which the receiver expects: a peer that called with another
length or method raises ``CallMismatchError`` on every rank at once.

Eager calls replay CUDA graphs (``eager_graphs``, as the overlapped ops): from the second
call of a kind (length, buffer set, operand alignment) on, a call's copies, flag writes,
barriers and kernels are one graph launch from the host.
"""

from __future__ import annotations

import torch

from ..errors import InterlaceValueError
from ..kernels.collective import (
    copy_and_consume_kernel,
    gather_pull_kernel,
    reduce_arrivals_kernel,
    reduce_pull_kernel,
)
from ..runtime import Group, fork, join, symm_empty, use_stream
from ._context import (
    BUFFER_SETS,
    GRAPH_SET,
    AlternatingSets,
    OpContext,
    cdiv,
    persistent_grid,
    replay_key,
)
from ._launch import PreparedLaunch, launch
from ._trace import copy_and_signal  # recorded as a copy where a recorder is in force

COPY_BLOCK = 4096
REDUCE_BLOCK = 2048


def _check_method(op: str, method: str, methods: tuple[str, ...]) -> str:
    if method not in methods:
        raise InterlaceValueError(f"{op}: method must be one of {methods}, got {method!r}")
    return method


class AllGather(AlternatingSets, OpContext):
    """All-gather along dim 0 over symmetric memory.

    Methods:

    * ``ce_push`` (default): each rank's copy engine pushes its shard into every peer's
      output buffer, peer by peer in rank-rotated order, raising the peer's arrival flag
      from the stream after each copy; no device barrier when eager (module docstring).
      The result is a view of the symmetric buffer.
    * ``ce_pull``: the shard is staged in symmetric memory and every rank's copy engine
      pulls the peers' shards, peer by peer in rank-rotated order.
    * ``sm_pull``: as ``ce_pull`` but the pulls are loads by a Triton kernel.
    """

    op_name = "all_gather"
    METHODS = ("ce_push", "ce_pull", "sm_pull")

    def __init__(
        self,
        group: Group,
        max_numel: int,
        dtype: torch.dtype,
        method: str = "ce_push",
        max_spins=None,
        eager_graphs: bool | None = None,
    ):
        self.method = _check_method(self.op_name, method, self.METHODS)
        w = group.world_size
        super().__init__(group, dtype, max_numel, {"arrival": BUFFER_SETS * w}, max_spins)
        self._init_eager_graphs(eager_graphs)
        # ce_push: the prepared own-shard copy and arrival wait, per (buffer set, numel)
        self._arrival_waits: dict[tuple[int, int], PreparedLaunch] = {}
        if method == "ce_push":
            self.gathered = self._track(symm_empty((BUFFER_SETS, w * self.max_numel), dtype, group))
        else:
            self.staging = self._track(symm_empty((self.max_numel,), dtype, group))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        key = None
        if out is None:  # (a call like an earlier one replays its graph at once)
            key, ptrs = replay_key(self._next_set, (x,))
            armed = self._armed(key)
            if armed is not None:
                if self.method == "ce_push":  # the note: the result's view of this set
                    self._replay(armed, (x,), ptrs)
                    return armed.note.view(armed.note.shape)  # (a view of its own)
                result = x.new_empty(armed.note)  # the note: the result's shape
                self._replay(armed, (x, result), (ptrs[0], result.data_ptr()))
                return result
        self._begin()
        self._check_tensor("x", x, max_numel=self.max_numel)
        shape = (self.world_size * x.shape[0], *x.shape[1:])
        out = self._check_out(out, shape)
        self._begin_call(graphed=True, numel=x.numel(), method=self.method)
        if self.method == "ce_push":
            n, s = x.numel(), self._next_set  # (the set a replay uses: see _enqueue)
            ran = []
            self._enqueue("push", lambda: ran.append(self._push(x, n)), x)
            result = (ran[0] if ran else self.gathered.local[s, : self.world_size * n]).view(shape)
            if out is not None:
                result = out.copy_(result)
        else:
            result = out if out is not None else x.new_empty(shape)
            self._enqueue("pull", lambda: self._pull(x, result), x, result)
        self._end()
        # (key None where out= was given: nothing armed)
        self._arm(key, result if self.method == "ce_push" else shape)
        return result

    def _pull(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n, w, r = x.numel(), self.world_size, self.rank
        self._stage(x)
        self._barrier()  # every rank's shard is staged
        flat = out.view(-1)
        if self.method == "ce_pull":
            for i in range(w):
                peer = (r + i) % w
                flat[peer * n : (peer + 1) * n].copy_(self.staging.peers[peer][:n])
        else:
            launch(
                gather_pull_kernel, persistent_grid(self.group, w * cdiv(n, COPY_BLOCK))[0],
                flat, self.staging.ptrs, self.staging.local, n, r, w,
                BLOCK=COPY_BLOCK, num_warps=8,
            )  # fmt: skip
        self._barrier()  # nobody still reads my staging buffer
        return out

    def _push(self, x: torch.Tensor, n: int) -> torch.Tensor:
        w, r = self.world_size, self.rank
        src = x.reshape(-1)
        s = self._buffer_set()
        first = self.pad.offset("arrival") + s * w  # this set's flags, one per source
        if s == GRAPH_SET:
            self._barrier()  # every peer is done with the previous replay's result
        for i in range(1, w):
            peer = (r + i) % w
            dst = self.gathered.peers[peer][s, r * n : (r + 1) * n]
            copy_and_signal(dst, src, self.pad.buffer.peers[peer], first + r, self.call_flag)
        # One launch: my own shard copied by SMs beside the copy engine's pushes, and the
        # w - 1 arrival flags consumed (self-resetting; my own slot is never raised).
        copy_wait = self._arrival_waits.get((s, n))
        if copy_wait is None:
            args = (
                self.gathered.local[s, r * n :], None, n, self.pad.buffer.local, first, w, r,
                self.error.address, r, self.max_spins,
            )  # fmt: skip
            grid = persistent_grid(self.group, cdiv(n, COPY_BLOCK))[0]
            copy_wait = self._arrival_waits[(s, n)] = PreparedLaunch(
                copy_and_consume_kernel, grid, args,
                {"BLOCK": COPY_BLOCK, "CALL_FLAGS": True, "num_warps": 8}, ("src",),
            )  # fmt: skip
        copy_wait(src)
        return self.gathered.local[s, : w * n]


class ReduceScatter(AlternatingSets, OpContext):
    """Reduce-scatter (sum) along dim 0: rank ``r`` gets the sum of every rank's
    ``x[r*m : (r+1)*m]``, accumulated in fp32.

    Methods:

    * ``ce_scatter`` (default): the copy engine pushes each chunk to its owner, in
      ``pieces`` parts per chunk, peer by peer in rank-rotated order, raising a flag per
      (source, piece) from the stream; a Triton kernel on the caller's stream reduces each
      piece as soon as it has landed, overlapping the reduction with the transfers, and
      clears the flags as it ends. No device barrier when eager (module docstring).
    * ``sm_pull``: the input is staged in symmetric memory and a Triton kernel on each rank
      loads its chunk from every peer and sums it.
    """

    op_name = "reduce_scatter"
    METHODS = ("ce_scatter", "sm_pull")
    MAX_PIECES = 16

    def __init__(
        self,
        group: Group,
        max_numel: int,
        dtype: torch.dtype,
        method: str = "ce_scatter",
        pieces: int | None = None,
        max_spins=None,
        eager_graphs: bool | None = None,
    ):
        """``max_numel``: capacity of the per-rank *output* (elements)."""
        self.method = _check_method(self.op_name, method, self.METHODS)
        if pieces is not None and not 1 <= pieces <= self.MAX_PIECES:
            raise InterlaceValueError(
                f"{self.op_name}: pieces must be in 1..{self.MAX_PIECES}, got {pieces}"
            )
        w = group.world_size
        self._set_slots = w * self.MAX_PIECES + 1  # per set: (source, piece) flags, a counter
        regions = {"arrival": BUFFER_SETS * self._set_slots}
        super().__init__(group, dtype, max_numel, regions, max_spins)
        self.pieces = pieces
        self._plans: dict[tuple[int, int], tuple] = {}
        self._init_eager_graphs(eager_graphs)
        if method == "ce_scatter":
            self.recv = self._track(symm_empty((BUFFER_SETS, w, self.max_numel), dtype, group))
        else:
            self.staging = self._track(symm_empty((w * self.max_numel,), dtype, group))

    def _pieces_for(self, m: int) -> int:
        """Pieces per chunk: each at least 32 MB, at most 4 (measured on 2 x H200: at 64 MB
        per rank one piece took 0.200-0.223 ms and two 0.223-0.230; at 256 MB 4 beat 1 and
        2). One piece also saves the comm stream's fork and join."""
        if self.pieces is not None:
            return self.pieces
        chunk_bytes = m * self.dtype.itemsize
        return max(1, min(4, chunk_bytes // (32 << 20)))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # (a call like an earlier one replays its graph at once; the note: the result's shape)
        key, result = self._replayed_out(self._next_set, (x,), out, lambda a: x.new_empty(a.note))
        if result is not None:
            return result
        self._begin()
        w = self.world_size
        self._check_tensor("x", x, max_numel=w * self.max_numel, numel_multiple=w)
        shape = (x.shape[0] // w, *x.shape[1:])
        out = self._check_out(out, shape)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=x.device)
        m = x.numel() // w
        self._begin_call(graphed=True, numel=x.numel(), method=self.method)
        self._enqueue(self.method, lambda: self._reduce_scatter(x, out, m), x, out)
        self._end()
        self._arm(key, shape)
        return out

    def _reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, m: int) -> None:
        w, r = self.world_size, self.rank
        src = x.reshape(w, m)
        if self.method == "ce_scatter":
            self._scatter_reduce(src, out.view(-1), m)
        else:
            self._stage(x)
            self._barrier()  # every rank's input is staged
            launch(
                reduce_pull_kernel,
                persistent_grid(self.group, cdiv(m, REDUCE_BLOCK))[0],
                out.view(-1),
                self.staging.ptrs,
                self.staging.local,
                m,
                r * m,
                r,
                w,
                BLOCK=REDUCE_BLOCK,
                num_warps=8,
            )
            self._barrier()  # nobody still reads my staging buffer

    def _scatter_plan(self, m: int, s: int) -> tuple[int, list, PreparedLaunch]:
        """Piece count, every transfer (source range, peer, destination view, the peer's
        signal pad as uint32, slot) and the prepared reduction, for a per-rank output of
        ``m`` elements through buffer set ``s``; built once per (``m``, ``s``)."""
        if (m, s) not in self._plans:
            w, r = self.world_size, self.rank
            pieces = self._pieces_for(m)
            piece_len = cdiv(cdiv(m, pieces), REDUCE_BLOCK) * REDUCE_BLOCK  # block-aligned
            n_pieces = cdiv(m, piece_len)
            first = self.pad.offset("arrival") + s * self._set_slots
            transfers = []
            for p in range(n_pieces):
                lo, hi = p * piece_len, min(m, (p + 1) * piece_len)
                for i in range(1, w):
                    peer = (r + i) % w
                    dst = self.recv.peers[peer][s, r, lo:hi]
                    signal = self.pad.buffer.peers[peer].view(torch.uint32)
                    transfers.append((lo, hi, peer, dst, signal, first + r * n_pieces + p))
            reduce = PreparedLaunch(
                reduce_arrivals_kernel, persistent_grid(self.group, cdiv(m, REDUCE_BLOCK))[0],
                (
                    None, None, self.recv.local[s], self.max_numel, m, piece_len, n_pieces,
                    self.pad.buffer.local, first, r, w, self.error.address, self.max_spins,
                    first + self._set_slots - 1, self._set_slots,
                ),
                {"BLOCK": REDUCE_BLOCK, "CLEAR_AT_END": True, "CALL_FLAGS": True, "num_warps": 8},
                ("out", "own"),
            )  # fmt: skip
            self._plans[(m, s)] = (n_pieces, transfers, reduce)
        return self._plans[(m, s)]

    def _scatter_reduce(self, src: torch.Tensor, out: torch.Tensor, m: int) -> None:
        r = self.rank
        s = self._buffer_set()
        n_pieces, transfers, reduce = self._scatter_plan(m, s)
        if s == GRAPH_SET:
            self._barrier()  # every peer is done reading the previous replay's pieces
        # The copies are enqueued before the reduction that waits for them. The other order
        # (a spinning kernel that fills every SM enqueued before its producers) deadlocked on
        # 2 x H200: the peer copies then could not start.
        # With one piece there is nothing to overlap: the copies go on the caller's stream
        # and the fork/join (two event round trips on the host) is saved.
        stream = fork(self.group) if n_pieces > 1 else None
        with use_stream(stream):
            for lo, hi, peer, dst, signal, slot in transfers:
                copy_and_signal(dst, src[peer, lo:hi], signal, slot, self.call_flag)
        reduce(out, src[r])
        join(self.group, stream)


class AllReduce(OpContext):
    """All-reduce (sum), accumulated in fp32 in rank order: every rank gets the same bits.

    Methods: ``one_shot`` (each rank loads every peer's whole input and sums it: least
    latency, for small tensors) and ``two_shot`` (reduce-scatter by loads, then all-gather
    of the reduced chunks: each byte crosses NVLink twice instead of ``world - 1`` times).
    """

    op_name = "all_reduce"
    METHODS = ("one_shot", "two_shot")

    def __init__(
        self,
        group: Group,
        max_numel: int,
        dtype: torch.dtype,
        method: str = "two_shot",
        max_spins=None,
        eager_graphs: bool | None = None,
    ):
        self.method = _check_method(self.op_name, method, self.METHODS)
        super().__init__(group, dtype, max_numel, {}, max_spins)
        self._init_eager_graphs(eager_graphs)
        self.staging = self._track(symm_empty((self.max_numel,), dtype, group))
        if method == "two_shot":
            self.reduced = self._track(symm_empty((self.max_numel,), dtype, group))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # (a call like an earlier one replays its graph at once)
        key, result = self._replayed_out(self._next_set, (x,), out, lambda _: torch.empty_like(x))
        if result is not None:
            return result
        self._begin()
        self._check_tensor("x", x, max_numel=self.max_numel)
        out = self._check_out(out, x.shape)
        if out is None:
            out = torch.empty_like(x)
        self._begin_call(graphed=True, numel=x.numel(), method=self.method)
        self._enqueue(self.method, lambda: self._all_reduce(x, out), x, out)
        self._end()
        self._arm(key)
        return out

    def _all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        w, r, n = self.world_size, self.rank, x.numel()
        flat = out.view(-1)
        self._stage(x)
        self._barrier()  # every rank's input is staged
        if self.method == "one_shot":
            launch(
                reduce_pull_kernel,
                persistent_grid(self.group, cdiv(n, REDUCE_BLOCK))[0],
                flat,
                self.staging.ptrs,
                self.staging.local,
                n,
                0,
                r,
                w,
                BLOCK=REDUCE_BLOCK,
                num_warps=8,
            )
        else:
            chunk = cdiv(n, w)
            lo, hi = min(n, r * chunk), min(n, (r + 1) * chunk)
            launch(
                reduce_pull_kernel,
                persistent_grid(self.group, cdiv(max(hi - lo, 1), REDUCE_BLOCK))[0],
                self.reduced.local[lo:],
                self.staging.ptrs,
                self.staging.local,
                hi - lo,
                lo,
                r,
                w,
                BLOCK=REDUCE_BLOCK,
                num_warps=8,
            )
            self._barrier()  # every reduced chunk is ready
            for i in range(w):
                peer = (r + i) % w
                plo, phi = min(n, peer * chunk), min(n, (peer + 1) * chunk)
                if phi > plo:
                    flat[plo:phi].copy_(self.reduced.peers[peer][plo:phi])
        self._barrier()  # nobody still reads my staging / reduced buffers
