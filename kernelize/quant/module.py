"""``QuantizedLinear``: an ``nn.Linear`` whose weight stays packed, and ``quantize_model`` to swap them in.

The module holds the packed bytes as a uint8 buffer (``qweight``), int8's row scales (``qscales``, empty
for the GGUF formats) and the format's name as extra state, so ``state_dict()`` / ``load_state_dict()``
round-trip through a fresh module of any format and shape. The float weight is not kept.

Example:
    >>> import torch
    >>> q = QuantizedLinear.from_linear(torch.nn.Linear(64, 16), "q4_0")
    >>> q.qweight.shape, q.format
    (torch.Size([16, 36]), 'q4_0')
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernelize.quant.formats import PackedWeight, apply_keeping_f32, get_format, quantize
from kernelize.quant.ops import linear

logger = logging.getLogger(__name__)


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed (:mod:`kernelize.quant.formats`); forward is
    :func:`kernelize.quant.ops.linear` (CPU: float32 / bfloat16 inputs; CUDA after ``.to("cuda")``: float16
    too; output in the input's dtype).

    Example:
        >>> q = QuantizedLinear(32, 4, "q8_0")
        >>> sorted(q.state_dict())
        ['_extra_state', 'bias', 'qscales', 'qweight']
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "q8_0", bias: bool = True) -> None:
        super().__init__()
        f = get_format(fmt)
        if in_features % f.block_size:
            raise ValueError(
                f"QuantizedLinear: in_features = {in_features} is not a multiple of {f.name}'s block of "
                f"{f.block_size}; pad the layer or leave it unquantized"
            )
        self.in_features, self.out_features, self.format = in_features, out_features, f.name
        self.register_buffer(
            "qweight", torch.zeros(out_features, f.row_bytes(in_features), dtype=torch.uint8)
        )
        rows = out_features if f.scale_per == "row" else 0
        self.register_buffer("qscales", torch.zeros(rows, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Module, fmt: str = "q8_0") -> QuantizedLinear:
        """``lin`` (an ``nn.Linear``, or transformers' ``Conv1D``, whose weight is stored ``(in, out)``)
        quantized to ``fmt`` (its bias kept as f32); ``lin`` itself is left as it was."""
        weight = linear_weight(lin)
        if weight is None:
            kind = type(lin).__name__
            raise TypeError(f"QuantizedLinear.from_linear: expected an nn.Linear or a Conv1D, got {kind}")
        q = cls(weight.shape[1], weight.shape[0], fmt, bias=lin.bias is not None)
        q.set_packed(quantize(weight.detach(), fmt))
        if lin.bias is not None:
            q.bias.data = lin.bias.detach().float().clone()
        return q.train(lin.training)  # an eval model's layers stay in eval mode

    def set_packed(self, packed: PackedWeight) -> None:
        """Take ``packed``'s bytes and scales (its format and shape must be this module's)."""
        assert packed.format.name == self.format and packed.shape == (self.out_features, self.in_features)
        self.qweight = packed.data.contiguous()
        self.qscales = packed.scales if packed.scales is not None else torch.zeros(0)

    @property
    def packed(self) -> PackedWeight:
        """The weight as a :class:`PackedWeight` (a view of the buffers; made once while they stay put)."""
        qweight, qscales = self._buffers["qweight"], self._buffers["qscales"]
        key = (id(qweight), qweight.data_ptr(), id(qscales), qscales.data_ptr(), self.format)
        held = self.__dict__.get("_packed")
        if held is None or held[0] != key:
            scales = qscales if qscales.numel() else None
            shape = (self.out_features, self.in_features)
            held = self.__dict__["_packed"] = (
                key,
                PackedWeight(qweight, get_format(self.format), shape, scales),
            )
        return held[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias)

    def get_extra_state(self) -> dict[str, Any]:
        return {"format": self.format, "in_features": self.in_features, "out_features": self.out_features}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.format = get_format(state["format"]).name
        self.in_features, self.out_features = state["in_features"], state["out_features"]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001
        # a fresh module may have another format or shape: take the stored buffers' shapes first
        for name in ("qweight", "qscales"):
            src = state_dict.get(prefix + name)
            if src is not None:
                setattr(self, name, torch.empty_like(src))
        bias = state_dict.get(prefix + "bias")
        if bias is not None and self.bias is not None:
            self.bias = nn.Parameter(torch.empty_like(bias, dtype=torch.float32), requires_grad=False)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        return apply_keeping_f32(self, ("qscales", "bias"), super()._apply, fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The ``(out, in)`` weight of an ``nn.Linear`` or of transformers' ``Conv1D`` (``y = x @ W + b``, its
    weight stored ``(in, out)``: the same layer transposed), None for any other module."""
    if isinstance(module, nn.Linear):
        return module.weight
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.t()
    return None


def _own_forward(module: nn.Module) -> bool:
    """Whether ``module`` (an ``nn.Linear`` or a ``Conv1D``) computes something else than its product: a
    forward set on the instance, or a subclass's forward (Phi-MoE's router returns its logits, weights and
    choices) that a probe on a random input finds is not ``x @ W.T + b`` (Falcon's ``FalconLinear``, a
    matmul and an add, is)."""
    if "forward" in module.__dict__:
        return True
    if not isinstance(module, nn.Linear) or type(module).forward is nn.Linear.forward:
        return False
    weight = module.weight
    x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.no_grad():
        try:
            out = module(x)
        except Exception:  # a forward that wants other inputs (DeepSeek-V4's grouped o_proj): not a linear's
            return True
        want = nn.functional.linear(x, weight, module.bias)
    if not isinstance(out, torch.Tensor) or out.shape != want.shape or out.dtype != want.dtype:
        return True
    tol = 1e-2 if weight.dtype in (torch.float16, torch.bfloat16) else 1e-4
    return not torch.allclose(out.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()) + 1e-6)


# what a model's own code does with a child's float weight that a packed layer (which has none) cannot serve:
# reads its dtype or device (DeepSeek-V3.2's indexer casts its input to `weights_proj.weight.dtype`, Mamba's
# head to `lm_head.weight.dtype`) or changes it in place (RWKV rescales `output.weight` in eval mode)
_WEIGHT_USE = re.compile(r"\.(\w+)\.weight(?:\.(?:dtype|device)\b|(?:\.data)?\.[a-z_]+_\(|\.data\b)")


def _weights_used(model: nn.Module) -> set[str]:
    """The child names (``lm_head``, ``weights_proj``) whose ``.weight`` the methods of ``model``'s module
    classes (their initialisers aside) use as :data:`_WEIGHT_USE` says."""
    import inspect

    names: set[str] = set()
    for cls in {type(m) for m in model.modules()}:
        for attr, fn in vars(cls).items():
            if "init" in attr or not inspect.isfunction(fn):
                continue
            try:
                names.update(_WEIGHT_USE.findall(inspect.getsource(fn)))
            except (OSError, TypeError):  # no source
                continue
    return names


@dataclass
class QuantizeSummary:
    """What :func:`quantize_model` did: the layers replaced and skipped, and the weights' bytes before and
    after (the float weights of the replaced layers against their packed bytes and scales)."""

    replaced: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0


def quantize_model(model: nn.Module, fmt: str = "q8_0", skip: Sequence[str] = ()) -> QuantizeSummary:
    """Replace every ``nn.Linear`` of ``model`` (in place; the LM head included), and every transformers
    ``Conv1D`` (GPT-2's projections), by a :class:`QuantizedLinear` of format ``fmt``, and every transformers
    experts module of a mixture-of-experts model by a :class:`~kernelize.quant.experts.QuantizedExperts`.
    Embeddings and other modules stay float.

    Args:
        model: the model (its linear layers on the CPU).
        fmt: ``"q8_0"``, ``"q4_0"``, ``"q5_0"``, ``"q4_k"``, ``"q6_k"`` or ``"int8"``.
        skip: qualified names (or their last component, e.g. ``"lm_head"``) of layers to leave as they are.

    Returns:
        A :class:`QuantizeSummary`; layers whose input size is not a multiple of the
        format's block (32; 256 for the k-quants) are skipped and named.

    Example:
        >>> m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> s = quantize_model(m, "q8_0")
        >>> s.replaced, s.bytes_before, s.bytes_after
        (['0', '2'], 18944, 5032)
    """
    f = get_format(fmt)
    summary = QuantizeSummary()
    _quantize_experts(model, f.name, skip, summary)
    used = _weights_used(model)
    for name, mod in list(model.named_modules()):
        weight = linear_weight(mod)
        if weight is None:
            continue
        if name in skip or name.rsplit(".", 1)[-1] in skip:
            summary.skipped[name] = "skipped by name"
            continue
        if _own_forward(mod):  # a router that returns scores and choices: a QuantizedLinear would not
            summary.skipped[name] = f"{type(mod).__name__} has a forward of its own, not a linear layer's"
            continue
        parent, _, leaf = name.rpartition(".")
        if leaf in used:
            summary.skipped[name] = f"the model's code uses {leaf}.weight itself (a packed layer has none)"
            continue
        if weight.shape[1] % f.block_size:
            summary.skipped[name] = f"in_features {weight.shape[1]} is not a multiple of {f.block_size}"
            continue
        q = QuantizedLinear.from_linear(mod, f.name)
        setattr(model.get_submodule(parent) if parent else model, leaf, q)
        summary.replaced.append(name)
        summary.bytes_before += weight.numel() * weight.element_size()
        summary.bytes_after += q.packed.nbytes
        logger.debug("quantize_model: %s -> QuantizedLinear(%s)", name, f.name)
    logger.info(
        "quantize_model: %d linear layers -> %s (%d skipped), weights %.1f MB -> %.1f MB",
        len(summary.replaced), f.name, len(summary.skipped), summary.bytes_before / 1e6,
        summary.bytes_after / 1e6,
    )  # fmt: skip
    return summary


def _quantize_experts(model: nn.Module, fmt: str, skip: Sequence[str], summary: QuantizeSummary) -> None:
    """Replace each transformers experts module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) by a
    :class:`~kernelize.quant.experts.QuantizedExperts`, or name why it stays float."""
    from kernelize.model_experts import experts_modules
    from kernelize.quant.experts import QuantizedExperts, experts_reason

    for name, mod in experts_modules(model).items():
        why = (
            "skipped by name" if name in skip or name.rsplit(".", 1)[-1] in skip else experts_reason(mod, fmt)
        )
        if why is not None:
            summary.skipped[name] = why
            continue
        before = sum(p.numel() * p.element_size() for p in mod.parameters())
        q = QuantizedExperts.from_experts(mod, fmt)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, q)
        summary.replaced.append(name)
        summary.bytes_before += before
        summary.bytes_after += sum(b.numel() * b.element_size() for b in q.buffers())
        logger.debug("quantize_model: %s -> QuantizedExperts(%s)", name, fmt)


__all__ = ["QuantizeSummary", "QuantizedLinear", "linear_weight", "quantize_model"]
