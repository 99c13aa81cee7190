"""A load guarded by a wait stays after the wait's acquire in the generated code.

The kernels below are consumer GEMM main loops: per iteration ``t`` they wait on signal
``sig + t``, load tile ``t`` and accumulate it. They are compiled for Hopper
(``GPUTarget("cuda", 90, 32)``, no GPU needed) with Triton's software pipeliner on
(``num_stages=3``) and the TTGIR after pipelining, then the PTX, is inspected with
``interlace.testing.codegen``:

* a *guarded* load takes its mask from ``guard(mask, token, expected)`` (for TMA, a
  coordinate from ``guard_coord``), so its operands are computed from the acquire's
  result. ``data_loads`` follows each load's operands back through the SSA definitions and
  reports the acquire they reach and how: ``"block"`` (in the load's own block: for a loop
  body, the same iteration, the acquire coming first there) or ``"carried"`` (through the
  loop's ``iter_args``: computed in an earlier iteration). Either way the load cannot be
  issued before that acquire has returned, wherever the pipeliner puts the two.
* the *unguarded* twin of each kernel (``GUARD=False``, nothing else differs) is the
  negative control: the same checks must see its loads hoisted, else they prove nothing.

What Triton 3.6 does (see the tests for the exact assertions):

* With a single acquiring poll per iteration (``tl.atomic_add(sig + t, 0, sem="acquire")``),
  the pipeliner pipelines the loop. Unguarded, it issues the copies of iterations 0 and 1 in
  the loop prologue before any acquire at all, and in the loop body the copy of iteration
  ``t + 2`` while the acquire of ``t + 2`` runs only two iterations later. Guarded, the
  pipeliner moves the acquire into the load's stage: every copy follows its own acquire.
* ``primitives.wait`` spins in an ``scf.while``; a loop whose body holds a nested loop is not
  pipelined at all, so there the load stays after the wait with or without ``guard`` (and
  the loop loses its pipelining: wait outside the K loop, or poll, in hot loops).
* A persistent loop with ``flatten=True`` is fused with its K loop and pipelined even with
  ``wait`` in it (the wait sits in the fused loop's tile-start ``scf.if``): the next tile's
  copies are prefetched during the current tile, after the next tile's wait.
"""

from __future__ import annotations

import functools

import pytest

from interlace.testing.codegen import (
    compile_for_hopper,
    cuda_compile_unavailable,
    data_loads,
    ptx_loads_before_acquire,
)

_reason = cuda_compile_unavailable()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from interlace.language.primitives import guard, guard_coord, wait  # noqa: E402

ASYNC_COPIES = ("ttg.async_copy_global_to_local", "ttng.async_tma_copy_global_to_local")


# --------------------------------------------------------------------------------------
# kernels


@triton.jit
def _vec_consumer(
    x, sig, err, out, n, n_tiles, expected, rank, max_spins,
    BLOCK: tl.constexpr, SPIN: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t in tl.range(0, n_tiles, num_stages=3):
        if SPIN:
            tok = wait(sig + t, expected, err, rank, t, max_spins)
        else:
            tok = tl.atomic_add(sig + t, 0, sem="acquire", scope="sys")
        mask = t * BLOCK + offs < n
        if GUARD:
            mask = guard(mask, tok, expected)
        acc += tl.load(x + t * BLOCK + offs, mask=mask, other=0.0)
    tl.store(out + offs, acc)


@triton.jit
def _dot_consumer(
    a, b, sig, err, out, m, k, n_tiles, expected, rank, max_spins,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPIN: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in tl.range(0, n_tiles, num_stages=3):
        if SPIN:
            tok = wait(sig + t, expected, err, rank, t, max_spins)
        else:
            tok = tl.atomic_add(sig + t, 0, sem="acquire", scope="sys")
        kk = t * BK + rk
        mask_a = rm[:, None] < m  # ragged rows, as in AG+GEMM
        mask_b = kk[:, None] < k
        if GUARD:
            mask_a = guard(mask_a, tok, expected)
            mask_b = guard(mask_b, tok, expected)
        tile_a = tl.load(a + rm[:, None] * k + kk[None, :], mask=mask_a, other=0.0)
        tile_b = tl.load(b + kk[:, None] * BN + rn[None, :], mask=mask_b, other=0.0)
        acc = tl.dot(tile_a, tile_b, acc)
    tl.store(out + rm[:, None] * BN + rn[None, :], acc)


@triton.jit
def _tma_consumer(
    a, b, sig, out, k, n_tiles, expected,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    desc_a = tl.make_tensor_descriptor(a, shape=[BM, k], strides=[k, 1], block_shape=[BM, BK])
    desc_b = tl.make_tensor_descriptor(b, shape=[k, BN], strides=[BN, 1], block_shape=[BK, BN])
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in tl.range(0, n_tiles, num_stages=3):
        tok = tl.atomic_add(sig + t, 0, sem="acquire", scope="sys")
        row = 0
        col = 0
        if GUARD:
            row = guard_coord(row, tok, expected, -2 * BM)
            col = guard_coord(col, tok, expected, -2 * BN)
        tile_a = desc_a.load([row, t * BK])
        tile_b = desc_b.load([t * BK, col])
        acc = tl.dot(tile_a, tile_b, acc)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    tl.store(out + rm[:, None] * BN + rn[None, :], acc)


@triton.jit
def _persistent_consumer(
    a, b, sig, err, out, m, n_m, k, expected, rank, max_spins,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), n_m, tl.num_programs(0), flatten=True):
        tok = wait(sig + tile, expected, err, rank, tile, max_spins)
        rows = tile * BM + rm
        mask_a = guard(rows[:, None] < m, tok, expected)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kt in tl.range(0, tl.cdiv(k, BK)):
            kk = kt * BK + rk
            tile_a = tl.load(a + rows[:, None] * k + kk[None, :], mask=mask_a, other=0.0)
            tile_b = tl.load(b + kk[:, None] * BN + rn[None, :], mask=kk[:, None] < k, other=0.0)
            acc = tl.dot(tile_a, tile_b, acc)
        tl.store(out + rows[:, None] * BN + rn[None, :], acc)


_SCALARS = {"expected": "i32", "rank": "i32", "max_spins": "i32", "n_tiles": "i32"}


@functools.cache
def _compiled(shape: str, spin: bool, guarded: bool) -> dict[str, str]:
    """IR stages of one kernel variant, compiled once per test session."""
    if shape == "vec":
        sig = {"x": "*fp32", "sig": "*i32", "err": "*i32", "out": "*fp32", "n": "i32"}
        consts = {"BLOCK": 256, "SPIN": spin, "GUARD": guarded}
        return compile_for_hopper(_vec_consumer, {**sig, **_SCALARS}, consts, aligned=("x", "out"))
    if shape in ("dot", "dot_unaligned"):
        # "dot": k % 16 == 0 (as Triton specialises it at launch), so A's rows are 16-byte
        # aligned and both tiles become cp.async copies. "dot_unaligned": A's row stride k
        # has no known alignment, so A is pipelined as a plain register load instead.
        sig = {"a": "*fp16", "b": "*fp16", "sig": "*i32", "err": "*i32", "out": "*fp32"}
        sig.update(m="i32", k="i32", **_SCALARS)
        consts = {"BM": 64, "BN": 64, "BK": 32, "SPIN": spin, "GUARD": guarded}
        aligned = ("a", "b", "out") + (("k",) if shape == "dot" else ())
        return compile_for_hopper(_dot_consumer, sig, consts, aligned=aligned)
    if shape == "tma":
        assert not spin
        sig = {"a": "*fp16", "b": "*fp16", "sig": "*i32", "out": "*fp32", "k": "i32"}
        sig.update(n_tiles="i32", expected="i32")
        consts = {"BM": 64, "BN": 64, "BK": 32, "GUARD": guarded}
        return compile_for_hopper(_tma_consumer, sig, consts, aligned=("a", "b", "out"))
    if shape == "persistent":
        assert spin and guarded
        sig = {"a": "*fp16", "b": "*fp16", "sig": "*i32", "err": "*i32", "out": "*fp32"}
        sig.update(m="i32", n_m="i32", k="i32", expected="i32", rank="i32", max_spins="i32")
        consts = {"BM": 128, "BN": 128, "BK": 64}
        return compile_for_hopper(_persistent_consumer, sig, consts, aligned=("a", "b", "out", "k"))
    raise ValueError(shape)


def _guard_role(load) -> str:
    tma = load.kind in ("ttng.async_tma_copy_global_to_local", "tt.descriptor_load")
    return "coord" if tma else "mask"


def _describe(loads) -> str:
    return "\n".join(
        f"  [{ld.path} #{ld.index}] guarded={ {r: how for r, (_, how) in ld.guarded.items()} } "
        f"first_acquire=#{ld.first_acquire_index}: {ld.text[:100]}"
        for ld in loads
    )


def _split(loads):
    """(loads in the function block, i.e. the pipeliner's prologue; loads in the loop body)"""
    return [ld for ld in loads if ld.path == "func"], [
        ld for ld in loads if ld.path == "func/scf.for"
    ]


# --------------------------------------------------------------------------------------
# one acquiring poll per iteration: the pipeliner is active

POLL_SHAPES = ["vec", "dot", "dot_unaligned", "tma"]


@pytest.mark.parametrize("shape", POLL_SHAPES)
def test_unguarded_load_is_hoisted_above_its_acquire(shape):
    """Negative control: without ``guard`` the pipeliner issues data loads before the acquire
    that should guard them.

    TTGIR: the loop is pipelined (data loads in the function block before the ``scf.for``,
    which the source has none of, and in its body); some of those prologue loads come before
    any acquire in the function block (the tiles of iterations 0 and 1 are fetched before
    anything was acquired); no data load anywhere depends on an acquire. PTX: some data load
    has no acquire before it in its basic block.
    """
    ir = _compiled(shape, spin=False, guarded=False)
    loads = data_loads(ir["ttgir"])
    prologue, body = _split(loads)
    assert prologue and body, "the loop was not pipelined:\n" + _describe(loads)
    assert any(ld.before_any_acquire for ld in prologue), _describe(prologue)
    assert not any(ld.guarded for ld in loads), _describe(loads)
    assert ptx_loads_before_acquire(ir["ptx"]), "PTX: every data load follows an acquire"


@pytest.mark.parametrize("shape", POLL_SHAPES)
def test_guarded_load_stays_after_its_acquire(shape):
    """With ``guard`` (TMA: ``guard_coord``) the loop is still pipelined, and every data load,
    prologue and loop body alike, has its mask (TMA: a coordinate) computed from an acquire.

    For cp.async and TMA copies the acquire is in the copy's own block and precedes it there
    (``"block"``): the pipeliner moved the acquire into the copy's stage, so in the loop body
    the acquire of iteration t+2 runs just before the copy of iteration t+2, and in the PTX
    every data load has an acquire before it in its basic block. ``dot_unaligned``'s A tile
    is pipelined as a register load instead: it is issued one stage later than its acquire
    and takes the guarded mask through the loop's ``iter_args`` (``"carried"``), a value
    computed in an earlier iteration from the acquire, so there it sits before the body's
    acquire (which is for a later tile) and the block-local PTX check does not apply.
    """
    ir = _compiled(shape, spin=False, guarded=True)
    loads = data_loads(ir["ttgir"])
    prologue, body = _split(loads)
    assert prologue and body, "the guarded loop was not pipelined:\n" + _describe(loads)
    for ld in loads:
        how = ld.guarded_by(_guard_role(ld))
        if shape == "dot_unaligned" and ld.kind == "tt.load":
            assert how == "carried", _describe([ld])
        else:
            assert how == "block" and not ld.before_any_acquire, _describe([ld])
    if shape == "dot_unaligned":
        assert any(ld.kind == "tt.load" for ld in body), _describe(loads)
    else:
        assert ptx_loads_before_acquire(ir["ptx"]) == []


# --------------------------------------------------------------------------------------
# primitives.wait (a bounded spin) inside the loop


@pytest.mark.parametrize("shape", ["vec", "dot"])
def test_guarded_load_after_spin_wait(shape):
    """The real ``wait`` + ``guard``: every data load's mask is computed, in the same loop
    body, from the wait (the acquire and the ``scf.while`` spinning on it), which comes
    before the load there. (The spin makes several basic blocks, so the PTX is not checked.)
    """
    ir = _compiled(shape, spin=True, guarded=True)
    loads = data_loads(ir["ttgir"])
    assert loads, ir["ttgir"]
    for ld in loads:
        assert ld.path == "func/scf.for", _describe([ld])
        assert ld.guarded_by("mask") == "block" and not ld.before_any_acquire, _describe([ld])


@pytest.mark.parametrize("shape", ["vec", "dot"])
def test_unguarded_spin_wait_loop_is_not_pipelined(shape):
    """The checker flags the unguarded twin (its loads do not depend on the wait), yet in
    Triton 3.6 nothing is hoisted: a loop whose body holds the spin's ``scf.while`` is not
    software-pipelined at all (plain ``tt.load`` after the wait, no async copies). If this
    fails after a Triton upgrade, the pipeliner now handles such loops and unguarded loads
    after ``wait`` can be hoisted; the guarded tests still check what matters."""
    ir = _compiled(shape, spin=True, guarded=False)
    loads = data_loads(ir["ttgir"])
    assert loads and not any(ld.guarded for ld in loads), _describe(loads)
    assert all(ld.kind == "tt.load" and ld.path == "func/scf.for" for ld in loads), (
        "Triton now pipelines a loop with a spin wait in it:\n" + _describe(loads)
    )
    assert all(not ld.before_any_acquire for ld in loads), _describe(loads)


def test_persistent_flattened_loop_prefetches_after_the_next_wait():
    """Persistent kernel, ``flatten=True``: Triton fuses the tile loop with the K loop and
    pipelines the fused loop although ``wait`` spins in it (inside the fused loop's
    tile-start ``scf.if``). Every guarded A-tile copy (prologue and fused loop body) depends
    on an acquire of its own block, which precedes it: the next tile's A is prefetched during
    the current tile, but only after the next tile's wait."""
    ir = _compiled("persistent", spin=True, guarded=True)
    loads = data_loads(ir["ttgir"])
    in_loop = [ld for ld in loads if ld.path.endswith("/scf.for")]
    assert in_loop and all(ld.kind in ASYNC_COPIES for ld in loads), _describe(loads)
    tiles_a = [ld for ld in loads if "tensor<128x64x!tt.ptr<f16>" in ld.text]  # B: 64x128
    assert tiles_a and len(tiles_a) * 2 == len(loads), _describe(loads)
    assert not any(ld.guarded for ld in loads if ld not in tiles_a)  # B is not guarded
    for ld in tiles_a:
        assert ld.guarded_by("mask") == "block" and not ld.before_any_acquire, _describe([ld])
