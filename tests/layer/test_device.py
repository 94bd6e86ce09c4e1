"""Device types, capability ranges, capability detection and device inference (kernelize.layer.device)."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch
from torch import nn

from kernelize import CUDAProperties, Device, ROCMProperties
from kernelize.layer.device import (
    DeviceType,
    device_capability,
    device_type_of,
    infer_device,
    parse_device_type,
)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cpu", "cpu"),
        ("cuda", "cuda"),
        ("cuda:1", "cuda"),
        ("rocm", "rocm"),
        ("mps", "mps"),
        ("metal", "mps"),
        ("xpu", "xpu"),
        ("npu", "npu"),
        ("CUDA", "cuda"),
    ],
)
def test_device_types_and_metal_alias(name: str, expected: str) -> None:
    assert parse_device_type(name) == expected
    assert Device(name).type == expected


def test_unknown_device_type_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"Unsupported device type 'gpu'.*cpu, cuda, metal, mps"):
        Device("gpu")


def test_capability_ranges_validate_themselves() -> None:
    with pytest.raises(ValueError, match=r"min_capability \(90\) must be <= max_capability \(80\)"):
        CUDAProperties(min_capability=90, max_capability=80)
    with pytest.raises(TypeError, match="must be an int such as 86"):
        CUDAProperties(min_capability=7.5, max_capability=90)
    with pytest.raises(TypeError, match="must be an int"):
        ROCMProperties(min_capability=True, max_capability=90)
    with pytest.raises(ValueError, match=">= 0"):
        ROCMProperties(min_capability=-1, max_capability=90)
    assert CUDAProperties(80, 80).contains(80)  # inclusive, single point
    assert not CUDAProperties(80, 89).contains(90)


def test_properties_only_on_their_device_type() -> None:
    with pytest.raises(ValueError, match="CUDAProperties can only be used with a 'cuda' device, not 'rocm'"):
        Device("rocm", CUDAProperties(80, 90))
    with pytest.raises(ValueError, match="ROCMProperties can only be used with a 'rocm' device, not 'cuda'"):
        Device("cuda", ROCMProperties(80, 90))
    with pytest.raises(TypeError, match="must be CUDAProperties or ROCMProperties"):
        Device("cuda", (80, 90))


def test_devices_are_frozen_hashable_values() -> None:
    a = Device("cuda", CUDAProperties(75, 89))
    assert a == Device("cuda", CUDAProperties(min_capability=75, max_capability=89))
    assert len({a, Device("cuda", CUDAProperties(75, 89)), Device("cuda")}) == 2
    assert CUDAProperties(75, 89) != ROCMProperties(75, 89)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.type = "cpu"  # type: ignore[misc]
    assert str(Device("cuda", CUDAProperties(90, sys.maxsize))) == "cuda (capability 90..max)"


@pytest.mark.parametrize("raw, expected", [("90", 90), ("8.6", 86), (" 75 ", 75), ("12.0", 120)])
def test_capability_override(monkeypatch: pytest.MonkeyPatch, raw: str, expected: int) -> None:
    monkeypatch.setenv("KERNELIZE_CUDA_CAPABILITY", raw)
    monkeypatch.setenv("KERNELIZE_ROCM_CAPABILITY", raw)
    assert device_capability(DeviceType.CUDA) == expected
    assert device_capability(DeviceType.ROCM) == expected
    assert device_capability(DeviceType.CPU) is None  # no capabilities outside cuda/rocm


@pytest.mark.parametrize("raw", ["hopper", "-5", "+90", "8.-6", "-8.6", "0", "8.66", "9 0", "1e2"])
def test_bad_capability_override_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("KERNELIZE_CUDA_CAPABILITY", raw)
    with pytest.raises(ValueError, match=re.escape(f"KERNELIZE_CUDA_CAPABILITY={raw!r} is not a capability")):
        device_capability(DeviceType.CUDA)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour without a GPU")
def test_capability_detection_does_not_crash_without_a_gpu() -> None:
    # `kernels` 0.17.2 calls torch.cuda.get_device_capability() here and fails on a CPU-only torch.
    assert device_capability(DeviceType.CUDA) is None
    assert device_capability(DeviceType.ROCM) is None


def test_cuda_under_hip_is_rocm() -> None:
    assert device_type_of(torch.device("cuda", 0), hip_version="6.2.41133") == DeviceType.ROCM
    assert device_type_of(torch.device("cuda", 0), hip_version=None) == DeviceType.CUDA
    assert device_type_of(torch.device("cpu"), hip_version="6.2") == DeviceType.CPU


def test_infer_device_from_first_parameter() -> None:
    assert infer_device(nn.Sequential(nn.Linear(2, 2))) == (DeviceType.CPU, None)


def test_model_without_parameters_needs_a_device() -> None:
    with pytest.raises(
        ValueError, match=r"cannot infer the device of `ReLU`.*no parameters.*device=\"cuda\""
    ):
        infer_device(nn.ReLU())


def test_parameters_on_an_unsupported_device() -> None:
    with pytest.raises(ValueError, match=r"on device `meta`.*Pass device=\.\.\. explicitly"):
        infer_device(nn.Linear(2, 2, device="meta"))
