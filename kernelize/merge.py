"""Projection merging: several linear layers that read the same input as one weight (q|k|v, gate|up);
and :func:`linear_layout`: a weight stored ``(in, out)`` (``Conv1D``) re-laid once as ``nn.Linear``'s.

A decode step reads every weight once; reading gate and up as one ``(2I, K)`` weight lets one few-row
kernel compute both and fuse ``act(gate) * up`` (see :mod:`kernelize.codegen.cpu_gemv`), instead of two
matmuls and a pass over their outputs. :func:`merged_parameter` builds the merged tensor once (on the kernel
layer's first call: kernel layers stay stateless, with no hook of their own at kernelize time) and turns
the original parameters into views of it, so merging costs no memory:

* ``state_dict()`` keys and values are unchanged (the views are the parameters), and the parameter
  objects stay the same objects (an optimizer built before kernelize still holds them);
* ``load_state_dict`` copies into the parameters, i.e. into the merged storage, so the kernels read the
  loaded values at once; anything that *replaces* a parameter's tensor (``load_state_dict(assign=True)``,
  ``model.to(dtype)``, ``param.data = ...``) is noticed on the next call (the views' addresses no longer
  match) and the weight is merged again from the new tensors;
* DTensor parameters (tensor parallelism, see :mod:`kernelize.shards`): each rank merges its local shards,
  and the tensors the DTensors hold become the views.

Example:
    >>> mlp = torch.nn.Module(); mlp.gate = torch.nn.Linear(8, 4, bias=False); mlp.up = torch.nn.Linear(8, 4, bias=False)
    >>> w = merged_parameter(mlp, ("gate", "up"))
    >>> w.shape, mlp.gate.weight.data_ptr() == w.data_ptr()
    (torch.Size([8, 8]), True)
"""  # noqa: E501

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kernelize.shards import local

__all__ = ["linear_layout", "merge_cost_bytes", "merged_parameter"]

logger = logging.getLogger(__name__)

_ATTR = "_kernelize_merged"  # on the owner module: {(names, attr): _Merged}


@dataclass(frozen=True)
class _Merged:
    tensor: torch.Tensor
    ptrs: tuple[int, ...]  # where each original parameter's data must start for the views to be intact
    shapes: tuple[torch.Size, ...]


def _parts(owner: nn.Module, names: Sequence[str], attr: str) -> list[torch.Tensor]:
    parts = []
    for name in names:
        sub = getattr(owner, name, None)
        t = local(getattr(sub, attr, None)) if sub is not None else None  # a DTensor: this rank's shard
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"merged_parameter: `{type(owner).__name__}.{name}` has no tensor `{attr}`; merge only "
                f"linear layers that all have a `{attr}`."
            )
        parts.append(t)
    if len({(p.dtype, p.device, tuple(p.shape[1:])) for p in parts}) != 1:
        raise ValueError(
            f"merged_parameter: {', '.join(f'{type(owner).__name__}.{n}.{attr}' for n in names)} differ in "
            f"dtype, device or trailing shape ({[(p.dtype, p.device, tuple(p.shape)) for p in parts]}); "
            "only projections of the same input in one dtype can be merged."
        )
    return parts


def _intact(m: _Merged, parts: Sequence[torch.Tensor]) -> bool:
    return all(
        p.data_ptr() == ptr and p.shape == shape and p.dtype == m.tensor.dtype and p.device == m.tensor.device
        for p, ptr, shape in zip(parts, m.ptrs, m.shapes)
    )


def merged_parameter(owner: nn.Module, names: Sequence[str], attr: str = "weight") -> torch.Tensor:
    """The ``attr`` tensors of ``owner``'s submodules ``names`` concatenated along dim 0, as one tensor
    whose row slices *are* the submodules' parameters (made so on the first call, checked on every call).

    Args:
        owner: the module holding the projections (e.g. a ``LlamaMLP``).
        names: submodule names in merge order (e.g. ``("gate_proj", "up_proj")``).
        attr: the parameter to merge (``"weight"`` or ``"bias"``).

    Raises:
        ValueError: a submodule lacks ``attr``, or the parts differ in dtype, device or trailing shape.
    """
    parts = _parts(owner, names, attr)
    key = (tuple(names), attr)
    cache = owner.__dict__.setdefault(_ATTR, {})
    m = cache.get(key)
    if m is not None and (torch.compiler.is_compiling() or _intact(m, parts)):
        return m.tensor
    return _merge_disabled()(owner, parts, key, names, attr)


def _merge(owner: nn.Module, parts: Sequence[torch.Tensor], key: tuple, names: Sequence[str], attr: str):
    with torch.no_grad():
        merged = torch.cat([p.detach() for p in parts], 0)
        ptrs, start = [], 0
        for p in parts:
            view = merged[start : start + p.shape[0]]
            p.data = view  # the same Parameter object, now a view of the merged storage
            ptrs.append(view.data_ptr())
            start += p.shape[0]
    owner.__dict__[_ATTR][key] = _Merged(merged, tuple(ptrs), tuple(p.shape for p in parts))
    logger.info(
        "Merged %s of %s.{%s} into one %s tensor %s (the parameters are now views of it)",
        attr,
        type(owner).__name__,
        ",".join(names),
        str(merged.dtype).removeprefix("torch."),
        tuple(merged.shape),
    )
    return merged


@functools.cache
def _merge_disabled():
    """`_merge` outside any torch.compile graph (it rebinds parameters), made on first use."""
    return torch.compiler.disable(_merge)


def merge_cost_bytes(owner: nn.Module) -> int:
    """Extra bytes the merged tensors of ``owner`` hold beyond its parameters (0 while views are intact)."""
    extra = 0
    for (names, attr), m in owner.__dict__.get(_ATTR, {}).items():
        parts = [local(getattr(getattr(owner, n), attr)) for n in names]
        if not _intact(m, parts):
            extra += m.tensor.numel() * m.tensor.element_size()
    return extra


def linear_layout(weight: torch.Tensor) -> torch.Tensor | None:
    """A weight stored ``(in, out)`` (transformers' ``Conv1D``) as an ``(out, in)`` row-major tensor that is
    the parameter's own memory, or None where it cannot be (a DTensor, a view of a larger storage such as a
    merged or tied weight, which re-laying would unshare; the caller then reads ``(in, out)`` as it is).

    On the first call the parameter's data is re-laid in place of the old (``weight.data =`` its
    transpose made contiguous, transposed back: the same shape, values and Parameter object, column-major
    in memory), so it costs no memory once the old storage is freed; later calls check ``weight.t()`` is
    contiguous and return it. ``nn.Linear``'s ``(out, in)`` is the layout the kernels read fastest: each
    output is a contiguous dot product over K in the few-row kernel (the ``(in, out)`` axpy form, GPT-2
    medium's projections, 2 threads: ~63% of a ``sum``'s bandwidth), and larger calls go to oneDNN with the
    bias and activation fused instead of MKL plus an epilogue pass. ``state_dict()`` values are unchanged
    (``save_pretrained`` writes them contiguous); ``Conv1D``'s own forward (``addmm``) reads either layout.

    Example:
        >>> p = torch.nn.Parameter(torch.randn(8, 4))
        >>> w = linear_layout(p)
        >>> w.shape, w.is_contiguous(), torch.equal(w, p.t()), w.data_ptr() == p.data_ptr()
        (torch.Size([4, 8]), True, True, True)
    """
    t = weight.t()
    if t.is_contiguous():
        return t
    data = weight.data
    if type(data) is not torch.Tensor or not _owns_storage(data) or torch.compiler.is_compiling():
        return None
    return _relay_disabled()(weight)


def _owns_storage(t: torch.Tensor) -> bool:
    """``t`` is contiguous and spans its whole storage (not a slice of a merged or shared tensor)."""
    return t.dim() == 2 and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _relay(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        weight.data = weight.data.t().contiguous().t()
    logger.info("Re-laid a %s weight %s as (out, in) in memory", type(weight).__name__, tuple(weight.shape))
    return weight.t()


@functools.cache
def _relay_disabled():
    """`_relay` outside any torch.compile graph (it rebinds the parameter's data), made on first use."""
    return torch.compiler.disable(_relay)
