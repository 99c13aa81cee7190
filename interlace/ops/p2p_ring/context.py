"""``P2PRing``: the context of the ``p2p_ring`` strategy (CommFuse).

Each collective becomes ``W - 1`` point-to-point steps interleaved with the compute of one
sequence slice each (``W`` = world size; ``chunks = m`` splits every slice again, giving
``m`` times as many, smaller steps). The order is chosen so that the transfer of step ``i``
runs under the compute of step ``i + 1`` and the last step computes only:

* ``ag_gemm``   ``all_gather(x) @ w``: own slice first, while it is sent on.
* ``gemm_rs``   ``reduce_scatter(x @ w)``: the partial of a slice, plus the partial sum
  received for it, is sent on; the own slice comes last.
* ``attn_rs``   query-split attention: one query slice's attention and output projection per
  step, reduced as in ``gemm_rs``.
* ``attn_a2a``  Ulysses: each query slice's attention is sent to its owner as soon as it is
  done, replacing the post-attention all-to-all.

Rows are split into ``W`` equal slices: a row count (sequence length for attention) not
divisible by the world size raises ``InterlaceValueError``.

Every call fingerprints what its peers depend on (which op, shapes, schedule, chunks;
``OpContext._begin_call``) and starts with a device barrier that carries the fingerprint,
so that ranks that called differently raise ``CallMismatchError`` on every rank, naming the
field, before any message moves. On the ``cpu`` backend, and for the ``p2p`` transport
over a gloo group (whose transfers block the host anyway; on a GPU after a stream
synchronisation), the host checks the barrier before issuing a transfer, so every rank
raises in that call. On a GPU the ``symm`` transport's barrier (which also keeps a peer
from overwriting data still being read) records the mismatch; it is raised by the next call
or ``check()``, as for the other ops. The ``p2p`` transport over NCCL runs no barrier (a
host check there would need a device synchronisation per call): a mismatch in its calls is
NCCL's to detect (its own timeout). ``compute_only`` moves nothing and checks nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...errors import InterlaceValueError
from ...runtime import Group, symm_empty
from ...runtime.signals import hash_text
from .._context import OpContext
from .plans import all_to_all_plan, gather_plan, reduce_plan, resolve_schedule
from .transport import TRANSPORTS

MAX_CHUNKS = 16
#: The ops of a ``P2PRing``: the ``call`` field of their fingerprints.
CALLS = ("ag_gemm", "gemm_rs", "attn_rs", "attn_a2a")


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous row ranges covering ``n`` rows (sizes differ by at most one;
    fewer when ``n < chunks``)."""
    m = max(1, min(chunks, n))
    return [(j * n // m, (j + 1) * n // m) for j in range(m)]


def _mm(a, b, acc=None, out=None):
    """``acc + a @ b`` (``a @ b`` without ``acc``), into ``out`` when given; the add is
    fused into the GEMM."""
    if acc is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(acc, a, b, out=out)


def attend(q, k, v, lo: int, hi: int, causal: bool, scale=None) -> torch.Tensor:
    """Attention of the queries at positions ``lo .. hi - 1`` over every key (causal: over
    keys ``0 .. hi - 1``, the mask aligned bottom-right). ``[B, h, hi - lo, d]``."""
    qs = q[:, :, lo:hi]
    if not causal:
        return F.scaled_dot_product_attention(qs, k, v, scale=scale)
    ks, vs = k[:, :, :hi], v[:, :, :hi]
    if lo == 0:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(hi - lo, hi)
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)


class P2PRing(OpContext):
    """Context of the ``p2p_ring`` ops over ``group``; see the module docstring.

    ``schedule``: ``auto`` (default; see ``schedule.resolve_schedule``), ``ring`` or
    ``pairwise`` (even world sizes only; odd ones raise). ``transport``: ``auto`` (``symm``
    on cuda, ``p2p`` on cpu), ``p2p``, ``symm`` or ``compute_only`` (benchmarks only: no
    communication, wrong results). ``chunks``: sub-slices per slice, default 2 for
    ``gemm_rs`` (the partial sum received is then added inside the next GEMM, a sub-slice
    later, instead of by a separate add) and 1 otherwise. Schedule and chunks can also be
    chosen per call. Every call is collective: all ranks call with the same shapes. Outputs
    are fresh tensors (or ``out=``).
    """

    #: the calls whose exceptions are reported to the peers (``OpContext``)
    CALLS = ("ag_gemm", "gemm_rs", "attn_rs", "attn_a2a")

    op_name = "p2p_ring"
    SCHEDULES = ("auto", "ring", "pairwise")
    TRANSPORTS = ("auto", *TRANSPORTS)

    def __init__(
        self,
        group: Group,
        dtype: torch.dtype = torch.bfloat16,
        schedule: str = "auto",
        transport: str = "auto",
        chunks: int | None = None,
        max_spins=None,
    ):
        if transport not in self.TRANSPORTS:
            raise InterlaceValueError(
                f"{self.op_name}: transport must be one of {self.TRANSPORTS}, got {transport!r}"
            )
        if isinstance(group, Group):
            resolve_schedule(schedule, group.world_size, "gather", self.op_name)
        self._check_chunks(chunks)
        w = group.world_size if isinstance(group, Group) else 1
        super().__init__(group, dtype, 1, {"arrival": w * MAX_CHUNKS}, max_spins)
        if transport == "auto":
            transport = "symm" if group.backend == "cuda" else "p2p"
        self.transport, self.schedule, self.chunks = transport, schedule, chunks
        pg = group.process_group
        self._global = [dist.get_global_rank(pg, p) for p in range(self.world_size)]
        self._symm = None
        # The host checks the call-start barrier where it runs synchronously (the cpu
        # backend, gloo groups); symm needs the barrier anyway; p2p over NCCL runs none.
        self._checks_calls = transport == "symm" or (transport == "p2p" and not group.nccl)
        for name in (*CALLS, *self.SCHEDULES):
            hash_text(name)  # so a peer's op and schedule read back as their names

    # ------------------------------------------------------------------ helpers
    def global_rank(self, peer: int) -> int:
        return self._global[peer]

    def symmetric_buffer(self, numel: int):
        """The context's flat symmetric buffer, grown (collectively) to ``numel``."""
        if self._symm is None or self._symm.numel < numel:
            if self._symm is not None:
                # Peers may still read or write the old buffer: settle everything first.
                if self.group.backend == "cuda":
                    torch.cuda.synchronize(self.group.device)
                    if self.error.fault_pending():  # e.g. only this rank grows: a mismatch
                        self._fail()
                self.group.host_barrier()
                self._buffers.remove(self._symm)
                self._symm.close()
            self._symm = self._track(symm_empty((max(numel, 1),), self.dtype, self.group))
        return self._symm

    def _check_chunks(self, chunks) -> None:
        if chunks is not None and not (isinstance(chunks, int) and 1 <= chunks <= MAX_CHUNKS):
            raise InterlaceValueError(
                f"{self.op_name}: chunks must be an int in 1..{MAX_CHUNKS}, got {chunks!r}"
            )

    def _config(self, kind: str, schedule, chunks, default_chunks: int):
        schedule = resolve_schedule(schedule or self.schedule, self.world_size, kind, self.op_name)
        self._check_chunks(chunks)
        return schedule, chunks or self.chunks or default_chunks

    def _check_dims(self, name: str, t, dims: int) -> None:
        self._check_placed(name, t)
        if t.dim() != dims:
            raise InterlaceValueError(
                f"{self.op_name}: {name} must have {dims} dimensions, got shape {tuple(t.shape)}"
            )

    def _check_rows(self, what: str, rows: int) -> int:
        if rows == 0 or rows % self.world_size:
            raise InterlaceValueError(
                f"{self.op_name}: {what} is {rows}, not a positive multiple of the world size "
                f"{self.world_size}; p2p_ring splits it into equal slices, one per rank "
                f"(pad the sequence)"
            )
        return rows // self.world_size

    def _check_weight(self, name: str, w, rows: int) -> None:
        self._check_dims(name, w, 2)
        if w.shape[0] != rows:
            raise InterlaceValueError(
                f"{self.op_name}: {name} has shape {tuple(w.shape)}, expected {rows} rows"
            )

    def _start(self, **fields) -> None:
        """Begin a call's communication: fingerprint it (``fields``: what the peers depend
        on), then run the device barrier that carries the fingerprint (see the module
        docstring). Where the barrier has already run when it returns (cpu backend), a
        fault it found raises here, on every rank, before any message moves."""
        self._begin_call(**fields)
        if not self._checks_calls:
            return
        self._barrier()  # every peer is in this call and done with the previous one's data
        if self.group.backend == "cpu":
            self._raise_pending()
        elif self.transport == "p2p":  # gloo transfers of GPU tensors: host-synchronous
            torch.cuda.current_stream(self.group.device).synchronize()
            self._raise_pending()

    # ------------------------------------------------------------------ ops
    def ag_gemm(self, x, w=None, *, out=None, return_gathered=False, schedule=None, chunks=None):
        """``all_gather(x) @ w``: ``x`` [R, K] (this rank's rows), ``w`` [K, N] -> [W*R, N].

        ``w=None`` only gathers. ``return_gathered=True`` also returns ``all_gather(x)``
        [W*R, K] (a fresh tensor): ``(y, gathered)``.
        """
        self._begin()
        self._check_tensor("x", x)
        self._check_dims("x", x, 2)
        sched, m = self._config("gather", schedule, chunks, 1)
        W, r = self.world_size, self.rank
        R, K = x.shape
        if R == 0:
            raise InterlaceValueError(f"{self.op_name}: x has no rows")
        if w is not None:
            self._check_weight("w", w, K)
            shape = (W * R, w.shape[1])
            out = self._check_out(out, shape)
            if out is None:
                out = torch.empty(shape, dtype=self.dtype, device=x.device)
        N = 0 if w is None else w.shape[1]
        self._start(call="ag_gemm", M=W * R, N=N, K=K, schedule=sched, chunks=m)
        bounds = chunk_bounds(R, m)
        m = len(bounds)
        plan = gather_plan(sched, r, W)
        t = TRANSPORTS[self.transport](self, W * R * K)
        gathered = t.local.view(W * R, K)

        def slot(s, j):  # offset, shape and signal of sub-slice j of rank s's slice
            lo, hi = bounds[j]
            return (s * R + lo) * K, (hi - lo, K), s * m + j

        # Every transfer first, in step order: the comm stream runs them back to back, each
        # forward as soon as its slice has arrived, while the compute below proceeds.
        for i in range(W - 1):
            s, nxt = plan.order[i], plan.order[i + 1]
            for j, (lo, hi) in enumerate(bounds):
                if sched == "pairwise" or s == r:
                    src = x[lo:hi]
                else:
                    offset, shape, sig = slot(s, j)
                    t.after_arrival(sig)
                    src = t.view(offset, shape)
                out_slot = slot(r if sched == "pairwise" else s, j)
                t.send(src, plan.dest[i], out_slot[0], out_slot[2])
                t.recv(plan.src[i], *slot(nxt, j))
                t.flush()
        for s in plan.order:
            for j, (lo, hi) in enumerate(bounds):
                if s == r:
                    a = x[lo:hi]
                else:
                    offset, shape, sig = slot(s, j)
                    t.arrived(sig)
                    a = t.view(offset, shape)
                if w is not None:
                    _mm(a, w, out=out[s * R + lo : s * R + hi])
        if return_gathered:
            gathered = gathered if t.fresh else gathered.clone()
            gathered[r * R : (r + 1) * R].copy_(x)
        t.finish()
        self._end()
        return (out, gathered) if return_gathered else out

    def gemm_rs(self, x, w, *, out=None, schedule=None, chunks=None):
        """``reduce_scatter(x @ w)``: ``x`` [W*R, K], ``w`` [K, N] -> [R, N], the sum over
        ranks of rows ``rank*R .. (rank+1)*R - 1`` of ``x @ w``."""
        self._begin()
        self._check_tensor("x", x)
        self._check_dims("x", x, 2)
        R = self._check_rows("x.shape[0]", x.shape[0])
        self._check_weight("w", w, x.shape[1])
        N = w.shape[1]
        out = self._check_out(out, (R, N))
        if out is None:
            out = torch.empty((R, N), dtype=self.dtype, device=x.device)

        sched, m = self._config("reduce", schedule, chunks, 2)
        self._start(call="gemm_rs", M=x.shape[0], N=N, K=x.shape[1], schedule=sched, chunks=m)

        def partial(lo, hi, acc, dst):
            return _mm(x[lo:hi], w, acc, dst)

        self._reduce(partial, R, N, out, sched, m)
        self._end()
        return out

    def attn_rs(
        self, q, k, v, w_o, *, causal=False, scale=None, out=None, schedule=None, chunks=None
    ):
        """Query-split attention with output projection, reduce-scattered over the sequence:
        ``q, k, v`` [B, h, S, d] (this rank's heads, whole sequence), ``w_o`` [h*d, H] ->
        [S/W, B, H] (sequence-major), ``reduce_scatter(attn(q, k, v) @ w_o)`` along S."""
        self._begin()
        B, h, S, d = self._check_attention(q, k, v)
        self._check_weight("w_o", w_o, h * d)
        H = w_o.shape[1]
        L = self._check_rows("the sequence length", S)
        out = self._check_out(out, (L, B, H))
        if out is None:
            out = torch.empty((L, B, H), dtype=self.dtype, device=q.device)

        def partial(lo, hi, acc, dst):
            o = attend(q, k, v, lo, hi, causal, scale)
            a = o.permute(2, 0, 1, 3).reshape((hi - lo) * B, h * d)
            flat = ((hi - lo) * B, H)
            acc = None if acc is None else acc.view(flat)
            return _mm(a, w_o, acc, None if dst is None else dst.view(flat)).view(hi - lo, B * H)

        # One slice per step by default: attention dominates the step, so the separate add
        # costs less than halving the query slices (2 x H200: 1.5-2% faster than chunks=2).
        sched, m = self._config("reduce", schedule, chunks, 1)
        self._start(
            call="attn_rs", B=B, h=h, S=S, d=d, H=H, causal=bool(causal), schedule=sched, chunks=m
        )
        self._reduce(partial, L, B * H, out.view(L, B * H), sched, m)
        self._end()
        return out

    def attn_a2a(self, q, k, v, *, causal=False, scale=None, out=None, schedule=None):
        """Ulysses attention with the post-attention all-to-all fused: ``q, k, v``
        [B, h, S, d] (this rank's heads, whole sequence) -> [S/W, B, W*h, d]: this rank's
        sequence slice, every rank's heads (rank p's heads at ``p*h .. (p+1)*h - 1``)."""
        self._begin()
        B, h, S, d = self._check_attention(q, k, v)
        L = self._check_rows("the sequence length", S)
        W, r = self.world_size, self.rank
        out = self._check_out(out, (L, B, W * h, d))
        if out is None:
            out = torch.empty((L, B, W * h, d), dtype=self.dtype, device=q.device)
        placed = out.view(L, B, W, h, d)
        sched, _ = self._config("all_to_all", schedule, None, 1)
        self._start(call="attn_a2a", B=B, h=h, S=S, d=d, causal=bool(causal), schedule=sched)
        plan = all_to_all_plan(sched, r, W)
        shape, n = (L, B, h, d), L * B * h * d
        t = TRANSPORTS[self.transport](self, (W - 1) * n)
        for i, s in enumerate(plan.order):
            o = attend(q, k, v, s * L, (s + 1) * L, causal, scale).permute(2, 0, 1, 3)
            if i < W - 1:
                msg = o.contiguous()
                t.after_compute()
                t.send(msg, plan.dest[i], i * n, i)
                t.recv(plan.src[i], i * n, shape, i)
                t.flush()
            else:
                placed[:, :, r].copy_(o)
            if i > 0:  # place the previous step's arrival, a step after it was sent
                t.arrived(i - 1)
                placed[:, :, plan.src[i - 1]].copy_(t.view((i - 1) * n, shape))
        t.finish()
        self._end()
        return out

    # ------------------------------------------------------------------ the reduction loop
    def _check_attention(self, q, k, v):
        for name, t in (("q", q), ("k", k), ("v", v)):
            self._check_dims(name, t, 4)
        if k.shape != q.shape or v.shape != q.shape:
            raise InterlaceValueError(
                f"{self.op_name}: q, k, v must have one shape [B, h, S, d], got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        return tuple(q.shape)

    def _reduce(self, partial, R: int, C: int, out, sched: str, m: int) -> None:
        """Reduce-scatter of ``partial``'s rows: ``partial(lo, hi, acc, dst)`` returns
        ``acc + rows lo .. hi - 1`` of this rank's [W*R, C] partial (into ``dst`` when given);
        ``out`` [R, C] receives the sum over ranks of rows ``rank*R ..``."""
        W, r = self.world_size, self.rank
        bounds = chunk_bounds(R, m)
        m = len(bounds)
        # With sub-slices, the sum needed by sub-slice j of step i left its sender m - 1
        # sub-slices earlier: add it inside the GEMM (addmm). Without, add it after.
        fused = m > 1
        plan = reduce_plan(sched, r, W)
        t = TRANSPORTS[self.transport](self, (W - 1) * R * C)

        def received(i, j):
            lo, hi = bounds[j]
            t.arrived(i * m + j)
            return t.view((i * R + lo) * C, (hi - lo, C))

        for i, s in enumerate(plan.order):
            last = i == W - 1
            for j, (lo, hi) in enumerate(bounds):
                dst = out[lo:hi] if last else None
                rows = (s * R + lo, s * R + hi)
                if fused and plan.acc[i]:
                    acc = received(plan.acc[i][0], j)
                    for k in plan.acc[i][1:]:
                        acc.add_(received(k, j))
                    res = partial(*rows, acc, dst)
                else:
                    res = partial(*rows, None, dst)
                    for k in plan.acc[i]:
                        res.add_(received(k, j))
                if not last:
                    t.after_compute()
                    t.send(res, plan.dest[i], (i * R + lo) * C, i * m + j)
                    t.recv(plan.src[i], (i * R + lo) * C, (hi - lo, C), i * m + j)
                    t.flush()
        t.finish()
