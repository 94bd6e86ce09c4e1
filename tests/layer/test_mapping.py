"""Kernel mapping registry: registration, scopes, threads, capability ranges (kernelize.layer.mapping)."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelize import (
    CUDAProperties,
    Device,
    LayerRepository,
    LocalLayerRepository,
    Mode,
    register_kernel_mapping,
    use_kernel_mapping,
)
from kernelize.layer.device import DeviceType
from kernelize.layer.mapping import CapabilityEntry, DeviceRepos, current_mapping

try:
    from kernels.layer._interval_tree import IntervalTree
except ImportError:  # `kernels` is only installed for compatibility tests
    IntervalTree = None

A = LocalLayerRepository(Path("/kernels/a"), layer_name="A")
B = LocalLayerRepository(Path("/kernels/b"), layer_name="B")
C = LocalLayerRepository(Path("/kernels/c"), layer_name="C")


def repos_for(layer: str, device: str = "cuda", capability: int | None = None) -> dict | None:
    per_device = current_mapping().get(layer)
    if per_device is None or device not in per_device:
        return None
    selected = per_device[DeviceType(device)].select(capability)
    return None if selected is None else dict(selected)


def test_repository_without_modes_is_registered_as_fallback() -> None:
    register_kernel_mapping({"SiluAndMul": {"cuda": A}})
    assert repos_for("SiluAndMul") == {Mode.FALLBACK: A}


def test_register_merges_and_inherit_false_replaces() -> None:
    register_kernel_mapping({"SiluAndMul": {"cuda": A}})
    register_kernel_mapping({"RMSNorm": {"cpu": B}})
    assert set(current_mapping()) == {"SiluAndMul", "RMSNorm"}
    register_kernel_mapping({"RMSNorm": {"cuda": C}}, inherit_mapping=False)
    assert set(current_mapping()) == {"RMSNorm"}
    assert set(current_mapping()["RMSNorm"]) == {DeviceType.CUDA}


def test_registering_a_device_again_replaces_its_mode_dict() -> None:
    register_kernel_mapping({"X": {"cuda": {Mode.INFERENCE: A, Mode.TRAINING: B}, "cpu": A}})
    register_kernel_mapping({"X": {"cuda": {Mode.TRAINING: C}}})
    assert repos_for("X") == {Mode.TRAINING: C}  # as in `kernels`: the device entry is replaced, not merged
    assert repos_for("X", "cpu") == {Mode.FALLBACK: A}  # other devices are kept


def test_metal_is_registered_as_mps() -> None:
    register_kernel_mapping({"X": {"metal": A}})
    assert repos_for("X", "mps") == {Mode.FALLBACK: A}


def test_snapshots_are_immutable_and_never_change() -> None:
    register_kernel_mapping({"X": {"cuda": A}})
    snapshot = current_mapping()
    register_kernel_mapping({"X": {"cuda": B}, "Y": {"cpu": C}})
    assert set(snapshot) == {"X"}
    assert dict(snapshot["X"][DeviceType.CUDA].select(None)) == {Mode.FALLBACK: A}
    with pytest.raises(TypeError):
        snapshot["Z"] = {}  # type: ignore[index]


def test_scoped_mapping_is_gone_after_the_block() -> None:
    register_kernel_mapping({"Global": {"cuda": A}})
    with use_kernel_mapping({"Scoped": {"cuda": B}}):
        assert set(current_mapping()) == {"Global", "Scoped"}
    assert set(current_mapping()) == {"Global"}


def test_scope_without_inheritance_hides_the_global_mapping() -> None:
    register_kernel_mapping({"Global": {"cuda": A}})
    with use_kernel_mapping({"Scoped": {"cuda": B}}, inherit_mapping=False):
        assert set(current_mapping()) == {"Scoped"}
    assert set(current_mapping()) == {"Global"}


def test_nested_scopes_stack_and_unwind() -> None:
    with use_kernel_mapping({"X": {"cuda": A}}):
        with use_kernel_mapping({"X": {"cuda": B}, "Y": {"cpu": C}}):
            assert repos_for("X") == {Mode.FALLBACK: B}
            with use_kernel_mapping({"Z": {"cpu": C}}, inherit_mapping=False):
                assert set(current_mapping()) == {"Z"}
            assert set(current_mapping()) == {"X", "Y"}
        assert repos_for("X") == {Mode.FALLBACK: A}
        assert set(current_mapping()) == {"X"}
    assert dict(current_mapping()) == {}


def test_register_inside_a_scope_stays_in_the_scope() -> None:
    with use_kernel_mapping({"X": {"cuda": A}}):
        register_kernel_mapping({"Y": {"cuda": B}})
        assert set(current_mapping()) == {"X", "Y"}
    assert dict(current_mapping()) == {}


def test_scope_is_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), use_kernel_mapping({"X": {"cuda": A}}):
        raise RuntimeError("boom")
    assert dict(current_mapping()) == {}


def test_scoped_mapping_is_invisible_in_other_threads() -> None:
    register_kernel_mapping({"Global": {"cuda": A}})
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, set[str]] = {}

    def scoped_worker() -> None:
        with use_kernel_mapping({"Scoped": {"cuda": B}}):
            seen["scoped worker"] = set(current_mapping())
            inside.set()
            release.wait(5)

    def other_worker() -> None:
        seen["other worker"] = set(current_mapping())

    worker = threading.Thread(target=scoped_worker)
    worker.start()
    assert inside.wait(5)
    other = threading.Thread(target=other_worker)
    other.start()
    other.join(5)
    seen["main"] = set(current_mapping())
    release.set()
    worker.join(5)
    assert seen == {"scoped worker": {"Global", "Scoped"}, "other worker": {"Global"}, "main": {"Global"}}


def test_global_registration_is_visible_in_threads() -> None:
    register_kernel_mapping({"Global": {"cuda": A}})
    seen = []
    thread = threading.Thread(target=lambda: seen.append(set(current_mapping())))
    thread.start()
    thread.join(5)
    assert seen == [{"Global"}]


@pytest.mark.parametrize(
    "mapping, error, message",
    [
        ([("X", A)], TypeError, "must be a dict of layer name"),
        ({1: {"cuda": A}}, TypeError, "keys must be layer names"),
        ({"X": A}, TypeError, "for `X` must map devices to repositories"),
        ({"X": {"gpu": A}}, ValueError, "Unsupported device type 'gpu'"),
        ({"X": {"cuda": {"inference": A}}}, TypeError, "for `X` on `cuda` has mode key 'inference'"),
        (
            {"X": {"cuda": "org/repo"}},
            TypeError,
            r"for `X` on `cuda` \(mode FALLBACK\) is 'org/repo', not a repo",
        ),
        (
            {"X": {"cuda": LayerRepository}},
            TypeError,
            r"for `X` on `cuda` \(mode FALLBACK\) is the class `LayerRepository` itself, not a repository; "
            r"create one, e.g. LayerRepository\(",
        ),
        (
            {"X": {"cpu": {Mode.INFERENCE: LocalLayerRepository}}},
            TypeError,
            r"for `X` on `cpu` \(mode INFERENCE\) is the class `LocalLayerRepository` itself",
        ),
    ],
)
def test_invalid_mappings_are_rejected_before_any_change(mapping: object, error: type, message: str) -> None:
    register_kernel_mapping({"Kept": {"cuda": A}})
    with pytest.raises(error, match=message):
        register_kernel_mapping(mapping)  # type: ignore[arg-type]
    with pytest.raises(error, match=message), use_kernel_mapping(mapping):  # type: ignore[arg-type]
        pass
    assert set(current_mapping()) == {"Kept"}


def test_a_mode_kernelize_never_asks_for_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kernelize"):
        register_kernel_mapping({"X": {"cuda": {Mode.TORCH_COMPILE: A}}})
    assert "registers mode TORCH_COMPILE, which kernelize never selects" in caplog.text


# --- capability ranges -------------------------------------------------------------------------------------


def entry(low: int, high: int, name: str) -> CapabilityEntry:
    return CapabilityEntry(low, high, {Mode.FALLBACK: name})


def pick(repos: DeviceRepos, capability: int | None) -> str | None:
    selected = repos.select(capability)
    return None if selected is None else selected[Mode.FALLBACK]


def test_ranges_are_inclusive() -> None:
    repos = DeviceRepos((entry(75, 89, "ampere"),))
    assert [pick(repos, c) for c in (74, 75, 89, 90)] == [None, "ampere", "ampere", None]


def test_smallest_containing_range_wins() -> None:
    # The seed's example: KernelA 80..89 and KernelB 75..89 on capability 86 -> KernelA.
    repos = DeviceRepos((entry(75, 89, "B"), entry(80, 89, "A"), entry(0, sys.maxsize, "any")))
    assert pick(repos, 86) == "A"
    assert pick(repos, 77) == "B"
    assert pick(repos, 95) == "any"


def test_ties_go_to_the_later_registration() -> None:
    assert pick(DeviceRepos((entry(80, 89, "first"), entry(85, 94, "second"))), 86) == "second"
    assert pick(DeviceRepos((entry(85, 94, "second"), entry(80, 89, "first"))), 86) == "first"


def test_registering_the_same_range_replaces_it() -> None:
    repos = DeviceRepos().with_entry(entry(80, 89, "old")).with_entry(entry(80, 89, "new"))
    assert len(repos.entries) == 1 and pick(repos, 85) == "new"


def test_unknown_capability_only_matches_unrestricted_registrations() -> None:
    assert pick(DeviceRepos((entry(0, 200, "ranged"),)), None) is None
    assert pick(DeviceRepos((entry(0, 200, "ranged"), entry(0, sys.maxsize, "any"))), None) == "any"


def test_register_with_cuda_properties() -> None:
    register_kernel_mapping(
        {
            "SiluAndMul": {
                Device("cuda", CUDAProperties(75, 89)): A,
                Device("cuda", CUDAProperties(90, sys.maxsize)): B,
            }
        }
    )
    register_kernel_mapping({"SiluAndMul": {Device("cuda", CUDAProperties(75, 89)): C}})  # replaces 75..89
    assert repos_for("SiluAndMul", capability=86) == {Mode.FALLBACK: C}
    assert repos_for("SiluAndMul", capability=90) == {Mode.FALLBACK: B}
    assert repos_for("SiluAndMul", capability=70) is None


ranges = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 40)), min_size=1, max_size=8)


@settings(deadline=None)
@given(ranges=ranges, capability=st.integers(0, 170))
def test_select_matches_a_naive_reference(ranges: list[tuple[int, int]], capability: int) -> None:
    entries = [entry(low, low + width, f"r{i}") for i, (low, width) in enumerate(ranges)]
    repos = DeviceRepos()
    for e in entries:
        repos = repos.with_entry(e)
    # Naive reference: later registrations of a range replace earlier ones; among ranges containing the
    # capability, the narrowest; among equally narrow ones, the latest registered.
    latest: dict[tuple[int, int], tuple[int, str]] = {}
    for position, e in enumerate(entries):
        latest.pop((e.min_capability, e.max_capability), None)
        latest[(e.min_capability, e.max_capability)] = (position, e.repos[Mode.FALLBACK])
    order = list(latest.items())
    fitting = [(hi - lo, -i, name) for i, ((lo, hi), (_, name)) in enumerate(order) if lo <= capability <= hi]
    expected = min(fitting)[2] if fitting else None
    assert pick(repos, capability) == expected


@pytest.mark.skipif(IntervalTree is None, reason="Hugging Face `kernels` is not installed")
@settings(deadline=None)
@given(ranges=ranges, capability=st.integers(0, 170))
def test_select_agrees_with_kernels_interval_tree(ranges: list[tuple[int, int]], capability: int) -> None:
    tree = IntervalTree()
    repos = DeviceRepos()
    for i, (low, width) in enumerate(ranges):
        tree.insert(low, low + width, f"r{i}")
        repos = repos.with_entry(entry(low, low + width, f"r{i}"))
    ours = pick(repos, capability)
    theirs = tree.find_smallest_interval(capability)
    assert (ours is None) == (theirs is None)
    if ours is not None:  # same width (`kernels` breaks ties by id(), so only the width must agree)
        width = {e.repos[Mode.FALLBACK]: e.max_capability - e.min_capability for e in repos.entries}
        their_width = min(hi - lo for lo, hi in {(lo, lo + w) for lo, w in ranges} if lo <= capability <= hi)
        assert width[ours] == their_width
        assert theirs is not None


def test_hub_repositories_are_hashable_values() -> None:
    a = LayerRepository("org/act", layer_name="SiluAndMul", version=1, trust_remote_code=["org/act"])
    b = LayerRepository("org/act", layer_name="SiluAndMul", version=1, trust_remote_code=["org/act"])
    assert a == b and hash(a) == hash(b) and a.trust_remote_code == ("org/act",)
    assert a != LayerRepository("org/act", layer_name="SiluAndMul", version=2)
