"""Build variant parsing and ranking (kernelize.layer.variants)."""

from __future__ import annotations

import platform

import pytest
import torch

from kernelize.layer.variants import (
    Backend,
    Decision,
    Framework,
    SystemInfo,
    format_decisions,
    parse_variant,
    rank_variants,
)

CPU_LINUX = SystemInfo((2, 13), True, Backend("cpu"), "x86_64", "linux")
CUDA_128 = SystemInfo((2, 13), True, Backend("cuda", (12, 8)), "x86_64", "linux")


@pytest.mark.parametrize(
    "text, backend",
    [
        ("cu128", Backend("cuda", (12, 8))),
        ("cu118", Backend("cuda", (11, 8))),
        ("rocm63", Backend("rocm", (6, 3))),
        ("xpu20251", Backend("xpu", (2025, 1))),
        ("cann81", Backend("cann", (8, 1))),
        ("cpu", Backend("cpu")),
        ("metal", Backend("metal")),
    ],
)
def test_backend_parse_and_round_trip(text: str, backend: Backend) -> None:
    assert Backend.parse(text) == backend
    assert backend.variant_str == text


def test_parse_variants() -> None:
    v = parse_variant("torch213-cxx11-cu128-x86_64-linux")
    assert (v.framework, v.version, v.cxx11_abi, v.backend, v.cpu, v.os) == (
        Framework.TORCH,
        (2, 13),
        True,
        Backend("cuda", (12, 8)),
        "x86_64",
        "linux",
    )
    assert parse_variant("torch29-cxx98-cpu-x86_64-linux").cxx11_abi is False
    assert parse_variant("torch210-cpu-aarch64-darwin").cxx11_abi is None
    stable = parse_variant("torch-stable-abi210-cu126-x86_64-linux")
    assert (stable.framework, stable.version, stable.backend) == (
        Framework.TORCH_STABLE_ABI,
        (2, 10),
        Backend("cuda", (12, 6)),
    )
    assert parse_variant("tvm-ffi01-cu128-x86_64-linux").framework == Framework.TVM_FFI
    assert parse_variant("torch-universal").noarch_backend == "universal"
    assert parse_variant("torch-cuda").framework == Framework.NOARCH


@pytest.mark.parametrize(
    "name",
    ["build", "torch", "torch213-cu128-x86_64", "torch213-cxx11-gpu9-x86_64-linux", "jax04-cpu-x86_64-linux"],
)
def test_invalid_variant_names(name: str) -> None:
    with pytest.raises(ValueError):
        parse_variant(name)


def test_rank_on_a_cpu_system_prefers_arch_builds_then_noarch() -> None:
    names = [
        "torch-universal",
        "torch-cpu",
        "torch-cuda",
        "torch213-cxx11-cpu-x86_64-linux",
        "torch213-cpu-x86_64-linux",
        "torch-stable-abi29-cpu-x86_64-linux",
        "torch-stable-abi210-cpu-x86_64-linux",
        "torch-stable-abi214-cpu-x86_64-linux",
        "torch212-cxx11-cpu-x86_64-linux",
        "torch213-cxx98-cpu-x86_64-linux",
        "torch213-cxx11-cpu-aarch64-linux",
        "torch213-cxx11-cpu-x86_64-darwin",
        "torch213-cxx11-cu128-x86_64-linux",
        "not-a-variant",
    ]
    accepted, decisions = rank_variants(names, CPU_LINUX)
    assert accepted == [
        "torch-stable-abi210-cpu-x86_64-linux",
        "torch-stable-abi29-cpu-x86_64-linux",
        "torch213-cpu-x86_64-linux",
        "torch213-cxx11-cpu-x86_64-linux",
        "torch-cpu",
        "torch-universal",
    ]
    reasons = {d.variant: d.reason for d in decisions if not d.accepted}
    assert reasons == {
        "torch-cuda": "backend (cuda) is neither this system's (cpu) nor universal",
        "torch-stable-abi214-cpu-x86_64-linux": "stable ABI 2.14 is newer than torch 2.13",
        "torch212-cxx11-cpu-x86_64-linux": "built for torch 2.12, this is torch 2.13",
        "torch213-cxx98-cpu-x86_64-linux": "C++11 ABI (False) does not match torch's (True)",
        "torch213-cxx11-cpu-aarch64-linux": "CPU (aarch64) does not match this system's CPU (x86_64)",
        "torch213-cxx11-cpu-x86_64-darwin": "OS (darwin) does not match this system's OS (linux)",
        "torch213-cxx11-cu128-x86_64-linux": "backend (cu128) does not match this system's (cpu)",
        "not-a-variant": "unknown framework in build variant 'not-a-variant'",
    }
    assert [d.variant for d in decisions[: len(accepted)]] == accepted  # accepted first, best first


def test_rank_on_a_cuda_system_accepts_older_minor_versions_of_the_same_major() -> None:
    names = [
        "torch213-cxx11-cu126-x86_64-linux",
        "torch213-cxx11-cu128-x86_64-linux",
        "torch213-cxx11-cu129-x86_64-linux",
        "torch213-cxx11-cu130-x86_64-linux",
        "torch213-cxx11-cpu-x86_64-linux",
        "torch-cuda",
        "torch-cpu",
        "torch-universal",
    ]
    accepted, decisions = rank_variants(names, CUDA_128)
    assert accepted == [
        "torch213-cxx11-cu128-x86_64-linux",
        "torch213-cxx11-cu126-x86_64-linux",
        "torch-cuda",
        "torch-universal",
    ]
    rejected = {d.variant for d in decisions if not d.accepted}
    assert rejected == {
        "torch213-cxx11-cu129-x86_64-linux",
        "torch213-cxx11-cu130-x86_64-linux",
        "torch213-cxx11-cpu-x86_64-linux",
        "torch-cpu",
    }


def test_ranking_is_deterministic() -> None:
    names = ["torch-universal", "torch-cpu", "torch213-cpu-x86_64-linux", "torch213-cxx11-cpu-x86_64-linux"]
    assert rank_variants(names, CPU_LINUX) == rank_variants(list(reversed(names)), CPU_LINUX)


def test_format_decisions() -> None:
    text = format_decisions(
        [Decision("torch-universal", True), Decision("torch-cuda", False, "wrong backend")]
    )
    assert text == "  - torch-universal: compatible\n  - torch-cuda: wrong backend"
    assert format_decisions([]) == "  (no build variants found)"


def test_detect_this_system() -> None:
    system = SystemInfo.detect()
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert system.torch_version == (major, minor)
    assert system.os == platform.system().lower()
    assert SystemInfo.detect("cpu").backend == Backend("cpu")
    assert str(SystemInfo.detect("cpu")).startswith(f"torch {major}.{minor}, cpu, ")


@pytest.mark.skipif(
    torch.version.cuda is not None and torch.cuda.is_available(),
    reason="a CUDA build of torch with a usable GPU supports the cuda backend",
)
def test_detect_rejects_a_backend_torch_was_not_built_for() -> None:
    with pytest.raises(ValueError, match="Backend 'cuda' is not available; this system supports 'cpu'"):
        SystemInfo.detect("cuda")


@pytest.mark.parametrize("gpu", [False, True])
def test_a_cuda_build_without_a_usable_gpu_selects_cpu_variants(monkeypatch, gpu: bool) -> None:
    """A CUDA wheel on a machine without a GPU (laptops, CI runners, containers): CPU and universal variants,
    with the reason in the report; with a GPU, the CUDA variants."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    system = SystemInfo.detect()
    if gpu:
        assert system.backend == Backend("cuda", (12, 8)) and system.note == ""
    else:
        assert system.backend == Backend("cpu")
        assert "cu128 build, but no GPU is usable" in str(system), str(system)
        ranked, _ = rank_variants(["torch-cuda", "torch-cpu", "torch-universal"], system)
        assert ranked == ["torch-cpu", "torch-universal"]
        with pytest.raises(ValueError, match="Backend 'cuda' is not available"):
            SystemInfo.detect("cuda")
