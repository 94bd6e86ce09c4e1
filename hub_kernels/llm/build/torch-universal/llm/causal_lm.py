"""A transformers causal LM whose training loss never materialises the logits.

`CausalLMWithLoss` replaces the forward of a `*ForCausalLM` module (`model` + `lm_head` + transformers'
`ForCausalLM` loss; recognised by `kernelize_model`). A call with `labels` while the module trains and
gradients are on runs the base model, then `kernelize/loss`'s fused linear + cross-entropy on its hidden
states: the `[tokens, vocab]` logits (and their gradient) are never held in memory, and the output's
`logits` is None. Every other call (no labels, evaluation, `no_grad`, `return_dict=False`) is the module's
own forward, logits included.

The loss is transformers' `ForCausalLMLoss`: labels shifted left by one (or `shift_labels` as given),
`ignore_index` -100, the mean over the other tokens, or the sum divided by `num_items_in_batch` when the
trainer passes it (gradient accumulation).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .decode_model import model_step

IGNORE_INDEX = -100
# what transformers' loss function reads from the call's kwargs (the rest go to the base model too)
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


@functools.cache
def _fused_loss() -> Any:
    from kernelize.layer.hub import get_kernel

    return get_kernel("kernelize/loss", version=1).fused_linear_cross_entropy


def _cache_name(module: nn.Module) -> str:
    """The cache argument's name: `cache` since transformers 5.24, `past_key_values` before."""
    return _cache_name_of(type(module))


@functools.cache
def _cache_name_of(cls: type) -> str:  # (perf) `inspect.signature` per decode step took ~30 us
    return list(inspect.signature(cls.forward).parameters)[4]


def causal_lm_loss(
    module: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, extra: dict
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` of `lm_head(hidden)` without the logits."""
    shift = extra.get("shift_labels")
    if shift is None:
        shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    count = extra.get("num_items_in_batch")
    head = module.lm_head
    loss = _fused_loss()(
        hidden,
        head.weight,
        shift.to(hidden.device),
        head.bias,
        ignore_index=extra.get("ignore_index", IGNORE_INDEX),
        reduction="mean" if count is None else "sum",
    )
    return loss if count is None else loss / (count.to(loss.device) if torch.is_tensor(count) else count)


def _output(outputs: Any, loss: torch.Tensor) -> Any:
    """The causal LM's output type with `loss`, no logits, and the base model's other fields."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} - {"loss", "logits"}
    carried = {name: getattr(outputs, name) for name in fields if hasattr(outputs, name)}
    return CausalLMOutputWithPast(loss=loss, logits=None, **carried)


class CausalLMWithLoss(nn.Module):
    """A `*ForCausalLM` forward whose training loss is the fused linear + cross-entropy (see module doc)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,  # named `past_key_values` before transformers 5.24
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        named = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        named.update(inputs_embeds=inputs_embeds, use_cache=use_cache)
        if cache is not None:  # by name: a `past_key_values=` keyword may be in kwargs instead
            named[_cache_name(self)] = cache
        if (
            labels is None
            or not (self.training and torch.is_grad_enabled())
            or not isinstance(self.lm_head, nn.Linear)  # a packed head: no float weight for the fused loss
            or kwargs.get("return_dict") is False
        ):

            def own() -> Any:
                return type(self).forward(
                    self, labels=labels, logits_to_keep=logits_to_keep, **named, **kwargs
                )

            if labels is None:  # a decode step with no module calls between the layers' programs
                out = model_step(
                    self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                    logits_to_keep, kwargs, own,
                )  # fmt: skip
                if out is not None:
                    return out
            return own()
        outputs = self.model(**named, **kwargs)
        extra = {k: kwargs[k] for k in _LOSS_KWARGS if k in kwargs}
        return _output(outputs, causal_lm_loss(self, outputs.last_hidden_state, labels, extra))


class MoECausalLM(nn.Module):
    """An MoE `*ForCausalLM` forward (`output_router_logits` among its parameters): a plain decode step runs
    the layers' programs back to back (`decode_model.py`); every other call, and any call that asks for the
    router's logits (the auxiliary loss reads them), is the module's own forward."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        named = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        named.update(inputs_embeds=inputs_embeds, use_cache=use_cache, labels=labels)
        named.update(output_router_logits=output_router_logits, logits_to_keep=logits_to_keep)
        if cache is not None:
            named[_cache_name(self)] = cache

        def own() -> Any:
            return type(self).forward(self, **named, **kwargs)

        router = output_router_logits
        if router is None:
            router = getattr(getattr(self, "config", None), "output_router_logits", False)
        if labels is None and not router:
            out = model_step(
                self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                logits_to_keep, kwargs, own,
            )  # fmt: skip
            if out is not None:
                return out
        return own()
