"""Where a kernel layer comes from: Hub, local folder or lock file; a layer class or a function.

Repositories are small frozen (hashable) descriptions; nothing is resolved or downloaded until `load()`.
Anything with a `load() -> type[nn.Module]` method can be used in a kernel mapping.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .decorators import function_layer_class
from .hub import check_repo_id, check_revision, check_trust_setting, get_kernel, get_local_kernel
from .importer import kernel_layers
from .lockfile import locked_commit

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "FuncRepository",
    "LayerRepository",
    "LocalFuncRepository",
    "LocalLayerRepository",
    "LockedFuncRepository",
    "LockedLayerRepository",
    "RepositoryProtocol",
]


@runtime_checkable
class RepositoryProtocol(Protocol):
    """What a kernel mapping needs from a repository."""

    def load(self) -> type[nn.Module]: ...


_LOCK = threading.RLock()
_LOADED: dict[RepositoryProtocol, type] = {}  # repository -> kernel layer class (loading may download)


def _load_once(repo: RepositoryProtocol, loader: Callable[[], type]) -> type:
    with _LOCK:
        if repo not in _LOADED:
            _LOADED[repo] = loader()
        return _LOADED[repo]


def _pick_layer(module: ModuleType, layer_name: str, where: str) -> type:
    layers = kernel_layers(module, where)
    layer = getattr(layers, layer_name, None)
    if layer is None:
        found = sorted(n for n, v in vars(layers).items() if isinstance(v, type) and not n.startswith("_"))
        raise ValueError(
            f"Layer `{layer_name}` not found in kernel repository {where} "
            f"(layers: {', '.join(found) or 'none'})."
        )
    return layer


def _pick_func(module: ModuleType, func_name: str, where: str) -> type:
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"Function `{func_name}` not found in kernel repository {where}.")
    return function_layer_class(func)


def _check_str(value: object, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty string, got {value!r}.")


@dataclass(frozen=True)
class _HubSource:
    """A repository on the Hugging Face Hub (or bundled: `kernelize/<name>`)."""

    repo_id: str
    _: KW_ONLY
    revision: str | None = None
    version: int | None = None
    trust_remote_code: bool | list[str] | tuple[str, ...] = False
    user_agent: str | dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_repo_id(self.repo_id)
        check_revision(f"{type(self).__name__}(`{self.repo_id}`)", self.revision, self.version)
        trust = check_trust_setting(self.trust_remote_code, self.repo_id)
        object.__setattr__(self, "trust_remote_code", trust)  # a tuple: the repository keys the load cache

    def _module(self) -> ModuleType:
        return get_kernel(
            self.repo_id,
            revision=self.revision,
            version=self.version,
            trust_remote_code=self.trust_remote_code,
            user_agent=self.user_agent,
        )

    def _where(self) -> str:
        if self.version is not None:
            return f"`{self.repo_id}` (version {self.version})"
        return f"`{self.repo_id}` (revision {self.revision})"


@dataclass(frozen=True)
class _LocalSource:
    """A repository (or build variant) folder on disk."""

    repo_path: Path
    _: KW_ONLY
    package_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.repo_path, str | os.PathLike):
            raise TypeError(f"repo_path must be a path, got {self.repo_path!r}.")
        object.__setattr__(self, "repo_path", Path(self.repo_path))

    def _module(self) -> ModuleType:
        return get_local_kernel(self.repo_path, self.package_name)

    def _where(self) -> str:
        return f"`{self.repo_path}`"


@dataclass(frozen=True)
class _LockedSource:
    """A Hub repository pinned to the commit recorded in a `kernels.lock` file (read at construction)."""

    repo_id: str
    _: KW_ONLY
    lockfile: str | os.PathLike[str] | None = None
    trust_remote_code: bool | list[str] | tuple[str, ...] = False
    commit: str = field(init=False)

    def __post_init__(self) -> None:
        check_repo_id(self.repo_id)
        trust = check_trust_setting(self.trust_remote_code, self.repo_id)
        object.__setattr__(self, "trust_remote_code", trust)
        object.__setattr__(self, "commit", locked_commit(self.repo_id, self.lockfile))

    def _module(self) -> ModuleType:
        return get_kernel(self.repo_id, revision=self.commit, trust_remote_code=self.trust_remote_code)

    def _where(self) -> str:
        return f"`{self.repo_id}` (locked at {self.commit[:12]})"


class _LayerPick:
    layer_name: str

    def load(self) -> type[nn.Module]:
        """Load (once per process) and return the kernel layer class."""
        _check_str(self.layer_name, "layer_name")
        return _load_once(self, lambda: _pick_layer(self._module(), self.layer_name, self._where()))

    def __str__(self) -> str:
        return f"{self._where()}, layer `{self.layer_name}`"


class _FuncPick:
    func_name: str

    def load(self) -> type[nn.Module]:
        """Load (once per process) the function and return a layer class whose forward calls it."""
        _check_str(self.func_name, "func_name")
        return _load_once(self, lambda: _pick_func(self._module(), self.func_name, self._where()))

    def __str__(self) -> str:
        return f"{self._where()}, function `{self.func_name}`"


@dataclass(frozen=True, kw_only=True)
class LayerRepository(_LayerPick, _HubSource):
    """A layer in a Hub repository.

    Args:
        repo_id: `org/name` on the Hub, or `kernelize/<name>` for a bundled repository.
        layer_name: Class name in the repository's `layers` module.
        revision: Branch, tag or commit. Exactly one of `revision` and `version` is required (as in
            `kernels` 0.17.2).
        version: Major version: the latest build on branch `v{version}`.
        trust_remote_code: `True`, or a list of repo ids or globs (`org/*`) whose code may run. Bundled
            repositories and `LOCAL_KERNELS` folders are trusted.

    Example:
        >>> str(LayerRepository("kernels-community/activation", layer_name="SiluAndMul", version=1))
        '`kernels-community/activation` (version 1), layer `SiluAndMul`'
    """

    layer_name: str


@dataclass(frozen=True, kw_only=True)
class FuncRepository(_FuncPick, _HubSource):
    """A function in a Hub repository, used as a layer (for stateless layers and function layers).

    Example:
        >>> str(FuncRepository("kernels-community/activation", func_name="silu_and_mul", version=1))
        '`kernels-community/activation` (version 1), function `silu_and_mul`'
    """

    func_name: str


@dataclass(frozen=True, kw_only=True)
class LocalLayerRepository(_LayerPick, _LocalSource):
    """A layer in a repository folder on disk.

    `package_name` is the older form (`build/<variant>/<package_name>/`); the newer form omits it.

    Example:
        >>> str(LocalLayerRepository("/kernels/act", package_name="act", layer_name="SiluAndMul"))
        '`/kernels/act`, layer `SiluAndMul`'
    """

    layer_name: str


@dataclass(frozen=True, kw_only=True)
class LocalFuncRepository(_FuncPick, _LocalSource):
    """A function in a repository folder on disk.

    Example:
        >>> str(LocalFuncRepository("/kernels/activation", func_name="silu_and_mul"))
        '`/kernels/activation`, function `silu_and_mul`'
    """

    func_name: str


@dataclass(frozen=True, kw_only=True)
class LockedLayerRepository(_LayerPick, _LockedSource):
    """A layer in a Hub repository pinned by a lock file (`lockfile=None`: the caller's package metadata).

    Example:
        >>> LockedLayerRepository("org/act", layer_name="Silu", lockfile="kernels.lock")  # doctest: +SKIP
    """

    layer_name: str


@dataclass(frozen=True, kw_only=True)
class LockedFuncRepository(_FuncPick, _LockedSource):
    """A function in a Hub repository pinned by a lock file."""

    func_name: str
