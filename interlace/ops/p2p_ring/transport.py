"""How the messages of one ``p2p_ring`` call move. A transport lives for one call.

The op names every message by a *slot*: an offset and shape in the receiver's buffer and
a signal index. Both sides derive them from the same plan, so a sender knows where its
message lands.

* ``p2p``: ``torch.distributed.batch_isend_irecv`` on the group (NCCL or gloo), one batch
  per step holding that step's send and receive. On cuda the batches are issued from the
  comm stream, so a forwarded slice leaves as soon as it has arrived, whatever the compute
  stream is doing.
* ``symm``: the copy engine writes each message straight into the receiver's symmetric
  buffer and raises the receiver's signal from the stream (no SM is used for transfers).
  A bounded one-warp wait kernel consumes each signal: on the compute stream right before
  the compute that reads the message (it then runs between two GEMMs instead of holding an
  SM during one), or, for a slice forwarded on (ring all-gather), on a second comm stream
  with an event the send and the compute wait on. The context's device barrier at the
  start of every call (``P2PRing._start``, which also checks the call fingerprints) makes
  sure every peer is done with the previous call's data.
* ``compute_only``: nothing moves; the same sliced compute runs on stale buffers. For
  measuring how much communication a call exposes; its results are wrong.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...language.primitives import wait_kernel
from ...runtime import fork, join, use_stream
from .._trace import copy_and_signal  # recorded as a copy where a recorder is in force

ON_COMPUTE = object()  # a signal consumed on the compute stream


def _current(group):
    return torch.cuda.current_stream(group.device) if group.backend == "cuda" else None


class Transport:
    """Base: a local receive buffer and no-op hooks (this is ``compute_only``)."""

    fresh = True  # ``local`` belongs to this call alone (no copy needed to keep it)

    def __init__(self, ring, numel: int):
        self.ring, self.group = ring, ring.group
        self.local = torch.empty(numel, dtype=ring.dtype, device=ring.group.device)

    def view(self, offset: int, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return self.local[offset : offset + n].view(shape)

    def send(self, src: torch.Tensor, peer: int, offset: int, sig: int) -> None:
        """Send ``src`` (ready on the comm stream) into ``peer``'s slot."""

    def recv(self, peer: int, offset: int, shape, sig: int) -> None:
        """Expect a message from ``peer`` in this rank's slot."""

    def flush(self) -> None:
        """Issue what was queued since the last flush (one step)."""

    def after_compute(self) -> None:
        """Later sends wait for the compute enqueued so far."""

    def after_arrival(self, sig: int) -> None:
        """Later sends wait for the message in slot ``sig`` (forwarding)."""

    def arrived(self, sig: int) -> None:
        """Later compute waits for the message in slot ``sig``."""

    def finish(self) -> None:
        """Everything of the call is done before later work on the compute stream."""


class P2PTransport(Transport):
    """``batch_isend_irecv`` on the group's process group."""

    def __init__(self, ring, numel: int):
        super().__init__(ring, numel)
        self.pg = self.group.process_group
        self.stream = fork(self.group)
        self._ops: list = []
        self._recv_ops: dict[int, int] = {}  # sig -> index of its op in the pending batch
        self._works: dict[int, list] = {}  # sig -> works to wait for its arrival
        self._all: list = []
        self._waited: set = set()
        self._keep: list = []

    def _wait(self, works, stream) -> None:
        """Make ``stream`` (cpu: the host) wait for ``works``, each once per stream: a
        second ``wait()`` on a completed gloo receive hangs."""
        for work in works:
            key = (id(work), None if stream is None else stream.cuda_stream)
            if key not in self._waited:
                self._waited.add(key)
                with use_stream(stream):
                    work.wait()

    def send(self, src, peer, offset, sig):
        self._ops.append(dist.P2POp(dist.isend, src, self.ring.global_rank(peer), self.pg, sig))
        self._keep.append(src)

    def recv(self, peer, offset, shape, sig):
        self._recv_ops[sig] = len(self._ops)
        view = self.view(offset, shape)
        self._ops.append(dist.P2POp(dist.irecv, view, self.ring.global_rank(peer), self.pg, sig))

    def flush(self):
        if not self._ops:
            return
        with use_stream(self.stream):
            works = dist.batch_isend_irecv(self._ops) or []
        per_op = len(works) == len(self._ops)  # gloo: one work per op; NCCL: one per batch
        for sig, index in self._recv_ops.items():
            self._works[sig] = [works[index]] if per_op else list(works)
        self._all.extend(works)
        self._ops, self._recv_ops = [], {}

    def after_compute(self):
        if self.stream is not None:
            self.stream.wait_stream(_current(self.group))

    def after_arrival(self, sig):
        self._wait(self._works[sig], self.stream)

    def arrived(self, sig):
        self._wait(self._works[sig], _current(self.group))

    def finish(self):
        self.flush()
        self._wait(self._all, _current(self.group))
        join(self.group, self.stream)
        self._keep.clear()


class SymmTransport(Transport):
    """Copy-engine writes into the receiver's symmetric buffer, signals from the stream."""

    fresh = False  # ``local`` is the context's symmetric buffer, reused by the next call

    def __init__(self, ring, numel: int):
        self.ring, self.group = ring, ring.group
        self.buffer = ring.symmetric_buffer(numel)
        self.local = self.buffer.local[:numel]
        self.arrival = ring.pad.offset("arrival")
        # (every peer is done with the previous call's buffer: the call-start barrier)
        self.send_stream = fork(self.group, 0)
        self.wait_stream = fork(self.group, 1)
        self._events: dict[int, object] = {}
        self._expected: set[int] = set()
        self._keep: list = []

    def send(self, src, peer, offset, sig):
        dst = self.buffer.peers[peer][offset : offset + src.numel()].view(src.shape)
        with use_stream(self.send_stream):
            copy_and_signal(dst, src, self.ring.pad.buffer.peers[peer], self.arrival + sig)
        self._keep.append(src)

    def recv(self, peer, offset, shape, sig):
        self._expected.add(sig)

    def after_compute(self):
        if self.send_stream is not None:
            self.send_stream.wait_stream(_current(self.group))

    def _consume(self, sig: int, stream):
        """Consume slot ``sig``'s signal once: a bounded one-warp wait kernel on ``stream``.
        Returns an event after it on the wait stream, ``ON_COMPUTE`` when it ran on the
        compute stream (later compute is ordered after it anyway), None on cpu."""
        if sig not in self._events:
            ring = self.ring
            with use_stream(stream):
                wait_kernel[(1,)](
                    ring.pad.buffer.local, self.arrival + sig, 1, 1, ring.error.address,
                    ring.rank, ring.max_spins, RESET=True, num_warps=1,
                )  # fmt: skip
            event = None
            if stream is self.wait_stream and stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
            elif stream is not None:
                event = ON_COMPUTE
            self._events[sig] = event
        return self._events[sig]

    def after_arrival(self, sig):
        # Forwarding must not wait for compute: consume on the wait stream. Its kernel spins
        # (one warp) alongside the compute until the slice lands.
        event = self._consume(sig, self.wait_stream)
        if event is ON_COMPUTE:
            self.send_stream.wait_stream(_current(self.group))
        elif event is not None:
            self.send_stream.wait_event(event)

    def arrived(self, sig):
        # Consumed on the compute stream itself, the wait runs after the compute before it,
        # when the message has usually landed: no SM is held spinning during a GEMM.
        event = self._consume(sig, _current(self.group))
        if event is not None and event is not ON_COMPUTE:
            _current(self.group).wait_event(event)

    def finish(self):
        for sig in sorted(self._expected - set(self._events)):
            # every signal is consumed: the pad is clean for the next call
            self._consume(sig, self.wait_stream)
        join(self.group, self.send_stream)
        join(self.group, self.wait_stream)
        self._keep.clear()


TRANSPORTS = {"p2p": P2PTransport, "symm": SymmTransport, "compute_only": Transport}
