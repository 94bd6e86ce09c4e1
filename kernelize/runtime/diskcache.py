"""A per-user disk cache of build artifacts (shared objects, cubins), safe across processes.

``get_or_build(key_parts, build_fn, suffix)`` returns the path of an artifact keyed by the sha256 of
``key_parts`` (source text, compiler version, flags...). On a miss it calls ``build_fn(tmp_path)`` to write
the artifact to a temporary name in the cache folder, records its sha256 in a sidecar ``<key>.sha256`` and
publishes both with ``os.replace`` (atomic), all under a ``filelock.FileLock`` so concurrent processes
build once. On a hit the artifact's hash is checked against the sidecar: a truncated or corrupt entry is
rebuilt, never returned.

The folder is ``$KERNELIZE_CACHE_DIR`` or ``~/.cache/kernelize``, created with mode 0700. When it cannot
be written (read-only mount, foreign owner) the cache falls back to a private temporary folder and logs a
warning once.

Example:
    >>> def build(tmp):  # doctest: +SKIP
    ...     subprocess.run(["cc", "-shared", "-o", str(tmp), "k.c"], check=True)
    >>> so = get_or_build(("int f(){return 1;}", "gcc 12.2", "-O3"), build, ".so")  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

ENV_VAR = "KERNELIZE_CACHE_DIR"
_fallback: Path | None = None


def cache_key(key_parts: Iterable[str | bytes]) -> str:
    """sha256 over the parts, each length-prefixed so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in key_parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _usable(folder: Path) -> bool:
    """Create ``folder`` (mode 0700) if needed and check that this user can write to it."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def cache_dir() -> Path:
    """The cache folder to use now (``$KERNELIZE_CACHE_DIR``, else ``~/.cache/kernelize``).

    Falls back to a private temporary folder, with a warning, when the configured one is not writable.
    """
    global _fallback
    configured = os.environ.get(ENV_VAR)
    folder = Path(configured).expanduser() if configured else Path.home() / ".cache" / "kernelize"
    if _usable(folder):
        return folder
    if _fallback is None or not _fallback.is_dir():
        _fallback = Path(tempfile.mkdtemp(prefix="kernelize-cache-"))  # mkdtemp makes it 0700
        msg = (
            f"kernelize cache folder {folder} is not writable; using the temporary folder {_fallback} "
            f"for this process (set {ENV_VAR} to a writable folder to keep compiled kernels across runs)"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        logger.warning(msg)
    return _fallback


def _valid(artifact: Path, sidecar: Path) -> bool:
    try:
        want = sidecar.read_text().strip()
    except OSError:
        return False
    try:
        return artifact.is_file() and _file_hash(artifact) == want
    except OSError:
        return False


def get_or_build(
    key_parts: Iterable[str | bytes], build_fn: Callable[[Path], None], suffix: str = ""
) -> Path:
    """The cached artifact for ``key_parts``, building it with ``build_fn(tmp_path)`` on a miss.

    ``build_fn`` must write the artifact to the path it is given (or raise); it runs at most once across
    concurrent processes for one key. A cached artifact whose content no longer matches its recorded
    sha256 (truncated, corrupted) is rebuilt.

    Example:
        >>> build = lambda p: p.write_bytes(b"x")
        >>> path = get_or_build(["source", "gcc 12", "-O3"], build, ".bin")  # doctest: +SKIP
        >>> path.read_bytes()  # doctest: +SKIP
        b'x'
    """
    key = cache_key(key_parts)
    folder = cache_dir()
    artifact = folder / f"{key}{suffix}"
    sidecar = folder / f"{key}.sha256"
    if _valid(artifact, sidecar):  # fast path: no lock taken for a good entry
        return artifact
    with FileLock(str(folder / f"{key}.lock")):
        if _valid(artifact, sidecar):  # another process built it while we waited
            return artifact
        if artifact.exists() or sidecar.exists():
            logger.warning("kernelize cache entry %s is corrupt or incomplete; rebuilding", artifact.name)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{key[:16]}-", suffix=suffix, dir=folder)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            build_fn(tmp)
            digest = _file_hash(tmp)
            tmp_side = tmp.with_name(tmp.name + ".sha256")
            tmp_side.write_text(digest + "\n")
            # artifact first, sidecar last: a reader that sees the new sidecar sees the new artifact
            os.replace(tmp, artifact)
            os.replace(tmp_side, sidecar)
        finally:
            for p in (tmp, tmp.with_name(tmp.name + ".sha256")):
                p.unlink(missing_ok=True)
    logger.debug("built cache entry %s", artifact)
    return artifact


__all__ = ["ENV_VAR", "cache_dir", "cache_key", "get_or_build"]
