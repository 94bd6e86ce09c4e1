"""Read the commit a kernel repository is locked to, from a `kernels.lock` file.

Two formats are accepted, both as written by `kernels lock`:

* `kernels` >= 0.13: `[{"dependency": {"repo-id": "org/name", "version": 1}, "lock": {"commit": "<sha>"}}]`
* older `kernels`: `[{"repo_id": "org/name", "sha": "<sha>", "variants": {...}}]`

Without an explicit path, the lock file is read from the metadata of the installed distribution that
contains the calling code, as `kernels` does for projects that declare `[tool.kernels.dependencies]`.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path
from types import ModuleType

from .hub import TrustRemoteCode, check_repo_id, check_trust_setting, get_kernel

__all__ = ["get_locked_kernel", "locked_commit"]

_COMMIT = re.compile(r"[0-9a-f]{40}")


def _entry_lock(entry: object) -> tuple[object, object]:
    """(repo id, commit) of one lock entry in either format; `None` where a part is missing or mistyped."""
    if not isinstance(entry, dict):
        return None, None
    if "dependency" in entry:  # kernels >= 0.13
        dependency, lock = entry.get("dependency"), entry.get("lock")
        repo_id = dependency.get("repo-id") if isinstance(dependency, dict) else None
        return repo_id, lock.get("commit") if isinstance(lock, dict) else None
    return entry.get("repo_id"), entry.get("sha")  # older kernels


def _parse(text: str, source: str) -> dict[str, str]:
    """`repo_id -> commit` for every entry of a lock file."""
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"Lock file {source} is not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise ValueError(f"Lock file {source} must contain a JSON list of locked kernels.")
    locks: dict[str, str] = {}
    for index, entry in enumerate(entries):
        repo_id, commit = _entry_lock(entry)
        if not isinstance(repo_id, str) or not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
            raise ValueError(
                f"Lock file {source}: entry {index} has no repo id and 40-hex commit: {entry!r}. "
                "Regenerate the file with `kernels lock`."
            )
        try:
            check_repo_id(repo_id)
        except ValueError as exc:
            raise ValueError(f"Lock file {source}: entry {index}: {exc}") from None
        if repo_id in locks:
            raise ValueError(
                f"Lock file {source} locks `{repo_id}` twice (entry {index} again); keep one entry per "
                "repository, e.g. by regenerating the file with `kernels lock`."
            )
        locks[repo_id] = commit
    return locks


def _caller_lock_text() -> tuple[str, str]:
    """The `kernels.lock` shipped in the metadata of the distribution that called into kernelize."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("kernelize.layer"):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    package = module.split(".")[0]
    for dist_name in importlib.metadata.packages_distributions().get(package, []):
        source = f"`kernels.lock` of distribution `{dist_name}`"
        try:
            text = importlib.metadata.distribution(dist_name).read_text("kernels.lock")
        except UnicodeDecodeError as exc:
            raise ValueError(f"Lock file {source} is not UTF-8 text: {exc}") from None
        if text is not None:
            return text, source
    raise ValueError(
        f"No `kernels.lock` found in the package metadata of `{package or module}` (the caller). "
        "Pass lockfile=Path('kernels.lock'), or lock the project with `kernels lock` and reinstall it."
    )


def locked_commit(repo_id: str, lockfile: str | Path | None = None) -> str:
    """The commit `repo_id` is locked to.

    Example:
        >>> import json, tempfile
        >>> path = Path(tempfile.mkdtemp()) / "kernels.lock"
        >>> _ = path.write_text(json.dumps([{"repo_id": "org/act", "sha": "a" * 40, "variants": {}}]))
        >>> locked_commit("org/act", path) == "a" * 40
        True
    """
    if lockfile is None:
        text, source = _caller_lock_text()
    else:
        path = Path(lockfile)
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except OSError as exc:
            raise FileNotFoundError(f"Cannot read lock file {path}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"Lock file {path} is not UTF-8 text ({exc}); regenerate it with `kernels lock`."
            ) from None
    locks = _parse(text, source)
    if repo_id not in locks:
        known = ", ".join(sorted(locks)) or "none"
        raise ValueError(
            f"Kernel `{repo_id}` is not locked in {source} (locked: {known}). "
            "Add it to [tool.kernels.dependencies] and run `kernels lock`."
        )
    return locks[repo_id]


def get_locked_kernel(
    repo_id: str,
    *,
    lockfile: str | Path | None = None,
    trust_remote_code: TrustRemoteCode = False,
    user_agent: str | dict | None = None,
) -> ModuleType:
    """Load the commit of `repo_id` pinned in a `kernels.lock` file (see `kernelize.layer.lockfile`)."""
    check_repo_id(repo_id)
    check_trust_setting(trust_remote_code, repo_id)
    commit = locked_commit(repo_id, None if lockfile is None else Path(lockfile))
    return get_kernel(repo_id, revision=commit, trust_remote_code=trust_remote_code, user_agent=user_agent)
