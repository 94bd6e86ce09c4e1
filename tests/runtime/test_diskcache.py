"""The disk cache: hits, corrupt entries, concurrent processes, unwritable folders (real files, processes)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest

from kernelize.codegen.cpu_build import compiler
from kernelize.runtime import diskcache
from kernelize.runtime.diskcache import cache_dir, cache_key, get_or_build


@pytest.fixture
def folder(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(d))
    monkeypatch.setattr(diskcache, "_fallback", None)
    return d


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Fallback folders go under this test's own temporary folder, not the machine's /tmp."""
    base = tmp_path / "tmpdir"
    base.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setattr(diskcache, "_fallback", None)
    return base


def _builder(calls: list, payload: bytes = b"artifact"):
    def build(path: Path) -> None:
        calls.append(path)
        path.write_bytes(payload)

    return build


def test_miss_then_hit_and_folder_mode(folder):
    calls: list = []
    p1 = get_or_build(["src", "cc 1", "-O3"], _builder(calls), ".so")
    p2 = get_or_build(["src", "cc 1", "-O3"], _builder(calls), ".so")
    assert p1 == p2 and p1.read_bytes() == b"artifact" and len(calls) == 1
    assert p1.parent == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not [f for f in folder.iterdir() if f.name.startswith(".")]  # no temporaries left


def test_key_parts_are_length_prefixed():
    assert cache_key(["ab", "c"]) != cache_key(["a", "bc"])
    assert cache_key(["x"]) == cache_key([b"x"])


def test_different_keys_build_separately(folder):
    calls: list = []
    a = get_or_build(["src", "gcc 12"], _builder(calls, b"a"), ".so")
    b = get_or_build(["src", "gcc 13"], _builder(calls, b"b"), ".so")
    assert a != b and len(calls) == 2 and a.read_bytes() == b"a" and b.read_bytes() == b"b"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_sidecar", "garbage_sidecar"])
def test_corrupt_entry_is_rebuilt_never_returned(folder, damage):
    calls: list = []
    path = get_or_build(["k"], _builder(calls, b"0123456789" * 100), ".so")
    sidecar = path.with_suffix(".sha256")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:37])
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[500] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "delete_sidecar":
        sidecar.unlink()
    else:
        sidecar.write_text("not a hash\n")
    again = get_or_build(["k"], _builder(calls, b"0123456789" * 100), ".so")
    assert again == path and len(calls) == 2 and again.read_bytes() == b"0123456789" * 100


def test_failed_build_leaves_nothing(folder):
    def boom(path: Path) -> None:
        path.write_bytes(b"half")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        get_or_build(["bad"], boom, ".so")
    assert not [f for f in folder.iterdir() if not f.name.endswith(".lock")]


_WORKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kernelize.runtime.diskcache import get_or_build
    log = Path(sys.argv[1])
    def build(p):
        with open(log, "a") as f:
            f.write("built\\n")
        time.sleep(0.5)  # a slow compile: the others must wait on the lock, not build again
        p.write_bytes(b"shared object")
    print(get_or_build(["same key"], build, ".so"))
    """
)


def test_concurrent_processes_build_once(folder, tmp_path):
    log = tmp_path / "builds.log"
    env = {**os.environ, "KERNELIZE_CACHE_DIR": str(folder)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(log)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and Path(outs[0]).read_bytes() == b"shared object"
    assert log.read_text().count("built") == 1


_CPU_WORKER = textwrap.dedent(
    """
    import ctypes, sys
    from kernelize.codegen.cpu_build import build_shared_object
    src = 'extern "C" int kz_answer(int x) { return x * 6; }'
    path = build_shared_object(src, "answer")
    print(path, ctypes.CDLL(str(path)).kz_answer(7))
    """
)


def test_concurrent_real_compiles_share_one_shared_object(folder):
    env = {**os.environ, "KERNELIZE_CACHE_DIR": str(folder)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CPU_WORKER], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=180)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({o[0] for o in outs}) == 1 and all(o[1] == "42" for o in outs)
    assert len(list(folder.glob("*.so"))) == 1


def test_unwritable_folder_falls_back_to_a_private_temp_folder(tmp_path, private_tmp, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(blocker / "cache"))  # cannot be created under a file
    calls: list = []
    with pytest.warns(RuntimeWarning, match="cannot be created"):
        path = get_or_build(["k"], _builder(calls), ".so")
    assert path.read_bytes() == b"artifact" and not str(path).startswith(str(blocker))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not per call
        assert get_or_build(["k"], _builder(calls), ".so") == path
    assert len(calls) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_folder_falls_back(tmp_path, private_tmp, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(ro))
    monkeypatch.setattr(diskcache, "_fallback", None)
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert cache_dir() != ro


# --- trust: a folder someone else can write never supplies code ----------------------------------------
_PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void kz_planted(void) {
    FILE *f = fopen("MARKER", "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
extern "C" int kz_answer(int x) { return x * 6; }
"""
_GOOD = 'extern "C" int kz_answer(int x) { return x * 6; }'


def _cc(source: str, out: Path) -> None:
    cxx, _ = compiler()
    cmd = [cxx, "-shared", "-fPIC", "-x", "c++", "-", "-o", str(out)]
    subprocess.run(cmd, input=source, text=True, check=True, capture_output=True)


def _plant(folder: Path, parts: list[str], marker: Path) -> None:
    """A shared object under the deterministic key, with a sidecar that matches it."""
    key = cache_key(parts)
    so = folder / f"{key}.so"
    _cc(_PLANTED.replace("MARKER", str(marker)), so)
    (folder / f"{key}.sha256").write_text(hashlib.sha256(so.read_bytes()).hexdigest() + "\n")


_UNSAFE = {
    "world_writable": "writable by group or others",
    "group_writable": "writable by group or others",
    "other_owner": "owned by uid 4242",
    "symlink_to_world_writable": "writable by group or others",
    "parent_writable": "writable by group or others without the sticky bit",
    "tmp_itself": "writable by group or others",
}


@pytest.mark.parametrize("case", list(_UNSAFE))
def test_planted_shared_object_in_unsafe_folder_is_never_loaded(case, tmp_path, private_tmp, monkeypatch):
    marker = tmp_path / "marker"
    parts = ["answer", "cc", str(tmp_path)]  # unique per test: /tmp itself is shared
    shared = tmp_path / "shared"
    shared.mkdir()
    root = real = shared
    if case == "tmp_itself":
        root = real = Path("/tmp")
    elif case == "symlink_to_world_writable":
        root = tmp_path / "link"
        root.symlink_to(shared)
    elif case == "parent_writable":
        root = real = shared / "cache"
        root.mkdir(mode=0o700)
    key = cache_key(parts)
    try:
        _plant(real, parts, marker)
        if case == "other_owner":
            for p in (real, *real.iterdir()):
                os.chown(p, 4242, 4242)
            real.chmod(0o755)
        else:
            shared.chmod({"group_writable": 0o770}.get(case, 0o777))
        monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(root))
        with pytest.warns(RuntimeWarning, match=_UNSAFE[case]) as caught:
            path = get_or_build(parts, lambda p: _cc(_GOOD, p), ".so")
        assert str(root) in str(caught[0].message)  # the warning names the refused folder
        assert ctypes.CDLL(str(path)).kz_answer(7) == 42
        assert not marker.exists(), "code planted in an unsafe cache folder ran"
        assert path.parent.resolve() != real.resolve() and path.parent.is_relative_to(private_tmp)
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    finally:
        if case == "tmp_itself":
            for suffix in (".so", ".sha256", ".lock"):
                Path(f"/tmp/{key}{suffix}").unlink(missing_ok=True)


def test_private_folder_through_a_symlink_is_used(tmp_path, private_tmp, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(link))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = get_or_build(["k"], _builder([]), ".so")
    assert path.parent == real.resolve()


def test_missing_components_are_created_private(tmp_path, private_tmp, monkeypatch):
    root = tmp_path / "a" / "b" / "c"
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(root))
    assert cache_dir() == root.resolve()
    for p in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    sub = cache_dir("triton")
    assert sub == root.resolve() / "triton" and stat.S_IMODE(sub.stat().st_mode) == 0o700


def test_unsafe_sub_folder_falls_back(tmp_path, private_tmp, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(root))
    (root / "triton").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (root / "triton").chmod(0o777)
    with pytest.warns(RuntimeWarning, match=r"triton.*writable by group or others"):
        sub = cache_dir("triton")
    assert sub.is_relative_to(private_tmp) and sub.name == "triton"


def test_fallback_is_one_private_folder_per_user_reused_across_runs(tmp_path, private_tmp, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path / "a_file" / "x"))
    with pytest.warns(RuntimeWarning, match="cannot be created"):
        first = cache_dir()
    monkeypatch.setattr(diskcache, "_fallback", None)  # as in a new process
    assert cache_dir() == first == private_tmp / f"kernelize-cache-{os.geteuid()}"
    assert list(private_tmp.iterdir()) == [first] and stat.S_IMODE(first.stat().st_mode) == 0o700


# the module alone (stdlib + filelock): a child process without torch starts in well under a second
_STANDALONE = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('diskcache', sys.argv[1])\n"
    "dc = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(dc)\n"
)


def _standalone(script: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _STANDALONE + textwrap.dedent(script), diskcache.__file__]
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)


def test_taken_per_user_fallback_gives_a_temporary_folder_removed_at_exit(tmp_path, private_tmp):
    taken = private_tmp / f"kernelize-cache-{os.geteuid()}"
    taken.mkdir()
    os.chown(taken, 4242, 4242)
    (tmp_path / "a_file").write_text("")
    env = {"KERNELIZE_CACHE_DIR": str(tmp_path / "a_file" / "x"), "TMPDIR": str(private_tmp)}
    script = """
        p = dc.get_or_build(["k"], lambda t: t.write_bytes(b"x"), ".so")
        print(p.parent, p.read_bytes().decode())
    """
    proc = _standalone(script, env)
    assert proc.returncode == 0, proc.stderr
    folder, content = proc.stdout.split()
    assert content == "x" and Path(folder).parent == private_tmp and Path(folder) != taken
    assert "owned by uid 4242" in proc.stderr
    assert not Path(folder).exists()  # removed when the process exited
    assert list(private_tmp.iterdir()) == [taken]


# --- leftovers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".so", ".lock", ".sha256"])
def test_folder_at_an_entry_name_builds_elsewhere_and_says_so(folder, private_tmp, suffix):
    parts = ["blocked"]
    folder.mkdir(mode=0o700)
    blocked = folder / f"{cache_key(parts)}{suffix}"
    blocked.mkdir()
    calls: list = []
    with pytest.warns(RuntimeWarning, match=f"{blocked}.*not a regular file.*remove it"):
        path = get_or_build(parts, _builder(calls), ".so")
    assert path.read_bytes() == b"artifact" and path.is_relative_to(private_tmp) and blocked.is_dir()
    assert get_or_build(parts, _builder(calls), ".so") == path and len(calls) == 1


_KILLED = """
    import os, signal
    def build(p):
        p.write_bytes(b"half a shared object")
        os.kill(os.getpid(), signal.SIGKILL)
    dc.get_or_build(["killed"], build, ".so")
"""


def test_temporaries_of_killed_builds_are_swept_once_stale(folder, monkeypatch):
    proc = _standalone(_KILLED, {"KERNELIZE_CACHE_DIR": str(folder)})
    assert proc.returncode == -9, proc.stderr
    left = [p for p in folder.iterdir() if p.name.startswith(".")]
    assert left, "the killed build left no temporary: the test does not exercise the sweep"
    fresh = folder / ".tmp-in-progress.so"  # another process's build that is still running
    fresh.write_bytes(b"")
    for p in left:
        os.utime(p, (1e9, 1e9))  # 2001: far older than an hour
    monkeypatch.setattr(diskcache, "_swept", set())
    get_or_build(["other"], _builder([]), ".so")
    assert not any(p.exists() for p in left) and fresh.exists()


def test_hit_with_the_published_stamp_is_not_rehashed(folder, monkeypatch):
    import kernelize.runtime.diskcache as diskcache

    calls: list = []
    path = get_or_build(["stamped"], _builder(calls, b"x" * 1000), ".so")
    hashed: list = []
    real = diskcache.file_sha256
    monkeypatch.setattr(diskcache, "file_sha256", lambda p: hashed.append(p) or real(p))
    assert get_or_build(["stamped"], _builder(calls, b"x" * 1000), ".so") == path
    assert hashed == [] and len(calls) == 1
    path.write_bytes(b"y" * 1000)  # same size, in place, within the same timestamp tick maybe
    assert get_or_build(["stamped"], _builder(calls, b"x" * 1000), ".so") == path
    assert len(calls) == 2 and path.read_bytes() == b"x" * 1000
