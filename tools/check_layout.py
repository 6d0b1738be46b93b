"""Check the library's layout rules: no import cycle between layerflow modules, no module over the size limit, no
module that imports the tests. `python -m tools.check_layout` prints what breaks a rule (exit 1) or nothing."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "layerflow"
MAX_LINES = 420


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The layerflow modules `path` imports at module level or inside functions (any import is an edge)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules or name.startswith("tests")}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def problems() -> list[str]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph: dict[str, set[str]] = {}
    found = []
    for f in files:
        name = module_name(f)
        deps = imports_of(f, modules)
        tests = sorted(d for d in deps if d.startswith("tests"))
        if tests:
            found.append(f"{name} imports the tests: {tests}")
        # A package's __init__ re-exporting its modules is not an edge back from those modules.
        graph[name] = {d for d in deps if d in modules and d != name and not name.startswith(d + ".")
                       and not (f.name == "__init__.py" and d.startswith(name + "."))}
        lines = len(f.read_text().splitlines())
        if lines > MAX_LINES:
            found.append(f"{name} has {lines} lines (limit {MAX_LINES})")
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
