"""The disk cache: hits, corrupt entries, concurrent processes, unwritable folders (real files, processes)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from kernelize.runtime import diskcache
from kernelize.runtime.diskcache import cache_dir, cache_key, get_or_build


@pytest.fixture
def folder(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(d))
    monkeypatch.setattr(diskcache, "_fallback", None)
    return d


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
    from kernelize.codegen.cpu import build_shared_object
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


def test_unwritable_folder_falls_back_to_a_private_temp_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(blocker / "cache"))  # cannot be created under a file
    monkeypatch.setattr(diskcache, "_fallback", None)
    calls: list = []
    with pytest.warns(RuntimeWarning, match="not writable"):
        path = get_or_build(["k"], _builder(calls), ".so")
    assert path.read_bytes() == b"artifact" and not str(path).startswith(str(blocker))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not per call
        assert get_or_build(["k"], _builder(calls), ".so") == path
    assert len(calls) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_folder_falls_back(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(ro))
    monkeypatch.setattr(diskcache, "_fallback", None)
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert cache_dir() != ro
