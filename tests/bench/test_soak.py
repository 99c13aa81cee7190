"""``bench soak`` in the CPU emulation (2 ranks, a few calls): the newer ops (MoE pair, EP
dispatch + combine, SPAttention, FlashDecode) run back to back on one context each, match
their ``none`` strategy, do not drift and raise no fault; the command exits 0."""

from __future__ import annotations

from interlace.bench import soak


def test_soak_of_the_newer_ops_passes(capsys):
    rc = soak.main(["--calls", "3", "--ops", "moe,ep,sp_attention,flash_decode"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for op in ("moe", "ep", "sp_attention", "flash_decode"):
        assert any(line.startswith(op) for line in out.splitlines()), out
