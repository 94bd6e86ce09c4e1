"""Attention variants of the one call's fused attention layer, recognised by probing the model file: rotary
tables read differently (gpt-oss: each angle once for both halves; GLM: interleaved pairs from the table's
first half, on part of the head) and attention sinks (gpt-oss)."""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize.models import zoo

from .test_experts import family
from .test_transformers import kernelized

transformers = pytest.importorskip("transformers")


def test_gpt_oss_attention_runs_the_kernel_with_half_rotary_tables_and_sinks() -> None:
    eager = family("gpt_oss")  # cos/sin of half the head width; a sink logit per head; sliding + full layers
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.normal_(0, 2.0)  # large sinks: a kernel that ignored them would change the logits
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        attention = {p: c for p, c in kernelize.inspect(fast).items() if p.endswith("self_attn")}
        assert len(attention) == 2 and all(c.uses_kernel for c in attention.values()), attention
        # its MoE block returns (output, router scores): the decoder layer's kernel forward takes the output
        layers = {p: c for p, c in kernelize.inspect(fast).items() if p.count(".") == 2 and ".layers." in p}
        assert len(layers) == 2 and all(c.uses_kernel for c in layers.values()), layers
        torch.testing.assert_close(
            zoo.logits(fast, ids, mask)[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4
        )
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert torch.equal(fast.generate(ids, **kw), eager.generate(ids, **kw))


@pytest.mark.parametrize("model_type", ["glm", "glm4"])
def test_glm_attention_reads_its_rotary_tables_as_interleaved_pairs_of_the_first_half(model_type) -> None:
    eager = family(model_type)  # interleaved rotary on part of the head, angles from the table's first half
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        attention = {p: c for p, c in kernelize.inspect(fast).items() if p.endswith("self_attn")}
        assert attention and all(c.uses_kernel for c in attention.values()), attention
        assert all(
            m.rotary_tables == "pairs from the first half"
            for m in fast.modules()
            if hasattr(m, "rotary_tables")
        )
        torch.testing.assert_close(
            zoo.logits(fast, ids, mask)[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4
        )
