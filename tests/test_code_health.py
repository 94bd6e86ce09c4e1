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


def _kernel_kind_tests(tree: ast.Module) -> list[int]:
    """Lines testing a kernel's kind: `KernelKind.X`, `.kind is / == / in ...`, `isinstance(_, *Kernel)`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "KernelKind":
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(
            isinstance(side, ast.Attribute) and side.attr == "kind" for side in (node.left, *node.comparators)
        ):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "isinstance"
            and len(node.args) == 2
        ):
            names = [n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)]
            lines += (
                [node.lineno] if any(n.endswith("Kernel") and n != "CompiledKernel" for n in names) else []
            )
    return lines


def test_backends_dispatch_on_kernel_classes_not_kinds() -> None:
    """codegen/ and runtime/ pick what to do with a kernel through per-kind tables (`kernels.dispatch`), never
    by testing its kind; kernels have no field typed `Any`."""
    found = {
        f"{path.relative_to(PKG).as_posix()}:{line}"
        for name, (path, tree) in MODULES.items()
        if name.startswith(("kernelize.codegen", "kernelize.runtime"))
        for line in _kernel_kind_tests(tree)
    }
    assert not found, f"kind tests outside the dispatch tables: {sorted(found)}"
    from dataclasses import fields

    from kernelize.autokernel import kernels

    classes = [c for c in vars(kernels).values() if isinstance(c, type) and issubclass(c, kernels.Kernel)]
    assert len(classes) >= 10
    untyped = [f"{c.__name__}.{f.name}" for c in classes for f in fields(c) if "Any" in str(f.type)]
    assert not untyped, f"kernel fields typed Any: {untyped}"


def test_kind_check_finds_kind_tests() -> None:
    """The rule above sees each spelling of a kind test."""
    code = "k.kind is KernelKind.ROW\nx.kind in s\nisinstance(k, RowKernel)\nisinstance(c, CompiledKernel)\n"
    assert sorted(_kernel_kind_tests(ast.parse(code))) == [1, 1, 2, 3]


def test_bundled_layers_do_not_import_the_integrations() -> None:
    """hub_kernels/ sits below the integrations: its layers import kernelize's core, never
    `kernelize.integrations` (which imports them)."""
    hub = PKG.parent / "hub_kernels"
    offenders = []
    for path in sorted(hub.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [
                f"{path.relative_to(hub)}:{node.lineno}"
                for n in names
                if n.startswith("kernelize.integrations")
            ]
    assert len(list(hub.rglob("*.py"))) > 5
    assert not offenders, f"hub_kernels importing kernelize.integrations: {offenders}"


def test_the_planner_is_not_steered_by_exceptions() -> None:
    """Lowering returns its reasons to plan again (``autokernel.reasons.Rejection``) as values: nothing
    raises, catches or defines the re-plan signals ``Materialize`` / ``DenseLayout`` as exceptions."""
    signals = {"Materialize", "DenseLayout"}

    def names(node: ast.AST | None) -> set[str]:
        return {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node)} if node else set()

    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise):
                hit = names(node.exc) & signals
            elif isinstance(node, ast.ExceptHandler):
                hit = names(node.type) & signals
            elif isinstance(node, ast.ClassDef):
                hit = {node.name} & signals
            else:
                continue
            found += [f"{path.relative_to(PKG).as_posix()}:{node.lineno} {h}" for h in hit]
    assert not found, f"the planner's re-plan signals are values (Rejection), not exceptions: {found}"


# OpenMP constructs that make or steer a thread team; `omp simd` (vectorisation) is free to use anywhere
_TEAM_OMP = re.compile(
    r"(#\s*pragma\s+omp|_Pragma\(\s*\"omp)\s+(parallel|for|barrier|single|master|critical|task)"
)
_TEAM_CALLS = re.compile(r"\bomp_(get|set)_\w+\s*\(")
PRELUDE = PKG / "codegen" / "templates" / "cpu_prelude.h"


def _team_openmp(text: str) -> list[str]:
    return [m.group(0) for m in _TEAM_OMP.finditer(text)] + [m.group(0) for m in _TEAM_CALLS.finditer(text)]


def _but_finder(path: Path) -> str:
    """``path``'s text without cpu_workers.cpp's ``find_openmp_pool``, whose one region only names torch's
    OpenMP pool threads (kz_openmp_away keeps them off the caller's core) and runs no kernel's work."""
    text = path.read_text()
    if path.name != "cpu_workers.cpp":
        return text
    start = text.index("void find_openmp_pool(")
    end = text.index("\n}\n", start)
    assert [m.group(2) for m in _TEAM_OMP.finditer(text[start:end])] == ["parallel"]
    return text[:start] + text[end:]


def test_one_cpu_parallel_for() -> None:
    """Every CPU kernel's threads come from `kz_parallel_region` in cpu_prelude.h (docs/runtime.md,
    "Threads"), on the one pool of cpu_workers.cpp: no template or code generator opens an OpenMP region,
    shares out a loop, asks OpenMP for thread ids or starts a thread."""
    sources = [p for p in sorted(PKG.rglob("*")) if p.suffix in {".py", ".h", ".c", ".cpp", ".tmpl"}]
    assert PRELUDE in sources
    found = {p.relative_to(PKG).as_posix(): _team_openmp(_but_finder(p)) for p in sources if p != PRELUDE}
    assert not {k: v for k, v in found.items() if v}, f"use kz_parallel_for / kz_range / kz_barrier: {found}"
    starts = [
        p.name
        for p in sources
        if p.suffix != ".py" and re.search(r"std::thread\(|pthread_create\(", p.read_text())
    ]
    assert starts == ["cpu_workers.cpp"], f"threads started outside the workers' pool: {starts}"
    prelude = PRELUDE.read_text()
    start = prelude.index("static inline int kz_parallel_region(")
    region = prelude[start : prelude.index("\n}\n", start)]
    assert [m.group(2) for m in _TEAM_OMP.finditer(prelude)] == ["parallel", "barrier"]
    assert len(_TEAM_OMP.findall(region)) == 1, "the prelude's one omp parallel is kz_parallel_region's"
    assert _team_openmp('#pragma omp parallel for\n_Pragma("omp barrier")\nomp_get_thread_num()') != []
