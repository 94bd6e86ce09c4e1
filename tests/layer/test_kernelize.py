"""kernelize(): substitution, revert, modes, conditions, function layers, logging and inspect."""

from __future__ import annotations

import copy
import logging
from types import MethodType

import pytest
import torch
from torch import nn

from kernelize import (
    FallbackReason,
    KernelizeFallback,
    LocalFuncRepository,
    LocalLayerRepository,
    Mode,
    inspect,
    kernelize,
    register_kernel_mapping,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub,
    use_kernel_mapping,
    use_kernelized_func,
)

from .models import (
    ACTIVATION,
    MLP,
    REPOS,
    RMSNorm,
    SiluAndMul,
    act,
    gated,
    kernel_calls,
    silu_and_mul_reference,
)

INF, TRAIN, TC, FB = Mode.INFERENCE, Mode.TRAINING, Mode.TORCH_COMPILE, Mode.FALLBACK


# --- substitution ------------------------------------------------------------------------------------------


def test_kernelize_replaces_forward_on_the_instance_only() -> None:
    model, untouched = gated(), gated()
    x = torch.randn(3, 4)
    expected = model(x)
    before = kernel_calls().get("SiluAndMul", 0)
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        assert kernelize(model, mode=INF) is model
    torch.testing.assert_close(model(x), expected)
    assert kernel_calls()["SiluAndMul"] == before + 1
    assert SiluAndMul.forward is not model[1].forward.__func__  # the instance runs the kernel layer's forward
    assert "forward" not in untouched[1].__dict__  # the class (and other instances) are untouched
    untouched(x)
    assert kernel_calls()["SiluAndMul"] == before + 1


def test_hooks_still_run() -> None:
    model = gated()
    seen = []
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    model[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model[1](x), silu_and_mul_reference(x * 2))
    assert seen == [torch.Size([2, 4])]


def test_kernel_layer_reads_the_state_of_the_replaced_module(repo_path) -> None:
    model = nn.Sequential(RMSNorm(4))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.randn(2, 4)
    expected = model(x)
    with use_kernel_mapping(
        {"RMSNorm": {"cpu": LocalLayerRepository(repo_path("layer_norm"), layer_name="RMSNorm")}}
    ):
        kernelize(model, mode=INF)
    assert inspect(model)["0"].kernel_layer == "RMSNorm"
    torch.testing.assert_close(model(x), expected)


def test_training_mode_kernel_has_gradients() -> None:
    model = gated()
    x = torch.randn(3, 4)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=TRAIN)
    model(x).sum().backward()
    for grad, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        torch.testing.assert_close(grad, want)


def test_deepcopy_binds_the_kernel_forward_to_the_copy() -> None:
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        model = kernelize(gated(), mode=INF)
    clone = copy.deepcopy(model)
    assert clone[1].forward.__self__ is clone[1]
    assert inspect(clone)["1"].uses_kernel


# --- revert ------------------------------------------------------------------------------------------------


def test_kernelize_again_without_a_mapping_restores_the_original_forward() -> None:
    model = gated()
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF)
    assert "forward" in model[1].__dict__
    with use_kernel_mapping({}, inherit_mapping=False):
        kernelize(model, mode=INF)
    assert "forward" not in model[1].__dict__
    assert inspect(model)["1"].fallback == FallbackReason.NO_LAYER
    before = kernel_calls().get("SiluAndMul", 0)
    model(torch.randn(1, 4))
    assert kernel_calls().get("SiluAndMul", 0) == before


def test_mode_change_reverts_a_kernel_that_no_longer_fits() -> None:
    model = gated()
    with use_kernel_mapping({"SiluAndMul": {"cpu": act("SiluAndMulNoBackward")}}):
        kernelize(model, mode=INF)
        assert inspect(model)["1"].uses_kernel
        kernelize(model, mode=TRAIN)
    assert "forward" not in model[1].__dict__
    assert inspect(model)["1"].fallback == FallbackReason.NO_COMPATIBLE_MODE


def test_an_instance_forward_set_by_the_user_is_restored() -> None:
    model = gated()

    def custom(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
        return input[..., :4]

    model[1].forward = MethodType(custom, model[1])
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF)
    assert model[1].forward.__func__ is not custom
    kernelize(model, mode=INF)  # no mapping outside the block
    assert model[1].forward.__func__ is custom

    def newer(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
        return input

    model[1].forward = MethodType(newer, model[1])  # replaced again after kernelize: that is the original now
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF)
    kernelize(model, mode=INF)
    assert model[1].forward.__func__ is newer


def test_a_failing_kernelize_leaves_the_module_as_it_was() -> None:
    model = gated()
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF)
    installed = model[1].forward
    with pytest.raises(ValueError), use_kernel_mapping({}, inherit_mapping=False):
        kernelize(model, mode=INF, use_fallback=False)
    assert model[1].forward is installed


@pytest.mark.parametrize("failure", ["no mapping", "invalid kernel layer", "cannot load"])
def test_kernelize_is_atomic_a_later_failure_leaves_every_module_as_it_was(failure: str, repo_path) -> None:
    """`act` (visited first) fits; `norm` (visited after it) fails: neither module may change."""
    model = MLP()
    x = torch.randn(3, 4)
    expected = model(x)
    norm_repo = LocalLayerRepository(repo_path("layer_norm"), layer_name="RMSNorm")
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}, "RMSNorm": {"cpu": norm_repo}}):
        kernelize(model, mode=INF)  # a first, successful kernelize: both modules run kernels
    before = {name: (dict(m.__dict__), m.forward) for name, m in model.named_modules()}
    choices = inspect(model)
    assert choices["act"].kernel_layer == "SiluAndMul" and choices["norm"].kernel_layer == "RMSNorm"
    bad_norm, error = {
        "no mapping": ({}, ValueError),
        "invalid kernel layer": (
            LocalLayerRepository(REPOS / "bad_layers", layer_name="WithInit"),
            TypeError,
        ),
        "cannot load": (LocalLayerRepository(REPOS / "broken", layer_name="RMSNorm"), Exception),
    }[failure]
    # A different kernel for `act` this time: it would be installed if kernelize swapped as it went.
    mapping = {"SiluAndMul": {"cpu": act("SiluAndMulEager")}}
    if bad_norm:
        mapping["RMSNorm"] = {"cpu": bad_norm}
    with (
        pytest.raises(error, match="norm|RMSNorm|broken"),
        use_kernel_mapping(mapping, inherit_mapping=False),
    ):
        kernelize(model, mode=INF, use_fallback=False)
    for name, module in model.named_modules():
        state, forward = before[name]
        assert module.__dict__ == state, name
        assert module.forward == forward, name
    assert inspect(model) == choices
    torch.testing.assert_close(model(x), expected)


# --- modes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, kernel_layer, registered",
    [
        (INF, "SiluAndMulNoBackward", INF),
        (TRAIN, "SiluAndMulEager", TRAIN),
        (INF | TC, "SiluAndMul", FB),  # the seed: INFERENCE/TRAINING kernels are not for torch.compile
        (TRAIN | TC, "SiluAndMul", FB),
    ],
)
def test_mode_specific_kernels(mode: Mode, kernel_layer: str, registered: Mode) -> None:
    mapping = {
        "SiluAndMul": {"cpu": {FB: act(), INF: act("SiluAndMulNoBackward"), TRAIN: act("SiluAndMulEager")}}
    }
    with use_kernel_mapping(mapping):
        model = kernelize(gated(), mode=mode)
    choice = inspect(model)["1"]
    assert (choice.kernel_layer, choice.registered_mode, choice.mode) == (kernel_layer, registered, mode)


def test_repository_without_modes_counts_as_fallback() -> None:
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        model = kernelize(gated(), mode=TRAIN | TC)
    assert inspect(model)["1"].registered_mode == FB


def test_a_training_kernel_serves_inference() -> None:
    with use_kernel_mapping({"SiluAndMul": {"cpu": {TRAIN: act()}}}):
        model = kernelize(gated(), mode=INF)
    assert inspect(model)["1"].registered_mode == TRAIN


def test_mislabelled_mapping_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="kernelize"),
        use_kernel_mapping({"SiluAndMul": {"cpu": {TRAIN: act("SiluAndMulNoBackward")}}}),
    ):
        model = kernelize(gated(), mode=INF)
    assert inspect(model)["1"].kernel_layer == "SiluAndMulNoBackward"  # fine for inference
    assert "for TRAINING, but that kernel layer has no backward" in caplog.text


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"mode": FB}, ValueError, "only be used to register"),
        ({"mode": TC}, ValueError, "must contain Mode.INFERENCE or Mode.TRAINING"),
        ({"mode": INF, "use_fallback": "yes"}, TypeError, "use_fallback must be a bool or KernelizeFallback"),
        ({"mode": INF, "device": 0}, TypeError, "device must be a string"),
        ({"mode": INF, "device": "gpu"}, ValueError, "Unsupported device type 'gpu'"),
    ],
)
def test_invalid_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        kernelize(gated(), **kwargs)


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        kernelize(lambda x: x, mode=INF)  # type: ignore[arg-type]


# --- conditions, disabling, functions -----------------------------------------------------------------------


@use_kernel_forward_from_hub("Switchable", condition=lambda module: module.enabled)
class Switchable(nn.Module):
    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.enabled = enabled

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_reference(input)


def test_condition_is_evaluated_per_instance() -> None:
    model = nn.Sequential(nn.Linear(4, 8), Switchable(True), Switchable(False))
    with use_kernel_mapping({"Switchable": {"cpu": act()}}):
        kernelize(model, mode=INF, use_fallback=False)  # a False condition never raises
        choices = inspect(model)
        assert choices["1"].uses_kernel
        assert choices["2"].fallback == FallbackReason.CONDITION
        model[1].enabled = False
        kernelize(model, mode=INF)
    assert "forward" not in model[1].__dict__  # reverted once the condition no longer holds


def test_disable_kernel_mapping_keeps_every_original_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = MLP()
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF)
        assert inspect(model)["act"].uses_kernel
        monkeypatch.setenv("DISABLE_KERNEL_MAPPING", "1")
        kernelize(model, mode=INF, use_fallback=False)
    assert {path: choice.fallback for path, choice in inspect(model).items()} == {
        "act": FallbackReason.DISABLED,
        "norm": FallbackReason.DISABLED,
    }
    assert "forward" not in model.act.__dict__


def test_function_layer_replaced_by_a_kernel_function() -> None:
    @use_kernel_func_from_hub("silu_and_mul")
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_reference(x)

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 8)
            self.silu_and_mul = silu_and_mul

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.silu_and_mul(self.linear(x))

    model = FeedForward()
    x = torch.randn(2, 4)
    expected = model(x)
    mapping = {"silu_and_mul": {"cpu": LocalFuncRepository(ACTIVATION, func_name="silu_and_mul")}}
    before = kernel_calls().get("silu_and_mul", 0)
    with use_kernel_mapping(mapping):
        kernelize(model, mode=INF)
    torch.testing.assert_close(model(x), expected)
    assert kernel_calls()["silu_and_mul"] == before + 1
    assert inspect(model)["silu_and_mul"].kernel_layer == "silu_and_mul"


def test_function_attached_with_use_kernelized_func() -> None:
    @use_kernel_forward_from_hub("SiluAndMul")
    def gate(x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_reference(x)

    @use_kernelized_func(gate)
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return gate(self.linear(x))

    model = nn.Sequential(Block())
    assert inspect(model)["0.gate"].fallback == FallbackReason.NOT_KERNELIZED
    before = kernel_calls().get("SiluAndMul", 0)
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF)
    model(torch.randn(2, 4))
    assert kernel_calls()["SiluAndMul"] == before + 1
    assert inspect(model)["0.gate"].kernel_layer == "SiluAndMul"


def test_stateless_layer_mapped_to_a_kernel_function() -> None:
    mapping = {"SiluAndMul": {"cpu": LocalFuncRepository(ACTIVATION, func_name="silu_and_mul")}}
    with use_kernel_mapping(mapping):
        model = kernelize(gated(), mode=INF)
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), model[1].__class__.forward(model[1], model[0](x)))
    assert inspect(model)["1"].kernel_layer == "silu_and_mul"


# --- logging and inspect -----------------------------------------------------------------------------------


def test_one_info_line_per_marked_module(caplog: pytest.LogCaptureFixture) -> None:
    register_kernel_mapping({"SiluAndMul": {"cpu": act()}})
    with caplog.at_level(logging.INFO, logger="kernelize"):
        kernelize(MLP(), mode=INF)
    records = [r for r in caplog.records if r.name.startswith("kernelize.layer.kernelize")]
    assert len(records) == 2 and all(r.levelno == logging.INFO for r in records)
    replaced, fallback = (r.getMessage() for r in records)
    assert replaced.startswith("`act` (SiluAndMul, layer `SiluAndMul`) -> kernel layer `SiluAndMul` from ")
    assert str(ACTIVATION) in replaced and "[device cpu, mode INFERENCE]" in replaced
    assert fallback == (
        "`norm` (RMSNorm, layer `RMSNorm`) keeps its original forward (no_layer): "
        "no kernel mapping for layer `RMSNorm` [device cpu, mode INFERENCE]"
    )


def test_loading_failures_are_logged_as_warnings(caplog: pytest.LogCaptureFixture) -> None:
    mapping = {"SiluAndMul": {"cpu": LocalLayerRepository(REPOS / "broken", layer_name="SiluAndMul")}}
    with caplog.at_level(logging.INFO, logger="kernelize"), use_kernel_mapping(mapping):
        kernelize(gated(), mode=INF, use_fallback=KernelizeFallback.ALL)
    (record,) = [r for r in caplog.records if r.name.startswith("kernelize.layer.kernelize")]
    assert record.levelno == logging.WARNING and "(cannot_load)" in record.getMessage()


def test_inspect_reports_every_marked_module() -> None:
    model = MLP()
    assert {p: c.fallback for p, c in inspect(model).items()} == {
        "act": FallbackReason.NOT_KERNELIZED,
        "norm": FallbackReason.NOT_KERNELIZED,
    }
    with use_kernel_mapping({"SiluAndMul": {"cpu": act()}}):
        kernelize(model, mode=INF | TC)
    choices = inspect(model)
    assert list(choices) == ["act", "norm"]
    act_choice = choices["act"]
    assert (act_choice.layer_name, act_choice.replaced_class, act_choice.kernel_layer) == (
        "SiluAndMul",
        "SiluAndMul",
        "SiluAndMul",
    )
    assert act_choice.repository == str(act()) and act_choice.mode == INF | TC and act_choice.fallback is None
    assert choices["norm"].fallback == FallbackReason.NO_LAYER and not choices["norm"].uses_kernel
