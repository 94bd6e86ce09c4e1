"""Mark layers (and functions) whose forward `kernelize` may replace.

Marking only sets class attributes (`kernel_layer_name`, `kernel_condition`), the same ones Hugging Face
`kernels` sets, so a model marked with either library can be kernelized by either. A marked function becomes
a singleton `nn.Module` whose forward calls the function and carries its signature.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from inspect import Parameter
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "Condition",
    "function_layer",
    "function_layer_class",
    "replace_kernel_forward_from_hub",
    "use_kernel_forward_from_hub",
    "use_kernel_func_from_hub",
    "use_kernelized_func",
]

Condition = Callable[["nn.Module"], bool]
_C = TypeVar("_C", bound=type)


def _check_name(layer_name: object, what: str) -> None:
    if not isinstance(layer_name, str) or not layer_name:
        raise TypeError(f"{what}: the layer name must be a non-empty string, got {layer_name!r}.")


def replace_kernel_forward_from_hub(cls: _C, layer_name: str, condition: Condition | None = None) -> _C:
    """Mark an existing layer class (e.g. from a library you do not own) as replaceable.

    Prefer the decorator on classes you own: it signals that the maintainer keeps `forward` compatible.

    Args:
        cls: An `nn.Module` subclass.
        layer_name: The name kernel mappings use for this layer.
        condition: Called with each instance at `kernelize` time; `False` keeps that instance's forward.

    Example:
        >>> import torch.nn as nn
        >>> _ = replace_kernel_forward_from_hub(nn.SiLU, "SiLU")
        >>> nn.SiLU.kernel_layer_name
        'SiLU'
    """
    from torch import nn

    _check_name(layer_name, "replace_kernel_forward_from_hub")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(
            f"replace_kernel_forward_from_hub('{layer_name}') needs an nn.Module subclass, got {cls!r}."
        )
    if condition is not None and not callable(condition):
        raise TypeError(f"The condition for layer `{layer_name}` must be callable, got {condition!r}.")
    cls.kernel_layer_name = layer_name
    # staticmethod: read through an instance, the condition must not be bound as a method.
    cls.kernel_condition = None if condition is None else staticmethod(condition)
    return cls


def use_kernel_forward_from_hub(layer_name: str, condition: Condition | None = None) -> Callable[[Any], Any]:
    """Class decorator marking a layer as replaceable; `forward` itself is not touched.

    Applied to a function instead, it returns a singleton module wrapping the function (see
    `use_kernel_func_from_hub`).

    Example:
        >>> import torch, torch.nn as nn, torch.nn.functional as F
        >>> @use_kernel_forward_from_hub("SiluAndMul")
        ... class SiluAndMul(nn.Module):
        ...     def forward(self, input: torch.Tensor) -> torch.Tensor:
        ...         d = input.shape[-1] // 2
        ...         return F.silu(input[..., :d]) * input[..., d:]
        >>> SiluAndMul.kernel_layer_name
        'SiluAndMul'
    """
    _check_name(layer_name, "use_kernel_forward_from_hub")

    def decorator(target: Any) -> Any:
        if inspect.isfunction(target):
            return function_layer(target, layer_name, condition)
        if isinstance(target, type):
            return replace_kernel_forward_from_hub(target, layer_name, condition)
        raise TypeError(
            f"@use_kernel_forward_from_hub('{layer_name}') applies to nn.Module classes or functions, "
            f"got {target!r}."
        )

    return decorator


def use_kernel_func_from_hub(func_name: str) -> Callable[[Any], Any]:
    """Turn a function into a replaceable singleton `nn.Module` whose forward calls it.

    The module's forward has the function's signature (after `self`); `inspect.signature(module)` is the
    function's. `kernelize` only sees it when it is reachable from the model: as a submodule attribute, or
    attached with `use_kernelized_func`.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> @use_kernel_func_from_hub("silu_and_mul")
        ... def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        ...     d = x.shape[-1] // 2
        ...     return F.silu(x[..., :d]) * x[..., d:]
        >>> isinstance(silu_and_mul, torch.nn.Module), list(inspect.signature(silu_and_mul).parameters)
        (True, ['x'])
    """
    return use_kernel_forward_from_hub(func_name)


def function_layer_class(func: Callable[..., Any]) -> type[nn.Module]:
    """An `nn.Module` class whose forward calls `func`, with `func`'s signature after `self`.

    `can_torch_compile` / `has_backward` attributes of the function carry over to the class.
    """
    from torch import nn

    name = getattr(func, "__name__", type(func).__name__)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # builtins without a signature: keep (self, *args, **kwargs)
        signature = None
    if signature is not None:
        params = list(signature.parameters.values())
        positional_only = any(p.kind is Parameter.POSITIONAL_ONLY for p in params)
        self_kind = Parameter.POSITIONAL_ONLY if positional_only else Parameter.POSITIONAL_OR_KEYWORD
        forward.__signature__ = signature.replace(parameters=[Parameter("self", self_kind), *params])
    forward.__qualname__ = f"{name}.forward"
    forward.__doc__ = func.__doc__
    namespace = {
        "forward": forward,
        "can_torch_compile": getattr(func, "can_torch_compile", False),
        "has_backward": getattr(func, "has_backward", True),
        "__doc__": func.__doc__,
        "__module__": getattr(func, "__module__", __name__),
        "__qualname__": name,
    }
    return type(name, (nn.Module,), namespace)


def function_layer(
    func: Callable[..., Any], layer_name: str, condition: Condition | None = None
) -> nn.Module:
    """The singleton module for a marked function (see `use_kernel_func_from_hub`)."""
    cls = replace_kernel_forward_from_hub(function_layer_class(func), layer_name, condition)
    instance = cls()
    # __name__, __doc__, __wrapped__ (so inspect.signature(instance) is the function's), ...
    functools.update_wrapper(instance, func, updated=())
    return instance


def _func_key(fn: Any) -> str:
    return getattr(fn, "__name__", None) or fn.kernel_layer_name


def use_kernelized_func(*funcs: Any) -> Callable[[_C], _C]:
    """Class decorator attaching marked functions to each instance so `kernelize` sees them.

    The functions are stored in the instance's `_kernel_funcs` (not as submodules: they do not appear in
    `named_modules()` or the state dict), as Hugging Face `kernels` does.

    Example:
        >>> import torch, torch.nn as nn
        >>> @use_kernel_forward_from_hub("Identity")
        ... def identity(x: torch.Tensor) -> torch.Tensor:
        ...     return x
        >>> @use_kernelized_func(identity)
        ... class Block(nn.Module):
        ...     def forward(self, x):
        ...         return identity(x)
        >>> list(Block()._kernel_funcs)
        ['identity']
    """
    for fn in funcs:
        if not hasattr(fn, "kernel_layer_name"):
            raise ValueError(
                f"`{getattr(fn, '__name__', fn)!r}` is not decorated with @use_kernel_forward_from_hub or "
                "@use_kernel_func_from_hub, so it cannot be used with @use_kernelized_func."
            )

    def decorator(cls: _C) -> _C:
        original_init = cls.__init__

        @functools.wraps(original_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            hidden = self.__dict__.setdefault("_kernel_funcs", {})
            for fn in funcs:
                hidden[_func_key(fn)] = fn

        cls.__init__ = __init__
        return cls

    return decorator
