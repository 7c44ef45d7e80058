"""The package layout holds: no import cycle anywhere, and the layers import only downwards.

``bridge`` is the ground floor and imports neither wing; ``trainer`` and ``inference_adapter`` do not
import each other; ``wsync`` and ``bench`` sit on top. Every import counts, also the ones inside
functions (a lazy import still ties two modules together).
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
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (resolved to the longest known module name)."""
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
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
