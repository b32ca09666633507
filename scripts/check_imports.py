"""Source hygiene of the monorepo's packages: no private cross-package import, no import cycle,
no oversized source file.

Three rules over every ``.py`` file under ``packages/*/src``, with every ``import`` statement
counted wherever it stands (module level, inside a function or a class, under ``try``), except
those under ``if TYPE_CHECKING:`` for the cycle rule (they never run):

* **Private cross-package import.** A module of one distribution (``gefen_core``) may import
  another's (``gefen_kernels``) public names only: no module path with a component starting
  with ``_`` (``gefen_kernels._triton``, ``gefen_core._dispatch``) and no imported name starting
  with ``_`` (``from gefen_core import _amp``). Dunder names (``__version__``) are public.
* **Import cycle.** The graph whose nodes are modules and whose edges are "module A imports
  module B" (``from pkg.mod import name`` is an edge to ``pkg.mod``, and to ``pkg.mod.name``
  when that is a module) has no cycle. An edge to a package means its ``__init__``.
* **Size.** No source file has more than :data:`MAX_LINES` lines, and the files of
  :data:`LINE_LIMITS` (the thin layers) stay within theirs.

Usage: ``python scripts/check_imports.py [ROOT]`` (default: the repository root). Prints each
violation and exits 1 when there is any, else prints a one-line summary and exits 0.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 900
#: Tighter limits, by path relative to the repository root: the torch.optim-shaped functional
#: layer is a dispatcher, not a place for launch code.
LINE_LIMITS = {"packages/gefen-core/src/gefen_core/functional.py": 400}


@dataclass(frozen=True)
class Import:
    """One imported module (and name, for ``from ... import name``) of one source file."""

    source: str  # importing module, dotted
    target: str  # imported module, dotted (absolute)
    name: str | None  # the imported name of ``from target import name``
    line: int
    runtime: bool  # False under ``if TYPE_CHECKING:``


def modules(root: Path) -> dict[str, Path]:
    """Every module under ``root/packages/*/src``: dotted name -> file."""
    found: dict[str, Path] = {}
    for src in sorted(root.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts:
                found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, runtime: bool = True) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, False
                yield from _walk(stmt, False)
            for stmt in child.orelse:
                yield stmt, runtime
                yield from _walk(stmt, runtime)
            continue
        yield child, runtime
        yield from _walk(child, runtime)


def imports(module: str, path: Path) -> list[Import]:
    """The imports of one file, relative ones resolved against ``module``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[Import] = []
    for node, runtime in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(module, alias.name, None, node.lineno, runtime))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                out.append(Import(module, target, alias.name, node.lineno, runtime))
    return out


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def private_imports(found: dict[str, Path], all_imports: list[Import]) -> list[str]:
    """``file:line: message`` for each import of another distribution's private name."""
    ours = {name.split(".")[0] for name in found}
    errors = []
    for imp in all_imports:
        top = imp.target.split(".")[0]
        if top not in ours or top == imp.source.split(".")[0]:
            continue
        what = imp.target if imp.name is None else f"{imp.target}.{imp.name}"
        if _private(what):
            errors.append(
                f"{found[imp.source]}:{imp.line}: {imp.source} imports the private "
                f"name {what} of another package (make it public and documented in "
                f"{top}, or drop the need)"
            )
    return errors


def graph(found: dict[str, Path], all_imports: list[Import]) -> dict[str, set[str]]:
    """Module -> the modules it imports at run time (this repository's modules only)."""
    edges: dict[str, set[str]] = {name: set() for name in found}
    for imp in all_imports:
        if not imp.runtime:
            continue
        targets = []
        if imp.name is not None and f"{imp.target}.{imp.name}" in found:
            targets.append(f"{imp.target}.{imp.name}")
        elif imp.target in found:
            targets.append(imp.target)
        for target in targets:
            if target != imp.source:
                edges[imp.source].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """The strongly connected components with more than one module (Tarjan), sorted, each as
    ``(one cycle through it, its modules)``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return [(_one_cycle(comp, edges), comp) for comp in sorted(comps)]


def _one_cycle(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    members = set(comp)
    start = comp[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp  # unreachable for a strongly connected component


def oversized(root: Path, found: dict[str, Path]) -> list[str]:
    """``file: message`` for each source file over its line limit."""
    errors = []
    for path in sorted(found.values()):
        rel = path.relative_to(root).as_posix()
        limit = LINE_LIMITS.get(rel, MAX_LINES)
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            errors.append(f"{path}: {n} lines, over the limit of {limit} (split it)")
    return errors


def check(root: Path) -> list[str]:
    """Every violation under ``root`` as one line each (empty: clean)."""
    found = modules(root)
    all_imports = [imp for name, path in found.items() for imp in imports(name, path)]
    errors = private_imports(found, all_imports) + oversized(root, found)
    for cycle in cycles(graph(found, all_imports)):
        errors.append(
            "import cycle: "
            + " -> ".join(cycle[0])
            + " (modules in the cycle: "
            + ", ".join(cycle[1])
            + ")"
        )
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "root",
        nargs="?",
        type=Path,
        default=ROOT,
        help="repository root holding packages/*/src (default: this one)",
    )
    args = parser.parse_args(argv)
    errors = check(args.root)
    for line in errors:
        print(line)
    if errors:
        print(f"check_imports: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print(
        f"check_imports: {len(modules(args.root))} modules, no private cross-package "
        f"import, no cycle, none over {MAX_LINES} lines"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
