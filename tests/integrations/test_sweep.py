"""The one call on every causal-LM class transformers ships: it never raises and never changes the logits.

Each family is a tiny random model built from its own default config (`kernelize.models.zoo`: 2 layers, one
of each kind where the config has `layer_types`), compared on a left-padded batch with its eager self:
max |logit difference| over the real positions <= 1e-4 x max |logit|, in f32; the same through the model's
own cache (the prompt, then decode steps of 1 and 2 tokens). Families whose tiny model transformers itself
cannot build or run are skipped with its error.
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


def close(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> tuple[bool, float, float]:
    real = mask.bool()
    worst = (got[real] - want[real]).abs().max().item()
    scale = want[real].abs().max().item()
    return worst <= 1e-4 * scale, worst, scale


@pytest.mark.parametrize("model_type, class_name", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_the_one_call_never_raises_and_keeps_the_logits(model_type: str, class_name: str) -> None:
    eager, ids, mask, want = eager_model(model_type, class_name)
    try:
        want_cached, full = zoo.cached_logits(eager, ids, mask)
    except Exception:  # the family's own forward cannot decode from its cache this way: logits only
        want_cached = full = None
    with kernelized(eager) as fast:
        ok, worst, scale = close(zoo.logits(fast, ids, mask), want, mask)
        assert ok, (worst, scale, kernelize.inspect(fast))
        if want_cached is not None:  # the same through the cache: the prompt, then steps of 1 and 2 tokens
            ok, worst, scale = close(zoo.cached_logits(fast, ids, mask)[0], want_cached, full)
            assert ok, ("through the cache", worst, scale, kernelize.inspect(fast))
