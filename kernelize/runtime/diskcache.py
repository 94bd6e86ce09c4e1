"""A per-user disk cache of build artifacts (shared objects, cubins, generated modules), safe across
processes.

``get_or_build(key_parts, build_fn, suffix)`` returns the path of an artifact keyed by the sha256 of
``key_parts`` (source text, compiler version, flags...). On a miss it calls ``build_fn(tmp_path)`` to write
the artifact to a temporary name in the cache folder, records its sha256 in a sidecar ``<key>.sha256`` and
publishes both with ``os.replace`` (atomic), all under a ``filelock.FileLock`` so concurrent processes
build once. On a hit the artifact is checked against the sidecar: a truncated or overwritten entry is
rebuilt, never returned. The sidecar also records the artifact's size, mtime and inode as published (the
mtime set seconds back, so any later write moves it): an entry that still has them is not rehashed (a
transformer's 440 MB optimized graph took 0.2-0.3 s to hash on every warm start); any other is checked by
its sha256. The sidecar is a corruption check, not a trust boundary: whoever can write the folder can write
a matching sidecar. Trust comes from the folder checks.

:func:`remembered_sha256` hashes a file that is not ours (a model) once per file identity (path, inode,
size, mtime, ctime) and remembers the digest in the sub folder ``digests``.

The folder is ``$KERNELIZE_CACHE_DIR`` or ``~/.cache/kernelize``; missing components are created with mode
0700. Since what it holds gets loaded and run (``dlopen``, ``import``), it is used only when, after
following symlinks, it is a folder owned by this user and not writable by group or others, and every
parent is owned by this user or root and not writable by group or others unless sticky (``/tmp``). Sub
folders (``triton/``) get the same checks. A refused or unwritable folder falls back, with a warning that
names the folder and the reason, to ``<tmp>/kernelize-cache-<uid>`` (checked the same way, reused across
runs) or, when that one is taken, to a fresh private folder removed at exit.

Leftovers: a folder (or any non-file) at an entry's name makes that entry build in the fallback folder,
with a warning; temporaries of killed builds (hidden ``.tmp-*`` files) older than :data:`STALE_SECONDS`
are deleted the first time a process uses the folder.

Example:
    >>> def build(tmp):  # doctest: +SKIP
    ...     subprocess.run(["cc", "-shared", "-o", str(tmp), "k.c"], check=True)
    >>> so = get_or_build(("int f(){return 1;}", "gcc 12.2", "-O3"), build, ".so")  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import getpass
import hashlib
import logging
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

ENV_VAR = "KERNELIZE_CACHE_DIR"
STALE_SECONDS = 3600.0  # a temporary older than this belongs to a build that was killed
_TMP_PREFIX = ".tmp-"

_fallback: Path | None = None
_swept: set[Path] = set()
_warned: set[str] = set()
_lock = threading.Lock()


class CacheFolderError(RuntimeError):
    """A cache folder that must not hold code this process loads; ``reason`` says why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"kernelize cache folder {path} is refused: {reason}; set {ENV_VAR} to a folder you own "
            "with mode 0700"
        )
        self.path, self.reason = path, reason


def cache_key(key_parts: Iterable[str | bytes]) -> str:
    """sha256 over the parts, each length-prefixed so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in key_parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's content, hashed from a memory map (no copy: a cached 440 MB graph of weights is
    checked in 0.35 s instead of 0.65 s)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # an empty file cannot be mapped
            return hashlib.sha256().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return hashlib.sha256(m).hexdigest()


RACY_SECONDS = 1.0  # a file changed this recently may still change within the same timestamp tick
DIGESTS = "digests"  # the cache sub folder of remembered file digests
_digests: dict[tuple, str] = {}


def file_identity(path: Path) -> tuple:
    """What changes whenever a file's content does: (real path, device, inode, size, mtime, ctime), in ns.
    Writing a file in place moves its mtime and ctime, replacing it gives another inode, and the ctime
    cannot be set back (``os.utime`` moves it too)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def racy(ident: tuple) -> bool:
    """Whether a file of this :func:`file_identity` changed within :data:`RACY_SECONDS` of now (its digest is
    not remembered: a write in the same timestamp tick would leave the identity unchanged)."""
    return time.time_ns() - max(ident[4], ident[5]) <= RACY_SECONDS * 1e9


def remembered_sha256(path: Path, compute: bool = True) -> str | None:
    """:func:`file_sha256` of ``path``, remembered per :func:`file_identity` (in this process and in the
    cache sub folder ``digests``), so an unchanged 440 MB model file is hashed once, not on every load.

    A file whose mtime or ctime is within :data:`RACY_SECONDS` of now is hashed and not remembered: a
    write in the same timestamp tick as our look would leave its identity unchanged (git's "racily clean"
    files). ``compute=False``: None where the digest is not remembered (nothing is hashed).

    Example:
        >>> remembered_sha256(Path("model.onnx"))  # doctest: +SKIP
        'e3b0c442...'
    """
    ident = file_identity(path)
    if ident in _digests:
        return _digests[ident]
    name = cache_key([repr(ident)])
    memo = cache_dir(DIGESTS) / name
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            _digests[ident] = digest
            return digest
    except (OSError, UnicodeDecodeError):
        pass
    if not compute:
        return None
    digest = file_sha256(path)
    if not racy(ident) and file_identity(path) == ident:
        _digests[ident] = digest
        cached_file(DIGESTS, name, f"{digest}\n".encode())
    return digest


# --- folder checks ------------------------------------------------------------------------------------------
def _euid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None  # None: no POSIX owners (Windows)


def folder_problem(folder: Path) -> str | None:
    """Why the existing, symlink-free ``folder`` must not hold code this process loads, or None.

    Someone else must not be able to write the folder, nor rename or replace it through a parent.
    """
    st = os.stat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    uid = _euid()
    if uid is None:
        return None
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o})"
    for parent in folder.parents:
        pst = os.stat(parent)
        if pst.st_uid not in (0, uid):
            return f"its parent {parent} is owned by uid {pst.st_uid}, not by this user or root"
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            mode = f"{stat.S_IMODE(pst.st_mode):#o}"
            return f"its parent {parent} is writable by group or others without the sticky bit (mode {mode})"
    return None


def _make(path: Path) -> None:
    """Create the missing components of ``path`` with mode 0700 (the checks run afterwards)."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:  # another process made it: the checks decide whether it is usable
            pass


def private_folder(path: Path) -> Path:
    """``path`` created if missing, resolved through symlinks and checked; the resolved path is returned.

    Callers use the resolved path, so a symlink swapped after the check cannot redirect them.

    Raises:
        CacheFolderError: the folder cannot be made or written, or someone else could write to it.

    Example:
        >>> private_folder(Path.home() / ".cache" / "kernelize")  # doctest: +SKIP
        PosixPath('/home/me/.cache/kernelize')
    """
    path = real = Path(os.path.abspath(path.expanduser()))
    try:
        _make(path)
        real = path.resolve(strict=True)
        problem = folder_problem(real)
        if problem is None and not os.access(real, os.W_OK | os.X_OK):
            problem = "it is not writable"
    except OSError as e:
        problem = f"it cannot be created or read ({e.strerror or e})"
    if problem is not None:
        shown = path if path == real else Path(f"{path} (-> {real})")
        raise CacheFolderError(shown, problem)
    return real


def _warn_once(msg: str) -> None:
    with _lock:
        if msg in _warned:
            return
        _warned.add(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    logger.warning(msg)


def _user() -> str:
    uid = _euid()
    return str(uid) if uid is not None else getpass.getuser()


def fallback_dir() -> Path:
    """The private folder used instead of a refused one: one per user under the temporary folder, reused
    across runs; when someone else holds that name, a fresh folder removed when the process exits."""
    global _fallback
    with _lock:
        if _fallback is not None and _fallback.is_dir():
            return _fallback
    per_user = Path(tempfile.gettempdir()) / f"kernelize-cache-{_user()}"
    try:
        folder = private_folder(per_user)
    except CacheFolderError as e:
        folder = Path(tempfile.mkdtemp(prefix="kernelize-cache-"))  # mode 0700
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _warn_once(f"{e}; using {folder} for this process instead (removed at exit)")
        folder = private_folder(folder)
    with _lock:
        _fallback = folder
    return folder


def cache_dir(sub: str = "") -> Path:
    """The checked cache folder to use now (``$KERNELIZE_CACHE_DIR``, else ``~/.cache/kernelize``), or its
    sub folder ``sub`` (created and checked the same way).

    A refused folder (see :func:`private_folder`) falls back to :func:`fallback_dir`, with a warning that
    names the folder and the reason.

    Example:
        >>> cache_dir("triton")  # doctest: +SKIP
        PosixPath('/home/me/.cache/kernelize/triton')
    """
    configured = os.environ.get(ENV_VAR)
    root = Path(configured) if configured else Path.home() / ".cache" / "kernelize"
    try:
        folder = private_folder(root)
        if sub:  # checked after the root, so nothing is created inside a refused root
            folder = private_folder(folder / sub)
    except CacheFolderError as e:
        fallback = fallback_dir()
        _warn_once(
            f"kernelize cache folder {e.path} is not used: {e.reason}. Compiled code is loaded from this "
            f"folder, so it must be yours alone (chmod 700, or set {ENV_VAR} to such a folder); using "
            f"{fallback} instead"
        )
        folder = private_folder(fallback / sub) if sub else fallback
    _sweep(folder)
    return folder


def _sweep(folder: Path) -> None:
    """Delete temporaries that builds killed before publishing left behind (once per folder and process)."""
    with _lock:
        if folder in _swept:
            return
        _swept.add(folder)
    cutoff = time.time() - STALE_SECONDS
    for p in folder.glob(".*"):  # every hidden file in a cache folder is a temporary of ours
        try:
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                p.unlink()
                logger.debug("removed stale cache temporary %s", p)
        except OSError:
            pass


# --- entries ------------------------------------------------------------------------------------------------
def _entry_folder(folder: Path, names: Iterable[str], sub: str = "") -> Path:
    """``folder``, or the fallback folder (its ``sub`` folder) when something that is not a file (a
    folder, a socket...) sits at one of ``names``."""
    for name in names:
        path = folder / name
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                continue
        except FileNotFoundError:
            continue
        fallback = private_folder(fallback_dir() / sub) if sub else fallback_dir()
        if fallback == folder:
            raise CacheFolderError(path, "it is not a regular file; remove it")
        _warn_once(
            f"kernelize cache entry {path} is not a regular file (a folder?); building in {fallback} "
            f"instead: remove it to use {folder} again"
        )
        return fallback
    return folder


def _temporary(folder: Path, stem: str, suffix: str) -> Path:
    fd, name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{stem}-", suffix=suffix, dir=folder)
    os.close(fd)
    return Path(name)


def _valid(artifact: Path, sidecar: Path) -> bool:
    """Whether ``artifact`` is what its sidecar recorded: the same size, mtime and inode as when it was
    published (its mtime was set to a moment before then, so any later write moves it), else the same
    sha256."""
    try:
        want, *stamp = sidecar.read_text().split()
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    try:
        if stamp and stamp == _stamp(artifact):
            return True
        return artifact.is_file() and file_sha256(artifact) == want
    except OSError:
        return False


def _stamp(path: Path) -> list[str]:
    st = os.stat(path)
    return [str(st.st_size), str(st.st_mtime_ns), str(st.st_ino)] if stat.S_ISREG(st.st_mode) else []


def _publish(tmp: Path, artifact: Path, sidecar: Path) -> None:
    """Move a built ``tmp`` to ``artifact`` with its sidecar: sha256, then size, mtime and inode.

    The mtime is set a few seconds back first, so a write after publishing (which stamps the current
    time) always changes it, even within one timestamp tick; the stamp lets a hit skip rehashing.
    """
    past = time.time_ns() - int(2 * RACY_SECONDS * 1e9)
    os.utime(tmp, ns=(past, past))
    tmp_side = tmp.with_name(tmp.name + ".sha256")
    try:
        digest = file_sha256(tmp)
        os.replace(tmp, artifact)  # a rename keeps the inode and the mtime
        tmp_side.write_text(" ".join([digest, *_stamp(artifact)]) + "\n")
        # artifact first, sidecar last: a reader that sees the new sidecar sees the new artifact
        os.replace(tmp_side, sidecar)
    finally:
        tmp_side.unlink(missing_ok=True)


def _place(key_parts: Iterable[str | bytes], suffix: str) -> tuple[str, Path]:
    key = cache_key(key_parts)
    return key, _entry_folder(cache_dir(), (f"{key}{suffix}", f"{key}.sha256", f"{key}.lock"))


def cached(key_parts: Iterable[str | bytes], suffix: str = "") -> Path | None:
    """The valid artifact :func:`get_or_build` would return for ``key_parts`` without building, or None.

    Example:
        >>> cached(["source", "gcc 12", "-O3"], ".bin")  # doctest: +SKIP
        PosixPath('/home/me/.cache/kernelize/5d1c....bin')
    """
    key, folder = _place(key_parts, suffix)
    artifact = folder / f"{key}{suffix}"
    return artifact if _valid(artifact, folder / f"{key}.sha256") else None


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
    key, folder = _place(key_parts, suffix)
    artifact = folder / f"{key}{suffix}"
    sidecar = folder / f"{key}.sha256"
    # the sidecar only detects corruption: the folder checks in cache_dir() are what make a hit trustworthy
    if _valid(artifact, sidecar):  # fast path: no lock taken for a good entry
        return artifact
    with FileLock(str(folder / f"{key}.lock")):
        if _valid(artifact, sidecar):  # another process built it while we waited
            return artifact
        if artifact.exists() or sidecar.exists():
            logger.warning("kernelize cache entry %s is corrupt or incomplete; rebuilding", artifact.name)
        tmp = _temporary(folder, key[:16], suffix)
        try:
            build_fn(tmp)
            _publish(tmp, artifact, sidecar)
        finally:
            tmp.unlink(missing_ok=True)
    logger.debug("built cache entry %s", artifact)
    return artifact


def cached_file(sub: str, name: str, data: bytes) -> Path:
    """The file ``name`` holding exactly ``data`` in the checked cache sub folder ``sub``, written
    atomically when it is missing or differs (generated sources that are imported by path).

    Example:
        >>> cached_file("triton", "k_0123.py", b"import triton\\n")  # doctest: +SKIP
        PosixPath('/home/me/.cache/kernelize/triton/k_0123.py')
    """
    folder = _entry_folder(cache_dir(sub), (name,), sub)
    path = folder / name
    try:
        if path.read_bytes() == data:
            return path
    except FileNotFoundError:
        pass
    tmp = _temporary(folder, Path(name).stem[:32], Path(name).suffix)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


__all__ = [
    "ENV_VAR",
    "STALE_SECONDS",
    "CacheFolderError",
    "cache_dir",
    "cache_key",
    "cached",
    "cached_file",
    "fallback_dir",
    "file_identity",
    "file_sha256",
    "folder_problem",
    "get_or_build",
    "private_folder",
    "racy",
    "remembered_sha256",
]
