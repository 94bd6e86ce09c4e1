"""Real transformers models (tiny configs built in code, no downloads), kernelized on the CPU with the hub.

Mapping: transformers already marks its RMSNorm classes `RMSNorm` (we mark them again with our
`replace_kernel_forward_from_hub`, as a user would for a class they do not own). Its MLP activation is
`ACT2FN[hidden_act]` *inside* the MLP, so marking only the activation module would replace a single silu and
leave the product with `up` to eager; we mark the whole MLP class (`LlamaMLP`), whose hub layer `GatedMLP`
keeps the three projections as torch matmuls and runs `act(gate) * up` as one generated kernel.
"""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize import Mode, hub

transformers = pytest.importorskip("transformers")

# family -> (config class, model class, RMSNorm class, MLP class, name to mark the norm with)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        "models.llama.modeling_llama",
        "LlamaRMSNorm",
        "LlamaMLP",
        "RMSNorm",
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        "models.qwen2.modeling_qwen2",
        "Qwen2RMSNorm",
        "Qwen2MLP",
        "RMSNorm",
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        "models.mistral.modeling_mistral",
        "MistralRMSNorm",
        "MistralMLP",
        "RMSNorm",
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        "models.gemma.modeling_gemma",
        "GemmaRMSNorm",
        "GemmaMLP",
        "GemmaRMSNorm",
    ),
}
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    head_dim=16,
)


@pytest.fixture
def marked(request):
    """Mark a family's RMSNorm and MLP classes for the test and restore the classes afterwards."""
    import importlib

    family = request.param
    cfg_name, model_name, module_path, norm_name, mlp_name, norm_mark = FAMILIES[family]
    module = importlib.import_module(f"transformers.{module_path}")
    # every class of the family's module: only the two this test marks may be kernelized (a `kernelize_model`
    # of another test leaves marks on the family's classes, as it does on a user's)
    classes = [getattr(module, norm_name), getattr(module, mlp_name)]
    classes += [c for c in vars(module).values() if isinstance(c, type) and c not in classes]
    saved = [
        {k: cls.__dict__[k] for k in ("kernel_layer_name", "kernel_condition") if k in cls.__dict__}
        for cls in classes
    ]
    for cls, attrs in zip(classes[2:], saved[2:]):
        for k in attrs:
            delattr(cls, k)
    kernelize.replace_kernel_forward_from_hub(classes[0], norm_mark)
    kernelize.replace_kernel_forward_from_hub(classes[1], "LlamaMLP")
    try:
        yield (
            family,
            getattr(transformers, cfg_name),
            getattr(transformers, model_name),
            (norm_mark, "LlamaMLP"),
        )
    finally:
        for cls, attrs in zip(classes, saved):
            for k in ("kernel_layer_name", "kernel_condition"):
                if k in attrs:
                    setattr(cls, k, attrs[k])
                elif k in cls.__dict__:
                    delattr(cls, k)


def _model(config_cls, model_cls, family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    extra = {"hidden_act": "gelu_pytorch_tanh"} if family == "gemma" else {}
    config = config_cls(**TINY, **extra)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    for name, p in model.named_parameters():  # non-trivial norm weights
        if "norm" in name:
            torch.nn.init.normal_(p, 0.5 if family == "gemma" else 1.0, 0.2)
    return model


@pytest.mark.parametrize("marked", list(FAMILIES), indirect=True)
def test_logits_and_greedy_generate_match_eager(marked) -> None:
    family, config_cls, model_cls, names = marked
    model = _model(config_cls, model_cls, family)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        want = model(ids).logits
        want_tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)

    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=Mode.INFERENCE)
    choices = kernelize.inspect(model)
    used = {c.layer_name for c in choices.values() if c.uses_kernel}
    assert set(names) <= used, [str(c) for c in choices.values()]

    with torch.no_grad():
        got = model(ids).logits
        got_tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_tokens, want_tokens)
    ran = [c for c in kernelize.inspect(model).values() if c.layer_name in names]
    assert ran and all(c.backend == "cpu" and c.kernels for c in ran), [str(c) for c in ran]


@pytest.mark.parametrize("marked", ["llama"], indirect=True)
def test_inference_torch_compile_mode_runs_under_torch_compile(marked) -> None:
    family, config_cls, model_cls, names = marked
    model = _model(config_cls, model_cls, family)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    compiled = torch.compile(model)
    with torch.no_grad():
        got = compiled(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # calls traced by torch.compile do not record; an eager call does
        torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)
    ran = [c for c in kernelize.inspect(model).values() if c.layer_name in names]
    assert ran and all(c.uses_kernel and c.backend == "cpu" for c in ran), [str(c) for c in ran]
