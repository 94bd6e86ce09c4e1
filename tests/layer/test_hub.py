"""Resolving and loading repositories: HF cache, versions, overrides, bundled hub, trust, lockfiles."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import kernelize
from kernelize import (
    FuncRepository,
    LayerRepository,
    LocalLayerRepository,
    LockedFuncRepository,
    LockedLayerRepository,
    Mode,
    get_kernel,
    get_local_kernel,
    get_locked_kernel,
    has_kernel,
    inspect,
    use_kernel_forward_from_hub,
    use_kernel_mapping,
)
from kernelize.layer import repos
from kernelize.layer.hub import bundled_hub_dir
from kernelize.layer.importer import import_variant
from kernelize.layer.lockfile import locked_commit
from kernelize.layer.variants import SystemInfo

from .conftest import REPOS, FakeHub

REPO_ID = "kernels-test/versioned"


@pytest.fixture
def versioned(fake_hub: FakeHub) -> dict[int, str]:
    """`kernels-test/versioned` v1 and v2 in the fake Hugging Face cache (a legacy `models--` folder)."""
    return fake_hub.add(REPO_ID, {1: REPOS / "versioned_v1", 2: REPOS / "versioned_v2"})


# --- the Hugging Face cache, offline -----------------------------------------------------------------------


@pytest.mark.parametrize("repo_type", ["model", "kernel"])
def test_version_resolves_through_refs_in_the_cache(fake_hub: FakeHub, repo_type: str) -> None:
    commits = fake_hub.add(
        REPO_ID, {1: REPOS / "versioned_v1", 2: REPOS / "versioned_v2"}, repo_type=repo_type
    )
    v1 = get_kernel(REPO_ID, version=1, trust_remote_code=True)
    v2 = get_kernel(REPO_ID, version=2, trust_remote_code=True)
    assert (v1.VERSION, v2.VERSION) == (1, 2)
    assert v1.__name__ != v2.__name__ and sys.modules[v1.__name__] is v1 and sys.modules[v2.__name__] is v2
    assert f"snapshots/{commits[1]}/build/torch-universal" in v1.__file__
    assert get_kernel(REPO_ID, revision="main", trust_remote_code=True) is v2  # main is the newest
    assert get_kernel(REPO_ID, revision=commits[1], trust_remote_code=True) is v1
    assert get_kernel(REPO_ID, revision="v1", trust_remote_code=True) is v1  # a branch name, via refs/


def test_two_versions_coexist_in_one_model(versioned: dict[int, str]) -> None:
    @use_kernel_forward_from_hub("Scale")
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = nn.Sequential(nn.Linear(2, 2), Scale(), Scale())
    v1 = LayerRepository(REPO_ID, layer_name="Scale", version=1, trust_remote_code=True)
    v2 = LayerRepository(REPO_ID, layer_name="Scale", version=2, trust_remote_code=True)
    with use_kernel_mapping({"Scale": {"cpu": v1}}):
        kernelize.kernelize(model[:2], mode=Mode.INFERENCE)
    with use_kernel_mapping({"Scale": {"cpu": v2}}):
        kernelize.kernelize(nn.Sequential(model[0], model[2]), mode=Mode.INFERENCE)
    x = torch.ones(1, 2)
    assert torch.equal(model[1](x), x) and torch.equal(model[2](x), 2 * x)
    assert inspect(model)["1"].repository == "`kernels-test/versioned` (version 1), layer `Scale`"


def test_func_repository_from_the_cache(versioned: dict[int, str]) -> None:
    layer = FuncRepository(REPO_ID, func_name="scale", version=2, trust_remote_code=True).load()
    assert torch.equal(layer.forward(None, torch.ones(2)), torch.full((2,), 2.0))


def test_the_variant_for_this_system_is_picked_from_the_cache(versioned: dict[int, str]) -> None:
    expected = "torch-cuda" if SystemInfo.detect().backend.name == "cuda" else "torch-universal"
    assert get_kernel(REPO_ID, version=1, trust_remote_code=True).VARIANT == expected


def test_missing_version_lists_the_cached_ones(versioned: dict[int, str]) -> None:
    with pytest.raises(
        FileNotFoundError,
        match=r"Version 3 of `kernels-test/versioned` is not in the Hugging Face "
        r"cache and HF_HUB_OFFLINE is set \(cached versions: v1, v2\)",
    ):
        get_kernel(REPO_ID, version=3, trust_remote_code=True)


def test_uncached_repository(fake_hub: FakeHub) -> None:
    with pytest.raises(
        FileNotFoundError, match=r"`org/absent` is not in the Hugging Face cache .*LOCAL_KERNELS="
    ):
        get_kernel("org/absent", version=1, trust_remote_code=True)


def test_uncached_revision(versioned: dict[int, str]) -> None:
    with pytest.raises(
        FileNotFoundError, match="Revision " + "f" * 40 + " of `kernels-test/versioned` is not in"
    ):
        get_kernel(REPO_ID, revision="f" * 40, trust_remote_code=True)


def test_no_fitting_variant_lists_every_variant_and_why(fake_hub: FakeHub) -> None:
    fake_hub.add("kernels-test/cuda-only", {1: REPOS / "cuda_only"})
    with pytest.raises(FileNotFoundError) as info:
        get_kernel("kernels-test/cuda-only", version=1, trust_remote_code=True)
    message = str(info.value)
    assert "No build of `kernels-test/cuda-only` (revision " in message
    assert "  - torch-cuda: backend (cuda) is neither this system's" in message
    assert "  - torch29-cxx11-cu126-x86_64-linux: " in message


def test_has_kernel_downloads_and_runs_nothing(versioned: dict[int, str], fake_hub: FakeHub) -> None:
    assert has_kernel(REPO_ID, version=1)  # no trust needed: nothing runs
    assert not has_kernel(REPO_ID, version=7)
    assert not has_kernel("org/absent", version=1)
    fake_hub.add("kernels-test/cuda-only", {1: REPOS / "cuda_only"})
    assert not has_kernel("kernels-test/cuda-only", version=1)
    with pytest.raises(ValueError, match="either revision= or version="):
        has_kernel(REPO_ID, revision="main", version=1)


# --- trust -------------------------------------------------------------------------------------------------


def test_hub_code_needs_trust(versioned: dict[int, str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError) as info:
        get_kernel(REPO_ID, version=1)
    assert str(info.value) == (
        "Kernel repository `kernels-test/versioned` is not bundled with kernelize, and loading it runs its "
        "Python code. If you trust it, pass trust_remote_code=True (or "
        "trust_remote_code=['kernels-test/versioned']) to the repository or get_kernel(), "
        "or set KERNELIZE_TRUST_REMOTE_CODE=kernels-test/versioned."
    )
    with pytest.raises(ValueError, match="is not bundled with kernelize"):
        LayerRepository(REPO_ID, layer_name="Scale", version=1, trust_remote_code=["other/repo"]).load()
    assert LayerRepository(REPO_ID, layer_name="Scale", version=1, trust_remote_code=[REPO_ID]).load()
    monkeypatch.setenv("KERNELIZE_TRUST_REMOTE_CODE", "other/*, kernels-test/*")
    assert get_kernel(REPO_ID, version=1).VERSION == 1


def test_trust_is_checked_before_looking_at_the_cache(fake_hub: FakeHub) -> None:
    with pytest.raises(ValueError, match="not bundled with kernelize"):
        get_kernel("org/absent", version=1)


# --- LOCAL_KERNELS and the bundled hub ---------------------------------------------------------------------


def test_local_kernels_override_a_repo_id(monkeypatch: pytest.MonkeyPatch, repo_path) -> None:
    monkeypatch.setenv(
        "LOCAL_KERNELS", f"org/act={repo_path('activation')}:org/norm={repo_path('layer_norm')}"
    )
    # No trust needed (the user chose the folder) and no cache or network: HF_HUB_OFFLINE is not even set.
    layer = LayerRepository("org/act", layer_name="SiluAndMul", version=1).load()
    assert layer.__name__ == "SiluAndMul"
    assert get_kernel("org/norm", version=1).VARIANT in ("torch-cpu", "torch-cuda")
    assert has_kernel("org/act", version=1)


def test_malformed_local_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_KERNELS", "org/act")
    with pytest.raises(ValueError, match="Invalid LOCAL_KERNELS entry 'org/act'; expected org/name=/path"):
        get_kernel("org/act", version=1)


def test_bundled_repositories_resolve_without_network_or_trust(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELIZE_HUB_DIR", str(REPOS / "bundled"))
    relu = get_kernel("kernelize/relu", version=1)
    assert torch.equal(relu.relu(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    assert LayerRepository("kernelize/relu", layer_name="ReLU", version=1).load().__name__ == "ReLU"
    assert has_kernel("kernelize/relu", version=1)
    with pytest.raises(
        FileNotFoundError, match=r"No bundled kernel repository `kernelize/gelu` in .* \(bundled: relu\)"
    ):
        get_kernel("kernelize/gelu", version=1)
    assert not has_kernel("kernelize/gelu", version=1)


def test_default_bundled_hub_is_next_to_the_package() -> None:
    assert bundled_hub_dir() == Path(kernelize.__file__).parents[1] / "hub_kernels"


# --- local repositories and the importer -------------------------------------------------------------------


def test_local_repository_in_both_layouts(repo_path) -> None:
    flat = get_local_kernel(repo_path("activation"))  # build/<variant>/__init__.py
    nested = get_local_kernel(repo_path("layer_norm"))  # build/<variant>/<package>/__init__.py
    assert flat.layers.SiluAndMul.__name__ == "SiluAndMul"
    assert nested.layers.RMSNorm.__name__ == "RMSNorm"
    # The seed's form names the package; it finds the same module.
    assert get_local_kernel(repo_path("layer_norm"), "layer_norm") is nested
    seed_form = LocalLayerRepository(repo_path("layer_norm"), package_name="layer_norm", layer_name="RMSNorm")
    assert seed_form.load() is nested.layers.RMSNorm
    # A variant folder itself, or a build/ folder, works too.
    assert get_local_kernel(repo_path("activation") / "build" / "torch-universal") is flat
    assert get_local_kernel(repo_path("activation") / "build") is flat


def test_local_variant_is_the_best_for_this_system(repo_path) -> None:
    expected = "torch-cuda" if SystemInfo.detect().backend.name == "cuda" else "torch-cpu"
    assert get_local_kernel(repo_path("layer_norm")).VARIANT == expected  # preferred over torch-universal
    assert get_local_kernel(repo_path("layer_norm"), backend="cpu").VARIANT == "torch-cpu"


def test_missing_local_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_local_kernel(tmp_path / "nowhere")


def test_package_folder_that_cannot_be_found(tmp_path: Path) -> None:
    variant = tmp_path / "build" / "torch-universal"
    (variant / "one").mkdir(parents=True)
    (variant / "two").mkdir()
    (variant / "one" / "__init__.py").write_text("")
    (variant / "two" / "__init__.py").write_text("")
    with pytest.raises(FileNotFoundError, match="Packages found: one, two; pass package_name=..."):
        get_local_kernel(tmp_path)
    assert get_local_kernel(tmp_path, package_name="two").__name__.startswith("_kernelize_kernel_two_")


def test_import_failure_is_not_cached(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("import kernelize_test_not_there_yet\n")
    loaded = {name for name in sys.modules if name.startswith("_kernelize_kernel_")}
    with pytest.raises(ModuleNotFoundError) as info:
        import_variant(tmp_path)
    assert f"while importing the kernel package at {tmp_path}" in info.value.__notes__[0]
    assert {name for name in sys.modules if name.startswith("_kernelize_kernel_")} == loaded  # no half module
    (tmp_path / "__init__.py").write_text("VALUE = 3\n")
    assert import_variant(tmp_path).VALUE == 3


def test_layers_module_is_imported_when_the_package_does_not(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "layers.py").write_text("from torch import nn\n\nclass Identity(nn.Module):\n    pass\n")
    assert LocalLayerRepository(tmp_path, layer_name="Identity").load().__name__ == "Identity"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "__init__.py").write_text("")
    with pytest.raises(ValueError, match="does not define any layers"):
        LocalLayerRepository(empty, layer_name="Identity").load()


# --- lock files --------------------------------------------------------------------------------------------


def write_lockfile(path: Path, commit: str, new_format: bool) -> Path:
    if new_format:  # kernels >= 0.13 (`kernels lock`)
        entries = [{"dependency": {"repo-id": REPO_ID, "version": 2}, "lock": {"commit": commit}}]
    else:  # older kernels
        entries = [{"repo_id": REPO_ID, "sha": commit, "variants": {"torch-universal": {"hash": "sha256-x"}}}]
    path.write_text(json.dumps(entries))
    return path


@pytest.mark.parametrize("new_format", [True, False])
def test_locked_repositories(versioned: dict[int, str], tmp_path: Path, new_format: bool) -> None:
    lockfile = write_lockfile(tmp_path / "kernels.lock", versioned[2], new_format)
    repo = LockedLayerRepository(REPO_ID, layer_name="Scale", lockfile=lockfile, trust_remote_code=True)
    assert repo.commit == versioned[2]
    assert str(repo) == f"`{REPO_ID}` (locked at {versioned[2][:12]}), layer `Scale`"
    assert repo.load().forward(None, torch.ones(1)).item() == 2.0
    func = LockedFuncRepository(REPO_ID, func_name="scale", lockfile=lockfile, trust_remote_code=True).load()
    assert func.forward(None, torch.ones(1)).item() == 2.0
    assert get_locked_kernel(REPO_ID, lockfile=lockfile, trust_remote_code=True).VERSION == 2


def test_lockfile_errors(tmp_path: Path) -> None:
    lockfile = write_lockfile(tmp_path / "kernels.lock", "a" * 40, new_format=True)
    with pytest.raises(
        ValueError, match=r"Kernel `org/other` is not locked in .*kernels.lock \(locked: kernels-test"
    ):
        LockedLayerRepository("org/other", layer_name="X", lockfile=lockfile)
    (tmp_path / "bad.lock").write_text(json.dumps([{"repo_id": REPO_ID, "sha": "short"}]))
    with pytest.raises(ValueError, match=r"bad.lock: entry 0 has no repo id and 40-hex commit"):
        LockedLayerRepository(REPO_ID, layer_name="X", lockfile=tmp_path / "bad.lock")
    with pytest.raises(FileNotFoundError, match="Cannot read lock file"):
        LockedLayerRepository(REPO_ID, layer_name="X", lockfile=tmp_path / "absent.lock")


def test_lockfile_from_the_callers_package_metadata() -> None:
    # This test module belongs to no installed distribution, so there is no `kernels.lock` to find.
    with pytest.raises(
        ValueError, match=r"No `kernels.lock` found in the package metadata of `.*` \(the caller\)"
    ):
        LockedLayerRepository(REPO_ID, layer_name="Scale")


# --- repository arguments ----------------------------------------------------------------------------------


def test_repository_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="either revision= or version=, not both"):
        LayerRepository(REPO_ID, layer_name="Scale", revision="main", version=1)
    with pytest.raises(TypeError, match="version must be an int"):
        LayerRepository(REPO_ID, layer_name="Scale", version="1")
    with pytest.raises(TypeError, match="repo_id must be a non-empty string"):
        LayerRepository("", layer_name="Scale")
    with pytest.raises(TypeError, match="repo_path must be a path"):
        LocalLayerRepository(3, layer_name="Scale")
    with pytest.raises(ValueError, match="either revision= or version="):
        get_kernel(REPO_ID, revision="main", version=1)
    assert str(LayerRepository(REPO_ID, layer_name="Scale", revision="main")) == (
        f"`{REPO_ID}` (revision main), layer `Scale`"
    )


# --- bundled names are plain names of the hub folder -------------------------------------------------------


def planted_repo(folder: Path) -> Path:
    """A kernel repository whose import leaves a marker file: it shows whether its code ran."""
    package = folder / "build" / "torch-universal"
    package.mkdir(parents=True)
    marker = folder / "code-ran"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nfrom . import layers\n")
    (package / "layers.py").write_text("from torch import nn\n\nclass ReLU(nn.Module):\n    pass\n")
    return marker


BAD_BUNDLED = [
    "kernelize//{planted}",
    "kernelize/../{name}",
    "kernelize/..",
    "kernelize/.",
    "kernelize/",
    "kernelize",
    "kernelize/a\\b",
    "kernelize/relu/../../x",
    "kernelize/.hidden",
]


@pytest.mark.parametrize("template", BAD_BUNDLED)
def test_bundled_names_that_are_paths_are_refused_everywhere(
    template: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    (hub_dir / "relu").symlink_to(REPOS / "bundled" / "relu", target_is_directory=True)
    monkeypatch.setenv("KERNELIZE_HUB_DIR", str(hub_dir))
    marker = planted_repo(tmp_path / "planted")
    repo_id = template.format(planted=str(tmp_path / "planted").lstrip("/"), name="planted")
    lockfile = tmp_path / "kernels.lock"
    lockfile.write_text(json.dumps([{"repo_id": repo_id, "sha": "a" * 40}]))
    message = rf"Kernel repository `{re.escape(repo_id)}` is not a valid repo id: .* \(kernelize/relu\)"
    with pytest.raises(ValueError, match=message):
        get_kernel(repo_id, version=1)
    with pytest.raises(ValueError, match=message):
        has_kernel(repo_id, version=1)
    with pytest.raises(ValueError, match=message):
        LayerRepository(repo_id, layer_name="ReLU", version=1)
    with pytest.raises(ValueError, match=message):
        FuncRepository(repo_id, func_name="relu", revision="main")
    with pytest.raises(ValueError, match=message):
        LockedLayerRepository(repo_id, layer_name="ReLU", lockfile=lockfile)
    with pytest.raises(ValueError, match=message):
        get_locked_kernel(repo_id, lockfile=lockfile)
    with pytest.raises(ValueError, match=rf"kernels.lock: entry 0: {message}"):
        locked_commit("org/other", lockfile)
    assert not marker.exists()


def test_the_absolute_path_exploit_no_longer_imports_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = planted_repo(tmp_path / "planted")
    repo_id = f"kernelize/{tmp_path / 'planted'}"  # kernelize//tmp/.../planted: joined, it is the folder
    with pytest.raises(ValueError, match="LocalLayerRepository / get_local_kernel, or LOCAL_KERNELS"):
        LayerRepository(repo_id, layer_name="ReLU", version=1).load()
    assert not marker.exists()
    get_local_kernel(tmp_path / "planted")  # named as a folder, it is the user's choice and loads
    assert marker.exists()


def test_a_bundled_name_must_be_a_folder_of_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub_dir = tmp_path / "hub"
    (hub_dir / "relu").mkdir(parents=True)
    (hub_dir / "notes.txt").write_text("not a repository")
    monkeypatch.setenv("KERNELIZE_HUB_DIR", str(hub_dir))
    with pytest.raises(
        FileNotFoundError, match=r"No bundled kernel repository `kernelize/notes.txt` .*relu\)"
    ):
        get_kernel("kernelize/notes.txt", version=1)
    assert not has_kernel("kernelize/notes.txt", version=1)


# --- trust_remote_code takes a bool or a list of repo ids / globs ------------------------------------------


@pytest.mark.parametrize("trust", ["org/x", "x", b"x", 1, None, {"x": True}, ["x", 3], [""], iter(["x"])])
def test_trust_remote_code_of_any_other_type_is_a_type_error(
    trust: object, fake_hub: FakeHub, tmp_path: Path
) -> None:
    fake_hub.add("x", {1: REPOS / "versioned_v1"})  # a one-letter repo id, trusted by "org/x" as characters
    lockfile = write_lockfile(tmp_path / "kernels.lock", "a" * 40, new_format=False)
    message = r"`(x|kernels-test/versioned|.*)`: trust_remote_code must be True, False or a list of repo ids"
    calls = [
        lambda: LayerRepository("x", layer_name="Scale", version=1, trust_remote_code=trust),
        lambda: FuncRepository("x", func_name="scale", version=1, trust_remote_code=trust),
        lambda: LockedLayerRepository(
            REPO_ID, layer_name="Scale", lockfile=lockfile, trust_remote_code=trust
        ),
        lambda: LockedFuncRepository(REPO_ID, func_name="scale", lockfile=lockfile, trust_remote_code=trust),
        lambda: get_kernel("x", version=1, trust_remote_code=trust),
        lambda: get_locked_kernel(REPO_ID, lockfile=lockfile, trust_remote_code=trust),
        lambda: has_kernel("x", version=1, trust_remote_code=trust),
        lambda: get_local_kernel(REPOS / "activation", trust_remote_code=trust),
    ]
    loaded = {name for name in sys.modules if name.startswith("_kernelize_kernel_")}
    for call in calls:
        with pytest.raises(TypeError, match=message):
            call()
    assert {name for name in sys.modules if name.startswith("_kernelize_kernel_")} == loaded  # no code ran


def test_trust_remote_code_takes_repo_ids_and_globs(versioned: dict[int, str]) -> None:
    for trust in ([REPO_ID], (REPO_ID,), ["other/*", "kernels-test/*"]):
        repo = LayerRepository(REPO_ID, layer_name="Scale", version=1, trust_remote_code=trust)
        assert repo.trust_remote_code == tuple(trust) and hash(repo)
        assert repo.load().__name__ == "Scale"
        repos._LOADED.clear()
    with pytest.raises(ValueError, match="is not bundled with kernelize"):
        get_kernel(REPO_ID, version=1, trust_remote_code=["kernels-test/other*"])


# --- exactly one of revision / version, as in kernels 0.17.2 -----------------------------------------------


def test_hub_repositories_need_a_version_or_a_revision(versioned: dict[int, str]) -> None:
    message = r"`kernels-test/versioned`.*: either a revision or a version must be specified. Use version="
    with pytest.raises(ValueError, match=message):
        LayerRepository(REPO_ID, layer_name="Scale", trust_remote_code=True)
    with pytest.raises(ValueError, match=message):
        FuncRepository(REPO_ID, func_name="scale", trust_remote_code=True)
    with pytest.raises(ValueError, match=message + r".*revision=<branch/tag/commit>"):
        get_kernel(REPO_ID, trust_remote_code=True)
    with pytest.raises(ValueError, match=message):
        has_kernel(REPO_ID)
    with pytest.raises(ValueError, match=r"`kernelize/activation`.*either a revision or a version"):
        LayerRepository("kernelize/activation", layer_name="SiluAndMul")
    with pytest.raises(TypeError, match="revision must be a non-empty string"):
        LayerRepository(REPO_ID, layer_name="Scale", revision="")
    assert LayerRepository(REPO_ID, layer_name="Scale", revision="main", trust_remote_code=True).load()


# --- lock files: every malformed entry is a named error ----------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        None,
        "kernels-test/versioned",
        {"dependency": None, "lock": {"commit": "a" * 40}},
        {"dependency": "kernels-test/versioned", "lock": {"commit": "a" * 40}},
        {"dependency": {"repo-id": REPO_ID}, "lock": None},
        {"dependency": {"repo-id": REPO_ID}, "lock": "a" * 40},
        {"dependency": {"repo-id": None}, "lock": {"commit": "a" * 40}},
        {"repo_id": REPO_ID, "sha": None},
    ],
)
def test_malformed_lock_entries_name_the_file_and_entry(entry: object, tmp_path: Path) -> None:
    lockfile = tmp_path / "kernels.lock"
    good = {"repo_id": "org/good", "sha": "b" * 40}
    lockfile.write_text(json.dumps([good, entry]))
    with pytest.raises(ValueError, match=rf"Lock file {re.escape(str(lockfile))}: entry 1 has no repo id"):
        locked_commit(REPO_ID, lockfile)


def test_duplicate_lock_entries_are_refused(tmp_path: Path) -> None:
    lockfile = tmp_path / "kernels.lock"
    lockfile.write_text(
        json.dumps(
            [
                {"repo_id": REPO_ID, "sha": "a" * 40},
                {"dependency": {"repo-id": REPO_ID, "version": 1}, "lock": {"commit": "b" * 40}},
            ]
        )
    )
    with pytest.raises(ValueError, match=rf"{re.escape(str(lockfile))} locks `{REPO_ID}` twice \(entry 1"):
        LockedLayerRepository(REPO_ID, layer_name="Scale", lockfile=lockfile)


def test_a_lock_file_that_is_not_utf8_names_its_path(tmp_path: Path) -> None:
    lockfile = tmp_path / "kernels.lock"
    lockfile.write_bytes(b'[{"repo_id": "org/x", "sha": "\xff\xfe"}]')
    with pytest.raises(ValueError, match=rf"Lock file {re.escape(str(lockfile))} is not UTF-8 text"):
        LockedLayerRepository(REPO_ID, layer_name="Scale", lockfile=lockfile)
