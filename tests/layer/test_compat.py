"""Compatibility with Hugging Face `kernels` 0.17.2, and the seed text's examples.

Each seed example is a function of the library module `k`, run once as `k = kernelize` and, where
`kernels` 0.17.2 can run it on this machine, once as `k = kernels`: switching is changing the import line.
Examples `kernels` cannot run here say why (and are run with kernelize only).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernelize
from kernelize.layer.variants import Backend, SystemInfo, parse_variant, rank_variants

from .conftest import REPOS

try:
    import kernels
    import kernels.layer.globals as kernels_globals
except ImportError:  # only installed for these tests
    kernels = None

needs_kernels = pytest.mark.skipif(kernels is None, reason="Hugging Face `kernels` is not installed")
LIBRARIES = ["kernelize"] + (["kernels"] if kernels is not None else [])
ACTIVATION = REPOS / "activation"


@pytest.fixture(params=LIBRARIES)
def k(request: pytest.FixtureRequest) -> ModuleType:
    """The library under test; `kernels` gets a private mapping (its default mapping dict is shared)."""
    module = importlib.import_module(request.param)
    if module is kernels:
        token = kernels_globals._KERNEL_MAPPING.set({})
        yield module
        kernels_globals._KERNEL_MAPPING.reset(token)
    else:
        yield module


@pytest.fixture
def ours() -> ModuleType:
    return kernelize


def kernel_module_of(module: nn.Module) -> str:
    """The module defining the forward now installed on `module`."""
    return module.forward.__func__.__module__


# --- loading the same repository through both libraries ----------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("repo, layer", [("activation", "SiluAndMul"), ("layer_norm", "RMSNorm")])
def test_same_repository_loads_through_both(repo: str, layer: str) -> None:
    theirs = kernels.LocalLayerRepository(REPOS / repo, layer_name=layer).load()
    mine = kernelize.LocalLayerRepository(REPOS / repo, layer_name=layer).load()
    assert theirs.__name__ == mine.__name__ == layer
    assert theirs is not mine  # two imports of the same code, under different module names
    assert (
        Path(sys.modules[theirs.__module__].__file__).read_text()
        == Path(sys.modules[mine.__module__].__file__).read_text()
    )


@needs_kernels
@pytest.mark.skipif(torch.cuda.is_available(), reason="a usable GPU fits the repository's CUDA variants")
def test_no_fitting_variant_is_a_file_not_found_error_in_both() -> None:
    """A repository of CUDA builds only, on a machine without a usable GPU. `kernels` goes by the torch build
    alone: a CUDA wheel without a GPU picks the CUDA variant, which fails on import; kernelize finds none."""
    theirs = FileNotFoundError if torch.version.cuda is None else ImportError
    with pytest.raises(theirs):
        kernels.get_local_kernel(REPOS / "cuda_only")
    with pytest.raises(FileNotFoundError):
        kernelize.get_local_kernel(REPOS / "cuda_only")


@needs_kernels
def test_marks_are_interchangeable() -> None:
    """Classes marked by either library are kernelized by either (transformers marks with `kernels`)."""

    def make(lib: ModuleType) -> type[nn.Module]:
        @lib.use_kernel_forward_from_hub("SiluAndMul")
        class SiluAndMul(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                d = x.shape[-1] // 2
                return F.silu(x[..., :d]) * x[..., d:]

        return SiluAndMul

    x = torch.randn(2, 8)
    token = kernels_globals._KERNEL_MAPPING.set({})
    try:
        for marker in (kernels, kernelize):
            for runner in (kernels, kernelize):
                model = nn.Sequential(nn.Linear(8, 8), make(marker)())
                mapping = {
                    "SiluAndMul": {"cpu": runner.LocalLayerRepository(ACTIVATION, layer_name="SiluAndMul")}
                }
                with runner.use_kernel_mapping(mapping, inherit_mapping=False):
                    runner.kernelize(model, mode=runner.Mode.INFERENCE)
                assert kernel_module_of(model[1]).endswith(".layers"), (marker.__name__, runner.__name__)
                torch.testing.assert_close(model[1](x), F.silu(x[..., :4]) * x[..., 4:])
    finally:
        kernels_globals._KERNEL_MAPPING.reset(token)


@needs_kernels
@pytest.mark.parametrize(
    "system",
    [
        SystemInfo((2, 13), True, Backend("cpu"), "x86_64", "linux"),
        SystemInfo((2, 13), True, Backend("cuda", (12, 8)), "x86_64", "linux"),
        SystemInfo((2, 9), None, Backend("metal"), "aarch64", "darwin"),
    ],
)
def test_variant_choice_matches_kernels(system: SystemInfo) -> None:
    from kernels import backends as kb
    from kernels import variants as kv
    from packaging.version import Version

    names = [
        "torch-universal",
        "torch-cpu",
        "torch-cuda",
        "torch-metal",
        "torch213-cxx11-cpu-x86_64-linux",
        "torch213-cpu-x86_64-linux",
        "torch-stable-abi29-cpu-x86_64-linux",
        "torch-stable-abi210-cu126-x86_64-linux",
        "torch212-cxx11-cpu-x86_64-linux",
        "torch213-cxx98-cpu-x86_64-linux",
        "torch213-cxx11-cu126-x86_64-linux",
        "torch213-cxx11-cu128-x86_64-linux",
        "torch213-cxx11-cu130-x86_64-linux",
        "torch29-metal-aarch64-darwin",
        "torch213-cxx11-cpu-aarch64-linux",
        "torch213-cxx11-rocm63-x86_64-linux",
    ]
    backend = {"cpu": kb.CPU(), "metal": kb.Metal()}.get(system.backend.name) or kb.CUDA(Version("12.8"))
    theirs, _ = kv._resolve_variant_for_system(
        variants=[kv.parse_variant(n) for n in names],
        selected_backend=backend,
        cpu=system.cpu,
        os=system.os,
        torch_version=Version("{}.{}".format(*system.torch_version)),
        torch_cxx11_abi=system.cxx11_abi,
        tvm_ffi_version=None,
        macos_version=Version("26.0"),
    )
    mine, _ = rank_variants(names, system)
    assert mine == [v.variant_str for v in theirs]
    assert parse_variant("torch213-cxx11-cu128-x86_64-linux").backend == Backend("cuda", (12, 8))


# --- the seed text's examples, with only the import line changed -------------------------------------------


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def seed_layers(k: ModuleType) -> tuple[type[nn.Module], nn.Module, type[nn.Module]]:
    """The seed's "Making a layer extensible" examples: a decorated class, an external class, a function."""

    @k.use_kernel_forward_from_hub("SiluAndMul")
    class SiluAndMul(nn.Module):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            d = input.shape[-1] // 2
            return F.silu(input[..., :d]) * input[..., d:]

    class ExternalSiluAndMul(nn.Module):  # "from somelibrary import SiluAndMul"
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return silu_and_mul_reference(input)

    k.replace_kernel_forward_from_hub(ExternalSiluAndMul, "SiluAndMul")

    @k.use_kernel_func_from_hub("silu_and_mul")
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    class FeedForward(nn.Module):
        def __init__(self, in_features: int, out_features: int) -> None:
            super().__init__()  # missing in the seed text: without it, both libraries fail on the next line
            self.linear = nn.Linear(in_features, out_features)
            # Note: silu_and_mul is a Torch module.
            self.silu_and_mul = silu_and_mul

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.silu_and_mul(self.linear(x))

    assert SiluAndMul.kernel_layer_name == ExternalSiluAndMul.kernel_layer_name == "SiluAndMul"
    return SiluAndMul, silu_and_mul, FeedForward


def test_seed_making_layers_extensible(k: ModuleType) -> None:
    SiluAndMul, silu_and_mul, FeedForward = seed_layers(k)
    assert isinstance(silu_and_mul, nn.Module)
    x = torch.randn(2, 8)
    torch.testing.assert_close(SiluAndMul()(x), silu_and_mul_reference(x))
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x))
    assert FeedForward(4, 8)(torch.randn(2, 4)).shape == (2, 4)


def test_seed_kernelizing_a_model(k: ModuleType) -> None:
    Mode, kernelize_ = k.Mode, k.kernelize
    _, _, FeedForward = seed_layers(k)
    model = FeedForward(4, 8)
    model = kernelize_(model, mode=Mode.INFERENCE)
    model = kernelize_(model, mode=Mode.TRAINING)
    model = kernelize_(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    model = kernelize_(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    model = kernelize_(model, device="cuda", mode=Mode.INFERENCE)
    assert isinstance(model, FeedForward)
    assert (
        "forward" not in model.silu_and_mul.__dict__
        or model.silu_and_mul.forward.__func__ is type(model.silu_and_mul).forward
    )  # no mapping: the original forward
    with pytest.raises(ValueError):
        kernelize_(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, use_fallback=False)


def seed_hub_mapping(k: ModuleType) -> dict:
    return {
        "SiluAndMul": {
            "cuda": k.LayerRepository(
                repo_id="kernels-community/activation", layer_name="SiluAndMul", version=1
            ),
            "rocm": k.LayerRepository(
                repo_id="kernels-community/activation", layer_name="SiluAndMul", version=1
            ),
        }
    }


def test_seed_registering_hub_kernels(k: ModuleType) -> None:
    Mode = k.Mode
    SiluAndMul, _, _ = seed_layers(k)
    model = nn.Sequential(nn.Linear(4, 8), SiluAndMul())  # on the CPU: the cuda/rocm kernels do not apply
    kernel_layer_mapping = seed_hub_mapping(k)
    k.register_kernel_mapping(kernel_layer_mapping)
    with k.use_kernel_mapping(kernel_layer_mapping):
        model = k.kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    kernel_layer_mapping = {
        "SiluAndMul": {
            "cuda": {
                Mode.INFERENCE: k.LayerRepository(
                    repo_id="kernels-community/activation-inference-optimized",
                    layer_name="SiluAndMul",
                    version=1,
                ),
                Mode.TRAINING | Mode.TORCH_COMPILE: k.LayerRepository(
                    repo_id="kernels-community/activation-training-optimized",
                    layer_name="SiluAndMul",
                    version=1,
                ),
            }
        }
    }
    with k.use_kernel_mapping(kernel_layer_mapping):
        model = k.kernelize(model, mode=Mode.INFERENCE)
    assert "forward" not in model[1].__dict__ or model[1].forward.__func__ is SiluAndMul.forward


def test_hub_repository_without_version_or_revision_raises_in_both(k: ModuleType) -> None:
    # `kernels` 0.17.2 requires revision= or version=; kernelize matches it (the seed's form omitted both).
    with pytest.raises(ValueError, match=r"(?i)either a revision or a version must be specified"):
        k.FuncRepository(repo_id="kernels-community/activation", func_name="silu_and_mul")
    with pytest.raises(ValueError, match=r"(?i)either a revision or a version must be specified"):
        k.LayerRepository(repo_id="kernels-community/activation", layer_name="SiluAndMul")


@pytest.fixture
def seed_repos_on_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's Hub repositories, served from the test repository by LOCAL_KERNELS (no network)."""
    names = [
        "activation",
        "activation-inference-optimized",
        "activation-training-optimized",
        "activation-hopper",
    ]
    monkeypatch.setenv("LOCAL_KERNELS", ":".join(f"kernels-community/{n}={ACTIVATION}" for n in names))


def test_seed_mode_specific_kernels(ours: ModuleType, seed_repos_on_disk: None) -> None:
    # Runs the kernels for device "cuda" on this CPU-only machine; `kernels` 0.17.2 cannot (it asks torch for
    # the CUDA capability and fails), kernelize treats the capability as unknown.
    k, Mode = ours, ours.Mode
    SiluAndMul, _, _ = seed_layers(k)
    kernel_layer_mapping = {
        "SiluAndMul": {
            "cuda": {
                Mode.FALLBACK: k.LayerRepository(
                    repo_id="kernels-community/activation", layer_name="SiluAndMul", version=1
                ),
                Mode.INFERENCE: k.LayerRepository(
                    repo_id="kernels-community/activation-inference-optimized",
                    layer_name="SiluAndMul",
                    version=1,
                ),
                Mode.TRAINING: k.LayerRepository(
                    repo_id="kernels-community/activation-training-optimized",
                    layer_name="SiluAndMul",
                    version=1,
                ),
            }
        }
    }
    chosen = {}
    with k.use_kernel_mapping(kernel_layer_mapping):
        for mode in (
            Mode.INFERENCE,
            Mode.TRAINING,
            Mode.INFERENCE | Mode.TORCH_COMPILE,
            Mode.TRAINING | Mode.TORCH_COMPILE,
        ):
            model = k.kernelize(nn.Sequential(nn.Linear(4, 8), SiluAndMul()), device="cuda", mode=mode)
            chosen[str(mode)] = k.inspect(model)["1"].repository.split("`")[1]
    assert chosen == {
        "INFERENCE": "kernels-community/activation-inference-optimized",
        "TRAINING": "kernels-community/activation-training-optimized",
        # The seed: "both ... will use the Mode.FALLBACK kernel".
        "INFERENCE | TORCH_COMPILE": "kernels-community/activation",
        "TRAINING | TORCH_COMPILE": "kernels-community/activation",
    }


@pytest.mark.parametrize(
    "capability, repo",
    [
        ("75", "activation"),
        ("86", "activation"),
        ("89", "activation"),
        ("90", "activation-hopper"),
        ("74", None),
    ],
)
def test_seed_cuda_capabilities(
    ours: ModuleType,
    seed_repos_on_disk: None,
    monkeypatch: pytest.MonkeyPatch,
    capability: str,
    repo: str | None,
) -> None:
    # kernelize only: `kernels` 0.17.2 needs a real GPU to read the capability.
    k = ours
    monkeypatch.setenv("KERNELIZE_CUDA_CAPABILITY", capability)
    SiluAndMul, _, _ = seed_layers(k)
    kernel_layer_mapping = {
        "SiluAndMul": {
            k.Device(
                type="cuda", properties=k.CUDAProperties(min_capability=75, max_capability=89)
            ): k.LayerRepository(repo_id="kernels-community/activation", layer_name="SiluAndMul", version=1),
            k.Device(
                type="cuda", properties=k.CUDAProperties(min_capability=90, max_capability=sys.maxsize)
            ): k.LayerRepository(
                repo_id="kernels-community/activation-hopper", layer_name="SiluAndMul", version=1
            ),
        }
    }
    with k.use_kernel_mapping(kernel_layer_mapping):
        model = k.kernelize(
            nn.Sequential(nn.Linear(4, 8), SiluAndMul()), device="cuda", mode=k.Mode.INFERENCE
        )
    choice = k.inspect(model)["1"]
    assert (choice.repository.split("`")[1] if choice.uses_kernel else None) == (
        None if repo is None else f"kernels-community/{repo}"
    )


def test_seed_local_repositories_in_the_seeds_form(ours: ModuleType, repo_path) -> None:
    # The seed's LocalLayerRepository/LocalFuncRepository take package_name=; `kernels` 0.17.2 no longer does.
    k, Mode = ours, ours.Mode
    SiluAndMul, silu_and_mul, FeedForward = seed_layers(k)
    linear = nn.Sequential(nn.Linear(4, 8), SiluAndMul())
    with k.use_kernel_mapping(
        {
            "SiluAndMul": {
                "cuda": k.LocalLayerRepository(
                    repo_path=repo_path("activation"), package_name="activation", layer_name="SiluAndMul"
                )
            }
        },
        inherit_mapping=False,
    ):
        k.kernelize(linear, mode=Mode.INFERENCE, device="cuda")
    model = FeedForward(4, 8)
    with k.use_kernel_mapping(
        {
            "silu_and_mul": {
                "cuda": k.LocalFuncRepository(
                    repo_path=repo_path("activation"), package_name="activation", func_name="silu_and_mul"
                )
            }
        },
        inherit_mapping=False,
    ):
        k.kernelize(model, mode=Mode.INFERENCE, device="cuda")
    assert k.inspect(linear)["1"].kernel_layer == "SiluAndMul"
    assert k.inspect(model)["silu_and_mul"].kernel_layer == "silu_and_mul"
    k.kernelize(model, mode=Mode.INFERENCE, device="cuda")  # revert: silu_and_mul is a process-wide singleton


def test_local_repositories_in_the_newer_form_run_the_kernel(k: ModuleType, repo_path) -> None:
    Mode = k.Mode
    SiluAndMul, silu_and_mul, FeedForward = seed_layers(k)
    linear = nn.Sequential(nn.Linear(4, 8), SiluAndMul())
    model = FeedForward(4, 8)
    mapping = {
        "SiluAndMul": {
            "cpu": k.LocalLayerRepository(repo_path=repo_path("activation"), layer_name="SiluAndMul")
        },
        "silu_and_mul": {
            "cpu": k.LocalFuncRepository(repo_path=repo_path("activation"), func_name="silu_and_mul")
        },
    }
    x = torch.randn(3, 4)
    expected = (linear(x), model(x))
    with k.use_kernel_mapping(mapping, inherit_mapping=False):
        k.kernelize(linear, mode=Mode.INFERENCE)
        k.kernelize(model, mode=Mode.INFERENCE)
    assert kernel_module_of(linear[1]).endswith(".layers")
    assert model.silu_and_mul.forward.__func__ is not type(model.silu_and_mul).forward  # the kernel's wrapper
    torch.testing.assert_close((linear(x), model(x)), expected)
