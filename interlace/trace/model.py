"""A recorded trace as spans and instants on tracks, every rank on rank 0's clock; decoding
of the kernels' event buffers; Chrome / Perfetto export.

Tracks per rank (Chrome ``tid``): one per program of the traced kernels (``program p``:
its launches' programs ``p`` in time order; a 2-D grid's programs numbered column by
column), one per stream that ran traced transfers, and ``exposed communication``
(computed, see ``summary``). Span categories: ``program`` (a program's whole run),
``compute`` (a tile: from the program's previous event to the tile's main-loop end),
``wait`` (a wait on a chunk, the entry barrier, the final waits), ``copy`` and
``chunk_wait`` (stream work), ``exposed``; instants: ``notify`` (a program released a
counter), ``signal`` (a stream wrote a peer's flag, at its copy's end). The grouped GEMM
(``wait tokens of rank q``, then its tile; reduce mode: its tiles, then ``notify every
rank``), ``MoERS``'s finish (``wait contributions of every rank``, then its tiles), the
attention forward and dQ (per query block and K/V chunk: ``wait chunk of rank q``, then
``block b chunk q``), dK/dV (``wait chunk of rank q``, ``dK/dV block j chunk q``, ``push
dK/dV to rank q``: a ``copy`` span, then ``notify rank q``) and its reduction (``wait
partials of rank q``, then ``add rank q``), the ``signal_reorder`` GEMM (``tile g``, then
``notify group i``: its wave group's counter, which the comm stream's ``wait group i``
waits for before the group's collective, a ``copy`` span), the split decode (``split s
(seq b, kv head h)``, ``combine (...)``, ``push (...)``: a ``copy`` span, the SM stores
into the merging ranks) and the decode merge (``wait partials of rank q``, then ``merge
rank q``) and the expert-parallel all-to-all (``wait data of rank q`` / ``wait slot of
rank q``, then ``push ...``: ``copy`` spans of SM stores into peers, or local ``expand`` /
``layout`` / ``sum`` work) and its low-latency mode (``push ...``, ``wait rows of rank
q`` / ``wait arrival of rank q``, ``receive rows ...`` / ``sum token t``) use the same
categories.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from ..kernels.gemm import (
    KIND_PUSH,
    KIND_REDUCE,
    KIND_STORE,
    KIND_STORE_OWN,
    SEG_KIND,
    SEG_OWNER,
    SEG_ROW0,
    SEG_ROWS,
    SEG_WAIT_COUNT,
)
from ..language.trace import HEADER, PER_TILE

#: Chrome thread ids of the tracks that are not programs
TID_STREAM = 100_000
TID_EXPOSED = 200_000


@dataclass
class Span:
    rank: int
    tid: int
    name: str
    cat: str
    t0: int  # ns, rank 0's clock
    t1: int
    args: dict = field(default_factory=dict)

    @property
    def dur(self) -> int:
        return self.t1 - self.t0


@dataclass
class Instant:
    rank: int
    tid: int
    name: str
    cat: str
    t: int
    args: dict = field(default_factory=dict)


@dataclass
class Trace:
    """The world's trace: spans and instants, track names, the clock alignment and what
    was traced (``meta``)."""

    world: int
    spans: list[Span]
    instants: list[Instant]
    tracks: dict[tuple[int, int], str]
    clock: dict
    label: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def t_origin(self) -> int:
        times = [s.t0 for s in self.spans] + [i.t for i in self.instants]
        return min(times) if times else 0

    def of(self, rank: int, cat: str | None = None) -> list[Span]:
        return [s for s in self.spans if s.rank == rank and (cat is None or s.cat == cat)]

    # ------------------------------------------------------------------ export
    def to_chrome(self) -> dict:
        """Chrome trace-event JSON (``chrome://tracing``, https://ui.perfetto.dev): one
        process per rank, one thread per track; times in µs from the first event."""
        t0 = self.t_origin
        events = []
        for rank in range(self.world):
            events.append(dict(ph="M", name="process_name", pid=rank, tid=0,
                               args=dict(name=f"rank {rank}")))  # fmt: skip
            events.append(dict(ph="M", name="process_sort_index", pid=rank, tid=0,
                               args=dict(sort_index=rank)))  # fmt: skip
        for (rank, tid), name in sorted(self.tracks.items()):
            events.append(dict(ph="M", name="thread_name", pid=rank, tid=tid, args=dict(name=name)))
            events.append(dict(ph="M", name="thread_sort_index", pid=rank, tid=tid,
                               args=dict(sort_index=tid)))  # fmt: skip
        for s in sorted(self.spans, key=lambda s: (s.rank, s.tid, s.t0, -s.t1)):
            events.append(dict(
                ph="X", name=s.name, cat=s.cat, pid=s.rank, tid=s.tid,
                ts=round((s.t0 - t0) / 1e3, 3), dur=round(max(0, s.dur) / 1e3, 3), args=s.args,
            ))  # fmt: skip
        for i in self.instants:  # zero-length slices: shown on their track like the spans
            events.append(dict(
                ph="X", name=i.name, cat=i.cat, pid=i.rank, tid=i.tid,
                ts=round((i.t - t0) / 1e3, 3), dur=0.0, args=i.args,
            ))  # fmt: skip
        other = dict(self.meta, label=self.label, world=self.world, clock=self.clock)
        return dict(traceEvents=events, displayTimeUnit="ns", otherData=other)

    def save(self, prefix: str, png: bool = True, quiet: bool = False) -> dict[str, str]:
        """Write ``<prefix>.json`` (Chrome / Perfetto), ``<prefix>-summary.json`` and, with
        ``png`` and matplotlib installed, ``<prefix>.png``. Returns what was written (and
        ``png_skipped``: why no PNG)."""
        from .summary import summarize

        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        out = {}
        with open(f"{prefix}.json", "w") as f:
            json.dump(self.to_chrome(), f, separators=(",", ":"))
        out["json"] = f"{prefix}.json"
        with open(f"{prefix}-summary.json", "w") as f:
            json.dump(summarize(self), f, indent=1)
            f.write("\n")
        out["summary"] = f"{prefix}-summary.json"
        if png:
            from .plot import plot

            try:
                plot(self, f"{prefix}.png")
                out["png"] = f"{prefix}.png"
            except ImportError as e:
                out["png_skipped"] = str(e)
                if not quiet:
                    print(f"trace: no PNG ({e})")
        return out

    def to_dict(self) -> dict:
        return dict(
            world=self.world, label=self.label, meta=self.meta, clock=self.clock,
            spans=[asdict(s) for s in self.spans], instants=[asdict(i) for i in self.instants],
            tracks=[[r, t, n] for (r, t), n in self.tracks.items()],
        )  # fmt: skip


# ---------------------------------------------------------------------- decoding
def _who(kind: int, owner: int, rank: int) -> str:
    """What a segment's wait waits for."""
    if kind == KIND_STORE.value:
        return f"rank {owner}'s chunk"
    if kind == KIND_REDUCE.value:
        return "peers' partials"
    if kind == KIND_PUSH.value:
        return "entry barrier (go)"
    return "own rows" if kind == KIND_STORE_OWN.value else "?"


def decode_launch(info: dict, rows: list, rank: int, shift: int, index: int):
    """Spans and instants of one traced launch (``rows``: its event buffer; ``shift``: ns
    to subtract to reach rank 0's clock), read as its layout (``ops._trace.LAYOUTS``)
    says: ``steps`` holds one block of programs per grid column."""
    if info.get("layout") == "steps":
        per = 1 + rows[0][0] * rows[0][1]
        spans, instants = [], []
        for col in range(info["columns"]):
            s, i = _decode_block(info, rows[col * per : (col + 1) * per], rank, shift, index, col)
            spans += s
            instants += i
        return spans, instants
    return _decode_block(info, rows, rank, shift, index, 0)


def _decode_block(info: dict, rows: list, rank: int, shift: int, index: int, col: int):
    """Spans and instants of one block of a trace buffer (header, then its programs)."""
    stride, grid, cap = rows[0][0], rows[0][1], rows[0][2]
    layout = info.get("layout", "segments")
    spans, instants = [], []
    name = info["kernel"]

    def t(ev):
        return ev[0] - shift

    for p in range(grid):
        ev = rows[1 + p * stride : 1 + (p + 1) * stride]
        start, end = ev[0], ev[1]
        if not start[1]:
            continue
        tid = col * grid + p  # the program's track: a 2-D grid's programs column by column
        args = dict(launch=index, kernel=name, program=tid)
        if layout == "steps":  # (the forward and dQ run their query blocks last first)
            args.update(column=col)
            if "slots" not in info:
                args.update(block=grid - 1 - p)
        if end[1]:
            spans.append(Span(rank, tid, f"{name} program {tid}", "program", t(start), t(end),
                              args))  # fmt: skip
        cursor = t(start)
        if ev[2][1] and ev[3][1]:
            spans.append(Span(rank, tid, "entry barrier", "wait", t(ev[2]), t(ev[3]),
                              dict(args, what="entry barrier")))  # fmt: skip
            cursor = t(ev[3])
        tile_slots = _TILE_DECODERS[info.get("slots", layout)]
        for j in range(cap):
            wb, we, te, nt = ev[HEADER.value + PER_TILE.value * j :][:4]
            g = j * grid + p
            sp, ins, cursor = tile_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t)
            spans += sp
            instants += ins
        if ev[4][1] and ev[5][1]:
            what = "peers' broadcasts" if layout == "segments" else "every arrival (exit)"
            spans.append(Span(rank, tid, "final waits", "wait", t(ev[4]), t(ev[5]),
                              dict(args, what=what)))  # fmt: skip
    return spans, instants


def _segment_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """One tile's slots of the segment GEMM (a wait where the program met a segment)."""
    spans, instants = [], []
    table = info["seg"]
    if we[1]:
        s = we[2]
        waited = not info["one_loop"] or wb[2] != s
        row = table[s] if 0 <= s < len(table) else None
        if waited and row is not None and row[SEG_WAIT_COUNT.value] > 0:
            kind, owner = row[SEG_KIND.value], row[SEG_OWNER.value]
            spans.append(Span(
                rank, tid, f"wait chunk {s}", "wait", t(wb), t(we),
                dict(args, segment=s, tile=g, what=_who(kind, owner, rank),
                     peer=owner if kind == KIND_STORE.value else -1,
                     kind=int(kind), rows=[row[SEG_ROW0.value],
                     row[SEG_ROW0.value] + row[SEG_ROWS.value]], token=we[3]),
            ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        s = te[2]
        spans.append(Span(rank, tid, f"tile {g}", "compute", cursor, t(te),
                          dict(args, tile=g, segment=s)))  # fmt: skip
        cursor = t(te)
    if nt[1]:
        dest = nt[3]
        label = "every peer" if dest == -1 else f"rank {dest}"
        instants.append(Instant(rank, tid, f"notify {label}", "notify", t(nt),
                                dict(args, segment=nt[2], dest=dest)))  # fmt: skip
    return spans, instants, cursor


def _sources(rank: int, world: int, lo: int, hi: int) -> list[int]:
    """Source ranks of arrival positions ``lo .. hi`` (position ``p``: rank ``rank + p``)."""
    return [(rank + p) % world for p in range(lo, hi + 1)]


def _tile_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """One tile's slots of the grouped GEMM: its wait for the token shards it reads (where
    it reads a peer's), then its compute. Reduce mode (``MoERS``): no waits; a tile's rows
    belong to the tokens of ``owners``, and the last program's raise of every owner's
    contribution counter is a notify (in its first tile's slots)."""
    spans, instants = [], []
    world = info["world"]
    if wb[1] and we[1]:
        lo, hi = wb[2], wb[3]
        if hi >= lo:  # the tile reads peers' tokens: arrival positions lo .. hi
            peers = _sources(rank, world, lo, hi)
            who = ", ".join(str(q) for q in peers)
            spans.append(Span(
                rank, tid, f"wait tokens of rank {who}", "wait", t(wb), t(we),
                dict(args, tile=g, positions=[lo, hi], peers=peers,
                     peer=peers[0] if len(peers) == 1 else -1,
                     what=f"rank {who}'s tokens", token=we[3]),
            ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        q, e = te[2], te[3]
        first, last = info["tiles"][q][2:4]
        if info.get("mode") == "reduce":  # rows added into this rank's accumulator
            who = dict(owners=_sources(rank, world, first, last))
        else:  # rows gathered from these peers' token shards
            who = dict(peers=_sources(rank, world, max(first, 1), last))
        spans.append(Span(
            rank, tid, f"tile {g}", "compute", cursor, t(te),
            dict(args, tile=g, row_tile=q, expert=e, positions=[first, last], **who),
        ))  # fmt: skip
        cursor = t(te)
    if nt[1]:
        what = dict(args, slot=nt[2], dest=nt[3], what="contributions")
        instants.append(Instant(rank, tid, "notify every rank", "notify", t(nt), what))
    return spans, instants, cursor


def _finish_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """One tile of ``MoERS``'s finish kernel: the program's wait for every rank's
    contribution (in its first tile's slots), then the tile's sum of every rank's
    accumulator rows of this rank's tokens (peer reads)."""
    spans = []
    world = info["world"]
    if wb[1] and we[1]:
        spans.append(Span(
            rank, tid, "wait contributions of every rank", "wait", t(wb), t(we),
            dict(args, tile=g, peer=-1, peers=[q for q in range(world) if q != rank],
                 what="every rank's contributions", slot=wb[2], token=we[3]),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        rt, ct = te[2], te[3]
        bm, bn = info["block_m"], info["block_n"]
        spans.append(Span(
            rank, tid, f"tile {g}", "compute", cursor, t(te),
            dict(args, tile=g, rows=[rt * bm, min(info["M"], (rt + 1) * bm)],
                 cols=[ct * bn, min(info["N"], (ct + 1) * bn)], peers=list(range(world))),
        ))  # fmt: skip
        cursor = t(te)
    return spans, [], cursor


#: the split-decode kernel's tile slots of a program: its split, the combine, the push
_DECODE_STEPS = ("split", "combine", "push")


def _split_decode_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """One of a split-decode program's three tiles: its split (``split s (seq b, kv head
    h)``); in the group's last program the combine of the splits and the push of the
    group's partial into the merging ranks (SM stores into their memory: a ``copy`` span,
    after a wait for the owner's acknowledgement in the one-owner mode; the owner's own,
    a ``store``); the launch's last program's arrival flags (a notify)."""
    spans, instants = [], []
    world, owner = info["world"], info["owner"]
    if wb[1] and we[1]:
        spans.append(Span(
            rank, tid, f"wait ack of rank {owner}", "wait", t(wb), t(we),
            dict(args, tile=g, step="push", peer=owner, peers=[owner], ack_at_least=wb[3],
                 what=f"rank {owner}'s merge of this buffer parity"),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        bh, hkv = te[3], info["kv_heads"]
        where = f"seq {bh // hkv}, kv head {bh % hkv}"
        step = _DECODE_STEPS[j]
        name = f"split {te[2]} ({where})" if j == 0 else f"{step} ({where})"
        extra = dict(split=te[2]) if j == 0 else {}
        cat = "compute"
        if step == "push":
            dests = list(range(world)) if owner is None else [owner]
            peers = [q for q in dests if q != rank]
            if peers:  # (the owner's push stays in its own memory: a store)
                nbytes = info["group_heads"] * (info["head_dim"] + 1) * 4 * len(peers)
                extra = dict(peer=peers[0] if len(peers) == 1 else -1, peers=peers, bytes=nbytes)
                cat = "copy"
            else:
                name = f"store ({where})"
        spans.append(Span(rank, tid, name, cat, cursor, t(te),
                          dict(args, tile=g, step=step, seq=bh // hkv, kv_head=bh % hkv,
                               **extra)))  # fmt: skip
        cursor = t(te)
    if nt[1]:
        dest = nt[3]
        label = "every rank" if dest == -1 else f"rank {dest}"
        instants.append(Instant(rank, tid, f"notify {label}", "notify", t(nt),
                                dict(args, dest=dest, epoch=nt[2], what="partials")))  # fmt: skip
    return spans, instants, cursor


def _merge_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """Step ``j`` of a decode-merge program: its wait for the partials of the step's
    source rank (its own, step 0, is not waited for), then their merge; the last
    program's acknowledgements in the one-owner mode (a notify)."""
    spans, instants = [], []
    block = tid * info["block_r"], min(info["rows"], (tid + 1) * info["block_r"])
    if wb[1] and we[1]:
        src = we[2]
        spans.append(Span(
            rank, tid, f"wait partials of rank {src}", "wait", t(wb), t(we),
            dict(args, tile=g, step=j, peer=src, peers=[src], epoch=wb[3], token=we[3],
                 what=f"rank {src}'s partials"),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        src = te[2]
        spans.append(Span(rank, tid, f"merge rank {src}", "compute", cursor, t(te),
                          dict(args, tile=g, step=j, src=src, rows=list(block))))  # fmt: skip
        cursor = t(te)
    if nt[1]:
        what = dict(args, dest=-1, epoch=nt[2], what="acknowledgement")
        instants.append(Instant(rank, tid, "notify every rank", "notify", t(nt), what))
    return spans, instants, cursor


def _step_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """One step of an attention program: its wait for a peer's K/V chunk (steps after the
    first), then the chunk's compute; tile ids number (program, step)."""
    spans = []
    tile = tid * info["world"] + j
    if wb[1] and we[1]:
        c = we[2]
        spans.append(Span(
            rank, tid, f"wait chunk of rank {c}", "wait", t(wb), t(we),
            dict(args, tile=tile, step=j, chunk=c, peer=c, what=f"rank {c}'s K/V"),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        c = te[2]
        spans.append(Span(
            rank, tid, f"block {te[3]} chunk {c}", "compute", cursor, t(te),
            dict(args, tile=tile, step=j, chunk=c),
        ))  # fmt: skip
        cursor = t(te)
    return spans, [], cursor


def _dkdv_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """Step ``j`` of a dK/dV program (one per (chunk, key block), batch x kv head): step 0
    its wait for the chunk's K/V (a peer's chunk) and the key block's dK / dV; step 1 the
    push of the partial into the chunk owner's receive buffer (SM stores into its memory:
    a ``copy`` span, ``args.peers``; the owner's own, a ``store``) and the owner's counter
    raised (a notify); tile ids number (program, step)."""
    spans, instants = [], []
    tile = tid * 2 + j
    step = dict(args, tile=tile, step=j)
    if wb[1] and we[1]:
        c = we[2]
        spans.append(Span(
            rank, tid, f"wait chunk of rank {c}", "wait", t(wb), t(we),
            dict(step, chunk=c, peer=c, peers=[c], token=we[3], what=f"rank {c}'s K/V"),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        c = te[2]
        cat = "compute"
        if j == 0:
            name, extra = f"dK/dV block {te[3]} chunk {c}", dict(key_block=te[3])
        else:  # te[3]: the rows pushed (dK and dV)
            nbytes = 2 * te[3] * info["d"] * info["itemsize"]
            name, extra = "store dK/dV (own chunk)", dict(rows=te[3], bytes=nbytes)
            if c != rank:
                name, cat = f"push dK/dV to rank {c}", "copy"
                extra.update(peer=c, peers=[c])
        spans.append(Span(rank, tid, name, cat, cursor, t(te), dict(step, chunk=c, **extra)))
        cursor = t(te)
    if nt[1]:
        dest = nt[2]
        instants.append(Instant(rank, tid, f"notify rank {dest}", "notify", t(nt),
                                dict(step, dest=dest, rows=nt[3],
                                     what="dK/dV partial rows")))  # fmt: skip
    return spans, instants, cursor


def _attn_reduce_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """Step ``j`` of a program of the attention backward's reduction: its wait for the
    dK/dV partials of source rank ``q`` (its counter reaching every row; this rank's own
    first), then their sum into the program's rows."""
    spans = []
    rows = [tid * info["block_r"], min(info["rows"], (tid + 1) * info["block_r"])]
    step = dict(args, tile=tid * info["world"] + j, step=j)
    if wb[1] and we[1]:
        q = we[2]
        spans.append(Span(
            rank, tid, f"wait partials of rank {q}", "wait", t(wb), t(we),
            dict(step, peer=q, peers=[q], token=we[3], what=f"rank {q}'s dK/dV partials"),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        q = te[2]
        spans.append(Span(rank, tid, f"add rank {q}", "compute", cursor, t(te),
                          dict(step, src=q, rows=rows)))  # fmt: skip
        cursor = t(te)
    return spans, [], cursor


def _signal_gemm_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """Tile ``g`` of the ``signal_reorder`` GEMM (program ``g % grid``): its main loop
    (``args.group``: its wave group, ``args.row_tile`` / ``col_tile``), then its group's
    counter raised (a notify to this rank's comm stream; with the TMA stores a tile is
    counted after the next tile's main loop, unless it is the program's last of its
    group)."""
    spans, instants = [], []
    if te[1]:
        tiles_m, tiles_n, group_m = info["tiles_m"], info["tiles_n"], info["group_m"]
        per = group_m * tiles_n  # (the grouped tile order, ``kernels.gemm._tile_coords``)
        first = (g // per) * group_m
        col = (g % per) // min(tiles_m - first, group_m)
        spans.append(Span(
            rank, tid, f"tile {g}", "compute", cursor, t(te),
            dict(args, tile=g, group=te[2], row_tile=te[3], col_tile=col),
        ))  # fmt: skip
        cursor = t(te)
    if nt[1]:
        instants.append(Instant(rank, tid, f"notify group {nt[2]}", "notify", t(nt),
                                dict(args, tile=g, group=nt[2], dest=rank,
                                     what="wave-group counter")))  # fmt: skip
    return spans, instants, cursor


#: expert-parallel all-to-all kernels: what a step's wait waits for (``data``: rows or
#: routing a peer pushes in this call; ``slot``: a peer freeing the slot written next)
_EP_WAITS = {
    "ep_route": ("slot", "routing slot of rank {q} freed"),
    "ep_layout": ("data", "rank {q}'s routing"),
    "ep_expand": ("data", "rank {q}'s tokens"),
    "ep_combine_send": ("slot", "rank {q}'s combine slot freed"),
    "ep_combine_recv": ("data", "rank {q}'s combined rows"),
}
#: what a kernel's notify raises
_EP_NOTIFIES = {
    "ep_route": "routing flag", "ep_send": "token counters", "ep_expand": "routing slots freed",
    "ep_combine_send": "combine counters", "ep_combine_recv": "combine slots freed",
}  # fmt: skip


def _ep_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """Step ``j`` of a program of the expert-parallel dispatch / combine kernels
    (``kernels.ep``): its wait for a peer (``wait ... of rank q``: ``args.waits_for`` says
    whether for data pushed in this call or for a slot freed by the previous one), then
    its work: a push into peers' memory (SM stores: a ``copy`` span, ``args.peers``; into
    this rank's own memory, a ``store``), or local work (``compute``); a notify where the
    program raised peers' flags (``dest`` -1: every rank)."""
    spans, instants = [], []
    kernel, world = info["kernel"], info["world"]
    if wb[1] and we[1]:
        q = we[2]
        waits_for, what = _EP_WAITS[kernel]
        spans.append(Span(
            rank, tid, f"wait {'slot' if waits_for == 'slot' else 'data'} of rank {q}", "wait",
            t(wb), t(we), dict(args, tile=g, step=j, peer=q, peers=[q], waits_for=waits_for,
                               what=what.format(q=q)),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        a, b = te[2], te[3]
        extra, cat = dict(step=j), "compute"
        if kernel == "ep_route":  # routing (ids, weights, count) of b tokens into rank a
            name, peers = f"push routing to rank {a}", [a]
            extra.update(tokens=b, bytes=b * info["kp"] * 8 + 4)
        elif kernel == "ep_send":  # this program's token blocks into every rank using them
            name, peers = "push tokens", list(range(world))
            extra.update(blocks=a)
        elif kernel == "ep_combine_send":  # rows of home rank a's tokens (b: sent at all)
            name, peers = f"push rows to rank {a}", [a] if b else []
        elif kernel == "ep_expand":
            name, peers = f"expand rows of rank {a}", []
            extra.update(src=a)
        elif kernel == "ep_layout":
            last = a >= info["grid"] - 1  # (the last program checks the whole routing)
            name, peers = ("layout (check)" if last else f"layout (expert {a})"), []
        else:
            name, peers = "sum rows of every rank", []
        others = [q for q in peers if q != rank]
        if others:
            cat = "copy"
            extra.update(peer=others[0] if len(others) == 1 else -1, peers=others)
        elif peers:
            name = name.replace("push", "store", 1)
        spans.append(Span(rank, tid, name, cat, cursor, t(te), dict(args, tile=g, **extra)))
        cursor = t(te)
    if nt[1]:
        dest = nt[3]
        label = "every rank" if dest == -1 else f"rank {dest}"
        instants.append(Instant(rank, tid, f"notify {label}", "notify", t(nt),
                                dict(args, dest=dest, slot=nt[2],
                                     what=_EP_NOTIFIES.get(kernel, "flags"))))  # fmt: skip
    return spans, instants, cursor


def _ep_ll_slots(info, rank, tid, args, g, j, wb, we, te, nt, cursor, t):
    """Step ``j`` (tile ``g``) of a program of ``EPLowLatency``'s dispatch or combine
    kernel (``kernels.ep_low_latency``). Its first ``send_steps`` steps send: the rows of
    expert ``g`` (dispatch) or of segment ``g`` = (local expert, home rank) (combine) are
    pushed into the rank that reads them (SM stores: a ``copy`` span, ``args.peers``; into
    this rank's own memory, a ``store``); program 0 of combine first raises every rank's
    arrival word (a notify). Then the receives, each a wait and the work after it: the
    dispatch's segment (local expert, source rank) (``wait rows of rank s``, then
    ``receive rows of rank s``), or, after program 0's waits for every rank's arrival word
    (``wait arrival of rank q``, at the launch's end), the combine's home token (``wait
    rows of rank ...``: the ranks holding its experts, then ``sum token t``). A receive's
    wait ends when the last word it polls arrived; where the kernel works on the rows as
    they land (dispatch; combine with the flag in the data) the work before that falls
    inside it."""
    spans, instants = [], []
    kernel, world, grid = info["kernel"], info["world"], info["grid"]
    sends, e_loc, wbytes = info["send_steps"], info["e_loc"], info["word_bytes"]
    dispatch = kernel == "ep_ll_dispatch"
    step = dict(args, tile=g, step=j)
    if nt[1]:
        instants.append(Instant(rank, tid, "notify every rank", "notify", t(nt),
                                dict(step, dest=-1, epoch=nt[2],
                                     what="combine arrival words")))  # fmt: skip
    if j < sends:
        if te[1]:
            dest, rows = te[2], te[3]
            if dispatch:  # count word, then each row and its meta word
                e = g
                name = f"push tokens to rank {dest} (expert {e})"
                nbytes = rows * (info["row_words"] * wbytes + 8) + 8
            else:  # each row and its meta word
                e = rank * e_loc + g // world
                name = f"push rows to rank {dest} (expert {e})"
                nbytes = rows * (info["row_words"] * wbytes + 8)
            extra, cat = dict(expert=e, rows=rows, bytes=nbytes), "compute"
            if dest != rank:
                cat = "copy"
                extra.update(peer=dest, peers=[dest])
            else:
                name = name.replace("push", "store", 1)
            spans.append(Span(rank, tid, name, cat, cursor, t(te), dict(step, **extra)))
            cursor = t(te)
        return spans, instants, cursor
    if not dispatch and j < sends + world:  # program 0: every rank's arrival word
        if wb[1] and we[1]:
            q = wb[2]
            spans.append(Span(
                rank, tid, f"wait arrival of rank {q}", "wait", t(wb), t(we),
                dict(step, peer=q, peers=[q], waits_for="arrival",
                     what=f"rank {q} started this combine"),
            ))  # fmt: skip
        return spans, instants, cursor  # (at the launch's end: the cursor stays)
    if dispatch:
        el, src = divmod(g - sends * grid, world)  # segment (local expert, source)
        e = rank * e_loc + el
        if wb[1] and we[1]:
            spans.append(Span(
                rank, tid, f"wait rows of rank {src}", "wait", t(wb), t(we),
                dict(step, peer=src, peers=list(range(src + 1)), waits_for="data", expert=e,
                     rows_seen=we[3], what=f"rank {src}'s rows of expert {e} (and the row "
                     f"counts of ranks 0 .. {src})"),
            ))  # fmt: skip
            cursor = max(cursor, t(we))
        if te[1]:
            spans.append(Span(rank, tid, f"receive rows of rank {src}", "compute", cursor,
                              t(te), dict(step, src=src, expert=e, rows=te[3])))  # fmt: skip
            cursor = t(te)
        return spans, instants, cursor
    if wb[1] and we[1]:
        mask = wb[3]
        peers = [q for q in range(min(world, 63)) if mask >> q & 1]
        who = ", ".join(str(q) for q in peers)
        spans.append(Span(
            rank, tid, f"wait rows of rank {who}", "wait", t(wb), t(we),
            dict(step, token=wb[2], peer=peers[0] if len(peers) == 1 else -1, peers=peers,
                 waits_for="data", what=f"rank {who}'s rows of token {wb[2]}"),
        ))  # fmt: skip
        cursor = max(cursor, t(we))
    if te[1]:
        spans.append(Span(rank, tid, f"sum token {te[2]}", "compute", cursor, t(te),
                          dict(step, token=te[2])))  # fmt: skip
        cursor = t(te)
    return spans, instants, cursor


#: how a launch's tile slots read: by ``info["slots"]`` where given, else by its layout
_TILE_DECODERS = {
    "segments": _segment_slots, "tiles": _tile_slots, "steps": _step_slots,
    "finish": _finish_slots, "split_decode": _split_decode_slots, "merge": _merge_slots,
    "ep": _ep_slots, "ep_ll": _ep_ll_slots, "dkdv": _dkdv_slots,
    "attn_reduce": _attn_reduce_slots, "signal_gemm": _signal_gemm_slots,
}  # fmt: skip


def _tiles_of(info: dict) -> int:
    """Tiles of a launch (every tile a trace must hold): ``n_tiles`` where the launch
    states it (known on the host); of its segments from ``seg_first`` on; of the grouped
    GEMM's tile table; one per (program, step)."""
    if "n_tiles" in info:
        return info["n_tiles"]
    layout = info.get("layout", "segments")
    if layout == "tiles":
        return info["tile_count"][0] * -(-info["N"] // info["block_n"])
    if layout == "steps":
        return info["grid"] * info["world"]
    tiles_n = -(-info["N"] // info["block_n"])
    return sum(
        -(-row[SEG_ROWS.value] // info["block_m"]) * tiles_n
        for row in info["seg"][info["seg_first"] : info["n_seg"]]
    )


def build_trace(everyone: list[dict], label: str = "", meta=None, shared: str | None = None):
    """The world's :class:`Trace` from every rank's ``Recorder.rank_data()`` (with its
    ``clock`` measurement), aligned to rank 0's clock."""
    world = len(everyone)
    deltas = [d["clock"]["delta_ns"] for d in everyone]
    windows = [d["clock"]["window_ns"] for d in everyone]
    measured = [x - deltas[0] for x in deltas]
    offsets = [0] * world if shared else measured
    clock = dict(
        method=f"same clock: {shared}" if shared else "host-bracketed timer reads",
        offsets_ns=offsets, measured_offsets_ns=measured,
        uncertainty_ns=[0 if shared else w + windows[0] for w in windows],
        stream_uncertainty_ns=[d.get("anchor_window_ns", 0) for d in everyone],
    )  # fmt: skip
    spans, instants, tracks = [], [], {}
    for d in everyone:
        r, shift = d["rank"], offsets[d["rank"]]
        for index, (info, rows) in enumerate(d["launches"]):
            s, i = decode_launch(info, rows, r, shift, index)
            spans += s
            instants += i
            for p in range(info["grid"]):
                tracks[(r, p)] = f"program {p}"
        names = sorted({track for _, track, *_ in d["spans"]})
        for kind, track, t0, t1, m in d["spans"]:
            tid = TID_STREAM + names.index(track)
            tracks[(r, tid)] = track
            peer = m.get("peer")
            name = m.get("name") or (
                f"copy to rank {peer}" if kind == "copy" else kind.replace("_", " ")
            )
            spans.append(Span(r, tid, name, kind, t0 - shift, t1 - shift, dict(m)))
            if kind == "copy" and m.get("signal_slot") is not None:
                instants.append(Instant(r, tid, f"signal rank {peer}", "signal", t1 - shift,
                                        dict(dest=peer, slot=m["signal_slot"])))  # fmt: skip
    launches = [[dict(kernel=info["kernel"], layout=info.get("layout", "segments"),
                      grid=info["grid"], tiles=_tiles_of(info),
                      one_loop=info.get("one_loop", False),
                      **{k: info[k] for k in ("M", "N", "K") if k in info})
                 for info, _ in d["launches"]] for d in everyone]  # fmt: skip
    meta = dict(meta or {}, launches=launches)
    trace = Trace(world, spans, instants, tracks, clock, label, meta)
    from .summary import exposed_spans

    for r in range(world):
        for s in exposed_spans(trace, r):
            trace.spans.append(s)
            trace.tracks[(r, TID_EXPOSED)] = "exposed communication"
    return trace
