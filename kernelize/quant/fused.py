"""Packed projections merged the way the float kernel layers merge theirs: q|k|v as one packed call, gate|up
as one call with ``act(gate) * up`` in the kernel's epilogue.

The hub's attention and MLP layers (``kernelize/llm``'s ``CausalSelfAttention``, ``kernelize/activation``'s
``GatedMLP`` / ``FusedGatedMLP``) call these when the module's projections are
:class:`~kernelize.quant.module.QuantizedLinear`. The rows of a packed weight run along K, so merging rows of
several projections is a byte concatenation along dim 0 (and of int8's row scales and the biases):
:func:`kernelize.merge.merged_parameter` builds the merged buffer once and turns each projection's
``qweight`` / ``qscales`` / ``bias`` into a view of it, so ``state_dict()`` is unchanged, merging costs no
memory, and a buffer replaced later (``load_state_dict``, ``set_packed``) is merged again on the next call.
A decode step then quantizes the activation row once per merged call instead of once per projection.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from kernelize.quant.module import QuantizedLinear
    >>> mlp = nn.Module()
    >>> mlp.gate_proj, mlp.up_proj = QuantizedLinear(64, 8, "q8_0", False), QuantizedLinear(64, 8, "q8_0", False)
    >>> merged_packed(mlp, ("gate_proj", "up_proj"))[0].shape
    (16, 64)
"""  # noqa: E501

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernelize.merge import merged_parameter
from kernelize.quant import kernels
from kernelize.quant.formats import PackedWeight, get_format
from kernelize.quant.module import QuantizedLinear
from kernelize.quant.ops import FEW_ROWS, linear

# a gated activation's name -> its torch math (prefill, where the product is not in the kernel's epilogue)
GLU_MATH = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "gelu_new": lambda g: F.gelu(g, approximate="tanh"),
}
assert set(GLU_MATH) == set(kernels.GLU_ACTS)


def is_packed(*modules: nn.Module) -> bool:
    """True when any of ``modules`` is a :class:`QuantizedLinear` (the layer takes the packed path)."""
    return any(isinstance(m, QuantizedLinear) for m in modules)


_CACHE = "_kernelize_packed"  # on the owner: {names: (the parts' buffers' addresses, the merged weight)}


def _addresses(mods: list[nn.Module]) -> tuple[int, ...]:
    """Where the parts' buffers start: replacing one (load_state_dict, set_packed) moves it."""
    out = []
    for m in mods:
        b = m._buffers
        out += [
            id(m),
            b["qweight"].data_ptr(),
            b["qscales"].data_ptr(),
            0 if m.bias is None else m.bias.data_ptr(),
        ]
    return tuple(out)


def merged_packed(
    owner: nn.Module, names: tuple[str, ...]
) -> tuple[PackedWeight, torch.Tensor | None] | None:
    """``owner``'s packed projections ``names`` as one packed weight (rows in ``names``' order) and the merged
    f32 bias (None: none has one; one name: that projection's own), or None when they cannot be merged (not
    all packed in one format and input size, or some but not all with a bias). Built once and kept while
    the parts' buffers stay where the merge put them (a decode step pays one address check)."""
    mods = [owner._modules.get(n) for n in names]
    if not all(isinstance(m, QuantizedLinear) for m in mods):
        return None
    if len(mods) == 1:  # already one projection (Phi-3's qkv_proj, gate_up_proj)
        return mods[0].packed, mods[0].bias
    cache = owner.__dict__.setdefault(_CACHE, {})
    hit = cache.get(names)
    if hit is not None and hit[0] == _addresses(mods):
        return hit[1]
    if len({(m.format, m.in_features) for m in mods}) != 1:
        return None
    has_bias = {m.bias is not None for m in mods}
    if len(has_bias) != 1:
        return None
    f = get_format(mods[0].format)
    data = merged_parameter(owner, names, "qweight")
    scales = merged_parameter(owner, names, "qscales") if f.scale_per == "row" else None
    bias = merged_parameter(owner, names, "bias") if has_bias == {True} else None
    merged = PackedWeight(data, f, (data.shape[0], mods[0].in_features), scales), bias
    cache[names] = (_addresses(mods), merged)
    return merged


def glu(x: torch.Tensor, packed: PackedWeight, act: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ gate.T) * (x @ up.T)`` for a merged gate|up packed weight ``[2I, K]`` (gate rows first):
    decode rows as one kernel call with the product in its epilogue; prefill as the packed matmul, then
    the activation in torch. ``act``: a :data:`GLU_MATH` name."""
    n, k = packed.shape
    if x.device.type != "cpu" or x.numel() // k > FEW_ROWS:
        gate, up = linear(x, packed, bias).chunk(2, dim=-1)
        return GLU_MATH[act](gate) * up
    x2 = x.reshape(-1, k).contiguous()
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    out = torch.empty(x2.shape[0], n // 2, dtype=x2.dtype)
    b = None if bias is None else bias.detach().float().contiguous()
    kernels.gemv(x2, packed, b, out, act)
    return out.reshape(*x.shape[:-1], n // 2).to(x.dtype)


def packed_mlp(owner: nn.Module, x: torch.Tensor, gate_up: tuple[str, ...], act: str) -> torch.Tensor | None:
    """``down_proj(act(gate) * up)`` of a packed gated MLP (``gate_up``: the merged projections' names, one
    for a fused ``gate_up_proj``), or None when its projections cannot be merged."""
    merged = merged_packed(owner, gate_up)
    if merged is None or act not in GLU_MATH:
        return None
    return owner.down_proj(glu(x, merged[0], act, merged[1]))


__all__ = ["GLU_MATH", "glu", "is_packed", "merged_packed", "packed_mlp"]
