"""interlace's import graph: no cycles, and every import goes down the layers.

Layers, lowest first (a module's layer is the first part of its name under ``interlace``):

    errors, runtime, language, kernels, schedule, ops, tune, nn, trace, (interlace),
    testing, bench, __main__

``(interlace)`` is the package root, ``interlace/__init__.py``: the public names. The rules:

* A module may import its own layer and the layers below it, never one above. This holds
  for every import, at module level or inside a function (a lazy import still couples
  the layers).
* Code inside interlace imports what it uses from the module that defines it, not from
  the package root: only ``testing``, ``bench`` and ``__main__`` may import ``interlace``
  itself (e.g. ``nn`` imports ``interlace.ops``, not ``interlace``).
* No cycles among module-level imports. Importing ``a.b.c`` also runs ``a/__init__`` and
  ``a/b/__init__``, so an import counts as an edge to the imported module and to each of
  its packages that the importing module is not itself inside.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import interlace

LAYERS = (
    "errors", "runtime", "language", "kernels", "schedule", "ops", "tune", "nn", "trace",
    "", "testing", "bench", "__main__",
)  # fmt: skip
ROOT_IMPORTERS = ("testing", "bench", "__main__")


def modules() -> dict[str, Path]:
    """Every module under interlace: dotted name -> source file."""
    found = {"interlace": Path(interlace.__file__)}
    for info in pkgutil.walk_packages(interlace.__path__, "interlace."):
        spec = importlib.util.find_spec(info.name)
        found[info.name] = Path(spec.origin)
    return found


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def rank(name: str) -> int:
    lay = layer(name)
    if lay not in LAYERS:
        raise AssertionError(f"{name}: layer {lay!r} is not in LAYERS; add it to the order")
    return LAYERS.index(lay)


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """``(imported module, at module level, line)`` for every interlace-internal import of
    module ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # imports under a top-level ``if`` / ``try`` run at import time
        if isinstance(node, (ast.If, ast.Try)):
            top_level |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import sub`` imports the submodule ``pkg.sub``
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t == "interlace" or t.startswith("interlace."):
                found.append((t, id(node) in top_level, node.lineno))
    return found


def packages_of(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def allowed(src: str, dst: str) -> bool:
    if dst == "interlace":
        return layer(src) in ROOT_IMPORTERS or src == "interlace"
    if src == "interlace":
        return True  # the root re-exports the public names of every layer
    return rank(dst) <= rank(src)


def test_layers():
    known = modules()
    bad = []
    for name, path in known.items():
        for dst, _, line in imports(name, path, known):
            if dst in known and not allowed(name, dst):
                bad.append(f"{name}:{line} imports {dst} ({layer(name)!r} -> {layer(dst)!r})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state and (cycle := visit(w)) is not None:
                return cycle
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (cycle := visit(v)) is not None:
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        own = set(packages_of(name)) | ({name} if path.name == "__init__.py" else set())
        for dst, top, _ in imports(name, path, known):
            if not top or dst not in known:
                continue
            graph[name] |= {dst, *packages_of(dst)} - own - {name}
    return graph


def test_no_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_can_fail():
    """The cycle finder and the layer rule on made-up graphs and names."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert not allowed("interlace.ops.x", "interlace.bench.timing")
    assert not allowed("interlace.nn.x", "interlace")
    assert not allowed("interlace.ops.x", "interlace.tune.search")
    assert not allowed("interlace.ops.x", "interlace.tune.cache")
    assert allowed("interlace.tune.x", "interlace.ops.policy")
    assert allowed("interlace.bench.x", "interlace")
    assert allowed("interlace.testing.x", "interlace.ops.x")
