"""GPT-2's attention (fused `c_attn`, `c_proj`, no rotary): `kernelize_model` serves it with
`kernelize/llm`'s `FusedQKVAttention` (the generated matmul and attention kernels), for every way GPT-2's
config scales the scores; cross-attention instances and the look-alikes of another layout stay eager with the
reason. Its decoder layers run `FusedQKVDecoderLayer`: three graphs around the attention kernel in inference,
their own forward (with the submodules' kernels) where hooks, gradients or cross-attention need it."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import kernelize
from kernelize.models import zoo

from .test_transformers import graphs_run, kernelized

transformers = pytest.importorskip("transformers")


def tiny_gpt2(**changes) -> nn.Module:
    config = zoo.tiny_config("gpt2")
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def attention_choices(model: nn.Module) -> dict:
    return {p: c for p, c in kernelize.inspect(model).items() if p.endswith(("attn", "crossattention"))}


def as_linears(model: nn.Module) -> nn.Module:
    """`model` with every attention `Conv1D` swapped for the equal `nn.Linear` (weight transposed)."""
    for block in model.transformer.h:
        for name in ("c_attn", "c_proj"):
            conv = getattr(block.attn, name)
            linear = nn.Linear(*conv.weight.shape)
            with torch.no_grad():
                linear.weight.copy_(conv.weight.t())
                linear.bias.copy_(conv.bias)
            setattr(block.attn, name, linear)
    return model


def assert_same_logits_and_tokens(eager: nn.Module, fast: nn.Module) -> None:
    """Logits on a left-padded batch within 1e-4 of the largest (f32), and the same greedy tokens with the
    KV cache."""
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want, got = zoo.logits(eager, ids, mask), zoo.logits(fast, ids, mask)
    real = mask.bool()  # a left pad's query sees no key: its row is the implementations' own
    torch.testing.assert_close(got[real], want[real], atol=1e-4 * want[real].abs().max(), rtol=1e-4)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(fast.generate(ids, **kw), eager.generate(ids, **kw))


VARIANTS = {
    "gpt2": {},
    "inverse-layer-scale": {"scale_attn_by_inverse_layer_idx": True},
    "unscaled": {"scale_attn_weights": False},
    "reorder-and-upcast": {"reorder_and_upcast_attn": True, "_attn_implementation": "eager"},
    "6-heads": {"n_head": 6, "n_embd": 96},
}


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS)
def test_gpt2_attention_runs_the_kernel_layer_with_its_own_logits_and_tokens(changes):
    eager = tiny_gpt2(**changes)
    with kernelized(eager) as fast:
        choices = attention_choices(fast)
        assert len(choices) == eager.config.n_layer, choices
        assert all(c.uses_kernel and c.layer_name == "FusedQKVAttention" for c in choices.values()), choices
        assert_same_logits_and_tokens(eager, fast)
        notes = [n for c in attention_choices(fast).values() for n in c.notes]
        assert not any(n.startswith(("eager attention", "own forward")) for n in notes), notes


def test_linear_projections_are_the_same_layout():
    eager = as_linears(tiny_gpt2())
    with kernelized(eager) as fast:
        choices = attention_choices(fast)
        assert all(c.layer_name == "FusedQKVAttention" and c.uses_kernel for c in choices.values()), choices
        assert "fused c_attn (Linear)" in " ".join(n for c in choices.values() for n in c.notes)
        assert_same_logits_and_tokens(eager, fast)


def test_calls_with_gradients_take_torch_projections_and_sdpa_with_a_backward():
    eager = tiny_gpt2()
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    real = mask.bool()
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        out = fast(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(out[real].detach(), want[real], atol=1e-4, rtol=1e-4)
        out[real].sum().backward()
        attn = fast.transformer.h[0].attn
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attn.parameters())
        assert all(c.uses_kernel for c in attention_choices(fast).values())


def test_cross_attention_stays_eager_with_the_reason():
    eager = tiny_gpt2(add_cross_attention=True)
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    encoder = torch.randn(ids.shape[0], 5, eager.config.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, encoder_hidden_states=encoder).logits
    with kernelized(eager) as fast:
        choices = attention_choices(fast)
        cross = {p: c for p, c in choices.items() if p.endswith("crossattention")}
        assert cross and all(not c.uses_kernel and "cross-attention" in c.reason for c in cross.values())
        own = {p: c for p, c in choices.items() if p not in cross}
        assert own and all(c.uses_kernel for c in own.values()), own
        with torch.no_grad():
            got = fast(input_ids=ids, attention_mask=mask, encoder_hidden_states=encoder).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4 * want[real].abs().max(), rtol=1e-4)


def test_gpt_bigcode_is_another_layout_and_stays_eager_with_the_reason():
    eager = zoo.tiny_causal_lm("gpt_bigcode")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        choices = attention_choices(fast)
        assert choices and not any(c.uses_kernel for c in choices.values()), choices
        assert all("differ from GPT-2's" in c.reason for c in choices.values()), choices
        real = mask.bool()
        torch.testing.assert_close(zoo.logits(fast, ids, mask)[real], want[real], atol=1e-4, rtol=1e-4)


def test_conv1d_weights_are_relaid_as_linear_in_memory_with_the_same_state_dict():
    """Inference re-lays every `Conv1D` weight (attention and MLP) once as `(out, in)` in memory, the layout
    the matmul kernels read fastest; values, shapes and the saved state are unchanged."""
    eager = tiny_gpt2()
    with kernelized(eager) as fast:
        convs = {n: m for n, m in fast.named_modules() if type(m).__name__ == "Conv1D"}
        assert len(convs) == 4 * eager.config.n_layer
        assert all(m.weight.t().is_contiguous() for m in convs.values()), "a Conv1D weight kept (in, out)"
        want, got = eager.state_dict(), fast.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert_same_logits_and_tokens(eager, fast)
        fast.load_state_dict(eager.state_dict())  # copies into the re-laid memory: the kernels read it
        assert all(m.weight.t().is_contiguous() for m in convs.values())
        assert_same_logits_and_tokens(eager, fast)


def layer_choices(model: nn.Module) -> dict:
    """The decoder layers' records (`transformer.h.<i>`)."""
    return {p: c for p, c in kernelize.inspect(model).items() if re.fullmatch(r"transformer\.h\.\d+", p)}


BLOCK_GRAPHS = ("dense_pre_math", "dense_post_math", "dense_mlp_math")


@pytest.mark.parametrize("changes", [{}, {"activation_function": "relu"}], ids=["gelu_new", "relu"])
def test_decoder_layers_run_three_graphs_around_the_attention_kernel(changes, monkeypatch):
    eager = tiny_gpt2(**changes)
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    with kernelized(eager) as fast:
        choices = layer_choices(fast)
        assert len(choices) == eager.config.n_layer, choices
        assert all(c.uses_kernel and c.layer_name == "FusedQKVDecoderLayer" for c in choices.values())
        names = graphs_run(fast, ids, mask, monkeypatch)
        per_layer = [n for n in names if n in BLOCK_GRAPHS]
        assert per_layer == list(BLOCK_GRAPHS) * eager.config.n_layer, names
        assert_same_logits_and_tokens(eager, fast)


def test_a_hooked_submodule_runs_the_layer_module_by_module_with_the_reason(monkeypatch):
    """A hook on the MLP must see its calls: that layer runs its own forward (the submodules' kernels)."""
    eager = tiny_gpt2()
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    with kernelized(eager) as fast:
        seen = []
        fast.transformer.h[1].mlp.register_forward_hook(lambda *_: seen.append(1))
        names = graphs_run(fast, ids, mask, monkeypatch)
        assert seen == [1]
        assert names.count("dense_mlp_math") == eager.config.n_layer - 1, names
        notes = layer_choices(fast)["transformer.h.1"].notes
        assert any("`mlp` has forward hooks" in n for n in notes), notes
        assert_same_logits_and_tokens(eager, fast)
