"""Every causal-LM family transformers ships, as a tiny random model built from its own default config.

`causal_lm_families()` lists `(model_type, class name)` for every `*ForCausalLM` / `*LMHeadModel` class in
transformers' auto mapping; `tiny_causal_lm(model_type)` builds one with 2 decoder layers (one of each kind
where the config has `layer_types`), small widths and a fixed seed, in f32, with eager attention. Nothing
is downloaded. The one-call sweep (`tests/integrations/test_sweep.py`) and `benchmarks/models.py` use them.

Example:
    >>> from kernelize.models.zoo import tiny_causal_lm  # doctest: +SKIP
    >>> model = tiny_causal_lm("llama")  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = [
    "TINY",
    "Unbuildable",
    "cached_logits",
    "causal_lm_families",
    "logits",
    "padded_batch",
    "tiny_causal_lm",
    "tiny_config",
]

# Widths every family shares, so that the generated kernels of one family serve the next (disk cache hits).
TINY: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    # MoE: few small experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,  # DeepSeek / GLM-MoE: of the 2 layers, one dense and one MoE
    # state-space layers (Mamba / Mamba2 hybrids): small states and chunks (the reference scan pads the
    # sequence to a whole chunk), heads x head size = expand x hidden
    chunk_size=16,
    mamba_chunk_size=16,
    state_size=16,
    ssm_state_size=16,
    mamba_d_state=16,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_headdim=16,
    mamba_d_ssm=128,
    # encoder-decoder and GPT-style names
    d_model=64,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=96,
    encoder_ffn_dim=96,
    ffn_dim=96,
    n_inner=96,
    num_heads=4,
    rotary_dim=8,  # GPT-J, CodeGen: rotary on part of the head
    # vision / audio towers of multimodal families
    image_size=32,
    patch_size=8,
    # multi-head latent attention (DeepSeek-V2/V3)
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)
LAYERS = 2
MAX_PARAMETERS = 20_000_000
_LAYER_COUNTS = ("num_layers", "decoder_layers", "encoder_layers", "n_layer", "num_encoder_layers")
_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class Unbuildable(Exception):
    """transformers itself cannot build or run this family's tiny model (the reason is the message)."""


def causal_lm_families() -> list[tuple[str, str]]:
    """`(model_type, class name)` of every causal-LM class in transformers' auto mapping, one per class."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    by_class: dict[str, str] = {}
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if not name.endswith(_SUFFIXES):
            continue
        config_class = getattr(getattr(transformers, name, None), "config_class", None)
        own = getattr(config_class, "model_type", None)  # the class's own family, not an alias of it
        if name not in by_class or model_type == own:
            by_class[name] = model_type
    return sorted((model_type, name) for name, model_type in by_class.items())


def _layer_kinds(config: Any, repeat: int = 1) -> list[str] | None:
    kinds = getattr(config, "layer_types", None)
    if not isinstance(kinds, list | tuple) or not kinds:
        return None
    unique = list(dict.fromkeys(kinds))
    return (unique * LAYERS * repeat)[: max(LAYERS, len(unique)) * repeat]


def _has(config: Any, key: str) -> bool:
    """The config sets `key` (directly or through its attribute_map) to a non-None, non-bool value."""
    if key not in vars(config) and key not in getattr(config, "attribute_map", {}):
        return False
    try:
        value = getattr(config, key)
    except Exception:  # a per-layer attribute (AmbiguousGlobalPerLayerAttributeError) and the like
        return False
    return value is not None and not isinstance(value, bool)


def _shrunk(config: Any, layers: bool = True, repeat: int = 1) -> Any:
    """`config` rebuilt with the tiny widths (and, with `layers`, layer count), and so every sub-config.

    Rebuilt through the constructor, not patched: configs derive fields (head_dim, KV heads, layer types)
    from the ones given. `repeat` > 1 keeps each layer kind that many times (Zamba ties weights across
    its hybrid layers, so it needs two of them).
    """
    from transformers import PretrainedConfig

    kwargs = {key: value for key, value in TINY.items() if _has(config, key)}
    if (
        "num_experts_per_tok" in vars(config)
        and config.num_experts_per_tok is None
        and _has(config, "n_routed_experts")
    ):
        kwargs["num_experts_per_tok"] = TINY["num_experts_per_tok"]  # DeepSeek-V2's default leaves it unset
    if _has(config, "kv_lora_rank"):  # latent attention: one KV head per head, head_dim from its parts
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    if layers:
        kwargs |= {key: LAYERS for key in _LAYER_COUNTS if _has(config, key)}
        kinds = _layer_kinds(config, repeat)
        key = getattr(config, "attribute_map", {}).get("layer_types", "layer_types")  # Zamba: an alias
        if kinds and key in vars(config):
            kwargs[key] = kinds
        if _has(config, "num_hidden_layers"):
            kwargs["num_hidden_layers"] = len(kinds) if kinds else LAYERS
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            kwargs[name] = _shrunk(value, layers, repeat)
    try:
        return type(config)(**kwargs)
    except Exception:  # the constructor wants the sub-configs as dicts
        subs = {k: v.to_dict() for k, v in kwargs.items() if isinstance(v, PretrainedConfig)}
        return type(config)(**(kwargs | subs))


def tiny_config(model_type: str, class_name: str | None = None, repeat: int = 1) -> Any:
    """The family's default config with 2 (or `repeat` per layer kind) layers and the `TINY` widths."""
    import transformers
    from transformers import AutoConfig

    name = class_name or dict(causal_lm_families())[model_type]
    config_class = getattr(getattr(transformers, name), "config_class", None)
    default = config_class() if config_class is not None else AutoConfig.for_model(model_type)
    try:
        config = _shrunk(default, repeat=repeat)
    except Exception:  # the family validates its layer pattern against its own layer count: keep both
        config = _shrunk(default, layers=False)
    text = config.get_text_config()
    if getattr(text, "pad_token_id", None) is None or text.pad_token_id >= TINY["vocab_size"]:
        text.pad_token_id = 0
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value >= TINY["vocab_size"]:
            setattr(text, key, 1)
    config._attn_implementation = "eager"
    return config


def _build(name: str, model_type: str, repeat: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = tiny_config(model_type, name, repeat)
    with torch.device("meta"):  # count first: a family whose sizes have other names stays large
        size = sum(p.numel() for p in getattr(transformers, name)(config).parameters())
    if size > MAX_PARAMETERS:
        raise Unbuildable(
            f"{name} keeps {size / 1e6:.0f} M parameters at the tiny widths (its sizes have other names)"
        )
    torch.manual_seed(0)
    return getattr(transformers, name)(config)


def tiny_causal_lm(model_type: str, class_name: str | None = None, dtype: torch.dtype = torch.float32):
    """A tiny random eval-mode model of the family; norm weights drawn around their init (not all ones).

    Raises:
        Unbuildable: transformers cannot build this configuration.
    """
    name = class_name or dict(causal_lm_families())[model_type]
    for repeat in (1, 2):  # 2: a family that ties weights across two layers of one kind (Zamba)
        try:
            model = _build(name, model_type, repeat)
            break
        except Unbuildable:
            raise
        except Exception as exc:  # a config the family's own code rejects at these sizes
            error = exc
    else:
        raise Unbuildable(f"transformers cannot build {name}: {type(error).__name__}: {error}") from error
    model = model.to(dtype).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def padded_batch(vocab: int = TINY["vocab_size"], batch: int = 2, seq: int = 9, pad: int = 3, seed: int = 0):
    """Left-padded `(ids, mask)`: the first row starts with `pad` pad tokens (id 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


def logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's logits on `ids`, no cache, no gradients."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def cached_logits(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, chunks: tuple[int, ...] = (1, 1, 2, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits, mask)` over every position, through the model's own cache: `ids` as the prompt, then decode
    steps of `chunks` tokens (fixed random ids, the same for every model: teacher forcing, so no argmax tie
    can fork two runs)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    # transformers 5.24 names the forward's cache argument `cache`, earlier versions `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        step = model(input_ids=ids, attention_mask=mask, use_cache=True)
        out.append(step.logits)
        for n in chunks:
            cache = getattr(step, "cache", None)
            cache = step.past_key_values if cache is None else cache
            new = torch.randint(2, int(ids.max()) + 1, (ids.shape[0], n), generator=gen)
            mask = torch.cat([mask, torch.ones_like(new)], dim=-1)
            step = model(input_ids=new, attention_mask=mask, use_cache=True, **{name: cache})
            out.append(step.logits)
    return torch.cat(out, dim=1), mask
