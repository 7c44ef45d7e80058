"""The package layout holds: no import cycle anywhere, the layers import only downwards, and every function
stays small enough to read.

``bridge`` is the ground floor and imports neither wing; ``trainer`` and ``inference_adapter`` do not
import each other; ``bench`` sits above them and ``wsync`` (the command line) on top of everything.
Every import counts, also the ones inside functions (a lazy import still ties two modules together).

Rooms: ``bridge`` keeps at most 12 modules at its top level (the shared ground: errors, config, protocol, tensors,
logs...); the rest lives in sub-packages named for what they hold (the publisher's lifecycle, codecs, transports,
LoRA, the serving side's imports...).

Size: no function over 80 lines in ``bridge`` and ``inference_adapter``, no module in ``bridge`` over 500 lines. A
module past that holds more than one concern, and is split by concern, never by a line count (a mixin using its
host's lock, a module re-exported through another). An underscore name is its module's own: no module imports one
from another.
Each failure lists every offender, so the message is the to-do list.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("bridge", "trainer", "inference_adapter", "wsync", "bench")
MAY_NOT_IMPORT = {
    "bridge": {"trainer", "inference_adapter", "wsync", "bench"},
    "trainer": {"inference_adapter", "wsync", "bench"},
    "inference_adapter": {"trainer", "wsync", "bench"},
    "bench": {"wsync"},
}
MAX_FUNCTION_LINES = 80
FUNCTION_LIMITED = ("bridge", "inference_adapter")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module ``from ... import`` names in module ``name`` (relative imports resolved)."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([base] if base else []))


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (resolved to the longest known module name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path, node)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is not a cycle
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers_import_only_downwards():
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in _graph().items()
        for dep in deps
        if dep.split(".")[0] in MAY_NOT_IMPORT.get(mod.split(".")[0], set())
    ]
    assert not wrong, "; ".join(sorted(wrong))


def _where(path: pathlib.Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def _long_functions(path: pathlib.Path) -> list[str]:
    """``path:line name N lines`` for each function over the limit; a nested one counts on its own and
    inside its enclosing one (a closure is part of its enclosing function's body)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{_where(path, node.lineno)} {node.name} {n} lines")
    return out


def test_no_function_over_80_lines_in_bridge_and_inference_adapter():
    long = [line for name, path in sorted(_modules().items()) if name.split(".")[0] in FUNCTION_LIMITED
            for line in _long_functions(path)]
    assert not long, f"{len(long)} function(s) over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_underscore_name_imported_from_another_module():
    """``from x import _y`` reaches into ``x``'s private part: make ``_y`` public there, or move it."""
    private = [
        f"{_where(path, node.lineno)} {_resolve(name, path, node)}.{alias.name}"
        for name, path in sorted(_modules().items())
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and _resolve(name, path, node).split(".")[0] in PACKAGES
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, f"{len(private)} underscore name(s) imported from another module:\n" + "\n".join(private)


TOP_LEVEL_MODULES = 12
MAX_MODULE_LINES = 500


def test_bridge_is_rooms_not_a_hall():
    top = sorted(p.name for p in (ROOT / "bridge").glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, f"bridge/ holds {len(top)} modules at its top level: {top}"
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "bridge").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by concern): {long}"
