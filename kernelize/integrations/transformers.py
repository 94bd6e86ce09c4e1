"""Kernelize an unmodified transformers model in one call: `kernelize_model(model)`.

`kernelize_model` walks the model, recognises its layers by structure and behaviour (attributes, then a
probe of the forward; a class-name hint only narrows the candidates: `*Norm`, `*MLP`, `*Attention`, GPT-2's
`Conv1D`), marks their classes with the matching hub layer name, registers the `kernelize` attention
implementation with transformers, switches the model to it, and calls `kernelize` with the bundled
`default_mapping()`:

| what the module has | layer | hub repository |
|---|---|---|
| 1-D `weight` + epsilon; forward == `w * rmsnorm(x)` (probed) | `RMSNorm` | `kernelize/layer_norm` |
| same; forward == `(1 + w) * rmsnorm(x)` (Gemma, probed) | `GemmaRMSNorm` | `kernelize/layer_norm` |
| forward `(x, gate)` == `w * rmsnorm(x) * act(gate)` (Qwen3.5, probed) | `GatedRMSNorm` | (same) |
| same, with or without a bias; forward == `layer_norm(x)` (probed) | `LayerNorm` | `kernelize/layer_norm` |
| no parameters (OLMo, nanochat); == rmsnorm / layer_norm, eps probed | `RMSNorm`, `LayerNorm` | (same) |
| `gate_proj`, `up_proj`, `down_proj`, gated activation (probed) | `GatedMLP` | `kernelize/activation` |
| `gate_up_proj`, `down_proj` (Phi-3), gated activation (probed) | `FusedGatedMLP` | `kernelize/activation` |
| `fc1`/`fc2`, `c_fc`/`c_proj`, `dense_h_to_4h`/`dense_4h_to_h`...; activation probed | `DenseMLP` | (same) |
| q/k/v/o or qkv/o linears + rotary (probed: neox or interleaved) | `CausalSelfAttention` | `kernelize/llm` |
| fused `query_key_value`, `dense`; forward takes `alibi` (BLOOM) | `ResidualAlibiAttention` | (same) |
| fused `Wqkv`, `out_proj`; forward takes `position_bias` (MPT) | `AlibiAttention` | (same) |
| fused `c_attn` (`Conv1D` or linear: q, k, v), `c_proj`; GPT-2's forward | `FusedQKVAttention` | (same) |
| source order: [norm] attn [norm] `residual +`, [norm] mlp [norm] `+` | `PreNormDecoderLayer` | (same) |
| same, `position_embeddings` second (Gemma 2 / 3) | `EmbeddingsFirstDecoderLayer` | (same) |
| `ln_1` attn `+`, `ln_2` mlp `+` (LayerNorms; GPT-2's forward) | `FusedQKVDecoderLayer` | (same) |
| the model's `lm_head`, a plain `nn.Linear` (its class becomes `LMHead`) | `Linear` | `kernelize/linear` |
| training: input embeddings, an `nn.Embedding` (class: `TokenEmbedding`) | `Embedding` | `kernelize/linear` |
| `model` + `lm_head` + transformers' `ForCausalLMLoss` | `CausalLMWithLoss` | `kernelize/llm` |
| the same with `output_router_logits` (an MoE model's; decode steps only) | `MoECausalLM` | `kernelize/llm` |

A module that looks like one of these but does not match is left eager, and `kernelize.inspect(model)`
says why; so does a replaced attention module whose calls took the eager path (see
`kernelize.model_attention`). A rule's match is a hypothesis: after `kernelize`, one probe forward
of the model checks every replaced module's kernel forward against the module's own forward
(`kernelize.integrations.verify`), and the model's output against its output before the call; what raises or
differs runs its own forward again, with the reason in `inspect`. A kernel layer whose forward takes other
parameters than the module's leaves that class eager (`KernelizeFallback.INCOMPATIBLE`). The call never
raises for a module it cannot serve.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect as pyinspect
import itertools
import logging
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernelize.ir.score_mod import alibi
from kernelize.layer.decorators import replace_kernel_forward_from_hub
from kernelize.layer.kernelize import KernelizeFallback, keep_original_forward, kernelize
from kernelize.layer.mapping import use_kernel_mapping
from kernelize.layer.mode import Mode
from kernelize.layer.record import FallbackReason, KernelChoice, record_choice, recorded_choice
from kernelize.model_attention import KERNEL_UNAVAILABLE, attention_forward, attention_kernel
from kernelize.model_experts import (
    EXPERTS_LAYER,
    EXPERTS_NAME,
    Routing,
    experts_modules,
    keep_experts,
    use_experts_function,
)
from kernelize.model_router import ROUTER_LAYER, use_router_kernels
from kernelize.runtime.memory import trim_heap
from kernelize.shards import Shards, shards_of

from .verify import TOLERANCE, difference, evaluating, sharded, verify_replacements

__all__ = [
    "ATTENTION_NAME",
    "RULES",
    "LMHead",
    "Recognition",
    "TokenEmbedding",
    "kernelize_model",
    "register_attention",
]

logger = logging.getLogger(__name__)

ATTENTION_NAME = "kernelize"  # the name in transformers' AttentionInterface / AttentionMaskInterface
_DECISION_ATTR = "_kernelize_recognition"
_CLASS_DECISION_ATTR = "_kernelize_class_recognition"  # on a marked class: the decision for new instances


@dataclass(frozen=True)
class Recognition:
    """What the table made of one module: the hub layer to use (None: left eager) and why."""

    kind: str  # "norm", "mlp", "attention", "decoder", "lm_head", "token_embedding", "causal_lm"
    layer_name: str | None
    reason: str
    setup: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # instance attributes the layer reads
    per_instance: bool = False  # the decision depends on the instance, not only on its class


def _eager(kind: str, reason: str) -> Recognition:
    return Recognition(kind, None, reason)


# ---- norms ----------------------------------------------------------------------------------------------
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def _eps_of(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _norm(module: nn.Module) -> Recognition | None:
    weight = getattr(module, "weight", None)
    if "Norm" not in type(module).__name__ or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    if any(True for _ in module.children()):
        return _eager("norm", "has submodules: not a plain norm")
    eps = _eps_of(module)
    if eps is None:
        return _eager("norm", f"no float epsilon attribute ({', '.join(_EPS_NAMES)})")
    if weight.is_meta:
        return _eager("norm", "weights on the meta device: cannot probe which norm this is")
    bias = getattr(module, "bias", None)
    if bias is not None and not (isinstance(bias, nn.Parameter) and bias.shape == weight.shape):
        return _eager("norm", f"a bias of another shape than the weight ({type(bias).__name__})")
    probe = copy.deepcopy(module).float().cpu()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in probe.parameters():
            p.normal_(0.0, 1.0, generator=gen)
        x = 3 * torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(1)) + 1
        got = type(module).forward(probe, x)
        w, b = probe.weight, getattr(probe, "bias", None)
        candidates = {"LayerNorm": torch.nn.functional.layer_norm(x, w.shape, w, b, eps)}
        if b is None:
            candidates |= {"RMSNorm": w * _rms(x, eps), "GemmaRMSNorm": (1 + w) * _rms(x, eps)}
        for name, want in candidates.items():
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                # torch's own classes (nn.LayerNorm) are everyone's: only the instances seen here
                shared = type(module).__module__.startswith("torch.")
                reason = f"forward equals the `{name}` math (probed)"
                return Recognition("norm", name, reason, per_instance=shared)
    known = "layer_norm(x), w * rmsnorm(x) or (1 + w) * rmsnorm(x)"
    return _eager("norm", f"forward matches none of {known} (probed)")


_PROBE_EPS = (1e-5, 1e-6, 1e-8, 1e-12)  # a norm that keeps its epsilon in its forward: the common ones


def _plain_norm(module: nn.Module) -> Recognition | None:
    """A norm without parameters (OLMo's LayerNorm; nanochat's and HRM's RMSNorm): its math and, when it
    keeps its epsilon in its forward (OLMo), its epsilon, probed on inputs of unit and of tiny variance (where
    the epsilon decides the output)."""
    if "Norm" not in type(module).__name__ or any(
        True for _ in itertools.chain(module.parameters(), module.buffers(), module.children())
    ):
        return None
    shared = type(module).__module__.startswith("torch.")  # torch's classes are everyone's: instances only
    if shared and not isinstance(module, nn.LayerNorm | nn.RMSNorm):  # GroupNorm, InstanceNorm: other axes
        return None
    shape = getattr(module, "normalized_shape", None)
    if shape is not None and not (
        isinstance(shape, tuple | list) and len(shape) == 1 and isinstance(shape[0], int)
    ):
        return _eager("norm", f"normalized_shape {shape}: not one axis")
    width = 64 if shape is None else shape[0]
    eps = _eps_of(module)
    gen = torch.Generator().manual_seed(1)
    # unit and tiny variance (the epsilon decides), and 3-D (a norm over more than the last axis differs)
    xs = [3 * torch.randn(3, width, generator=gen) + 1, 1e-3 * torch.randn(3, width, generator=gen)]
    xs.append(torch.randn(2, 3, width, generator=gen) * torch.arange(1.0, 4.0).view(1, 3, 1))
    with torch.no_grad():
        got = [type(module).forward(module, x) for x in xs]
        for e in (eps,) if eps is not None else _PROBE_EPS:
            candidates = {
                "LayerNorm": [torch.nn.functional.layer_norm(x, (width,), None, None, e) for x in xs],
                "RMSNorm": [_rms(x, e) for x in xs],
            }
            for name, want in candidates.items():
                if all(
                    g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-5)
                    for g, w in zip(got, want)
                ):
                    setup = {} if eps is not None else {"kernelize_eps": e}
                    reason = f"no parameters; forward equals the `{name}` math with eps {e:g} (probed)"
                    return Recognition("norm", name, reason, setup, per_instance=shared)
    return _eager(
        "norm", "no parameters, and the forward matches neither layer_norm(x) nor rmsnorm(x) (probed)"
    )


def _norm_layers() -> Any:
    from kernelize.layer.hub import get_kernel

    return get_kernel("kernelize/layer_norm", version=1).layers


def _gated_norm(module: nn.Module) -> Recognition | None:
    """`norm(x) * act(gate)`: a norm whose forward takes `(hidden_states, gate)` (Qwen3-Next, Qwen3.5)."""
    weight = getattr(module, "weight", None)
    if "Norm" not in type(module).__name__ or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    try:
        params = tuple(pyinspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return None
    if params[2:3] != ("gate",):
        return None
    if len(params) != 3 or any(True for _ in module.children()):
        return _eager("norm", f"a gated norm with forward parameters {params} or submodules: not a plain one")
    eps = _eps_of(module)
    if eps is None:
        return _eager("norm", f"no float epsilon attribute ({', '.join(_EPS_NAMES)})")
    if weight.is_meta:
        return _eager("norm", "weights on the meta device: cannot probe which norm this is")
    if getattr(module, "bias", None) is not None:
        return _eager("norm", "a gated norm with a bias: not in the gated RMSNorm kernel")
    layers = _norm_layers()
    probe = copy.deepcopy(module).float().cpu()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        probe.weight.normal_(1.0, 0.5, generator=gen)
        x = 3 * torch.randn(3, weight.shape[0], generator=gen) + 1
        gate = 2 * torch.randn(3, weight.shape[0], generator=gen)
        got = type(module).forward(probe, x, gate)
        named = getattr(module, "activation", None)
        for act in dict.fromkeys([*([named] if named in layers.GATE_ACT else []), *layers.GATE_ACT]):
            want = layers.gated_rms_norm_math(x, gate, probe.weight, eps=eps, act=act)
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                reason = f"forward equals `w * rmsnorm(x) * {act}(gate)` (probed)"
                return Recognition("norm", "GatedRMSNorm", reason, {"kernelize_gate_act": act})
    known = " or ".join(layers.GATE_ACT)
    return _eager("norm", f"forward matches no `w * rmsnorm(x) * act(gate)` with act {known} (probed)")


# ---- gated MLPs -------------------------------------------------------------------------------------------
def _activation_layers() -> Any:
    from kernelize.layer.hub import get_kernel

    return get_kernel("kernelize/activation", version=1).layers


def _mlp(module: nn.Module) -> Recognition | None:
    fused = all(_linear(getattr(module, n, None)) for n in ("gate_up_proj", "down_proj"))
    split = all(_linear(getattr(module, n, None)) for n in ("gate_proj", "up_proj", "down_proj"))
    if not (fused or split):
        dense = _dense_mlp(module)
        if dense is not None:
            return dense
        looks_like = type(module).__name__.endswith("MLP")
        return (
            _eager("mlp", "no gate_proj/up_proj/down_proj, gate_up_proj/down_proj or up/down projections")
            if looks_like
            else None
        )
    w = getattr(module.down_proj, "weight", None)
    if w is None:  # packed (QuantizedLinear): probed in f32, which its kernels take
        w = module.down_proj.qweight.new_empty(0, dtype=torch.float32)
    if w.is_meta:
        return _eager("mlp", "weights on the meta device: cannot probe the MLP")
    if why := sharded(module):
        return Recognition("mlp", None, why, per_instance=True)
    layers = _activation_layers()
    table = layers.GATED_PAIR_MATH if fused else layers.GATED_MATH
    with torch.no_grad():
        x = torch.randn(2, module.down_proj.out_features, generator=torch.Generator().manual_seed(2))
        x = x.to(w.device, w.dtype)
        got = type(module).forward(module, x).float()

        def want(act: str) -> torch.Tensor:
            if fused:
                return module.down_proj(table[act](module.gate_up_proj(x)))
            return module.down_proj(table[act](module.gate_proj(x), module.up_proj(x)))

        act = _closest_activation(got, _activation_candidates(module, table), want)
        if act is not None:
            name = "FusedGatedMLP" if fused else "GatedMLP"
            return Recognition("mlp", name, f"down_proj({act}(gate) * up) (probed)", {"hidden_act": act})
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    known = ", ".join(dict.fromkeys(table))
    detail = f"no gated activation ({known}) reproduces the forward; the config's activation is {act!r}"
    return _eager("mlp", f"{detail} (probed)")


# (up, down) projection names of non-gated MLPs: OPT/Phi, GPT-2/StarCoder2, GPT-NeoX/Falcon/BLOOM, GPT-J,
# Nemotron
_DENSE_PAIRS = (
    ("fc1", "fc2"),
    ("c_fc", "c_proj"),
    ("dense_h_to_4h", "dense_4h_to_h"),
    ("fc_in", "fc_out"),
    ("up_proj", "down_proj"),
)


def _projection(module: nn.Module) -> bool:
    """An `nn.Linear`, or transformers' `Conv1D` (weight stored `(in, out)`)."""
    return isinstance(module, nn.Linear) or (
        type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), nn.Parameter)
    )


def _dense_mlp(module: nn.Module) -> Recognition | None:
    """`down(act(up(x)))` with one known pair of projections and nothing else holding parameters."""
    pair = next((p for p in _DENSE_PAIRS if all(_projection(getattr(module, n, None)) for n in p)), None)
    if pair is None:
        return None
    others = [
        n for n, child in module.named_children() if n not in pair and any(True for _ in child.parameters())
    ]
    if others:  # a decoder layer holding its MLP's projections itself (OPT): not an MLP module
        return None
    up, down = (getattr(module, n) for n in pair)
    if up.weight.is_meta:
        return _eager("mlp", "weights on the meta device: cannot probe the MLP")
    table = _activation_layers().ACT_MATH
    width = up.weight.shape[0] if type(up).__name__ == "Conv1D" else up.in_features
    with torch.no_grad():
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(2)).to(
            up.weight.device, up.weight.dtype
        )
        got = type(module).forward(module, x).float()
        act = _closest_activation(got, _activation_candidates(module, table), lambda a: down(table[a](up(x))))
        if act is not None:
            setup = {"kernelize_dense_mlp": (*pair, act)}
            return Recognition("mlp", "DenseMLP", f"{pair[1]}({act}({pair[0]}(x))) (probed)", setup, True)
    return _eager(
        "mlp", f"no activation ({', '.join(table)}) reproduces {pair[1]}(act({pair[0]}(x))) (probed)"
    )


def _closest_activation(
    got: torch.Tensor, candidates: list[str], want: Callable[[str], torch.Tensor]
) -> str | None:
    """The candidate whose output `want(name)` is closest to the module's `got`, among those within the
    probe's tolerance (ties: the first, the config's name), or None. The closest, not the first close one:
    erf GELU passes the tolerance of a tanh GELU (GPT-2's gelu_new) on a probe, and then differs by 1e-4 of
    the output in the model, where the whole-model check withdraws it."""
    errors = {}
    for act in candidates:
        w = want(act).float()
        if got.shape == w.shape and torch.allclose(got, w, rtol=1e-3, atol=1e-4):
            errors[act] = (got - w).abs().max().item()
    return min(errors, key=errors.__getitem__) if errors else None


def _activation_candidates(module: nn.Module, table: Mapping[str, Any]) -> list[str]:
    """The config's activation names first (`hidden_act`, Gemma-2's `hidden_activation`, GPT-2's
    `activation_function`), then the rest."""
    config = getattr(module, "config", None)
    names = ("hidden_activation", "hidden_act", "activation_function")
    named = [getattr(config, n, None) for n in names]
    return list(dict.fromkeys([n for n in named if n in table] + list(table)))


# ---- attention --------------------------------------------------------------------------------------------
def _rotary_style(module: nn.Module) -> tuple[bool | None, str, str]:
    """(is_neox_style, tables, detail) of the model file's `apply_rotary_pos_emb`, probed on random tensors:
    how it reads the cos/sin tables it is given (`ROTARY_TABLES` of the llm layers: as they are, each angle
    once for both halves as gpt-oss, the first half's angles per pair as GLM) and rotates the first dims they
    cover (partial rotary) in the neox or the interleaved layout."""
    rotary, tables = _hub_layers("rotary"), _hub_layers("llm").ROTARY_TABLES
    apply = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    if apply is None:
        return None, "", f"`{type(module).__module__}` has no apply_rotary_pos_emb"
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 1, 3, 8, generator=gen)
    failure = ""
    for width in (8, 4):
        cos, sin = torch.randn(1, 3, width, generator=gen), torch.randn(1, 3, width, generator=gen)
        try:
            got = apply(q, k, cos, sin)
        except Exception as exc:  # a rotary with another signature or table width
            failure = failure or f"{type(exc).__name__}: {exc}"
            continue
        for (name, table), neox in itertools.product(tables.items(), (True, False)):
            c, s = table(cos).unsqueeze(1), table(sin).unsqueeze(1)
            one, r = rotary.rotary_neox_one if neox else rotary.rotary_interleaved_one, c.shape[-1]
            if r > 8:
                continue
            want = [torch.cat((one(t[..., :r], c, s), t[..., r:]), dim=-1) for t in (q, k)]
            if all(g.shape == w.shape and torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want)):
                layout = "neox" if neox else "interleaved"
                return neox, name, layout + ("" if name == "same" else f", {name}")
    if failure:
        return None, "", f"apply_rotary_pos_emb(q, k, cos, sin) failed on a probe: {failure}"
    return None, "", "apply_rotary_pos_emb is neither the neox nor the interleaved layout (probed)"


def _hub_layers(name: str) -> Any:
    from kernelize.layer.hub import get_kernel

    return get_kernel(f"kernelize/{name}", version=1).layers


_ATTENTION_ATTRS = ("head_dim", "scaling", "layer_idx", "config")
# each step may be spelled several ways: transformers 5.24 renamed `past_key_values` to `cache`
_FORWARD_CALLS = (
    ("apply_rotary_pos_emb(",),
    ("past_key_values.update(", "cache.update("),
    ("ALL_ATTENTION_FUNCTIONS",),
)


def _attention(module: nn.Module) -> Recognition | None:
    has = lambda *names: all(_linear(getattr(module, n, None)) for n in names)  # noqa: E731
    if not (has("q_proj", "k_proj", "v_proj", "o_proj") or has("qkv_proj", "o_proj")):
        return (
            _eager("attention", "no q/k/v/o projections")
            if type(module).__name__.endswith("Attention")
            else None
        )
    reason = _attention_blocker(module) or sharded(module)
    if reason:
        return Recognition("attention", None, reason, per_instance=True)
    neox, tables, style = _rotary_style(module)
    if neox is None:
        return Recognition("attention", None, style, per_instance=True)
    window = getattr(module, "sliding_window", getattr(module.config, "sliding_window", None))
    detail = f"{style} rotary, {module.config.num_attention_heads}/{module.config.num_key_value_heads} heads"
    if window is not None:
        detail += f"; sliding window {window}"
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap:
        detail += f"; logit soft-capping {softcap}"
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        detail += "; attention sinks"
    setup = {"is_neox_style": neox, "rotary_tables": tables}
    return Recognition("attention", "CausalSelfAttention", detail, setup, per_instance=True)


# ---- ALiBi attention written out by the family (BLOOM, MPT): one hub layer per forward signature ---------
@dataclass(frozen=True)
class _AlibiFamily:
    """How one family's attention module looks: its fused q|k|v and output linears, its forward's parameters
    and the attribute holding its head count; the arithmetic of its slopes (`score_mod.alibi`). Both families'
    models build their bias with the default maximum 8 (MPT's model passes no `alibi_bias_max`)."""

    layer: str
    linears: tuple[str, str]
    params: tuple[str, ...]
    heads: str
    slopes: str


_ALIBI_FAMILIES = (
    _AlibiFamily(
        "ResidualAlibiAttention",
        ("query_key_value", "dense"),
        (
            "hidden_states",
            "residual",
            "alibi",
            "attention_mask",
            "layer_past",
            "use_cache",
            "output_attentions",
        ),
        "num_heads",
        "bloom",
    ),
    _AlibiFamily(
        "AlibiAttention",
        ("Wqkv", "out_proj"),
        ("hidden_states", "position_bias", "cache", "attention_mask"),
        "n_heads",
        "mpt",
    ),
)
# Falcon adds `bf16(bf16(slope) * position)`, the position counted over each row's unpadded keys: the
# rounding depends on the padding, so no function of (query, key, head) is that bias
_FALCON_ALIBI = (
    "Falcon's ALiBi bias is rounded to bf16 at each key's position among the row's unpadded tokens "
    "(build_alibi_tensor): it depends on the padding, so no score modification of (query, key, head) is it"
)


def _alibi_attention(module: nn.Module) -> Recognition | None:
    """BLOOM's and MPT's attention modules (ALiBi added to the scores in their own forward), or None: a
    module with a family's fused q|k|v linear whose forward takes the bias (`alibi`, `position_bias`)."""
    fused = {f.linears[0] for f in _ALIBI_FAMILIES}
    if not any(isinstance(getattr(module, n, None), nn.Linear) for n in fused):
        return None
    try:
        params = tuple(pyinspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return None
    params = tuple("cache" if p == "past_key_values" else p for p in params if p != "kwargs")
    if "alibi" not in params and "position_bias" not in params:
        return None
    uses = getattr(getattr(module, "config", None), "alibi", None)  # Falcon: ALiBi or rotary, by config
    if uses is not None:
        return Recognition("attention", None, _FALCON_ALIBI, per_instance=True) if uses else None
    family = next((f for f in _ALIBI_FAMILIES if params == f.params), None)
    if family is None:
        return _eager("attention", f"an ALiBi attention whose forward parameters {params} no layer takes")
    missing = [n for n in family.linears if not isinstance(getattr(module, n, None), nn.Linear)]
    heads = getattr(module, family.heads, None)
    if missing or not isinstance(heads, int) or not isinstance(getattr(module, "layer_idx", None), int):
        what = ", ".join(missing) or f"int {family.heads} and layer_idx"
        return Recognition("attention", None, f"ALiBi attention without {what}", per_instance=True)
    if attention_kernel() is None:
        return Recognition("attention", None, KERNEL_UNAVAILABLE, per_instance=True)
    mod = alibi(heads, slopes=family.slopes)
    detail = f"ALiBi in the kernel: {mod.name}, fused {family.linears[0]}"
    return Recognition("attention", family.layer, detail, {"kernelize_alibi": mod}, per_instance=True)


# ---- fused q|k|v attention without rotary (GPT-2): `c_attn` -> heads -> attention -> `c_proj` ------------
_FUSED_QKV_PARAMS = (
    *("hidden_states", "cache", "attention_mask", "encoder_hidden_states", "encoder_attention_mask"),
    "output_attentions",
)


def _width(proj: nn.Module) -> tuple[int, int]:
    """(in, out) features of an `nn.Linear`, its packed `QuantizedLinear` or a `Conv1D` (whose weight is
    stored `(in, out)`)."""
    if type(proj).__name__ == "Conv1D":
        return tuple(proj.weight.shape)
    return proj.in_features, proj.out_features


_C_ATTN = ("c_attn", "c_proj")  # GPT-2's attention projections


def _fused_qkv_attention(module: nn.Module) -> Recognition | None:
    """GPT-2's attention (and look-alikes): `c_attn` projecting q | k | v, each `heads * head_dim` wide,
    `c_proj`, the scale in `scaling`, the forward GPT-2's. Recognised by structure; the probe verifies it."""
    if not all(_projection(getattr(module, n, None)) or _linear(getattr(module, n, None)) for n in _C_ATTN):
        return None
    kind, why = "attention", _fused_qkv_blocker(module)
    if why:
        return Recognition(kind, None, why, per_instance=True)
    heads = _width(module.c_attn)[0] // module.head_dim
    detail = f"fused c_attn ({type(module.c_attn).__name__}), {heads} heads, no rotary"
    if getattr(module, "reorder_and_upcast_attn", False):  # the kernel's scores and softmax are f32 anyway
        detail += "; reorder_and_upcast_attn: the kernel's scores and softmax are f32"
    return Recognition(kind, "FusedQKVAttention", detail, per_instance=True)


def _fused_qkv_blocker(module: nn.Module) -> str | None:
    """Why `FusedQKVAttention` cannot stand in for a module with `c_attn` / `c_proj` (None: it can)."""
    try:
        params = tuple(pyinspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return "the forward's signature is not available"
    params = tuple("cache" if p == "past_key_values" else p for p in params if p != "kwargs")
    if params != _FUSED_QKV_PARAMS:  # GPT-BigCode (per-head q|k|v, multi-query), OpenAI GPT (no cache)
        return f"a c_attn attention whose forward parameters {params} differ from GPT-2's {_FUSED_QKV_PARAMS}"
    if getattr(module, "is_cross_attention", False) or hasattr(module, "q_attn"):
        return "cross-attention (queries from q_attn, keys and values from the encoder): not in the layer"
    if not getattr(module, "is_causal", True):
        return "not causal attention"
    head_dim, scaling = getattr(module, "head_dim", None), getattr(module, "scaling", None)
    if not isinstance(head_dim, int) or not isinstance(scaling, float):
        return "no int head_dim and float scaling: not GPT-2's attention"
    if not isinstance(getattr(module, "layer_idx", None), int):
        return "no int layer_idx to update the cache with"
    (width, fused), (out_in, _) = _width(module.c_attn), _width(module.c_proj)
    config_heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    heads = getattr(module, "num_heads", config_heads)
    if fused != 3 * width or out_in != width or heads is None or heads * head_dim != width:
        return f"c_attn {width} -> {fused}, c_proj {out_in} in: not q|k|v of {heads} heads of {head_dim} each"
    if attention_kernel() is None:
        return KERNEL_UNAVAILABLE
    return None


def _on_shards(module: nn.Module) -> str:
    """The note `inspect` shows on a module whose kernels run on tensor-parallel shards ("": a whole one)."""
    found = shards_of(module)
    if not isinstance(found, Shards):
        return ""
    return f"on its tensor-parallel local shards ({found.world} ranks, Megatron split, one all-reduce)"


def _attention_blocker(module: nn.Module) -> str | None:
    """Why the attention layer cannot stand in for this module (None: it can)."""
    config = module.config
    missing = [n for n in _ATTENTION_ATTRS if not hasattr(module, n)]
    if missing or not hasattr(config, "num_key_value_heads"):
        return f"missing {', '.join(missing) or 'config.num_key_value_heads'}: not a Llama-style attention"
    if not getattr(module, "is_causal", True):
        return "not causal attention"
    if getattr(config, "alibi", False) or "alibi" in str(getattr(config, "position_embedding_type", "")):
        return "ALiBi position bias is not in the attention kernel"
    try:
        source = pyinspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return "the forward's source is not available to check its structure"
    absent = [" or ".join(calls) for calls in _FORWARD_CALLS if not any(c in source for c in calls)]
    if absent:
        return f"the forward does not call {', '.join(absent)}: not the Llama-style attention structure"
    if attention_kernel() is None:
        return KERNEL_UNAVAILABLE
    return None


# ---- decoder layers: residual adds + norms at any of four places ----------------------------------------
_DECODER_OPTIONAL = frozenset({"resid_attn_dropout", "resid_mlp_dropout"})  # Phi-3 (identity in eval)
# forward parameter order -> (the kernel layer taking it, its attention child, its norms' layer names)
_PRE_NORMS = ("RMSNorm", "GemmaRMSNorm", "LayerNorm")  # LayerNorm: Starcoder2, Jais2, PhiMoE
_DECODER_SIGNATURES = {
    ("self", "hidden_states", "attention_mask", "position_ids", "cache", "use_cache"): (
        "PreNormDecoderLayer",
        "self_attn",
        _PRE_NORMS,
    ),
    ("self", "hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache"): (
        "EmbeddingsFirstDecoderLayer",
        "self_attn",
        _PRE_NORMS,
    ),
    ("self", "hidden_states", "cache", "attention_mask", "encoder_hidden_states", "encoder_attention_mask"): (
        "FusedQKVDecoderLayer",
        "attn",
        ("LayerNorm",),  # GPT-2
    ),
}
_ATTENTION_CHILDREN = frozenset(attn for _, attn, _ in _DECODER_SIGNATURES.values())
# The data flow in source order: `residual = hidden_states`, attention, `residual +`, the same around the
# MLP, with a norm call allowed at each of the four slots (`block.NORM_SLOTS`): before attention, on its
# output, before the MLP, on its output. Which slot a norm fills comes from where it is called, not its name
# (Llama's `post_attention_layernorm` is the pre-MLP norm; Gemma 2's is on the attention's output).
_DECODER_FLOW = re.compile(
    r"R (?:N:(?P<input>\w+) )?A (?:N:(?P<post_attn>\w+) )?\+ "
    r"R (?:N:(?P<pre_ff>\w+) )?M (?:N:(?P<post_ff>\w+) )?\+"
)
_FLOW_EVENTS = re.compile(r"residual = hidden_states|residual \+|\+ residual|self\.(\w+)\(")


def _flow(source: str, norms: frozenset[str], attention: str) -> str:
    """The forward's data flow as events: R (residual saved), A / M (attention / MLP called), + (residual
    added), N:name (a norm called); other calls (dropouts) are left out."""
    events = []
    for match in _FLOW_EVENTS.finditer(source):
        name = match.group(1)
        if name is None:
            events.append("R" if match.group(0).startswith("residual =") else "+")
        elif name in norms:
            events.append(f"N:{name}")
        elif name in (attention, "mlp"):
            events.append("A" if name == attention else "M")
    return " ".join(events)


def _live_source(module: nn.Module, source: str) -> str:
    """`source` without the `if` blocks (no `else`) that call a submodule `module` does not have: they
    cannot run on this instance (GPT-2's cross-attention branch in a layer built without one)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return source
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or node.orelse:
            continue
        called = {
            call.func.attr
            for call in ast.walk(node)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self"
        }
        if any(not hasattr(module, name) for name in called):
            lines[node.lineno - 1 : node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
    return "\n".join(lines)


def _decoder(module: nn.Module) -> Recognition | None:
    children = {name for name, _ in module.named_children()}
    attention = next((a for a in _ATTENTION_CHILDREN if a in children), None)
    named_norm = any(n.endswith("layernorm") or re.fullmatch(r"ln_\d", n) for n in children)
    if attention is None or "mlp" not in children or not named_norm:
        return None
    norms = frozenset(children - {attention, "mlp"} - _DECODER_OPTIONAL)
    try:
        source = _live_source(module, pyinspect.getsource(type(module).forward))
        params = tuple(pyinspect.signature(type(module).forward).parameters)
        params = tuple("cache" if p == "past_key_values" else p for p in params)  # its name before 5.24
    except (OSError, TypeError):
        return _eager("decoder", "the forward's source is not available to check its data flow")
    events = _flow(source, norms, attention)
    flow = _DECODER_FLOW.fullmatch(events)
    if flow is None:
        return _eager(
            "decoder",
            "the forward is not the residual flow of a decoder layer (attention and MLP each between "
            f"`residual = hidden_states` and `residual +`, norms around them): {events!r}",
        )
    slots = {slot: name for slot, name in flow.groupdict().items() if name is not None}
    unused = norms - set(slots.values())
    if unused:
        return _eager("decoder", f"submodules beyond a decoder layer's norms: {', '.join(sorted(unused))}")
    found = next((v for k, v in _DECODER_SIGNATURES.items() if params[: len(k)] == k), None)
    if found is None or found[1] != attention:
        return _eager("decoder", f"forward parameters {params} differ from those of the decoder layers")
    layer, _, norm_layers = found
    styles = {}
    for slot, name in slots.items():
        norm = _norm(getattr(module, name)) or _plain_norm(getattr(module, name))
        if norm is None or norm.layer_name not in norm_layers:
            return _eager("decoder", f"{name} is not a recognised {' or '.join(norm_layers)}")
        styles[slot] = norm.layer_name
    layout = ", ".join(f"{slot}: {name}" for slot, name in slots.items())
    setup = {"kernelize_norms": slots, "kernelize_norm_style": styles.get("pre_ff")}
    return Recognition("decoder", layer, f"norms {layout}", setup)


# ---- the LM head ----------------------------------------------------------------------------------------
class LMHead(nn.Linear):
    """A causal LM's `lm_head`: `kernelize_model` gives the model's plain `nn.Linear` head this subclass, so
    the head alone is marked (marking `nn.Linear` would mark every linear in the process). In decode its
    forward is the few-row matmul kernel: one or a few rows against the largest weight of a small model."""


def _adopt_lm_head(model: nn.Module) -> None:
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear:
        head.__class__ = LMHead


def _lm_head(module: nn.Module) -> Recognition | None:
    if type(module) is not LMHead:
        return None
    return Recognition("lm_head", "Linear", "x @ W.T (+ b): the few-row matmul kernel for up to 16 rows")


# ---- the token embedding -------------------------------------------------------------------------------
class TokenEmbedding(nn.Embedding):
    """A model's input embeddings: `kernelize_model` gives a plain `nn.Embedding` this subclass, so only it is
    marked. In training its weight gradient is lazily zeroed memory (the pages of the rows written, not a
    zero fill of the whole [vocab, hidden] tensor); without gradients it is the generated gather kernel."""


def _adopt_token_embedding(model: nn.Module) -> None:
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return
    if type(embedding) is nn.Embedding:
        embedding.__class__ = TokenEmbedding


def _token_embedding(module: nn.Module) -> Recognition | None:
    if type(module) is not TokenEmbedding:
        return None
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return _eager("token_embedding", "max_norm, scale_grad_by_freq or sparse: torch's embedding")
    return Recognition(
        "token_embedding", "Embedding", "weight[ids]; training: the weight gradient lazily zeroed"
    )


# ---- the causal LM's loss ------------------------------------------------------------------------------
# the forward computes the logits of the base model's hidden states and hands them to the loss function
_CAUSAL_LM_STEPS = ("self.model(", "self.lm_head(", "self.loss_function(")
_CAUSAL_LM_PARAMS = (
    *("self", "input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "labels"),
    *("use_cache", "logits_to_keep", "kwargs"),
)
_MOE_CAUSAL_LM_PARAMS = (*_CAUSAL_LM_PARAMS[:-2], "output_router_logits", *_CAUSAL_LM_PARAMS[-2:])


def _causal_lm(module: nn.Module) -> Recognition | None:
    # a packed head (kernelize_model(quantize=...)) takes the decode step; its loss is the module's own
    head, base = getattr(module, "lm_head", None), getattr(module, "model", None)
    if not (_linear(head) and isinstance(base, nn.Module)):
        return None
    kind = "causal_lm"
    loss = getattr(module, "loss_function", None)
    if getattr(loss, "__name__", None) != "ForCausalLMLoss":
        return _eager(kind, f"the loss function is {getattr(loss, '__name__', loss)!r}, not ForCausalLMLoss")
    try:
        source = pyinspect.getsource(type(module).forward)
        params = tuple(pyinspect.signature(type(module).forward).parameters)
    except (OSError, TypeError):
        return _eager(kind, "the forward's source is not available to check its data flow")
    missing = [step for step in _CAUSAL_LM_STEPS if step not in source]
    if missing:
        return _eager(kind, f"the forward does not call {', '.join(missing)}")
    params = tuple("cache" if p == "past_key_values" else p for p in params)  # its name before 5.24
    if params == _MOE_CAUSAL_LM_PARAMS:  # its loss adds the router's: the module's own
        return Recognition(kind, "MoECausalLM", "decode steps: the layers' programs back to back")
    if params != _CAUSAL_LM_PARAMS:
        return _eager(kind, f"forward parameters {params} differ from a causal LM's {_CAUSAL_LM_PARAMS}")
    for extra in ("softcap", "aux_loss"):
        if extra in source:
            return _eager(kind, f"the forward has `{extra}` on the logits or loss: not in the fused loss")
    return Recognition(
        kind, "CausalLMWithLoss", "training calls with labels: fused linear + cross-entropy, no logits"
    )


# ---- packed projections (kernelize_model(quantize=...)) -------------------------------------------------
def _linear(module: nn.Module | None) -> bool:
    """An `nn.Linear`, or its packed stand-in `QuantizedLinear` (the attention and MLP layers take both)."""
    from kernelize.quant.module import QuantizedLinear

    return isinstance(module, nn.Linear | QuantizedLinear)


# the projections of the layers that serve packed weights: Llama-style and GPT-2 attention, gated MLPs
_PACKED_SERVED = (
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("qkv_proj", "o_proj"),
    ("gate_proj", "up_proj", "down_proj"),
    ("gate_up_proj", "down_proj"),
    _C_ATTN,
)


def _packed(module: nn.Module) -> Recognition | None:
    """An attention or MLP with `QuantizedLinear` projections that no kernel layer serves packed (only the
    Llama-style and GPT-2 attention and the gated MLPs do): it runs its own forward, which calls the packed
    kernels. Those the layers serve go on to the attention / MLP rules."""
    from kernelize.quant.model import packed_reason

    name = type(module).__name__
    if not name.endswith(("Attention", "MLP")):  # a causal LM with a packed `lm_head` is not one
        return None
    reason = packed_reason(module)
    if reason is None or any(all(_linear(getattr(module, n, None)) for n in s) for s in _PACKED_SERVED):
        return None
    kind = "attention" if name.endswith("Attention") else "mlp"
    return Recognition(kind, None, reason, per_instance=True)


# ---- the table ----------------------------------------------------------------------------------------
# Each rule: module -> Recognition (a layer, or left eager with the reason), or None (not this kind).
RULES: tuple[Callable[[nn.Module], Recognition | None], ...] = (
    _packed,
    _gated_norm,
    _norm,
    _plain_norm,
    _mlp,
    _alibi_attention,
    _fused_qkv_attention,
    _attention,
    _decoder,
    _lm_head,
    _token_embedding,
    _causal_lm,
)
# The class mark of a kind whose modules are left eager: a name no mapping has, so nothing replaces them.
_UNRECOGNISED = "{kind} (not recognised by kernelize_model)"


def recognise(module: nn.Module) -> Recognition | None:
    """The first rule's verdict on `module`, or None if no rule applies.

    A rule that raises on a module (its probe call, an attribute it reads) leaves the module eager with the
    error as the reason: a module the table cannot judge is not one it may replace.
    """
    for rule in RULES:
        try:
            found = rule(module)
        except Exception as exc:
            kind = rule.__name__.strip("_")
            reason = f"recognition failed: {type(exc).__name__}: {exc}"
            return Recognition(kind, None, reason, per_instance=True)
        if found is not None:
            return found
    return None


def _condition(module: nn.Module) -> bool:
    """Class-mark condition: the recognition kernelize_model stored on the instance decides."""
    found = module.__dict__.get(_DECISION_ATTR)
    if found is None:  # an instance kernelize_model has not seen: class-level decisions hold for it too
        found = type(module).__dict__.get(_CLASS_DECISION_ATTR)
        if found is None or found.per_instance:
            return False
        _adopt(module, found)  # the layer reads the decision's attributes (e.g. the norm style)
    return found.layer_name is not None


def _adopt(module: nn.Module, verdict: Recognition) -> None:
    """Store the decision on the instance and set the instance attributes its hub layer reads."""
    module.__dict__[_DECISION_ATTR] = verdict
    for name, value in verdict.setup.items():
        setattr(module, name, value)


def _mark(model: nn.Module) -> dict[str, Recognition]:
    """Recognise every module; mark each class once with the layer name of its recognised instances."""
    found: dict[str, Recognition] = {}
    verdicts: dict[type, Recognition] = {}
    layers: dict[type, set[str | None]] = {}
    unrecognised: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        cls = type(module)
        verdict = verdicts.get(cls)
        if verdict is None or verdict.per_instance:
            verdict = recognise(module)
            if verdict is None:
                unrecognised[path] = module
                continue
            verdicts.setdefault(cls, verdict)
        _adopt(module, verdict)
        found[path] = verdict
        layers.setdefault(cls, set()).add(verdict.layer_name)
    # a class whose instances differ in structure (Qwen3.5's decoder layer: attention or linear attention):
    # those no rule recognised stay eager when the class is marked
    for path, module in unrecognised.items():
        verdict = verdicts.get(type(module))
        if verdict is not None:
            why = f"not a {verdict.kind} as other instances of its class are (its submodules differ)"
            found[path] = Recognition(verdict.kind, None, why, per_instance=True)
            _adopt(module, found[path])
    for cls, verdict in verdicts.items():
        names = layers[cls] - {None}
        layer = next(iter(names)) if len(names) == 1 else _UNRECOGNISED.format(kind=verdict.kind)
        replace_kernel_forward_from_hub(cls, layer, condition=_condition)
        setattr(cls, _CLASS_DECISION_ATTR, verdict)
    return found


def register_attention() -> None:
    """Register `kernelize` with transformers' AttentionInterface (the kernel) and AttentionMaskInterface.

    The masks are transformers' `sdpa_mask` (boolean, or None for plain causal attention), which the kernel's
    SDPA semantics take as they are.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _use_attention_function(model: nn.Module, mode: Mode) -> str:
    """Switch the model to the `kernelize` attention implementation; returns what happened."""
    if attention_kernel() is None:
        return f"attention implementation unchanged: {KERNEL_UNAVAILABLE}"
    if mode & (Mode.TRAINING | Mode.TORCH_COMPILE):
        # the kernel has no backward and is not traceable: the model keeps its own implementation (and
        # masks); the attention layer's calls with gradients take torch's SDPA
        return f"attention implementation unchanged for {mode}"
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return "attention implementation unchanged: not a transformers PreTrainedModel"
    register_attention()
    try:
        setter(ATTENTION_NAME)
    except (ValueError, KeyError) as exc:
        return f"attention implementation unchanged: {exc}"
    return f"attention implementation set to `{ATTENTION_NAME}`"


# a kernel layer whose forward cannot take the module's arguments leaves that class eager (not an error)
_FALLBACKS = KernelizeFallback.DEFAULT | KernelizeFallback.INCOMPATIBLE
# No padding: a left pad's queries see no key, and what attention returns for such rows (which the model
# never reads) differs between implementations.
_PROBE_BATCH, _PROBE_SEQ = 2, 8


def _probe_call(model: nn.Module) -> Callable[[], Any] | str:
    """One forward of `model` on a batch of random token ids (or why there is none)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    if not isinstance(embedding, nn.Embedding):
        return "the model has no token embedding (get_input_embeddings) to feed a probe"
    if embedding.weight.is_meta:
        return "weights on the meta device"
    params = pyinspect.signature(model.forward).parameters
    if "input_ids" not in params:
        return "the model's forward takes no input_ids"
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, embedding.num_embeddings, (_PROBE_BATCH, _PROBE_SEQ), generator=gen)
    mask = torch.ones_like(ids)
    kwargs: dict[str, Any] = {"input_ids": ids.to(embedding.weight.device)}
    if "attention_mask" in params:
        kwargs["attention_mask"] = mask.to(embedding.weight.device)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return lambda: model(**kwargs)


_PROBE_ROUNDS = 4  # a refused forward exposes the submodules its kernel bypassed: probe again, this deep


def _model_output(model: nn.Module, call: Callable[[], Any] | str) -> Any:
    """The model's output on the probe (eval mode, no gradients), or None when there is no probe."""
    if isinstance(call, str):
        return None
    try:
        with evaluating(model):
            return call()
    except Exception as exc:  # the model's own forward fails on the probe: nothing can be judged by it
        logger.warning("kernelize_model: the probe forward raised %s: %s", type(exc).__name__, exc)
        return None


# On a GPU the whole-model path measured slower than the model's own (H200, a 0.85 B Llama in bf16, two
# runs: prefill 0.66-0.71x, decode 0.63x; benchmarks/results/gpu/llm.json): the one call leaves a GPU model
# as it is unless this variable is 1. `kernelize()` on marked layers and the hub layers are not affected.
GPU_MODEL_ENV = "KERNELIZE_GPU_MODEL"


def _gpu_held_back(model: nn.Module, mode: Mode, device: str | torch.device | None) -> bool:
    """Whether the one call leaves `model` as it is (on a GPU, not opted in): then the reason is recorded on
    the root for `inspect`, and logged."""
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    kind = torch.device(device).type
    if kind == "cpu" or os.environ.get(GPU_MODEL_ENV, "") == "1":
        return False
    reason = (
        f"the model is on {kind}, where the generated kernels measured slower than its own forward in whole "
        f"models (H200, 0.85 B Llama bf16: prefill 0.66-0.71x, decode 0.63x): it keeps its own forward; set "
        f"{GPU_MODEL_ENV}=1 to kernelize it there"
    )
    name, fallback = type(model).__qualname__, FallbackReason.CONDITION
    choice = KernelChoice("", "kernelize_model", name, kind, mode, fallback=fallback, reason=reason)
    record_choice(model, choice)
    logger.warning("kernelize_model: %s", reason)
    return True


def _verify(
    model: nn.Module,
    call: Callable[[], Any] | str,
    want: Any,
    attention: str | None,
    experts: str | None = None,
) -> str:
    """Probe the replaced modules (see `kernelize.integrations.verify`); put refused ones back to eager.

    A kernel forward that bypasses its submodules (a decoder layer's fused block) is judged as a whole; when
    it is refused, its submodules run again, so the next round probes them. Rounds stop when one refuses
    nothing. Then the whole model's output is compared with `want` (its output before `kernelize_model`):
    on a difference the model's own experts implementation (`experts`, if it was switched) comes back, then
    its own attention implementation (`attention`, likewise), and if the difference stays, every module runs
    its own forward. Returns what the last step did.
    """
    ran: set[str] = set()
    targets = _replaced(model)
    for _ in range(_PROBE_ROUNDS):
        if not targets or want is None:
            break
        try:
            refused, ran_now = verify_replacements(model, targets, call)
        except Exception as exc:  # the probe failed outside every checked forward: nothing was judged
            logger.warning("kernelize_model: the probe forward raised %s: %s", type(exc).__name__, exc)
            break
        ran |= ran_now
        for path, why in refused.items():
            detail = f"{why} (probed); its own forward runs"
            keep_original_forward(targets[path], FallbackReason.VERIFY, detail)
        targets = _replaced(model)
        if not refused:
            break
    if want is None:
        why = call if isinstance(call, str) else "the model's own forward raised on the probe"
        _note_all(targets, f"not verified: {why}")
        return "not verified"
    # a module inside a verified kernel forward (a decoder layer's fused norm) need not run on its own
    unjudged = {p: m for p, m in targets.items() if not any(r == p or p.startswith(f"{r}.") for r in ran)}
    _note_all(unjudged, "not verified: the probe did not call it")
    return _whole_output(model, call, want, attention, experts)


def _whole_output(
    model: nn.Module, call: Callable[[], Any], want: Any, attention: str | None, experts: str | None
) -> str:
    """Compare the model's output with `want`; on a difference take back, in turn, the experts
    implementation, the attention implementation, then every kernel forward, until it is the same.

    When taking back both implementations makes it the same, the first one taken back is tried again alone:
    only the implementation that changed the output goes (DeepSeek-V4's attention needs eager masks, while
    its experts match).
    """
    switches = [
        _Switch("experts", EXPERTS_NAME, experts, model.set_experts_implementation) if experts else None,
        _Switch("attention", ATTENTION_NAME, attention, model.set_attn_implementation) if attention else None,
    ]
    taken: list[_Switch] = []
    compute = _coarsest_dtype(model)

    def differs() -> str | None:
        return difference(_model_output(model, call), want, "the model's output", compute)

    why = differs()
    for switch in (s for s in switches if s is not None):
        if not why:
            break
        logger.warning("kernelize_model: %s; taking back the `%s` %s (to `%s`)", why, *switch.names)
        switch.set(switch.previous)
        taken.append(switch)
        found, why = why, differs()
        switch.why = found
    if not why and len(taken) == 2:  # was the first one needed?
        taken[0].set(taken[0].kernel)
        if differs() is None:
            logger.warning(
                "kernelize_model: the `%s` %s stay: the output is the same with them", *taken[0].names[:2]
            )
            taken.pop(0)
        else:
            taken[0].set(taken[0].previous)
    for switch in taken:
        if switch.kind == "experts":
            for module in experts_modules(model).values():
                keep_experts(module, f"{switch.why} with the `{EXPERTS_NAME}` experts; back to `{experts}`")
    if why:
        for module in _replaced(model).values():
            detail = f"{why} with every module probed alone; every module runs its own forward"
            keep_original_forward(module, FallbackReason.VERIFY, detail)
        return f"kernels withdrawn: {why}"
    done = [f"{s.kind} implementation back to `{s.previous}`: `{s.kernel}` changed the output" for s in taken]
    return "; ".join(done) or "verified"


def _coarsest_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype of the model's parameters with the widest tolerance (bf16 over f16 over f32): a bf16
    model's logits upcast to f32 (Nemotron-H) are judged as bf16 results."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: TOLERANCE.get(d, 0.0), default=None)


@dataclass
class _Switch:
    """One implementation the one call switched (experts or attention), and how to switch it back."""

    kind: str
    kernel: str
    previous: str
    set: Callable[[str], Any]
    why: str = ""

    @property
    def names(self) -> tuple[str, str, str]:
        return self.kernel, self.kind, self.previous


def _replaced(model: nn.Module) -> dict[str, nn.Module]:
    """path -> module, for every module whose forward is a kernel layer's now (experts modules run the kernel
    through transformers' experts interface instead, and are judged by the whole model's output)."""
    return {
        path: module
        for path, module in model.named_modules()
        if (choice := recorded_choice(module)) is not None
        and choice.uses_kernel
        and choice.layer_name not in (EXPERTS_LAYER, ROUTER_LAYER)
    }


def _note_all(modules: Mapping[str, nn.Module], note: str) -> None:
    for module in modules.values():
        choice = recorded_choice(module)
        if choice is not None and note not in choice.notes:
            record_choice(module, dataclasses.replace(choice, notes=(*choice.notes, note)))


def _record_verdicts(model: nn.Module, found: Mapping[str, Recognition]) -> None:
    """Put the recognition's reason on modules left eager, and its detail on replaced attention modules."""
    for path, verdict in found.items():
        module = model.get_submodule(path)
        choice = recorded_choice(module)
        if choice is None:
            continue
        if choice.fallback == FallbackReason.CONDITION and verdict.layer_name is None:
            choice = dataclasses.replace(choice, reason=verdict.reason)
        elif choice.uses_kernel and verdict.kind == "attention" and verdict.reason not in choice.notes:
            choice = dataclasses.replace(choice, notes=(verdict.reason, *choice.notes))
        if choice.uses_kernel and (shards := _on_shards(module)) and shards not in choice.notes:
            choice = dataclasses.replace(choice, notes=(*choice.notes, shards))
        record_choice(module, choice)


def _prepare(model: nn.Module, mapping: Mapping[str, Any] | None, quantize: str | None) -> Mapping[str, Any]:
    """The mapping to use (the bundled `default_mapping()` when None), after quantizing the model if asked:
    before the probe, so the verification's reference is the quantized model's output."""
    if quantize is not None:
        from kernelize.quant.model import quantize_for_kernelize

        quantize_for_kernelize(model, quantize)
    if mapping is None:
        from kernelize.hub import default_mapping

        return default_mapping()
    return mapping


def _reference(model: nn.Module, verify: bool) -> tuple[Callable[[], Any] | str, Any]:
    """The probe forward (or why there is none) and the model's own output on it. The probe replays the
    routing of the reference forward (`Routing`): a near-tie token routed elsewhere is no kernel's fault."""
    call = _probe_call(model) if verify else "verify=False"
    routing = Routing(model)
    with routing.recording():
        want = _model_output(model, call) if verify else None
    return (call if isinstance(call, str) else routing.pinning(call)), want


def kernelize_model(
    model: nn.Module,
    mode: Mode = Mode.INFERENCE,
    mapping: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    verify: bool = True,
    quantize: str | None = None,
) -> nn.Module:
    """Kernelize a transformers model in one call: recognise its layers, mark them, `kernelize`, verify.

    Args:
        model: An unmodified transformers model (Llama, Qwen2, Mistral, Gemma, Phi-3 and look-alikes).
        mode: As for `kernelize` (`Mode.INFERENCE` by default).
        mapping: A kernel mapping (layer name -> repositories) used instead of the bundled
            `default_mapping()`.
        device: Device type to select kernels for; default: the device of the model's parameters.
        verify: Probe every replaced module on one small forward of the model (a batch of random token
            ids, no cache): a kernel forward that raises or whose output differs from the
            module's own (`kernelize.integrations.verify`) is put back to the module's forward, with the
            reason in `inspect`. This also compiles the kernels the probe's shapes need.
        quantize: a packed format (`kernelize.quant.FORMATS`: q8_0, q4_0, q5_0, q4_k, q6_k, int8): first pack
            every projection and the LM head; verification compares with the quantized model's output.

    Returns:
        `model`, kernelized in place (on a GPU: as it is, unless `KERNELIZE_GPU_MODEL=1`); `inspect` lists
        every replaced module and every one left eager, with the reason. Never raises for a module.

    Example:
        >>> import transformers  # doctest: +SKIP
        >>> config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # doctest: +SKIP
        >>> model = kernelize_model(transformers.LlamaForCausalLM(config).eval())  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize_model: model must be a torch.nn.Module, got {type(model).__name__}.")
    mapping = _prepare(model, mapping, quantize)  # packed weights even on a GPU: asked for, and save memory
    if _gpu_held_back(model, mode, device):
        return model
    call, want = _reference(model, verify)
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    _adopt_lm_head(model)
    if Mode.TRAINING in mode:  # inference: torch's embedding is a row copy; a kernel call adds ~20 us
        _adopt_token_embedding(model)
    found = _mark(model)
    with use_kernel_mapping(dict(mapping)):
        kernelize(model, mode=mode, device=device, use_fallback=_FALLBACKS)
    _record_verdicts(model, found)
    status = _use_attention_function(model, mode)
    switched = attention if status.startswith("attention implementation set") else None
    experts_status, experts = use_experts_function(model, mode, device)
    status = f"{status}; {experts_status}; {use_router_kernels(model, mode)}"
    if verify:
        status = f"{status}; {_verify(model, call, want, switched, experts)}"
    trim_heap()  # what the probe's merges freed (the old q/k/v, gate/up storages) goes back to the system
    replaced = sum(1 for p in found if (c := recorded_choice(model.get_submodule(p))) and c.uses_kernel)
    if replaced == 0:  # a family the table does not know: one clear line, never an exception
        logger.info("kernelize_model: no layer of %s is served: it runs its own forward", model.__class__)
    logger.info("kernelize_model: %d of %d recognised modules replaced; %s", replaced, len(found), status)
    return model
