"""Decoder layers whose norms sit before and after attention and the MLP (Gemma 2 / 3's sandwich, OLMo2's
post-norms) and the gated norms of Qwen3.5 / Qwen3-Next, kernelized in one call and compared with the
model's own eager forward (logits within 1e-4, greedy tokens identical)."""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize import hub
from kernelize.layer.record import FallbackReason
from kernelize.models import zoo

from .test_transformers import (
    assert_same_logits_and_tokens,
    graphs_run,
    kernelized,
    needs_kernel,
    padded_batch,
    tiny_model,
)

transformers = pytest.importorskip("transformers")

LAYOUTS = {  # family -> (config, model, decoder kernel layer, slot -> norm submodule)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "EmbeddingsFirstDecoderLayer",
        {
            "input": "input_layernorm",
            "post_attn": "post_attention_layernorm",
            "pre_ff": "pre_feedforward_layernorm",
            "post_ff": "post_feedforward_layernorm",
        },
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        "PreNormDecoderLayer",
        {"post_attn": "post_attention_layernorm", "post_ff": "post_feedforward_layernorm"},
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        "PreNormDecoderLayer",
        {"input": "input_layernorm", "pre_ff": "post_attention_layernorm"},
    ),
}


@needs_kernel
@pytest.mark.parametrize("family", list(LAYOUTS))
def test_norms_at_any_place_are_served_by_the_decoder_layer(family: str) -> None:
    config, model, layer_name, slots = LAYOUTS[family]
    eager = tiny_model(config_name=config, model_name=model)
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        for i in range(2):
            layer = fast.model.layers[i]
            choice = kernelize.inspect(fast)[f"model.layers.{i}"]
            assert choice.uses_kernel and choice.layer_name == layer_name, str(choice)
            assert layer.kernelize_norms == slots
            for name in slots.values():
                assert kernelize.inspect(fast)[f"model.layers.{i}.{name}"].uses_kernel
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        notes = kernelize.inspect(fast)["model.layers.0"].notes
        if family == "olmo2":  # its query/key norms are not in the block: module by module, noted
            assert any("query/key norms" in n for n in notes), notes
        else:  # the whole layer as the three graphs: nothing noted, and the layer's graphs ran
            assert notes == (), notes
            assert hub.kernels_ran(fast.model.layers[0]) is not None


@needs_kernel
def test_gemma3_layer_runs_the_block_with_its_per_head_query_key_norms() -> None:
    """Gemma 3's per-head query / key norms ((1 + w) style) run in the block's first graph, before the rotary:
    nothing is noted on the layer and the logits and tokens are the model's."""
    eager = tiny_model(config_name="Gemma3TextConfig", model_name="Gemma3ForCausalLM")
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)["model.layers.0"]
        assert choice.layer_name == "EmbeddingsFirstDecoderLayer", str(choice)
        assert choice.notes == (), choice.notes
        block = fast.model.layers[0].__dict__["_kernelize_block"][1]
        assert block.pre["qk_norm"] == "GemmaRMSNorm", block
        assert_same_logits_and_tokens(eager, fast, ids, mask)


class ScaledResidualLayer(transformers.models.olmo2.modeling_olmo2.Olmo2DecoderLayer):
    """OLMo2's data flow in source order, but the MLP's branch scaled: the probe, not the source, decides."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + 0.5 * hidden_states


@needs_kernel
def test_a_layer_that_differs_stays_eager_with_the_reason() -> None:
    eager = tiny_model(config_name="Olmo2Config", model_name="Olmo2ForCausalLM")
    for layer in eager.model.layers:
        layer.__class__ = ScaledResidualLayer
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)["model.layers.0"]
        assert not choice.uses_kernel and choice.fallback == FallbackReason.VERIFY, str(choice)
        assert "differs" in choice.reason, choice.reason
        assert kernelize.inspect(fast)["model.layers.0.mlp"].uses_kernel  # its submodules still are served
        assert_same_logits_and_tokens(eager, fast, ids, mask)


def test_a_norm_outside_the_four_places_leaves_the_layer_eager() -> None:
    """A norm the forward does not call where a decoder layer's norms sit: the layer is not recognised."""
    eager = tiny_model("llama")
    for layer in eager.model.layers:
        layer.extra_layernorm = type(layer.input_layernorm)(eager.config.hidden_size)
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)["model.layers.0"]
        assert not choice.uses_kernel and "extra_layernorm" in choice.reason, str(choice)


@pytest.mark.parametrize(
    "model_type, class_name", [("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3_next", "Qwen3NextForCausalLM")]
)
def test_gated_norms_get_the_kernel(model_type: str, class_name: str) -> None:
    eager = zoo.tiny_causal_lm(model_type, class_name)
    ids, mask = zoo.padded_batch(eager.get_input_embeddings().num_embeddings)
    want = zoo.logits(eager, ids, mask)
    path = "model.layers.0.linear_attn.norm"
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)[path]
        assert choice.uses_kernel and choice.layer_name == "GatedRMSNorm", str(choice)
        got = zoo.logits(fast, ids, mask)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
        assert hub.kernels_ran(fast.get_submodule(path)).backend == "cpu"
        layer = kernelize.inspect(fast)["model.layers.0"]  # linear attention: its class is marked, it is not
        assert not layer.uses_kernel and "submodules differ" in layer.reason, str(layer)


@needs_kernel
@pytest.mark.parametrize("family", ["starcoder2", "jais2", "llama-layernorm-no-bias"])
def test_layer_norm_decoder_layers_run_the_block(family: str, monkeypatch) -> None:
    """Llama-style layers with LayerNorms (with a bias: Starcoder2, Jais2; without: a Llama whose norms are
    swapped for `nn.LayerNorm(bias=False)`) run the block's graphs, the norms inside them."""
    if family == "llama-layernorm-no-bias":
        eager = zoo.tiny_causal_lm("llama")
        for layer in eager.model.layers:
            for name in ("input_layernorm", "post_attention_layernorm"):
                norm = torch.nn.LayerNorm(eager.config.hidden_size, bias=False)
                torch.nn.init.normal_(norm.weight, 1.0, 0.2)
                setattr(layer, name, norm)
    else:
        eager = zoo.tiny_causal_lm(family)
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    with kernelized(eager) as fast:
        layers = len(fast.model.layers)
        for i in range(layers):
            assert kernelize.inspect(fast)[f"model.layers.{i}"].uses_kernel
        names = graphs_run(fast, ids, mask, monkeypatch)
        assert names.count("pre_attention_math") == layers, names
        assert names.count("post_attention_math") == layers, names
        real = mask.bool()
        want, got = zoo.logits(eager, ids, mask), zoo.logits(fast, ids, mask)
        torch.testing.assert_close(got[real], want[real], atol=1e-4 * want[real].abs().max(), rtol=1e-4)


class _HardCodedEpsNorm(torch.nn.Module):
    """A norm without parameters whose epsilon lives in its forward (as OLMo's)."""

    def __init__(self, width: int, eps: float, rms: bool) -> None:
        super().__init__()
        self.normalized_shape, self._e, self._rms = (width,), eps, rms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._e)
        return torch.nn.functional.layer_norm(x, self.normalized_shape, None, None, self._e)


@pytest.mark.parametrize("eps, rms", [(1e-5, False), (1e-6, True), (1e-3, False)])
def test_a_norm_without_parameters_is_recognised_with_its_probed_epsilon(eps: float, rms: bool) -> None:
    from kernelize.integrations.transformers import _plain_norm

    found = _plain_norm(_HardCodedEpsNorm(48, eps, rms))
    if eps == 1e-3:  # not an epsilon the probe tries: left eager, with the reason
        assert found.layer_name is None and "matches neither" in found.reason
        return
    assert found.layer_name == ("RMSNorm" if rms else "LayerNorm"), found
    assert found.setup == {"kernelize_eps": eps}


@needs_kernel
def test_olmo_layers_with_parameter_free_layer_norms_run_the_block(monkeypatch) -> None:
    """OLMo's norms have no parameters and keep eps = 1e-5 in their forward: recognised by probe, they run
    inside the block's graphs (style `LayerNorm:0`)."""
    eager = zoo.tiny_causal_lm("olmo")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    with kernelized(eager) as fast:
        layers = len(fast.model.layers)
        assert fast.model.layers[0].input_layernorm.kernelize_eps == 1e-5
        assert kernelize.inspect(fast)["model.norm"].uses_kernel
        names = graphs_run(fast, ids, mask, monkeypatch)
        assert names.count("pre_attention_math") == layers, names
        real = mask.bool()
        want, got = zoo.logits(eager, ids, mask), zoo.logits(fast, ids, mask)
        torch.testing.assert_close(got[real], want[real], atol=1e-4 * want[real].abs().max(), rtol=1e-4)


class _GroupNormLike(torch.nn.Module):
    """A parameter-free norm over the last two axes: equal to a last-axis layer norm on 2-D inputs only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            torch.nn.functional.layer_norm(x, x.shape[-2:], None, None, 1e-5)
            if x.dim() > 2
            else (torch.nn.functional.layer_norm(x, x.shape[-1:], None, None, 1e-5))
        )


def test_a_parameter_free_norm_over_other_axes_is_not_taken_for_a_layer_norm() -> None:
    from kernelize.integrations.transformers import _plain_norm

    assert "matches neither" in _plain_norm(_GroupNormLike()).reason
    assert _plain_norm(torch.nn.GroupNorm(1, 8, affine=False)) is None  # torch's, over other axes
    found = _plain_norm(torch.nn.LayerNorm(16, elementwise_affine=False))
    assert found.layer_name == "LayerNorm" and found.per_instance and found.setup == {}
