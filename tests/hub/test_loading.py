"""The bundled repositories load every way a user can load them, and their layers pass validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import kernelize
from kernelize import hub
from kernelize.layer.validate import ALLOWED_MEMBERS

HUB_DIR = Path(__file__).resolve().parents[2] / "hub_kernels"
LAYERS = [(repo, layer) for repo, names in hub.HUB_LAYERS.items() for layer in sorted(set(names.values()))]


@pytest.mark.parametrize("repo", list(hub.HUB_LAYERS))
def test_repository_layout(repo: str) -> None:
    """Hugging Face layout: metadata.json at the root and in the variant, package with a `layers` module."""
    root = HUB_DIR / repo
    meta = json.loads((root / "metadata.json").read_text())
    assert meta["name"] == repo.replace("_", "-") and meta["version"] == 1  # HF names use dashes
    variant = root / "build" / "torch-universal"
    assert json.loads((variant / "metadata.json").read_text()) == meta
    assert (variant / repo / "__init__.py").is_file() and (variant / repo / "layers.py").is_file()


@pytest.mark.parametrize("repo,layer", LAYERS)
def test_layer_follows_kernel_layer_rules(repo: str, layer: str) -> None:
    cls = kernelize.LayerRepository(f"kernelize/{repo}", layer_name=layer, version=1).load()
    assert issubclass(cls, nn.Module)
    own = set(vars(cls)) - {
        "__module__",
        "__qualname__",
        "__doc__",
        "__firstlineno__",
        "__static_attributes__",
        "__annotations__",
        "__dict__",
        "__weakref__",
    }
    assert own <= ALLOWED_MEMBERS, own - ALLOWED_MEMBERS
    assert "__init__" not in vars(cls)
    assert isinstance(cls.has_backward, bool) and isinstance(cls.can_torch_compile, bool)


@pytest.mark.parametrize("repo", list(hub.HUB_LAYERS))
def test_local_and_bundled_load_the_same_class(repo: str) -> None:
    layer = sorted(set(hub.HUB_LAYERS[repo].values()))[0]
    bundled = kernelize.LayerRepository(f"kernelize/{repo}", layer_name=layer, version=1).load()
    local = kernelize.LocalLayerRepository(HUB_DIR / repo, package_name=repo, layer_name=layer).load()
    assert bundled.__name__ == local.__name__ == layer
    assert bundled is local  # same package folder -> imported once


def test_hugging_face_kernels_loads_and_runs_them(monkeypatch) -> None:
    """The repositories are real Hugging Face kernel repositories: `kernels` itself loads them."""
    kernels = pytest.importorskip("kernels")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cls = kernels.LocalLayerRepository(repo_path=HUB_DIR / "activation", layer_name="SiluAndMul").load()
    assert cls.__name__ == "SiluAndMul"
    x = torch.randn(5, 32)
    with torch.no_grad():
        y = cls.forward(nn.Module(), x)
    torch.testing.assert_close(y, torch.nn.functional.silu(x[:, :16]) * x[:, 16:])


def test_hugging_face_kernels_kernelize_with_our_repo(monkeypatch) -> None:
    """A model marked with `kernels` and kernelized by `kernels` runs our generated RMSNorm kernel."""
    kernels = pytest.importorskip("kernels")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    @kernels.use_kernel_forward_from_hub("RMSNorm")
    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            xf = x.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    model = nn.Sequential(Norm())
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = model(x)
    mapping = {
        "RMSNorm": {
            "cpu": kernels.LocalLayerRepository(repo_path=HUB_DIR / "layer_norm", layer_name="RMSNorm")
        }
    }
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, device="cpu", mode=kernels.Mode.INFERENCE)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, want)
    assert hub.kernels_ran(model[0]).backend == "cpu"


def test_default_mapping_covers_the_common_names() -> None:
    mapping = hub.default_mapping()
    for name in (
        "RMSNorm",
        "SiluAndMul",
        "GeluAndMul",
        "LayerNorm",
        "FusedAddRMSNorm",
        "RotaryEmbedding",
        "ScaledMaskedSoftmax",
        "Linear",
        "LlamaMLP",
        "rotary_pos_emb",
    ):
        assert set(mapping[name]) == {"cpu", "cuda", "rocm"}, name
        repo = mapping[name]["cpu"]
        assert repo.repo_id.startswith("kernelize/")
        assert repo.load().__name__ == repo.layer_name


def test_default_mapping_kernelizes_the_demo_model() -> None:
    from kernelize.models.llama_demo import MARKED_LAYERS, LlamaDemo, LlamaDemoConfig

    model = LlamaDemo(LlamaDemoConfig.tiny()).eval()
    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=kernelize.Mode.INFERENCE)
    choices = kernelize.inspect(model)
    assert {c.layer_name for c in choices.values()} == set(MARKED_LAYERS.values())
    assert all(c.uses_kernel for c in choices.values()), [
        str(c) for c in choices.values() if not c.uses_kernel
    ]
