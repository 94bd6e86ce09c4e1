"""ALiBi families (BLOOM, MPT): `kernelize_model` serves their attention with the generated kernel, ALiBi
as a score modification (`kernelize.ir.score_mod.alibi`); Falcon with `alibi=True` stays eager with the
reason."""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize import attention as kernel_attention
from kernelize.models import zoo

from .test_transformers import kernelized

transformers = pytest.importorskip("transformers")

LAYERS = {"bloom": "ResidualAlibiAttention", "mpt": "AlibiAttention"}


def tiny(model_type: str, **changes):
    """The family's tiny model, with config changes (6 heads: slopes past the power of two)."""
    if not changes:
        return zoo.tiny_causal_lm(model_type)
    config = zoo.tiny_config(model_type)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return getattr(transformers, dict(zoo.causal_lm_families())[model_type])(config).eval()


def attention_choices(model) -> dict:
    return {p: c for p, c in kernelize.inspect(model).items() if p.endswith(("self_attention", "attn"))}


def alibi_launchers() -> set[str]:
    """The ALiBi modifications of the attention kernels built so far."""
    mods = (key[-1].score_mod for key in kernel_attention._LAUNCHERS)
    return {m.name for m in mods if m is not None and m.name.startswith("alibi")}


CASES = [
    ("bloom", {}),
    ("mpt", {}),
    ("bloom", {"n_head": 6, "hidden_size": 96}),
    ("mpt", {"n_heads": 6, "d_model": 96}),
]


@pytest.mark.parametrize("model_type,changes", CASES, ids=["bloom", "mpt", "bloom-6-heads", "mpt-6-heads"])
def test_alibi_families_run_the_attention_kernel_with_their_own_logits_and_tokens(model_type, changes):
    eager = tiny(model_type, **changes)
    heads = eager.config.num_attention_heads
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        choices = attention_choices(fast)
        assert len(choices) == eager.config.num_hidden_layers, choices
        assert all(c.uses_kernel and c.layer_name == LAYERS[model_type] for c in choices.values()), choices
        got = zoo.logits(fast, ids, mask)
        real = mask.bool()  # a left pad's query sees no key: its row is the implementations' own
        torch.testing.assert_close(got[real], want[real], atol=1e-4 * want[real].abs().max(), rtol=1e-4)
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert torch.equal(fast.generate(ids, **kw), eager.generate(ids, **kw))
        notes = [n for c in attention_choices(fast).values() for n in c.notes]
        assert not any(n.startswith("eager attention") for n in notes), notes
        slopes = ", bloom" if model_type == "bloom" else ""
        assert f"alibi({heads}, 8.0{slopes})" in alibi_launchers()


def test_calls_with_gradients_and_attention_weights_take_the_bias_outside_the_kernel():
    """With gradients: torch's SDPA with the bias in the mask; `output_attentions`: the written-out softmax
    with the weights. Both keep the model's logits, and the reason is in `inspect`."""
    eager = tiny("bloom")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
    with kernelized(eager) as fast:
        with torch.no_grad():
            got = fast(input_ids=ids, attention_mask=mask, output_attentions=True)
        torch.testing.assert_close(got.logits[real], want.logits[real], atol=1e-4, rtol=1e-4)
        last = want.attentions[-1][1]  # the unpadded row's attention weights
        torch.testing.assert_close(got.attentions[-1][1], last, atol=1e-5, rtol=1e-4)
        out = fast(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(out[real].detach(), want.logits[real], atol=1e-4, rtol=1e-4)
        out[real].sum().backward()
        assert all(p.grad is not None for p in fast.transformer.h[0].self_attention.parameters())
        notes = " ".join(n for c in attention_choices(fast).values() for n in c.notes)
        assert "output_attentions=True" in notes and "with gradients" not in notes, notes


def test_falcon_with_alibi_stays_eager_with_the_reason():
    eager = tiny("falcon", alibi=True)
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        choices = attention_choices(fast)
        assert choices and not any(c.uses_kernel for c in choices.values())
        assert all("rounded to bf16" in c.reason for c in choices.values()), choices
        torch.testing.assert_close(zoo.logits(fast, ids, mask), want, atol=1e-4, rtol=1e-4)
