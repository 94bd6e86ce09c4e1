"""Quantizing a whole transformers model for ``kernelize_model(model, quantize=...)``, and the reason its
recognition gives for the modules whose projections are packed.

Every ``nn.Linear`` (the attention and MLP projections, the LM head) becomes a
:class:`~kernelize.quant.module.QuantizedLinear`; embeddings and norms stay float. The Llama-style attention
and gated MLP kernel layers take packed projections (:mod:`kernelize.quant.fused`: q|k|v and gate|up merged as
bytes, rotary and the attention kernel as for float models, ``act(gate) * up`` in the gate|up kernel's
epilogue); any other module whose projections are packed runs its own forward, which calls the packed decode
kernels, with :func:`packed_reason` as the reason.

Example:
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(40, 8))
    >>> s = quantize_for_kernelize(m, "q8_0")
    >>> s.replaced, s.skipped
    (['0'], {'1': 'in_features 40 is not a multiple of 32'})
"""

from __future__ import annotations

import logging

from torch import nn

from kernelize.quant.formats import get_format
from kernelize.quant.module import QuantizedLinear, QuantizeSummary, quantize_model

logger = logging.getLogger(__name__)


def quantize_for_kernelize(model: nn.Module, fmt: str) -> QuantizeSummary:
    """Quantize every projection and the LM head of ``model`` to ``fmt`` in place (before recognition).

    Args:
        model: the model, its linear layers on the CPU.
        fmt: ``"q8_0"``, ``"q4_0"``, ``"q5_0"``, ``"q4_k"``, ``"q6_k"`` or ``"int8"``.

    Returns:
        What :func:`~kernelize.quant.module.quantize_model` did; each layer left float is logged with why.
    """
    f = get_format(fmt)  # an unknown name raises here, before anything changes
    params = [p for p in model.parameters() if p.device.type not in ("cpu", "meta")]
    if params:
        raise ValueError(
            f"kernelize_model(quantize={f.name!r}): the packed kernels run on the CPU but the model has "
            f"parameters on {params[0].device}; move the model to the CPU first (model.cpu())"
        )
    summary = quantize_model(model, f.name)
    for name, why in summary.skipped.items():
        logger.info("kernelize_model: %s stays float (not %s): %s", name, f.name, why)
    return summary


def packed_reason(module: nn.Module) -> str | None:
    """Why a module with packed projections runs its own forward (None: none of its children is packed).

    Example:
        >>> m = nn.Module()
        >>> m.up_proj = QuantizedLinear(32, 8, "q4_0")
        >>> packed_reason(m)
        'packed q4_0 weights: the module runs its QuantizedLinear projections (up_proj)'
    """
    packed = {n: c for n, c in module.named_children() if isinstance(c, QuantizedLinear)}
    if not packed:
        return None
    formats = "/".join(sorted({c.format for c in packed.values()}))
    return f"packed {formats} weights: the module runs its QuantizedLinear projections ({', '.join(packed)})"


__all__ = ["packed_reason", "quantize_for_kernelize"]
