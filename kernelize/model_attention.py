"""The `kernelize` attention function for transformers' `AttentionInterface`, with its eager fallback.

`attention_forward(module, query, key, value, attention_mask, ...)` has the signature transformers gives
every attention implementation (query `(batch, heads, q_len, head_dim)`, key/value with the KV heads,
output `(batch, q_len, heads, head_dim)`) and runs the generated attention kernel
(`kernelize.attention.scaled_dot_product_attention`, torch SDPA semantics). The masks come from
transformers' `sdpa_mask` (registered for `kernelize` too): a boolean `(batch, 1, q_len, kv_len)` mask, or
`None` when plain causal attention is enough.

A call the kernel does not support runs the module's own eager attention instead (the
`eager_attention_forward` of the model's modeling file, so softcapping and sinks stay exact), and the
reason is noted on the module for `kernelize.inspect`. This module imports neither transformers nor the
kernel at import time.

A module with its own attention code (BLOOM, MPT: ALiBi added to the scores there) calls it too, with
`alibi=` the score modification (`kernelize.ir.score_mod.alibi`): the kernel applies it, and the eager and
gradient paths add the bias it stands for to the mask (those modeling files have no
`eager_attention_forward`: the eager path is then the plain softmax attention they write out).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kernelize.ir.score_mod import ScoreMod, chain, sliding_window, softcap
from kernelize.layer.record import record_choice, recorded_choice

__all__ = [
    "KERNEL_UNAVAILABLE",
    "attention_forward",
    "attention_kernel",
    "call_fallback_reason",
    "note_fallback",
    "reference_attention",
]

logger = logging.getLogger(__name__)

KERNEL_UNAVAILABLE = "the attention kernel `kernelize.attention` is not in this build"
# Call arguments checked below or meaningless to the kernel; any other non-None argument falls back.
_HANDLED_KWARGS = frozenset({"output_attentions", "sliding_window", "softcap", "s_aux", "alibi"})
_IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "return_dict",
        "output_hidden_states",
        "output_router_logits",  # MoE models pass their output flags down to every layer
    }
)
_KNOWN_KWARGS = _HANDLED_KWARGS | _IGNORED_KWARGS
# set while a module's own forward runs as the reference of a probe (`kernelize.integrations.verify`)
_REFERENCE = contextvars.ContextVar("kernelize_reference_attention", default=False)


@contextlib.contextmanager
def reference_attention() -> Iterator[None]:
    """Within: `attention_forward` runs the module's eager attention (the probe's reference), no notes."""
    token = _REFERENCE.set(True)
    try:
        yield
    finally:
        _REFERENCE.reset(token)


@functools.cache
def attention_kernel() -> tuple[Callable[..., torch.Tensor], type[Exception]] | None:
    """`(scaled_dot_product_attention, AttentionUnsupported)` from `kernelize.attention`, or None."""
    try:
        from kernelize.attention import AttentionUnsupported, scaled_dot_product_attention
    except ImportError:
        return None
    return scaled_dot_product_attention, AttentionUnsupported


def call_fallback_reason(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict[str, Any]
) -> str | None:
    """Why this call must take the eager path (`None`: the kernel runs it); cheap, checked per call."""
    if attention_kernel() is None:
        return KERNEL_UNAVAILABLE
    if kwargs.get("output_attentions"):
        return "output_attentions=True needs the attention weights, which the kernel never materialises"
    if dropout and module.training:
        return f"attention dropout ({dropout}) in training is not in the kernel"
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in _KNOWN_KWARGS)
    if extra:
        return f"attention arguments the kernel does not know: {', '.join(extra)}"
    return None


def note_fallback(module: torch.nn.Module, reason: str, path: str = "eager attention") -> None:
    """Add `path: reason` to the module's `inspect` record (once per reason) and log it once."""
    choice = recorded_choice(module)
    note = f"{path}: {reason}"
    if choice is None or note in choice.notes or torch.compiler.is_compiling():
        return
    record_choice(module, dataclasses.replace(choice, notes=(*choice.notes, note)))
    logger.info("`%s` ran %s: %s", choice.module_path, path, reason)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention implementation `kernelize`: the generated kernel, or eager with a reason.

    Example:
        >>> from transformers import AttentionInterface  # doctest: +SKIP
        >>> AttentionInterface.register("kernelize", attention_forward)  # doctest: +SKIP
    """
    if _REFERENCE.get():
        return eager_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return attention_with_grad(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    reason = call_fallback_reason(module, query, key, dropout, kwargs)
    if reason is None:
        sdpa, unsupported = attention_kernel()  # type: ignore[misc]
        mask, causal = _kernel_mask(module, query, key, attention_mask, is_causal)
        try:
            out = sdpa(
                query,
                key,
                value,
                attn_mask=mask,
                is_causal=causal,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
                score_mod=_mods(
                    kwargs.get("softcap"), _window(kwargs, mask is None, key.shape[-2]), kwargs.get("alibi")
                ),
                sinks=_sinks(kwargs.get("s_aux")),
            )
        except unsupported as exc:
            reason = f"the attention kernel declined the call: {exc}"
        else:
            return out.transpose(1, 2).contiguous(), None  # as transformers' SDPA path returns it
    note_fallback(module, reason)
    return eager_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def attention_with_grad(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A call that needs gradients: torch's `scaled_dot_product_attention`, which has a backward (on the CPU
    its flash kernel; the generated kernel has none), or the module's eager attention when the call needs
    what SDPA lacks (soft-capping, sinks, the attention weights, unknown arguments)."""
    reason = call_fallback_reason(module, query, key, 0.0, kwargs)
    if kwargs.get("softcap") is not None:  # torch's SDPA has no soft-capping
        reason = f"attention logit softcapping ({kwargs['softcap']}) is not in torch's SDPA"
    if kwargs.get("s_aux") is not None:
        reason = "attention sinks (s_aux) are not in torch's SDPA"
    if reason is not None and reason != KERNEL_UNAVAILABLE:
        note_fallback(module, reason, "eager attention (with gradients)")
        return eager_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    mask, causal = _kernel_mask(module, query, key, attention_mask, is_causal)
    if mask is not None and mask.dim() == 4:  # an eager-style mask may be longer than the keys
        mask = mask[..., : key.shape[-2]]
    if kwargs.get("alibi") is not None:  # SDPA has no ALiBi: its bias joins the mask
        mask, causal = _biased_mask(kwargs["alibi"], query, key, mask, causal), False
    window = _mods(None, _window(kwargs, mask is None, key.shape[-2]))
    if window is not None:  # SDPA has no window: the mask the modification stands for, written out
        q_len, kv_len = query.shape[-2], key.shape[-2]
        keep = window.apply(torch.zeros(1, 1, q_len, kv_len, device=query.device)) > -torch.inf
        if causal:
            keep &= _bottom_right_causal(q_len, kv_len, query.device)
        mask, causal = keep, False
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=64)
def _mods(cap: float | None, window: int | None, alibi: ScoreMod | None = None) -> ScoreMod | None:
    return chain(alibi, softcap(cap) if cap else None, sliding_window(window) if window else None)


def _biased_mask(
    alibi: ScoreMod, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """The additive mask `bias + mask` (query's dtype) that stands for the ALiBi modification and `mask`
    (boolean: keep where True; float: added), with the causal cut when `causal` and no mask is given."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    bias = alibi.apply(torch.zeros(1, query.shape[1], q_len, kv_len, device=query.device))
    if mask is None and causal and q_len > 1:
        mask = _bottom_right_causal(q_len, kv_len, query.device)
    if mask is not None and mask.dtype == torch.bool:
        bias = bias.masked_fill(~mask, -torch.inf)
    elif mask is not None:
        bias = bias + mask
    return bias.to(query.dtype)


def _window(kwargs: dict[str, Any], unmasked: bool, keys: int) -> int | None:
    """The call's sliding window where no mask carries it and it cuts keys (transformers' masks of sliding
    layers already cut the window; without a mask the keys are the cache's contiguous last positions, which
    is what the window modification assumes)."""
    window = kwargs.get("sliding_window")
    return window if unmasked and window is not None and keys > window else None


def _sinks(s_aux: torch.Tensor | None) -> torch.Tensor | None:
    """The attention sinks of a call (gpt-oss's `s_aux`: a logit per query head), detached (no backward)."""
    return None if s_aux is None else s_aux.detach().reshape(-1)


def _kernel_mask(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool | None,
) -> tuple[torch.Tensor | None, bool]:
    """The mask and causal flag for the kernel, as transformers' sdpa path derives them.

    `sdpa_mask` returns None only when attention is plainly causal with as many keys as queries, or for one
    query; a causal call with more keys than queries (a chunk after a cached prefix) gets an explicit
    bottom-right mask, because SDPA's `is_causal` aligns the triangle top-left.
    """
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if mask is not None or q_len == 1 or not causal:
        return mask, False
    if kv_len == q_len:
        return None, True
    return _bottom_right_causal(q_len, kv_len, query.device), False


def _bottom_right_causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    ones = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    return ones.tril(kv_len - q_len)[None, None]


def eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The module's own eager attention (its modeling file's `eager_attention_forward`), additive mask.

    The boolean / `None` masks made for `kernelize` become the additive float mask eager attention expects
    (as transformers' `eager_mask` builds it from the same boolean mask).
    """
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    alibi = kwargs.pop("alibi", None)
    if alibi is not None:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        causal = getattr(module, "is_causal", True)
        mask = _biased_mask(alibi, query, key, attention_mask, causal)
        return _softmax_attention(module, query, key, value, mask, dropout, scale)
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = attention_mask
    if mask is None and q_len > 1 and getattr(module, "is_causal", True):
        mask = _bottom_right_causal(q_len, kv_len, query.device)
    if mask is not None and mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        mask = torch.where(mask, zero, torch.finfo(query.dtype).min)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_KWARGS}
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scale, **kwargs)


def _softmax_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    dropout: float,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention written out with an additive mask, softmax in f32 (as BLOOM's and MPT's own code):
    `(out (batch, q_len, heads, head_dim), attention weights)`."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scores = (query @ key.transpose(-1, -2)) * scaling + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights
