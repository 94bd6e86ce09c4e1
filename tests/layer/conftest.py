"""Fixtures for the layer-substitution tests: test repositories, isolated state, a fake Hugging Face cache."""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelize.layer import mapping, repos

REPOS = Path(__file__).parent / "repos"

# Environment variables that change what kernelize resolves or selects; each test starts without them.
_ENV = (
    "LOCAL_KERNELS",
    "KERNELIZE_HUB_DIR",
    "KERNELIZE_TRUST_REMOTE_CODE",
    "KERNELIZE_CUDA_CAPABILITY",
    "KERNELIZE_ROCM_CAPABILITY",
    "DISABLE_KERNEL_MAPPING",
    "HF_HUB_OFFLINE",
    "KERNELS_CACHE",
)


@pytest.fixture(autouse=True)
def isolated_layer_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Empty process-wide mapping, no cached repository loads, no kernelize env vars, a private HF cache."""
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    saved = mapping._global
    mapping._global = mapping._EMPTY
    repos._LOADED.clear()
    yield
    mapping._global = saved
    repos._LOADED.clear()


@pytest.fixture
def repo_path():
    """`repo_path("activation")` -> the test kernel repository folder."""

    def get(name: str) -> Path:
        path = REPOS / name
        assert path.is_dir(), path
        return path

    return get


@dataclass
class FakeHub:
    """A Hugging Face cache on disk, in the layout `huggingface_hub` writes (blobs + symlinked snapshots)."""

    cache: Path

    def add(self, repo_id: str, versions: dict[int, Path], repo_type: str = "model") -> dict[int, str]:
        """Cache each version (a repository folder) as a commit with branch `v{N}`; `main` is the newest.

        Returns `{version: commit}`.
        """
        from huggingface_hub.file_download import repo_folder_name

        folder = self.cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        commits = {}
        for version, source in versions.items():
            commit = hashlib.sha1(f"{repo_id}@v{version}".encode()).hexdigest()
            for file in sorted(source.rglob("*")):
                if not file.is_file() or "__pycache__" in file.parts:
                    continue
                data = file.read_bytes()
                blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
                blob.parent.mkdir(parents=True, exist_ok=True)
                blob.write_bytes(data)
                link = folder / "snapshots" / commit / file.relative_to(source)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(blob, link.parent))
            ref = folder / "refs" / f"v{version}"
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit)
            commits[version] = commit
        (folder / "refs" / "main").write_text(commits[max(commits)])
        return commits

    def remove(self, repo_id: str, repo_type: str = "model") -> None:
        from huggingface_hub.file_download import repo_folder_name

        shutil.rmtree(self.cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type))


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """An empty Hugging Face cache in `HF_HUB_CACHE`, with `HF_HUB_OFFLINE=1`."""
    cache = tmp_path / "hf-cache"
    cache.mkdir(exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return FakeHub(cache)
