"""kernelize(): each fallback case and its KernelizeFallback flag; devices and capability ranges."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from kernelize import (
    CUDAProperties,
    Device,
    FallbackReason,
    KernelizeFallback,
    LocalLayerRepository,
    Mode,
    ROCMProperties,
    inspect,
    kernelize,
    use_kernel_mapping,
)

from .models import REPOS, SiluAndMul, act, gated

INF, TRAIN, TC = Mode.INFERENCE, Mode.TRAINING, Mode.TORCH_COMPILE


# --- fallbacks ---------------------------------------------------------------------------------------------

SCENARIOS = {
    "no layer": ({}, {}, {}, KernelizeFallback.NO_LAYER),
    "no device": ({"SiluAndMul": {"cuda": act()}}, {}, {}, KernelizeFallback.NO_DEVICE),
    "no compatible properties": (
        {"SiluAndMul": {Device("cuda", CUDAProperties(75, 89)): act()}},
        {"device": "cuda"},
        {"KERNELIZE_CUDA_CAPABILITY": "70"},
        KernelizeFallback.NO_COMPATIBLE_PROPERTIES,
    ),
    "no mode in the chain": (
        {"SiluAndMul": {"cpu": {INF: act()}}},
        {"mode": TRAIN},
        {},
        KernelizeFallback.NO_COMPATIBLE_MODE,
    ),
    "kernel without backward": (
        {"SiluAndMul": {"cpu": act("SiluAndMulNoBackward")}},
        {"mode": TRAIN},
        {},
        KernelizeFallback.NO_COMPATIBLE_MODE,
    ),
    "kernel without torch.compile": (
        {"SiluAndMul": {"cpu": act("SiluAndMulEager")}},
        {"mode": INF | TC},
        {},
        KernelizeFallback.NO_COMPATIBLE_MODE,
    ),
    "import fails": (
        {"SiluAndMul": {"cpu": LocalLayerRepository(REPOS / "broken", layer_name="SiluAndMul")}},
        {},
        {},
        KernelizeFallback.CANNOT_LOAD,
    ),
    "no build for this system": (
        {"SiluAndMul": {"cpu": LocalLayerRepository(REPOS / "cuda_only", layer_name="SiluAndMul")}},
        {},
        {},
        KernelizeFallback.CANNOT_LOAD,
    ),
    "layer missing from repository": (
        {"SiluAndMul": {"cpu": act("Missing")}},
        {},
        {},
        KernelizeFallback.CANNOT_LOAD,
    ),
}


def run_scenario(name: str, monkeypatch: pytest.MonkeyPatch, use_fallback: object) -> nn.Sequential:
    mapping, kwargs, env, _ = SCENARIOS[name]
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    model = gated()
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, **{"mode": INF, **kwargs, "use_fallback": use_fallback})
    return model


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fallback_permitted_by_its_flag(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    flag = SCENARIOS[name][3]
    for use_fallback in (flag, KernelizeFallback.ALL):
        model = run_scenario(name, monkeypatch, use_fallback)
        choice = inspect(model)["1"]
        assert "forward" not in model[1].__dict__
        assert choice.fallback == FallbackReason[flag.name]
        assert choice.reason


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fallback_refused_without_its_flag(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    flag = SCENARIOS[name][3]
    for use_fallback in (False, KernelizeFallback.NONE, KernelizeFallback.ALL & ~flag):
        if flag == KernelizeFallback.CANNOT_LOAD:  # the loading error itself, with a note naming the module
            with pytest.raises(Exception) as info:
                run_scenario(name, monkeypatch, use_fallback)
            notes = "\n".join(getattr(info.value, "__notes__", []))
            assert "while loading" in notes and "for `1` (layer `SiluAndMul`" in notes
            assert "KernelizeFallback.ALL" in notes
        else:
            with pytest.raises(ValueError) as info:
                run_scenario(name, monkeypatch, use_fallback)
            message = str(info.value)
            assert "`1` (SiluAndMul, layer `SiluAndMul`)" in message
            assert "on device " in message and " in mode " in message
            assert f"use_fallback=KernelizeFallback.{flag.name}" in message


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_default_fallback_is_everything_but_loading_errors(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if SCENARIOS[name][3] == KernelizeFallback.CANNOT_LOAD:
        with pytest.raises((ImportError, FileNotFoundError, ValueError)):
            run_scenario(name, monkeypatch, True)
    else:
        assert "forward" not in run_scenario(name, monkeypatch, True)[1].__dict__


def test_fallback_messages_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    reasons = {
        name: inspect(run_scenario(name, monkeypatch, KernelizeFallback.ALL))["1"].reason
        for name in SCENARIOS
    }
    assert reasons["no layer"] == "no kernel mapping for layer `SiluAndMul`"
    assert reasons["no device"] == "kernels are registered for cuda, not cpu"
    assert (
        reasons["no compatible properties"]
        == "no registered capability range (75..89) contains capability 70"
    )
    assert reasons["no mode in the chain"] == (
        "no kernel registered for the mode chain TRAINING -> TRAINING | TORCH_COMPILE -> FALLBACK "
        "(registered: INFERENCE)"
    )
    assert (
        "has no backward (has_backward = False), which Mode.TRAINING needs"
        in reasons["kernel without backward"]
    )
    assert "does not declare can_torch_compile = True" in reasons["kernel without torch.compile"]
    assert "kernelize_test_missing_dependency" in reasons["import fails"]
    assert "torch-cuda: backend (cuda) is neither this system's" in reasons["no build for this system"]
    assert "Layer `Missing` not found" in reasons["layer missing from repository"]
    assert "SiluAndMulNoBackward" in reasons["layer missing from repository"]  # lists what exists


# --- devices and capabilities ------------------------------------------------------------------------------


def test_model_without_parameters_needs_a_device() -> None:
    model = nn.Sequential(SiluAndMul())
    with pytest.raises(ValueError, match="has no parameters.*device="):
        kernelize(model, mode=INF)
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF, device="cpu")
        assert inspect(model)["0"].uses_kernel
        kernelize(model, mode=INF, device=torch.device("cpu"))
        assert inspect(model)["0"].device == "cpu"


def test_metal_alias_and_explicit_device() -> None:
    with use_kernel_mapping({"SiluAndMul": {"metal": act()}}):
        model = kernelize(gated(), mode=INF, device="mps")
    assert inspect(model)["1"].uses_kernel and inspect(model)["1"].device == "mps"


CAPABILITY_MAPPING = {
    "SiluAndMul": {
        Device("cuda", CUDAProperties(75, 89)): act("SiluAndMulEager"),
        Device("cuda", CUDAProperties(80, 89)): act("SiluAndMulNoBackward"),
        Device("cuda", CUDAProperties(90, sys.maxsize)): act("SiluAndMul"),
    }
}


@pytest.mark.parametrize(
    "capability, kernel_layer",
    [
        ("75", "SiluAndMulEager"),
        ("79", "SiluAndMulEager"),
        ("8.0", "SiluAndMulNoBackward"),
        ("86", "SiluAndMulNoBackward"),
        ("89", "SiluAndMulNoBackward"),
        ("90", "SiluAndMul"),
        ("120", "SiluAndMul"),
        ("70", None),
    ],
)
def test_capability_selects_the_smallest_range(
    capability: str, kernel_layer: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELIZE_CUDA_CAPABILITY", capability)
    with use_kernel_mapping(CAPABILITY_MAPPING):
        model = kernelize(gated(), mode=INF, device="cuda")
    choice = inspect(model)["1"]
    assert choice.kernel_layer == kernel_layer
    assert choice.device.startswith("cuda (")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour without a GPU")
def test_unknown_capability_uses_only_unrestricted_kernels() -> None:
    with use_kernel_mapping(CAPABILITY_MAPPING):
        model = kernelize(gated(), mode=INF, device="cuda")
    choice = inspect(model)["1"]
    assert choice.fallback == FallbackReason.NO_COMPATIBLE_PROPERTIES
    assert "capability is unknown" in choice.reason and "KERNELIZE_CUDA_CAPABILITY" in choice.reason
    with use_kernel_mapping({"SiluAndMul": {"cuda": act()}}):
        assert inspect(kernelize(model, mode=INF, device="cuda"))["1"].uses_kernel


def test_rocm_capabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    mapping = {
        "SiluAndMul": {
            Device("rocm", ROCMProperties(90, 94)): act("SiluAndMulEager"),
            Device("rocm", ROCMProperties(95, 95)): act("SiluAndMul"),
        }
    }
    monkeypatch.setenv("KERNELIZE_ROCM_CAPABILITY", "9.4")
    with use_kernel_mapping(mapping):
        assert inspect(kernelize(gated(), mode=INF, device="rocm"))["1"].kernel_layer == "SiluAndMulEager"
        monkeypatch.setenv("KERNELIZE_ROCM_CAPABILITY", "95")
        assert inspect(kernelize(gated(), mode=INF, device="rocm"))["1"].kernel_layer == "SiluAndMul"
