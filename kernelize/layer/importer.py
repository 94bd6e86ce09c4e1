"""Import the Python package of one build variant under a module name of its own.

A variant folder holds the package either flattened (`build/<variant>/__init__.py`) or in a folder
(`build/<variant>/<package>/__init__.py`, the older layout that `LocalLayerRepository(package_name=...)`
names). Each package is imported under a name derived from its resolved path, so two versions of the same
kernel can be loaded side by side, and it is imported once per process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import re
import sys
import threading
from pathlib import Path
from types import ModuleType

from kernelize._compat import add_note

__all__ = ["import_variant", "kernel_layers", "read_metadata"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_IMPORTED: dict[Path, ModuleType] = {}  # package folder (resolved) -> module


def read_metadata(variant_dir: Path) -> dict:
    """The `metadata.json` of a variant (or of its repository root), or `{}` if there is none.

    Only `name` is used here; the rest (license, python-depends, ...) is informational.
    """
    for candidate in (variant_dir / "metadata.json", variant_dir.parent.parent / "metadata.json"):
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"Cannot read kernel metadata {candidate}: {exc}") from exc
            return data if isinstance(data, dict) else {}
    return {}


def _package_dir(variant_dir: Path, package_name: str | None, meta_name: object) -> Path:
    """Find the folder whose `__init__.py` is the kernel's top module (`meta_name`: metadata's `name`)."""
    tried: list[Path] = []
    names: list[str] = []
    if package_name:
        names.append(package_name)
    if isinstance(meta_name, str) and meta_name:
        names.append(meta_name.replace("-", "_"))
    # The seed form names the package folder; the newer form flattens it. Accept either for either call.
    candidates = [variant_dir / name for name in names] + [variant_dir]
    for candidate in candidates:
        tried.append(candidate / "__init__.py")
        if (candidate / "__init__.py").is_file():
            return candidate
    subpackages = (
        sorted(p for p in variant_dir.iterdir() if (p / "__init__.py").is_file())
        if variant_dir.is_dir()
        else []
    )
    if len(subpackages) == 1:
        return subpackages[0]
    listed = "\n".join(f"  - {path}" for path in tried)
    hint = (
        f" Packages found: {', '.join(p.name for p in subpackages)}; pass package_name=..."
        if subpackages
        else ""
    )
    raise FileNotFoundError(
        f"No kernel package in build variant {variant_dir}. Looked for:\n{listed}\n{hint}".rstrip()
    )


def _module_name(package_dir: Path, meta_name: object) -> str:
    # Readable part: the kernel's name (the folder of a flattened build is the variant, e.g. torch-universal).
    name = meta_name or package_dir.name or "kernel"
    stem = re.sub(r"\W", "_", str(name))
    digest = hashlib.sha1(str(package_dir).encode()).hexdigest()[:12]
    return f"_kernelize_kernel_{stem}_{digest}"


def import_variant(variant_dir: Path, *, package_name: str | None = None) -> ModuleType:
    """Import the kernel package of `variant_dir` (once per process) and return its top module.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "__init__.py").write_text("ANSWER = 42")
        >>> import_variant(root).ANSWER
        42
    """
    variant_dir = Path(variant_dir)
    meta_name = read_metadata(variant_dir).get("name")  # read once: it names both the folder and the module
    package_dir = _package_dir(variant_dir, package_name, meta_name).resolve()
    with _LOCK:
        module = _IMPORTED.get(package_dir)
        if module is not None:
            return module
        name = _module_name(package_dir, meta_name)
        spec = importlib.util.spec_from_file_location(
            name, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before executing: the package's relative imports look it up
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            add_note(exc, f"while importing the kernel package at {package_dir}")
            raise
        logger.debug("Imported kernel package %s as %s", package_dir, name)
        _IMPORTED[package_dir] = module
        return module


def kernel_layers(module: ModuleType, where: str) -> ModuleType:
    """The `layers` submodule of a kernel package (imported if the package does not import it itself)."""
    layers = getattr(module, "layers", None)
    if isinstance(layers, ModuleType):
        return layers
    package_dir = Path(module.__file__ or "").parent
    if (package_dir / "layers.py").is_file() or (package_dir / "layers" / "__init__.py").is_file():
        return importlib.import_module(f"{module.__name__}.layers")
    raise ValueError(
        f"Kernel repository {where} does not define any layers (no `layers` module in {package_dir})."
    )
