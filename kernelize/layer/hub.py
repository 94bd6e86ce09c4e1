"""Resolve a kernel repository to the one build variant folder this system loads, and import it.

A repo id resolves, in order:

1. `kernelize/<name>`: the bundled repository `<name>` of `bundled_hub_dir()` (`kernelize/hub_kernels` in
   an installed wheel, `hub_kernels/` in a source checkout, or `$KERNELIZE_HUB_DIR`). `<name>` must be a
   plain name of a folder there (`check_repo_id`). No network; trusted.
2. `LOCAL_KERNELS=org/name=/path:org2/name2=/path2`: a folder on disk replaces the repository. Trusted
   (the user chose the folder).
3. The Hugging Face Hub, through `huggingface_hub` (repo type `kernel`, then `model`). Only the selected
   build variant is downloaded. With `HF_HUB_OFFLINE=1` everything comes from the Hugging Face cache,
   including version branches (`refs/vN`). Code from these repositories runs only with
   `trust_remote_code=True` (or the repo id listed in it, or in `$KERNELIZE_TRUST_REMOTE_CODE`).
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from .importer import import_variant
from .variants import SystemInfo, format_decisions, rank_variants

if TYPE_CHECKING:
    from huggingface_hub import HfApi

__all__ = [
    "BUNDLED_ORG",
    "bundled_hub_dir",
    "check_repo_id",
    "check_revision",
    "check_trust_setting",
    "check_trusted",
    "get_kernel",
    "get_local_kernel",
    "has_kernel",
    "resolve_kernel",
    "resolve_local_variant",
]

logger = logging.getLogger(__name__)

BUNDLED_ORG = "kernelize"
_REPO_TYPES = ("kernel", "model")  # newer Hub kernel repos first; older ones are model repos
_BYTECODE = ["*.pyc", "*/__pycache__/*"]
_TRUE = frozenset({"1", "true", "yes", "on", "all", "*"})

TrustRemoteCode = bool | list[str] | tuple[str, ...]  # repo ids or globs; a bare string is refused


def bundled_hub_dir() -> Path:
    """The folder of the bundled repositories.

    `$KERNELIZE_HUB_DIR` if set; else `kernelize/hub_kernels` inside an installed package (the wheel ships
    `hub_kernels/` there as package data); else `hub_kernels/` at the top of a source checkout (also what an
    editable install uses).
    """
    override = os.environ.get("KERNELIZE_HUB_DIR", "").strip()
    if override:
        return Path(override)
    packaged = importlib.resources.files("kernelize") / "hub_kernels"
    if isinstance(packaged, Path) and packaged.is_dir():  # not for zip imports: kernels import from files
        return packaged
    import kernelize

    return Path(kernelize.__file__).parents[1] / "hub_kernels"


def _local_overrides() -> dict[str, Path]:
    """`LOCAL_KERNELS=org/name=/path:org2/name2=/path2`, as in Hugging Face `kernels`."""
    raw = os.environ.get("LOCAL_KERNELS", "").strip()
    overrides: dict[str, Path] = {}
    for entry in filter(None, raw.split(":")):
        repo_id, sep, path = entry.partition("=")
        if not sep or not repo_id or not path:
            raise ValueError(
                f"Invalid LOCAL_KERNELS entry {entry!r}; expected org/name=/path[:org2/name2=/path2]."
            )
        overrides[repo_id] = Path(path)
    return overrides


def _bundled_names(hub_dir: Path) -> list[str]:
    return sorted(p.name for p in hub_dir.iterdir() if p.is_dir()) if hub_dir.is_dir() else []


def check_repo_id(repo_id: object) -> str:
    """Return `repo_id` if it is a Hub repo id (`org/name`); bundled `kernelize/<name>` takes a plain name.

    Every entry point (repositories, `get_kernel`, `has_kernel`, lock files) calls this before it resolves
    anything, so a name such as `kernelize/../x` can never turn a folder into a trusted bundled repository.

    Example:
        >>> check_repo_id("kernelize/activation")
        'kernelize/activation'
        >>> check_repo_id("kernelize/../x")
        Traceback (most recent call last):
        ...
        ValueError: Kernel repository `kernelize/../x` is not a valid repo id: ...
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        raise TypeError(f"repo_id must be a non-empty string such as 'org/name', got {repo_id!r}.")
    try:  # one slash; letters, digits, `-`, `_`, `.`; no `..`, `--`, leading `.` or path separators
        validate_repo_id(repo_id)
        if repo_id == BUNDLED_ORG:
            raise HFValidationError("a bundled repository needs a name: kernelize/<name>")
    except HFValidationError as exc:
        bundled = ", ".join(f"{BUNDLED_ORG}/{n}" for n in _bundled_names(bundled_hub_dir())) or "none"
        raise ValueError(
            f"Kernel repository `{repo_id}` is not a valid repo id: {exc} "
            f"Use `org/name` for a Hub repository or a bundled name ({bundled}); for a folder on disk use "
            "LocalLayerRepository / get_local_kernel, or LOCAL_KERNELS=org/name=/path."
        ) from None
    return repo_id


def _local_folder_for(repo_id: str) -> Path | None:
    """The folder that stands in for `repo_id` (bundled or `LOCAL_KERNELS`), or `None` for the Hub."""
    check_repo_id(repo_id)
    override = _local_overrides().get(repo_id)
    if override is not None:
        return override
    org, _, name = repo_id.partition("/")
    if org != BUNDLED_ORG:
        return None
    hub_dir = bundled_hub_dir()
    bundled = _bundled_names(hub_dir)
    if name not in bundled:  # a listed child of the hub folder, never a path that leads elsewhere
        raise FileNotFoundError(
            f"No bundled kernel repository `{repo_id}` in {hub_dir} "
            f"(bundled: {', '.join(bundled) or 'none'}). "
            "Check the name, or point KERNELIZE_HUB_DIR at the folder holding it."
        )
    return hub_dir / name


def check_trust_setting(trust_remote_code: object, repo_id: object) -> bool | tuple[str, ...]:
    """`trust_remote_code` as `bool` or a tuple of repo ids / globs; anything else is a `TypeError`.

    A bare string is refused: iterating it would trust one-letter repo ids.

    Example:
        >>> check_trust_setting(["org/*"], "org/x")
        ('org/*',)
    """
    if isinstance(trust_remote_code, bool):
        return trust_remote_code
    if isinstance(trust_remote_code, list | tuple) and all(
        isinstance(p, str) and p.strip() for p in trust_remote_code
    ):
        return tuple(p.strip() for p in trust_remote_code)
    raise TypeError(
        f"Kernel repository `{repo_id}`: trust_remote_code must be True, False or a list of repo ids or "
        f"globs (e.g. [{repo_id!r}] or ['org/*']), got {trust_remote_code!r}."
    )


def check_revision(where: str, revision: object, version: object) -> None:
    """Exactly one of `revision` / `version`, as `kernels` 0.17.2 requires (`where` names the repository).

    Example:
        >>> check_revision("Kernel `org/x`", None, None)
        Traceback (most recent call last):
        ...
        ValueError: Kernel `org/x`: either a revision or a version must be specified. ...
    """
    if revision is not None and version is not None:
        raise ValueError(f"{where}: pass either revision= or version=, not both.")
    if revision is None and version is None:
        raise ValueError(
            f"{where}: either a revision or a version must be specified. Use version=<major> for a stable "
            "kernel API version, or revision=<branch/tag/commit> for an explicit Hub revision."
        )
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise TypeError(f"{where}: version must be an int, got {version!r}.")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise TypeError(f"{where}: revision must be a non-empty string, got {revision!r}.")


def check_trusted(repo_id: str, trust_remote_code: TrustRemoteCode) -> None:
    """Raise unless the user opted in to running code from `repo_id`."""
    trust = check_trust_setting(trust_remote_code, repo_id)
    patterns = trust if isinstance(trust, tuple) else ("*",) if trust else ()
    env = os.environ.get("KERNELIZE_TRUST_REMOTE_CODE", "").strip()
    patterns += ("*",) if env.lower() in _TRUE else tuple(p.strip() for p in env.split(",") if p.strip())
    if any(fnmatch.fnmatchcase(repo_id, p) for p in patterns):
        return
    raise ValueError(
        f"Kernel repository `{repo_id}` is not bundled with kernelize, and loading it runs its Python code. "
        f"If you trust it, pass trust_remote_code=True (or trust_remote_code=[{repo_id!r}]) to the "
        f"repository or get_kernel(), or set KERNELIZE_TRUST_REMOTE_CODE={repo_id}."
    )


def resolve_local_variant(repo_path: Path, system: SystemInfo) -> Path:
    """The best build variant folder of a repository on disk.

    `repo_path` may be a repository (`build/<variant>/...`), a `build` folder, or a variant folder itself.
    """
    repo_path = Path(repo_path)
    if not repo_path.is_dir():
        raise FileNotFoundError(f"Kernel repository folder {repo_path} does not exist.")
    decisions = []
    for base in (repo_path / "build", repo_path):
        names = [p.name for p in base.iterdir() if p.is_dir()] if base.is_dir() else []
        accepted, base_decisions = rank_variants(names, system)
        if accepted:
            return base / accepted[0]
        decisions += [d for d in base_decisions if not d.reason.startswith(("unknown framework", "invalid"))]
    if not decisions and (any(repo_path.glob("*/__init__.py")) or (repo_path / "__init__.py").is_file()):
        return repo_path  # a variant folder itself
    raise FileNotFoundError(
        f"No build variant in {repo_path} fits this system ({system}):\n{format_decisions(decisions)}"
    )


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return bool(constants.HF_HUB_OFFLINE) or env in _TRUE


def _cache_dir() -> str:
    from huggingface_hub import constants

    # Read at call time: HF_HUB_CACHE may be set after huggingface_hub was imported (tests, notebooks).
    return os.environ.get("KERNELS_CACHE") or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def _api(user_agent: str | dict | None = None) -> HfApi:
    from huggingface_hub import HfApi

    try:
        from importlib.metadata import version

        ours = version("kernelize")
    except Exception:  # not installed (plain source checkout)
        ours = "0"
    return HfApi(library_name="kernelize", library_version=ours, user_agent=user_agent)


@dataclass(frozen=True)
class _HubBuild:
    """One build variant of one revision of a Hub repository."""

    repo_id: str
    repo_type: str
    revision: str
    variant: str


def _cached_folder(repo_id: str, cache: str) -> tuple[str, Path]:
    from huggingface_hub.file_download import repo_folder_name

    for repo_type in _REPO_TYPES:
        folder = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        if folder.is_dir():
            return repo_type, folder
    raise FileNotFoundError(
        f"Kernel repository `{repo_id}` is not in the Hugging Face cache ({cache}) "
        "and HF_HUB_OFFLINE is set. "
        f"Download it once while online, or set LOCAL_KERNELS={repo_id}=/path/to/repo."
    )


def _offline_revision(repo_id: str, folder: Path, revision: str | None, version: int | None) -> str:
    if version is None:
        return revision or "main"
    ref = folder / "refs" / f"v{version}"
    if not ref.is_file():
        cached = sorted(p.name for p in (folder / "refs").glob("v*")) if (folder / "refs").is_dir() else []
        raise FileNotFoundError(
            f"Version {version} of `{repo_id}` is not in the Hugging Face cache and HF_HUB_OFFLINE is set "
            f"(cached versions: {', '.join(cached) or 'none'}). "
            "Download it while online or pin revision=<commit>."
        )
    return ref.read_text().strip()


def _online_revision(api: HfApi, repo_id: str, revision: str | None, version: int | None) -> tuple[str, str]:
    from huggingface_hub.errors import RepositoryNotFoundError

    for repo_type in _REPO_TYPES:
        try:
            refs = api.list_repo_refs(repo_id, repo_type=repo_type)
        except RepositoryNotFoundError:
            continue
        if version is None:
            return repo_type, revision or "main"
        branches = {b.name: b.target_commit for b in refs.branches}
        if f"v{version}" not in branches:
            available = sorted(n for n in branches if n.startswith("v") and n[1:].isdigit())
            raise FileNotFoundError(
                f"Version {version} of `{repo_id}` does not exist "
                f"(versions: {', '.join(available) or 'none'})."
            )
        return repo_type, branches[f"v{version}"]
    raise FileNotFoundError(f"Kernel repository `{repo_id}` was not found on the Hugging Face Hub.")


def _find_hub_build(
    repo_id: str, revision: str | None, version: int | None, system: SystemInfo, user_agent: str | dict | None
) -> _HubBuild:
    """Pick the build variant of a Hub repository, listing variants without downloading them."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.hf_api import RepoFolder

    api, cache = _api(user_agent), _cache_dir()
    if _offline():
        repo_type, folder = _cached_folder(repo_id, cache)
        resolved = _offline_revision(repo_id, folder, revision, version)
        try:
            snapshot = api.snapshot_download(
                repo_id, repo_type=repo_type, revision=resolved, cache_dir=cache, local_files_only=True
            )
        except LocalEntryNotFoundError as exc:
            raise FileNotFoundError(
                f"Revision {resolved} of `{repo_id}` is not in the Hugging Face cache "
                "and HF_HUB_OFFLINE is set."
            ) from exc
        build = Path(snapshot) / "build"
        names = [p.name for p in build.iterdir() if p.is_dir()] if build.is_dir() else []
    else:
        repo_type, resolved = _online_revision(api, repo_id, revision, version)
        tree = api.list_repo_tree(repo_id, path_in_repo="build", revision=resolved, repo_type=repo_type)
        names = [item.path.rsplit("/", 1)[-1] for item in tree if isinstance(item, RepoFolder)]
    accepted, decisions = rank_variants(names, system)
    if not accepted:
        raise FileNotFoundError(
            f"No build of `{repo_id}` (revision {resolved}) fits this system ({system}):\n"
            f"{format_decisions(decisions)}"
        )
    return _HubBuild(repo_id, repo_type, resolved, accepted[0])


def _download(build: _HubBuild, user_agent: str | dict | None) -> Path:
    """Fetch (or find in the cache) only the files of the selected variant."""
    snapshot = _api(user_agent).snapshot_download(
        build.repo_id,
        repo_type=build.repo_type,
        revision=build.revision,
        cache_dir=_cache_dir(),
        allow_patterns=[f"build/{build.variant}/*", "metadata.json"],
        ignore_patterns=_BYTECODE,
        local_files_only=_offline(),
    )
    variant_dir = Path(snapshot) / "build" / build.variant
    if not variant_dir.is_dir():
        raise FileNotFoundError(
            f"Build variant {build.variant} of `{build.repo_id}` is missing from {snapshot}."
        )
    return variant_dir


def _locate(
    repo_id: str,
    revision: str | None,
    version: int | None,
    trust_remote_code: TrustRemoteCode,
    backend: str | None,
    user_agent: str | dict | None,
) -> Path | _HubBuild:
    """The variant folder of a bundled or local `repo_id`, else the Hub build to download (not downloaded)."""
    check_repo_id(repo_id)
    check_revision(f"Kernel `{repo_id}`", revision, version)
    check_trust_setting(trust_remote_code, repo_id)
    system = SystemInfo.detect(backend)
    local = _local_folder_for(repo_id)
    if local is not None:
        return resolve_local_variant(local, system)
    check_trusted(repo_id, trust_remote_code)
    return _find_hub_build(repo_id, revision, version, system, user_agent)


def resolve_kernel(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    trust_remote_code: TrustRemoteCode = False,
    backend: str | None = None,
    user_agent: str | dict | None = None,
) -> Path:
    """The variant folder of `repo_id` for this system, downloading it if needed.

    Raises:
        FileNotFoundError: the repository, version, cached files or a fitting build variant are missing.
        ValueError: an invalid repo id, an untrusted repository, or not exactly one of `revision` and
            `version`.
        TypeError: `trust_remote_code` is neither a bool nor a list of repo ids / globs.
    """
    found = _locate(repo_id, revision, version, trust_remote_code, backend, user_agent)
    if isinstance(found, Path):
        return found
    logger.debug("Resolved `%s` to revision %s, variant %s", repo_id, found.revision, found.variant)
    return _download(found, user_agent)


def get_kernel(
    repo_id: str,
    revision: str | None = None,
    version: int | None = None,
    *,
    backend: str | None = None,
    user_agent: str | dict | None = None,
    trust_remote_code: TrustRemoteCode = False,
    check_arch: bool = True,
) -> ModuleType:
    """Load a functional kernel from a repository and return its top module.

    Args:
        repo_id: `org/name` on the Hub, or `kernelize/<name>` for a bundled repository.
        revision: Branch, tag or commit. Exactly one of `revision` and `version` is required.
        version: Major version: the latest build on branch `v{version}`.
        backend: `"cpu"` to load a CPU build on a GPU system; default: the backend torch was built for.
        user_agent: Extra user-agent information for Hub requests.
        trust_remote_code: `True`, or a list of the repo ids (or globs such as `org/*`) whose code may run.
            Bundled repositories and `LOCAL_KERNELS` folders are trusted.
        check_arch: Accepted for compatibility with `kernels`; kernelize does not check declared archs.

    Example:
        >>> activation = get_kernel("kernelize/activation", version=1)  # doctest: +SKIP
    """
    del check_arch
    variant_dir = resolve_kernel(
        repo_id,
        revision=revision,
        version=version,
        trust_remote_code=trust_remote_code,
        backend=backend,
        user_agent=user_agent,
    )
    return import_variant(variant_dir)


def get_local_kernel(
    repo_path: str | os.PathLike[str],
    package_name: str | None = None,
    *,
    backend: str | None = None,
    trust_remote_code: TrustRemoteCode = False,
    user_agent: str | dict | None = None,
) -> ModuleType:
    """Load a kernel from a repository (or build variant) folder on disk.

    `package_name` is the older `kernels` form for `build/<variant>/<package>/`; it is optional.

    Example:
        >>> activation = get_local_kernel("/path/to/activation")  # doctest: +SKIP
    """
    check_trust_setting(trust_remote_code, repo_path)  # same argument contract as get_kernel
    del trust_remote_code, user_agent  # a folder the caller names is trusted; nothing is downloaded
    variant_dir = resolve_local_variant(Path(repo_path), SystemInfo.detect(backend))
    return import_variant(variant_dir, package_name=package_name)


def has_kernel(
    repo_id: str,
    revision: str | None = None,
    version: int | None = None,
    *,
    backend: str | None = None,
    trust_remote_code: TrustRemoteCode = False,
    check_arch: bool = True,
) -> bool:
    """Whether `repo_id` has a build this system can load. Downloads and runs nothing.

    Example:
        >>> has_kernel("kernelize/no-such-kernel", version=1)
        False
    """
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    check_trust_setting(trust_remote_code, repo_id)
    del trust_remote_code, check_arch  # nothing runs, so trust does not matter
    # A usage error (an invalid repo id, not exactly one of revision= / version=) raises, it is not a "no".
    try:
        _locate(repo_id, revision, version, True, backend, None)
    except (FileNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return False
    return True
