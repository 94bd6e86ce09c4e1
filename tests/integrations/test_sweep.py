"""The one call on every causal-LM class transformers ships: it never raises and never changes the logits.

Each family is a tiny random model built from its own default config (`kernelize.models.zoo`: 2 layers, one
of each kind where the config has `layer_types`), compared on a left-padded batch with its eager self:
max |logit difference| over the real positions <= 1e-4 x max |logit|, in f32. Families whose tiny model
transformers itself cannot build or run are skipped with its error.
"""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize.models import zoo

from .test_transformers import kernelized

transformers = pytest.importorskip("transformers")

FAMILIES = zoo.causal_lm_families()


def eager_model(model_type: str, class_name: str):
    try:
        model = zoo.tiny_causal_lm(model_type, class_name)
    except zoo.Unbuildable as exc:
        pytest.skip(str(exc))
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, torch.nn.Embedding):
        pytest.skip(
            f"{class_name} takes no token ids (its input embeddings are a {type(embedding).__name__})"
        )
    ids, mask = zoo.padded_batch(embedding.num_embeddings)
    try:
        want = zoo.logits(model, ids, mask)
    except Exception as exc:  # the family's own forward fails on its tiny config
        pytest.skip(f"transformers cannot run {class_name}: {type(exc).__name__}: {exc}")
    return model, ids, mask, want


@pytest.mark.parametrize("model_type, class_name", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_the_one_call_never_raises_and_keeps_the_logits(model_type: str, class_name: str) -> None:
    eager, ids, mask, want = eager_model(model_type, class_name)
    with kernelized(eager) as fast:
        got = zoo.logits(fast, ids, mask)
        real = mask.bool()
        worst = (got[real] - want[real]).abs().max().item()
        scale = want[real].abs().max().item()
        choices = {p: c for p, c in kernelize.inspect(fast).items()}
        assert worst <= 1e-4 * scale, (worst, scale, choices)


def test_the_sweep_covers_the_popular_families() -> None:
    listed = {name for _, name in FAMILIES}
    popular = {
        *("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        *("Qwen3_5ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "PhiForCausalLM"),
        *("Phi3ForCausalLM", "GPT2LMHeadModel", "GptOssForCausalLM", "DeepseekV3ForCausalLM"),
    }
    assert popular <= listed, popular - listed
    assert len(FAMILIES) >= 150
