"""Compile ``@triton.jit`` kernels for Hopper without a GPU and check what the compiler made.

Used by tests that must see generated code, e.g. that a load guarded by a wait still comes
after the wait's acquire once Triton's software pipeliner has run.

* ``compile_for_hopper(kernel, signature, constexprs, aligned=...)`` compiles for
  ``GPUTarget("cuda", 90, 32)`` (no GPU needed, but ``ptxas`` must be there) and returns
  the IR stages: ``{"ttir", "ttgir", "llir", "ptx"}``.
* ``cuda_compile_unavailable()`` says why that cannot work here (``None`` when it can).
* ``data_loads(ttgir)`` lists every global data load of the TTGIR (``tt.load`` of a tensor,
  ``ttg.async_copy_global_to_local``, TMA copies, ``tt.descriptor_load``), where it sits,
  whether an acquire precedes it in its block, and which of its operands are computed from
  the result of an acquiring atomic (``tt.atomic_rmw`` / ``tt.atomic_cas`` with
  ``acquire`` or ``acq_rel``, or inline PTX with an ``ld.acquire``), and how: in the same
  block (``"block"``: for a loop body, the same iteration), from an enclosing block
  (``"outer"``) or through a loop-carried value (``"carried"``: an earlier iteration, or
  the pipeliner's prologue).
* ``ptx_loads_before_acquire(ptx)`` lists the data loads of the PTX that no acquire
  precedes in their basic block.

A load with an operand computed from an acquire's result cannot be issued before that
acquire has returned, whatever the schedulers do: that data dependency is the ordering
guarantee a wait's ``guard`` provides (the role of Triton-distributed's ``consume_token``).
The compiler preserves the program's meaning, so the acquire a guarded load depends on is
the one of its own tile, even when the pipeliner runs the two in different iterations.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

__all__ = [
    "Load",
    "Op",
    "compile_for_hopper",
    "cuda_compile_unavailable",
    "data_loads",
    "parse_ttgir",
    "ptx_loads_before_acquire",
]


# --------------------------------------------------------------------------------------
# compiling


def compile_for_hopper(
    kernel,
    signature: dict[str, str],
    constexprs: dict | None = None,
    *,
    aligned: tuple[str, ...] = (),
    num_warps: int = 4,
    num_stages: int = 3,
    capability: int = 90,
) -> dict:
    """Compile the ``@triton.jit`` (or ``@gluon.jit``) function ``kernel`` for
    ``cuda:<capability>``.

    ``signature`` maps each runtime argument to its Triton type (``"*fp16"``, ``"i32"``, a
    Gluon host descriptor ``"tensordesc<bf16[64, 128],<layout repr>>"``);
    constexpr arguments only need to appear in ``constexprs``. ``aligned`` names arguments
    (pointers, or integers such as strides) to mark divisible by 16, as Triton specialises
    them at a launch with aligned tensors; without it Triton cannot vectorise the loads and
    does not turn them into ``cp.async`` copies. Returns the IR stages ``ttir``, ``ttgir``,
    ``llir`` and ``ptx`` as text, and ``shared``: the bytes of shared memory a program
    takes (an H100 / H200 has 232448 per block).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    constexprs = dict(constexprs or {})
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    names = list(kernel.arg_names)
    missing = [n for n in names if n not in sig]
    if missing:
        raise ValueError(f"signature lacks arguments {missing}")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(kernel, sig, constexprs, attrs)
    else:
        src = triton.compiler.ASTSource(
            fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs
        )
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ir = {k: compiled.asm[k] for k in ("ttir", "ttgir", "llir", "ptx") if k in compiled.asm}
    ir["shared"] = compiled.metadata.shared
    return ir


_unavailable: list[str | None] = []


def cuda_compile_unavailable() -> str | None:
    """Why kernels cannot be compiled for Hopper here, or ``None`` when they can."""
    if _unavailable:
        return _unavailable[0]
    reason = None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        reason = "TRITON_INTERPRET is set: @triton.jit functions are interpreted, not compiled"
    else:
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def _probe(x, n, BLOCK: tl.constexpr):
                offs = tl.arange(0, BLOCK)
                tl.store(x + offs, tl.load(x + offs, mask=offs < n) + 1, mask=offs < n)

            compile_for_hopper(_probe, {"x": "*fp32", "n": "i32"}, {"BLOCK": 32}, num_stages=1)
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot compile here"
            reason = f"cannot compile for cuda:90 here: {type(exc).__name__}: {exc}"[:500]
    _unavailable.append(reason)
    return reason


# --------------------------------------------------------------------------------------
# TTGIR


@dataclass
class Op:
    """One operation of a TTGIR function: its header line and nested regions."""

    kind: str  # e.g. "tt.load", "scf.for"
    text: str  # header line, locations and attribute dicts removed
    results: list[str]  # "%acc" for "%acc:7 = ..." (uses "%acc#3" are mapped to "%acc")
    regions: list[list[Op]] = field(default_factory=list)
    index: int = 0  # position in its block

    def uses(self) -> list[str]:
        """Values named on the header line, after the ``=``."""
        rhs = self.text.split("=", 1)[1] if self.results else self.text
        return [_base(v) for v in _VALUE.findall(rhs)]

    def walk(self):
        yield self
        for region in self.regions:
            for op in region:
                yield from op.walk()


_VALUE = re.compile(r"%[\w$.]+(?:#\d+)?")
_HEADER = re.compile(r"^\s*(?:(%[\w$.]+)(?::\d+)?(?:\s*,\s*%[\w$.]+)*\s*=\s*)?\"?([\w.]+)\"?")


def _base(value: str) -> str:
    return value.split("#", 1)[0]


def _strip_locs(line: str) -> str:
    """Remove every ``loc(...)`` (nested parentheses included) from a line."""
    while True:
        m = re.search(r"(?<![\w#.\"])loc\(", line)
        if m is None:
            return line
        depth, k = 0, m.end() - 1
        while k < len(line):
            depth += {"(": 1, ")": -1}.get(line[k], 0)
            if depth == 0:
                break
            k += 1
        line = line[: m.start()].rstrip() + line[k + 1 :]


def _strip_attr_dicts(text: str) -> str:
    """Remove ``{...}`` attribute dictionaries that open and close on one line."""
    prev = None
    while prev != text:
        prev = text
        text = re.sub(r"\{[^{}]*\}", "", text)
    return text


def parse_ttgir(ttgir: str) -> list[Op]:
    """The top-level operations of the (first) ``tt.func`` body, with nested regions."""
    lines = [_strip_locs(raw).rstrip() for raw in ttgir.splitlines()]
    start = next(i for i, s in enumerate(lines) if s.lstrip().startswith("tt.func"))
    root: list[Op] = []
    stack: list[tuple[list[Op], Op | None]] = [(root, None)]  # (current block, owning op)
    for line in lines[start + 1 :]:
        s = line.strip()
        if not s or s.startswith("^bb"):
            continue
        if s.startswith("}"):
            block, owner = stack.pop()
            if len(stack) == 0:  # end of the function
                break
            if s.endswith("{") and owner is not None:  # "} else {", "} do {": next region
                region: list[Op] = []
                owner.regions.append(region)
                stack.append((region, owner))
            continue
        m = _HEADER.match(s)
        if not m:
            continue
        lhs = s.split("=", 1)[0] if m.group(1) else ""
        results = [_base(v) for v in re.findall(r"%[\w$.]+", lhs)]
        block = stack[-1][0]
        op = Op(kind=m.group(2), text=s, results=results, index=len(block))
        block.append(op)
        if s.endswith("{"):
            region = []
            op.regions.append(region)
            stack.append((region, op))
    return root


def _is_acquire(op: Op) -> bool:
    if op.kind == "tt.elementwise_inline_asm":  # e.g. ``primitives.wait_inline``
        return "ld.acquire" in op.text
    return op.kind in ("tt.atomic_rmw", "tt.atomic_cas") and bool(
        re.search(r"\b(acquire|acq_rel)\b", op.text)
    )


def _iter_args(op: Op) -> list[tuple[str, str]]:
    """``(block argument, initial value)`` pairs of an ``scf.for``'s ``iter_args``."""
    m = re.search(r"iter_args\((.*?)\)\s*->", op.text)
    if op.kind != "scf.for" or m is None:
        return []
    return [
        (a, _base(b)) for a, b in re.findall(r"(%[\w$.]+)\s*=\s*(%[\w$.]+(?:#\d+)?)", m.group(1))
    ]


#: how a load's operand depends on an acquire, most direct first
BLOCK, OUTER, CARRIED = "block", "outer", "carried"
_RANK = {BLOCK: 0, OUTER: 1, CARRIED: 2}


def _find_acquire(
    value: str, scopes: list[list[Op]], owners: list[Op | None]
) -> tuple[Op, str] | None:
    """The acquiring atomic that ``value`` (used in block ``scopes[-1]``) is computed from.

    Returns the acquire and how the value depends on it, the most direct way found:

    * ``"block"``: through operations of the use's own block (for a loop body: the same
      iteration), the acquire sitting in that block or inside one of its region operations;
    * ``"outer"``: through a value of an enclosing block, computed before the region began;
    * ``"carried"``: through a loop-carried value (``iter_args``), i.e. computed in an earlier
      iteration or in the loop prologue.

    Any of these is a data dependency, so the value, and a load that uses it, cannot exist
    before the acquire has returned. A region operation (``scf.if``, ``scf.while``) passes
    on its header operands and every value its regions yield: whatever uses its results runs
    after the whole operation. Induction variables and function arguments end the search.
    """
    base = len(scopes) - 1
    best: tuple[Op, str] | None = None
    seen: set = set()

    def note(op: Op, how: str) -> None:
        nonlocal best
        if best is None or _RANK[how] < _RANK[best[1]]:
            best = (op, how)

    def go(v: str, sc: list[list[Op]], ow: list[Op | None], carried: bool, outer: bool) -> None:
        for level in range(len(sc) - 1, -1, -1):
            op = next((o for o in sc[level] if v in o.results), None)
            if op is not None:
                out = outer or level < base
                key = (id(op), carried, out)
                if key in seen:
                    return
                seen.add(key)
                if _is_acquire(op):
                    note(op, CARRIED if carried else OUTER if out else BLOCK)
                    return
                for u in op.uses():
                    go(u, sc[: level + 1], ow[: level + 1], carried, out)
                for region in op.regions:
                    if region and region[-1].kind in ("scf.yield", "scf.condition"):
                        for u in region[-1].uses():
                            go(u, [*sc[: level + 1], region], [*ow[: level + 1], op], carried, out)
                return
            owner = ow[level]
            pairs = _iter_args(owner) if owner is not None else []
            for i, (arg, init) in enumerate(pairs):
                if arg != v:
                    continue
                key = (id(owner), i, outer or level < base)
                if key in seen:
                    return
                seen.add(key)
                out = outer or level < base
                block = sc[level]
                if block and block[-1].kind == "scf.yield" and i < len(block[-1].uses()):
                    go(block[-1].uses()[i], sc[: level + 1], ow[: level + 1], True, out)
                go(init, sc[:level], ow[:level], True, True)
                return

    go(value, scopes, owners, False, False)
    return best


@dataclass
class Load:
    """A global data load, and which of its operands are computed from an acquire."""

    kind: str
    text: str
    path: str  # where it sits: "func", "func/scf.for", "func/scf.if/scf.for", ...
    index: int  # position in its block
    #: operand role ("mask", "ptr", "coord", ...) -> (the acquire's header line, how:
    #: "block", "outer" or "carried", see ``_find_acquire``)
    guarded: dict[str, tuple[str, str]]
    #: position in the load's block of the first operation that is or holds an acquire
    first_acquire_index: int | None

    def guarded_by(self, role: str) -> str | None:
        """How operand ``role`` depends on an acquire (``None``: it does not)."""
        return self.guarded[role][1] if role in self.guarded else None

    @property
    def before_any_acquire(self) -> bool:
        """No acquire precedes the load in its block (e.g. a pipeliner prologue prefetch)."""
        return self.first_acquire_index is None or self.first_acquire_index > self.index


_LOAD_KINDS = (
    "tt.load",
    "ttg.async_copy_global_to_local",
    "ttng.async_tma_copy_global_to_local",
    "tt.descriptor_load",
)


def _load_roles(op: Op) -> dict[str, list[str]] | None:
    """Operand roles of a data load (``None``: not a global tensor load)."""
    body = _strip_attr_dicts(op.text.split("=", 1)[1] if op.results else op.text)
    body = body.split(op.kind, 1)[1]
    args, _, types = body.partition(" : ")
    vals = [_base(v) for v in _VALUE.findall(args)]
    if op.kind == "tt.load":
        if "tensor<" not in types:
            return None  # a scalar load (a pointer table, a signal), not a tile
        roles = ["ptr", "mask", "other"]
        return {roles[i]: [v] for i, v in enumerate(vals[:3])}
    if op.kind == "ttg.async_copy_global_to_local":
        out = {"ptr": vals[:1], "dst": vals[1:2]}
        for role in ("mask", "other"):
            mm = re.search(rf"\b{role}\s+(%[\w$.]+)", args)
            if mm:
                out[role] = [_base(mm.group(1))]
        return out
    coords = re.search(r"\[([^\]]*)\]", args)
    coord = [_base(v) for v in _VALUE.findall(coords.group(1))] if coords else []
    out = {"desc": vals[:1], "coord": coord}
    if op.kind == "ttng.async_tma_copy_global_to_local":
        rest = _VALUE.findall(args[coords.end() :] if coords else "")
        out.update({"dst": rest[:1], "barrier": rest[1:2], "pred": rest[2:3]})
    return out


def data_loads(ttgir: str) -> list[Load]:
    """Every global data load of the function, in program order within each block."""
    found: list[Load] = []

    def visit(scopes: list[list[Op]], owners: list[Op | None], path: str) -> None:
        block = scopes[-1]
        acquires = [op.index for op in block if any(_is_acquire(o) for o in op.walk())]
        for op in block:
            roles = _load_roles(op) if op.kind in _LOAD_KINDS else None
            if roles is not None:
                guarded = {}
                for role, vals in roles.items():
                    for v in vals:
                        hit = _find_acquire(v, scopes, owners)
                        if hit is not None and (
                            role not in guarded or _RANK[hit[1]] < _RANK[guarded[role][1]]
                        ):
                            guarded[role] = (hit[0].text, hit[1])
                first = acquires[0] if acquires else None
                found.append(Load(op.kind, op.text, path, op.index, guarded, first))
            for region in op.regions:
                visit([*scopes, region], [*owners, op], f"{path}/{op.kind}")

    visit([parse_ttgir(ttgir)], [None], "func")
    return found


# --------------------------------------------------------------------------------------
# PTX

_PTX_ACQUIRE = re.compile(r"^(?:@!?%p\d+\s+)?(?:ld|atom)\.[\w.:]*\b(?:acquire|acq_rel)\b")
_PTX_DATA_LOAD = re.compile(
    r"^(?:@!?%p\d+\s+)?(?:ld\.global\.(?![\w.:]*\b(?:acquire|acq_rel|relaxed|volatile)\b)"
    r"|cp\.async\.(?:cg|ca)\.shared\.global|cp\.async\.bulk\.tensor\.[\w.:]*global)"
)


def ptx_loads_before_acquire(ptx: str) -> list[str]:
    """Data loads (``ld.global``, ``cp.async``, TMA ``cp.async.bulk.tensor``) of the PTX that
    no ``ld``/``atom`` with acquire semantics precedes within their basic block (blocks split
    at ``$L__BB`` labels; a fall-through path counts as one block)."""
    bad: list[str] = []
    acquired = False
    for raw in ptx.splitlines():
        s = raw.strip()
        if re.match(r"^\$L__BB\d+_\d+:", s):
            acquired = False
            continue
        if _PTX_ACQUIRE.match(s):
            acquired = True
        elif _PTX_DATA_LOAD.match(s) and not acquired:
            bad.append(s)
    return bad
