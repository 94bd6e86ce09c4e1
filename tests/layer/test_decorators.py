"""Marking layers and functions (kernelize.layer.decorators)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernelize import (
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub,
    use_kernelized_func,
)


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_decorator_only_sets_attributes() -> None:
    forward = Plain.forward

    @use_kernel_forward_from_hub("Marked")
    class Marked(Plain):
        pass

    assert Marked.kernel_layer_name == "Marked"
    assert Marked.kernel_condition is None
    assert Marked.forward is forward  # forward untouched
    x = torch.randn(2, 4)
    assert torch.equal(Marked()(x), x)
    assert "forward" not in Marked().__dict__


def test_condition_is_not_bound_to_the_instance() -> None:
    @use_kernel_forward_from_hub("Conditional", condition=lambda module: module.size > 2)
    class Conditional(nn.Module):
        def __init__(self, size: int) -> None:
            super().__init__()
            self.size = size

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    # Read through the class or an instance, the condition takes the module as its only argument.
    assert Conditional.kernel_condition(Conditional(4)) is True
    assert Conditional(1).kernel_condition(Conditional(1)) is False


def test_replace_kernel_forward_marks_an_external_class() -> None:
    class External(nn.Module):  # stands in for a class from a library you do not own
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    assert replace_kernel_forward_from_hub(External, "External") is External
    assert External.kernel_layer_name == "External"


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: use_kernel_forward_from_hub("")(Plain), TypeError, "layer name must be a non-empty string"),
        (
            lambda: use_kernel_forward_from_hub("X")(42),
            TypeError,
            "applies to nn.Module classes or functions",
        ),
        (
            lambda: use_kernel_forward_from_hub("X")(int),
            TypeError,
            r"needs an nn.Module subclass, got <class 'int'>",
        ),
        (lambda: replace_kernel_forward_from_hub(Plain, "X", condition=1), TypeError, "must be callable"),
    ],
)
def test_marking_errors(call: Callable[[], object], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call()


@use_kernel_func_from_hub("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gated SiLU."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def test_function_becomes_a_singleton_module_with_its_signature() -> None:
    assert isinstance(silu_and_mul, nn.Module)
    assert type(silu_and_mul).kernel_layer_name == "silu_and_mul"
    x = torch.randn(3, 8)
    torch.testing.assert_close(silu_and_mul(x), reference_silu_and_mul(x))
    forward_signature = inspect.signature(type(silu_and_mul).forward)
    assert list(forward_signature.parameters) == ["self", "x"]
    assert (
        forward_signature.return_annotation == inspect.signature(silu_and_mul.__wrapped__).return_annotation
    )
    assert inspect.signature(silu_and_mul) == inspect.signature(silu_and_mul.__wrapped__)  # the function's
    assert silu_and_mul.__name__ == "silu_and_mul"
    assert silu_and_mul.__doc__ == "Gated SiLU."
    assert list(silu_and_mul.parameters()) == []


def test_function_module_is_a_submodule_of_its_owner() -> None:
    class FeedForward(nn.Module):  # the seed's example (plus the super().__init__() it forgot)
        def __init__(self, in_features: int, out_features: int) -> None:
            super().__init__()
            self.linear = nn.Linear(in_features, out_features)
            self.silu_and_mul = silu_and_mul

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.silu_and_mul(self.linear(x))

    a, b = FeedForward(4, 8), FeedForward(4, 8)
    assert dict(a.named_modules())["silu_and_mul"] is dict(b.named_modules())["silu_and_mul"] is silu_and_mul
    assert a(torch.randn(2, 4)).shape == (2, 4)


def test_function_flags_carry_over() -> None:
    def fast(x: torch.Tensor) -> torch.Tensor:
        return x

    fast.can_torch_compile = True
    fast.has_backward = False
    module = use_kernel_func_from_hub("fast")(fast)
    assert type(module).can_torch_compile is True and type(module).has_backward is False
    plain = use_kernel_func_from_hub("plain")(lambda x: x)
    assert type(plain).can_torch_compile is False and type(plain).has_backward is True


def test_positional_only_function() -> None:
    def add(x: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
        return x + y

    module = use_kernel_forward_from_hub("add")(add)
    assert [p.kind.name for p in inspect.signature(type(module).forward).parameters.values()] == [
        "POSITIONAL_ONLY",
        "POSITIONAL_ONLY",
        "POSITIONAL_ONLY",
    ]
    assert torch.equal(module(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))


def test_use_kernelized_func_attaches_functions_outside_the_module_tree() -> None:
    @use_kernel_forward_from_hub("Identity")
    def identity(x: torch.Tensor) -> torch.Tensor:
        return x

    @use_kernelized_func(identity, silu_and_mul)
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return identity(self.linear(x))

    block = Block()
    assert block._kernel_funcs == {"identity": identity, "silu_and_mul": silu_and_mul}
    assert [name for name, _ in block.named_modules()] == ["", "linear"]
    assert set(block.state_dict()) == {"linear.weight", "linear.bias"}
    assert Block.__init__.__name__ == "__init__"


def test_use_kernelized_func_rejects_unmarked_functions() -> None:
    def unmarked(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match="`'unmarked'` is not decorated with @use_kernel_forward_from_hub"):
        use_kernelized_func(unmarked)
