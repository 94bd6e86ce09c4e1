"""What the kernels do not support runs the eager path, the reason in `kernelize.inspect`; never wrong."""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize import model_attention

from .test_transformers import (
    HAS_KERNEL,
    assert_same_logits_and_tokens,
    kernelized,
    needs_kernel,
    padded_batch,
    tiny_model,
)

transformers = pytest.importorskip("transformers")


def attention_choice(model, layer: int = 0):
    return kernelize.inspect(model)[f"model.layers.{layer}.self_attn"]


@needs_kernel
def test_softcapping_runs_in_the_attention_kernel() -> None:
    """Gemma 2's logit soft-capping is a score modification compiled into the kernel (tiny caps, so it
    bites); with gradients torch's SDPA has none, and the module's eager attention runs, with the note."""
    eager = tiny_model(config_name="Gemma2Config", model_name="Gemma2ForCausalLM", attn_logit_softcapping=0.5)
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        choice = attention_choice(fast)
        assert choice.uses_kernel and "soft-capping 0.5" in str(choice), str(choice)
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        assert not any("softcapping" in n for n in attention_choice(fast).notes)
        fast.train()
        fast(ids, attention_mask=mask).logits.sum().backward()
        assert any("softcapping (0.5) is not in torch's SDPA" in n for n in attention_choice(fast).notes)


@needs_kernel
@pytest.mark.parametrize(
    "config_name, model_name", [("Qwen3Config", "Qwen3ForCausalLM"), ("Olmo2Config", "Olmo2ForCausalLM")]
)
def test_query_key_norms_run_before_rotary_in_the_attention_layer(config_name: str, model_name: str) -> None:
    """Qwen3 normalises each head, OLMo2 the whole projection: the decoder layer's fused block takes per-head
    norms into its first graph (Qwen3) and steps aside for the others, with the reason (OLMo2)."""
    eager = tiny_model(config_name=config_name, model_name=model_name)
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        assert attention_choice(fast).uses_kernel, str(attention_choice(fast))
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        layer = kernelize.inspect(fast)["model.layers.0"]
        block = fast.model.layers[0].__dict__["_kernelize_block"][1]
        if model_name.startswith("Qwen3"):
            assert layer.uses_kernel and layer.notes == (), layer
            assert block.pre["qk_norm"] == "RMSNorm", block
        else:
            assert any("query/key norms" in n for n in layer.notes), layer.notes


def test_alibi_config_keeps_the_attention_module_eager() -> None:
    eager = tiny_model("llama")
    eager.config.alibi = True
    with kernelized(eager) as fast:
        choice = attention_choice(fast)
        assert not choice.uses_kernel and "ALiBi" in choice.reason, str(choice)


def test_activation_without_gated_math_keeps_the_mlp_eager() -> None:
    eager = tiny_model("llama", hidden_act="relu")
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)["model.layers.0.mlp"]
        assert not choice.uses_kernel and "'relu'" in choice.reason, str(choice)
        assert kernelize.inspect(fast)["model.norm"].uses_kernel
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        notes = kernelize.inspect(fast)["model.layers.0"].notes
        assert notes == (
            "the block runs the MLP's own forward: mlp is not a GatedMLP / FusedGatedMLP kernel layer",
        ), notes


def test_missing_attention_kernel_keeps_attention_eager(monkeypatch) -> None:
    monkeypatch.setattr(model_attention, "attention_kernel", lambda: None)
    monkeypatch.setattr("kernelize.integrations.transformers.attention_kernel", lambda: None)
    eager = tiny_model("llama")
    with kernelized(eager) as fast:
        choice = attention_choice(fast)
        assert not choice.uses_kernel and choice.reason == model_attention.KERNEL_UNAVAILABLE
        assert fast.config._attn_implementation == "eager"


@needs_kernel
def test_sliding_window_beyond_the_window_runs_in_the_kernel() -> None:
    """Past the window: transformers' mask cuts it (padded batch), or, without a mask, the kernel's
    sliding-window score modification does; prefill, decode with the cache, and gradients agree."""
    eager = tiny_model("mistral", sliding_window=6)
    ids, mask = padded_batch(seq=11)
    with kernelized(eager) as fast:
        assert attention_choice(fast).uses_kernel
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        assert_same_logits_and_tokens(eager, fast, ids, torch.ones_like(mask))
        notes = attention_choice(fast).notes
        assert notes == ("neox rotary, 4/2 heads; sliding window 6",), notes  # no eager-path note
        fast.train(), eager.train()
        for model in (fast, eager):
            model.zero_grad()
            model(ids).logits.square().mean().backward()
        for p, q in zip(fast.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)


@needs_kernel
def test_output_attentions_runs_eager_attention_and_returns_weights() -> None:
    eager = tiny_model("qwen2")
    ids, mask = padded_batch()
    with kernelized(eager) as fast, torch.no_grad():
        want = eager(ids, attention_mask=mask, output_attentions=True)
        got = fast(ids, attention_mask=mask, output_attentions=True)
        real = mask.bool()
        torch.testing.assert_close(got.logits[real], want.logits[real], atol=1e-4, rtol=1e-4)
        assert got.attentions is not None and len(got.attentions) == len(want.attentions)
        torch.testing.assert_close(got.attentions[1][1], want.attentions[1][1], atol=1e-5, rtol=1e-5)
        assert any("output_attentions" in n for n in attention_choice(fast).notes)


@needs_kernel
def test_kernel_declining_a_call_runs_eager_attention(monkeypatch) -> None:
    """AttentionUnsupported from the kernel: that call runs the eager path, the reason is noted."""
    _, unsupported = model_attention.attention_kernel()

    def declining(*args, **kwargs):
        raise unsupported("head dim 16 declined for the test")

    eager = tiny_model("llama")
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        monkeypatch.setattr(model_attention, "attention_kernel", lambda: (declining, unsupported))
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        assert any("declined" in n for n in attention_choice(fast).notes), attention_choice(fast).notes


def test_training_dropout_and_unknown_arguments_take_the_eager_path() -> None:
    module = torch.nn.Linear(2, 2).train()
    q = k = torch.zeros(1, 2, 3, 4)
    reason = model_attention.call_fallback_reason(module, q, k, 0.1, {})
    if not HAS_KERNEL:
        assert reason == model_attention.KERNEL_UNAVAILABLE
    else:
        assert "dropout (0.1) in training" in reason
        assert model_attention.call_fallback_reason(module.eval(), q, k, 0.1, {}) is None
        assert "position_bias" in model_attention.call_fallback_reason(
            module, q, k, 0.0, {"position_bias": q}
        )
        assert model_attention.call_fallback_reason(module, q, k, 0.0, {"position_ids": q}) is None


@pytest.mark.parametrize("q_len, kv_len, padded", [(5, 5, False), (3, 7, False), (1, 6, True), (4, 4, True)])
def test_eager_path_masks_match_sdpa(q_len: int, kv_len: int, padded: bool) -> None:
    """The eager path turns the boolean / None masks into additive ones (rows with keys compared)."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.is_causal = 2, False, True
    q, k, v = torch.randn(2, 4, q_len, 8), torch.randn(2, 2, kv_len, 8), torch.randn(2, 2, kv_len, 8)
    mask = None
    if padded:
        mask = torch.ones(2, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        mask[0, :, :, :2] = False
    out, _ = model_attention.eager_attention(module, q, k, v, mask, scaling=0.3)
    causal = mask if mask is not None else torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal, scale=0.3, enable_gqa=True
    )
    live = causal.expand(2, 1, q_len, kv_len).any(-1).squeeze(1)  # (batch, q): a fully masked row is padding
    torch.testing.assert_close(out[live], want.transpose(1, 2)[live], atol=1e-5, rtol=1e-5)


def test_a_mapping_without_the_attention_layer_keeps_attention_eager() -> None:
    from kernelize.hub import default_mapping

    mapping = {k: v for k, v in default_mapping().items() if k != "CausalSelfAttention"}
    eager = tiny_model("llama")
    with kernelized(eager, mapping=mapping) as fast:
        choice = attention_choice(fast)
        assert not choice.uses_kernel and choice.fallback == kernelize.FallbackReason.NO_LAYER, str(choice)
        assert kernelize.inspect(fast)["model.norm"].uses_kernel


def test_training_mode_attention_runs_torch_sdpa_with_gradients() -> None:
    """Calls that need gradients take torch's SDPA inside the attention layer (rotary stays a generated
    kernel with its generated backward); the model's attention implementation is left as it was."""
    eager = tiny_model("llama").train()
    eager.config._attn_implementation = "sdpa"
    with kernelized(eager, mode=kernelize.Mode.TRAINING) as fast:
        assert attention_choice(fast).uses_kernel
        assert fast.config._attn_implementation == "sdpa"
        ids, mask = torch.randint(1, 96, (2, 9)), torch.ones(2, 9, dtype=torch.long)
        mask[0, :3] = 0  # a left-padded row: the model's own sdpa mask reaches the layer
        want = eager(input_ids=ids, attention_mask=mask).logits
        got = fast(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
        seed = torch.randn_like(want)
        (want[real] * seed[real]).sum().backward()
        (got[real] * seed[real]).sum().backward()
        for (name, p), q in zip(eager.named_parameters(), fast.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
        assert not [n for n in attention_choice(fast).notes if n.startswith("eager attention")]


def test_not_a_module_is_a_type_error() -> None:
    from kernelize.integrations.transformers import kernelize_model

    with pytest.raises(TypeError, match="kernelize_model: model must be a torch.nn.Module"):
        kernelize_model("llama")


@needs_kernel
def test_attention_sinks_and_alternating_windows_run_in_the_kernel(monkeypatch) -> None:
    """gpt-oss: sinks (a logit per head, `s_aux`) and sliding-window layers go through the `kernelize`
    attention function into the kernel, sinks included (no eager-attention note); logits and greedy tokens
    equal eager's."""
    sdpa, unsupported = model_attention.attention_kernel()
    with_sinks: list[bool] = []

    def counted(*args, **kwargs):
        with_sinks.append(kwargs.get("sinks") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(model_attention, "attention_kernel", lambda: (counted, unsupported))
    eager = tiny_model(config_name="GptOssConfig", model_name="GptOssForCausalLM", sliding_window=4)
    for module in eager.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)  # sinks that take a real share of the softmax
    ids, mask = padded_batch(seq=11)
    with kernelized(eager) as fast:
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        assert_same_logits_and_tokens(eager, fast, ids, torch.ones_like(mask))
        for layer in (0, 1):
            notes = attention_choice(fast, layer).notes
            assert not any(n.startswith("eager attention") for n in notes), notes
    assert with_sinks and all(with_sinks), with_sinks


def test_a_gpu_model_keeps_its_own_forward_unless_asked_and_still_gets_packed_weights(monkeypatch) -> None:
    """The whole-model path measured slower than eager on an H200: the one call leaves a GPU model as it is,
    says why (and how to opt in) in `inspect` and the log, and still packs the weights it was asked to."""
    from kernelize.integrations import transformers as integration
    from kernelize.quant import QuantizedLinear

    monkeypatch.delenv(integration.GPU_MODEL_ENV, raising=False)
    model = tiny_model()
    forward = type(model.model.layers[0].mlp).forward
    out = integration.kernelize_model(model, device="cuda", quantize="q8_0")
    assert out is model
    choice = kernelize.inspect(model)[""]  # the root: other modules' classes may be marked by earlier tests
    assert not choice.uses_kernel and integration.GPU_MODEL_ENV in choice.reason and "cuda" in choice.reason
    assert type(model.model.layers[0].mlp).forward is forward  # no class was marked, no forward swapped
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
