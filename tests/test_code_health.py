"""Code-health rules for `kernelize/`, checked on the source (ast): function length, no import of another
module's underscore name, no two modules importing each other at run time (lazy imports inside functions
count; imports under `if TYPE_CHECKING:` never run and do not)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kernelize"
MAX_LINES = 60


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text(), str(path)))
    return out


MODULES = _modules()


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
        ):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str, path: Path, tree: ast.Module):
    """(imported module, imported name or None) for every run-time `from ... import` / `import`."""
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                yield (full, None) if full in MODULES else (target, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None


def test_functions_are_at_most_60_lines() -> None:
    too_long = {}
    for path, tree in MODULES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    too_long[f"{path.relative_to(PKG).as_posix()}:{node.name}"] = lines
    assert not too_long, f"functions over {MAX_LINES} lines (split them): {too_long}"


def test_no_module_imports_another_modules_private_name() -> None:
    private = [
        f"{name} imports {target}.{what}"
        for name, (path, tree) in MODULES.items()
        for target, what in _imports(name, path, tree)
        if what and what.startswith("_") and target in MODULES and target != name
    ]
    assert not private, "give these names a public spelling: " + "; ".join(private)


def test_no_two_modules_import_each_other() -> None:
    edges = defaultdict(set)
    for name, (path, tree) in MODULES.items():
        for target, _ in _imports(name, path, tree):
            if target in MODULES and target != name:
                edges[name].add(target)
    cycles = sorted({tuple(sorted((a, b))) for a in list(edges) for b in edges[a] if a in edges.get(b, ())})
    assert not cycles, f"modules importing each other: {cycles}"


def test_the_checks_see_the_package() -> None:
    """The rules above scan real code: the package's modules and their imports are found."""
    assert len(MODULES) > 80 and "kernelize.ir.graph" in MODULES
    path, tree = MODULES["kernelize.runtime.compiled"]
    assert ("kernelize.ir.reference", "EVAL") in set(_imports("kernelize.runtime.compiled", path, tree))


# OpenMP constructs that make or steer a thread team; `omp simd` (vectorisation) is free to use anywhere
_TEAM_OMP = re.compile(
    r"(#\s*pragma\s+omp|_Pragma\(\s*\"omp)\s+(parallel|for|barrier|single|master|critical|task)"
)
_TEAM_CALLS = re.compile(r"\bomp_(get|set)_\w+\s*\(")
PRELUDE = PKG / "codegen" / "templates" / "cpu_prelude.h"


def _team_openmp(text: str) -> list[str]:
    return [m.group(0) for m in _TEAM_OMP.finditer(text)] + [m.group(0) for m in _TEAM_CALLS.finditer(text)]


def test_one_cpu_parallel_for() -> None:
    """Every CPU kernel's threads come from `kz_parallel_for` in cpu_prelude.h (docs/runtime.md, "Threads"):
    no template or code generator opens an OpenMP region, shares out a loop or asks OpenMP for thread ids."""
    sources = [p for p in sorted(PKG.rglob("*")) if p.suffix in {".py", ".h", ".c", ".cpp", ".tmpl"}]
    assert PRELUDE in sources
    found = {p.relative_to(PKG).as_posix(): _team_openmp(p.read_text()) for p in sources if p != PRELUDE}
    assert not {k: v for k, v in found.items() if v}, f"use kz_parallel_for / kz_range / kz_barrier: {found}"
    prelude = PRELUDE.read_text()
    start = prelude.index("static inline int kz_parallel_for(")
    region = prelude[start : prelude.index("\n}\n", start)]
    assert [m.group(2) for m in _TEAM_OMP.finditer(prelude)] == ["parallel", "barrier"]
    assert len(_TEAM_OMP.findall(region)) == 1, "the prelude's one omp parallel is kz_parallel_for's"
    assert _team_openmp('#pragma omp parallel for\n_Pragma("omp barrier")\nomp_get_thread_num()') != []
