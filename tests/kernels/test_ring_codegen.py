"""The GEMM+RS ring kernel compiled for Hopper without a GPU: its stores into the right
neighbour's receive slot vectorise (the peer pointer keeps the local tensor's 16-byte
alignment), and it publishes each step with a system-scope release."""

from __future__ import annotations

import pytest

from interlace.kernels.ring_reduce import ring_reduce_scatter_kernel
from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable

pytestmark = pytest.mark.skipif(
    cuda_compile_unavailable() is not None, reason=str(cuda_compile_unavailable())
)


@pytest.fixture(scope="module")
def ptx() -> str:
    sig = {n: "i32" for n in ring_reduce_scatter_kernel.arg_names}
    sig.update({n: "*bf16" for n in ("partials", "out", "recv")})
    sig.update(sig="*i32", sig_table="*i64", recv_table="*i64", err="i64")
    for name in ("WORLD", "BLOCK"):
        del sig[name]
    out = compile_for_hopper(
        ring_reduce_scatter_kernel, sig, {"WORLD": 4, "BLOCK": 2048},
        aligned=("partials", "out", "recv", "slot_elems", "n_elems"), num_warps=8,
    )  # fmt: skip
    return out["ptx"]


def test_remote_stores_vectorise(ptx):
    assert "st.global.v4" in ptx
    assert "st.global.b16" not in ptx and "st.global.u16" not in ptx


def test_steps_are_published_with_a_release(ptx):
    assert "atom.global.sys.release" in ptx or "atom.release.sys" in ptx
