"""Helpers shared by the bench tests."""

from __future__ import annotations

from interlace import __main__ as cli


def fake_suite(monkeypatch, name: str, rc: int) -> list:
    """Make ``python -m interlace`` find only the suite ``name``, whose ``main`` returns
    ``rc`` and appends the argv it was given to the returned list."""
    seen = []

    def fake_main(argv):
        seen.append(argv)
        return rc

    monkeypatch.setattr(cli, "suite_main", lambda suite: fake_main if suite == name else None)
    return seen
