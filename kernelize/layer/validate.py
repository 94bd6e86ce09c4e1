"""Check that a kernel layer can stand in for the forward of a marked layer.

A kernel layer's `forward` runs with the replaced module as `self`, so the kernel layer must be stateless:
an `nn.Module` subclass with no constructor and no members beyond `forward`, `can_torch_compile` and
`has_backward`, whose `forward` takes the same number and kinds of parameters as the forward it replaces.
The check runs for every replaced class (a kernel layer fine for one class may not fit another).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ALLOWED_MEMBERS", "validate_kernel_layer"]

ALLOWED_MEMBERS = frozenset({"forward", "can_torch_compile", "has_backward"})
# Entries Python (or typing) puts in every class namespace; they are not members the author wrote.
_CLASS_BOOKKEEPING = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__annotations__",
        "__annotate__",
        "__annotate_func__",
        "__annotations_cache__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
        "__type_params__",
        "__classcell__",
    }
)


def _name(cls: object) -> str:
    return getattr(cls, "__qualname__", None) or repr(cls)


def _own_members(layer: type) -> set[str]:
    """Names defined by `layer` and its bases below `nn.Module`."""
    from torch import nn

    members: set[str] = set()
    for klass in layer.__mro__:
        if klass in nn.Module.__mro__:
            continue
        members |= set(vars(klass)) - _CLASS_BOOKKEEPING
    return members


def validate_kernel_layer(layer: object, replaced: type[nn.Module], repo: object) -> None:
    """Raise `TypeError` (naming the repository, the kernel layer and the replaced class) unless `layer` fits.

    Example:
        >>> import torch.nn as nn
        >>> class Replaced(nn.Module):
        ...     def forward(self, x): return x
        >>> class Kernel(nn.Module):
        ...     def forward(self, x): return x
        >>> validate_kernel_layer(Kernel, Replaced, "org/repo")
        >>> class Stateful(nn.Module):
        ...     def __init__(self): super().__init__()
        ...     def forward(self, x): return x
        >>> validate_kernel_layer(Stateful, Replaced, "org/repo")
        Traceback (most recent call last):
        ...
        TypeError: Kernel layer `Stateful` from org/repo cannot replace `Replaced`: it defines __init__. ...
    """
    from torch import nn

    where = f"Kernel layer `{_name(layer)}` from {repo} cannot replace `{_name(replaced)}`"
    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        raise TypeError(f"{where}: it is not an nn.Module subclass.")
    members = _own_members(layer)
    if "__init__" in members:
        raise TypeError(
            f"{where}: it defines __init__. Kernel layers run with the replaced module as `self`, so they "
            "must be stateless: remove the constructor and read state from the replaced module's attributes."
        )
    extra = sorted(members - ALLOWED_MEMBERS)
    if extra:
        raise TypeError(
            f"{where}: it defines {', '.join(extra)}; a kernel layer may only define "
            f"{', '.join(sorted(ALLOWED_MEMBERS))}. Move helpers to module-level functions."
        )
    if "forward" not in members:
        raise TypeError(f"{where}: it does not define forward.")
    forward = inspect.getattr_static(layer, "forward")
    if not inspect.isfunction(forward):  # kernelize binds it to the replaced module as a method
        raise TypeError(
            f"{where}: its forward is {forward!r}, not a function. Define it as `def forward(self, ...)`."
        )
    signature, ref_signature = inspect.signature(layer.forward), inspect.signature(replaced.forward)
    params, ref_params = list(signature.parameters.values()), list(ref_signature.parameters.values())
    signatures = f"kernel forward{signature} vs forward{ref_signature}"
    if len(params) != len(ref_params):
        raise TypeError(
            f"{where}: forward takes {len(params)} parameters but the replaced forward takes "
            f"{len(ref_params)} ({signatures})."
        )
    for param, ref in zip(params, ref_params, strict=True):
        if param.kind != ref.kind:
            raise TypeError(
                f"{where}: forward parameter `{param.name}` is {param.kind.description} but `{ref.name}` "
                f"of the replaced forward is {ref.kind.description} ({signatures})."
            )
