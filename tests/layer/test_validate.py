"""Validation of kernel layers against the layers they replace (kernelize.layer.validate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kernelize import LocalLayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping
from kernelize.layer.validate import validate_kernel_layer

BAD = Path(__file__).parent / "repos" / "bad_layers"
ACTIVATION = Path(__file__).parent / "repos" / "activation"


@use_kernel_forward_from_hub("Gate")
class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@use_kernel_forward_from_hub("Add")
class Add(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


@pytest.mark.parametrize(
    "layer, message",
    [
        ("NotAModule", "it is not an nn.Module subclass."),
        ("WithInit", "it defines __init__. Kernel layers run with the replaced module as `self`"),
        (
            "WithHelper",
            "it defines helper; a kernel layer may only define can_torch_compile, forward, has_backward",
        ),
        ("WithOverride", "it defines extra_repr;"),
        ("NoForward", "it does not define forward."),
        ("ForwardNotAFunction", "its forward is 3, not a function. Define it as `def forward(self, ...)`."),
        ("StaticForward", "its forward is <staticmethod(<built-in method relu"),
        ("TwoInputs", "forward takes 3 parameters but the replaced forward takes 2"),
        (
            "KeywordOnly",
            "forward parameter `x` is keyword-only but `x` of the replaced forward is positional or keyword",
        ),
    ],
)
def test_invalid_kernel_layers_name_repo_layer_and_replaced_class(layer: str, message: str) -> None:
    repo = LocalLayerRepository(BAD, layer_name=layer)
    model = nn.Sequential(nn.Linear(2, 2), Gate())
    with pytest.raises(TypeError) as info, use_kernel_mapping({"Gate": {"cpu": repo}}):
        kernelize(model, mode=Mode.INFERENCE)
    text = str(info.value)
    assert text.startswith(f"Kernel layer `{layer}` from `{BAD}`, layer `{layer}` cannot replace `Gate`: ")
    assert message in text
    assert "forward" not in model[1].__dict__  # nothing was replaced


def test_signature_mismatch_shows_both_signatures() -> None:
    repo = LocalLayerRepository(BAD, layer_name="TwoInputs")
    with pytest.raises(TypeError) as info:
        validate_kernel_layer(repo.load(), Gate, repo)
    assert (
        "(kernel forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor vs forward(self, x: "
        in str(info.value)
    )


def test_inherited_kernel_members_are_allowed() -> None:
    repo = LocalLayerRepository(BAD, layer_name="Subclassed")
    validate_kernel_layer(repo.load(), Gate, repo)  # forward and can_torch_compile come from its kernel base


def test_validation_runs_for_every_replaced_class() -> None:
    """One kernel layer, two marked classes: fine for the first does not make it fine for the second.

    (`kernels` 0.17.2 memoises validation per repository, so the second class would slip through.)
    """
    repo = LocalLayerRepository(ACTIVATION, layer_name="SiluAndMul")
    model = nn.Sequential(nn.Linear(2, 2), Gate(), Add())
    with use_kernel_mapping({"Gate": {"cpu": repo}, "Add": {"cpu": repo}}):
        with pytest.raises(
            TypeError, match="`SiluAndMul` .*cannot replace `Add`: forward takes 2 parameters"
        ):
            kernelize(model, mode=Mode.INFERENCE)
        assert "forward" not in model[1].__dict__  # Gate, fine on its own, is untouched: kernelize is atomic


def test_incompatible_fallback_keeps_the_class_eager_with_the_reason() -> None:
    """`KernelizeFallback.INCOMPATIBLE` (the one call passes it): the class the layer cannot replace keeps
    its forward, the reason in `inspect`; the class it fits is replaced."""
    from kernelize import KernelizeFallback, inspect
    from kernelize.layer.record import FallbackReason

    repo = LocalLayerRepository(ACTIVATION, layer_name="SiluAndMul")
    model = nn.Sequential(nn.Linear(2, 2), Gate(), Add())
    with use_kernel_mapping({"Gate": {"cpu": repo}, "Add": {"cpu": repo}}):
        kernelize(
            model,
            mode=Mode.INFERENCE,
            use_fallback=KernelizeFallback.DEFAULT | KernelizeFallback.INCOMPATIBLE,
        )
    choices = inspect(model)
    assert (
        choices["2"].fallback == FallbackReason.INCOMPATIBLE
        and "forward takes 2 parameters" in choices["2"].reason
    )
    assert "forward" not in model[2].__dict__
    assert choices["1"].uses_kernel and "forward" in model[1].__dict__
