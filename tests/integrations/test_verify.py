"""Recognition verifies, then swaps: the probe refuses a kernel forward that raises, returns another structure
or differs, and the one call never raises for a module it cannot serve."""

from __future__ import annotations

import math

import pytest
import torch

import kernelize
from kernelize.integrations import transformers as integration
from kernelize.integrations.verify import difference
from kernelize.layer.record import FallbackReason
from kernelize.models import zoo

from .test_transformers import kernelized, tiny_model

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama as llama  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402  (the recogniser reads them from here)
    ALL_ATTENTION_FUNCTIONS,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


def assert_same_logits(eager, fast, ids, mask) -> None:
    real = mask.bool()  # a left pad's logits are whatever attention makes of a row with no key
    torch.testing.assert_close(zoo.logits(fast, ids, mask)[real], zoo.logits(eager, ids, mask)[real])


def test_difference_compares_structure_dtype_tolerance_and_nan() -> None:
    x = torch.randn(3, 4)
    assert difference((x, None), (x.clone(), None)) is None
    assert difference((x, None), (x, x)) is None  # an optional output the kernel does not compute
    assert "returns" in difference(x, (x, x)) or "is a" in difference(x, (x, x))
    assert "is a (3, 4) float64" in difference(x.double(), x)
    assert difference(x + 1e-6 * x.abs().max(), x) is None
    assert "differs by" in difference(x + 1e-3 * x.abs().max(), x)
    assert difference(x.bfloat16() + 0.01 * x.abs().max().bfloat16(), x.bfloat16()) is None  # 16-bit slack
    # f32 values a bf16 model computed (logits upcast at the end) get the bf16 slack, and no more
    assert "differs by" in difference(x + 0.01 * x.abs().max(), x)
    assert difference(x + 0.01 * x.abs().max(), x, compute=torch.bfloat16) is None
    assert "differs by" in difference(x + 0.1 * x.abs().max(), x, compute=torch.bfloat16)
    assert "differs by" in difference(x + 1e-3 * x.abs().max(), x, compute=torch.float32)
    nan = x.clone()
    nan[0, 0] = math.nan
    assert "NaN" in difference(nan, x)
    assert difference(nan, nan.clone()) is None
    assert "output[1]" in difference([x, x + 1], [x, x])
    assert difference({"a": x}, {"a": x.clone()}) is None
    assert "a dict of a, b" in difference({"a": x, "b": x}, {"a": x, "c": x})
    assert "a tuple of 1" in difference((x,), (x, x))


def test_cohere2_full_attention_layers_without_rotary_are_refused_and_logits_match() -> None:
    """Cohere2 applies rotary only in its sliding-window layers: the full-attention layers' kernel (which
    rotates) is refused by the probe, the sliding ones keep it."""
    eager = zoo.tiny_causal_lm("cohere2")
    kinds = eager.config.layer_types
    ids, mask = zoo.padded_batch()
    with kernelized(eager) as fast:
        for i, kind in enumerate(kinds):
            choice = kernelize.inspect(fast)[f"model.layers.{i}.self_attn"]
            if kind == "full_attention":
                assert choice.fallback == FallbackReason.VERIFY and "(probed)" in choice.reason, choice
            else:
                assert choice.uses_kernel, choice
        torch.testing.assert_close(
            zoo.logits(fast, ids, mask)[mask.bool()], zoo.logits(eager, ids, mask)[mask.bool()]
        )


def norm_layer():
    from kernelize.layer.hub import get_kernel

    return get_kernel("kernelize/layer_norm", version=1).layers.RMSNorm


def test_a_wrong_kernel_is_refused_and_the_model_stays_right(monkeypatch) -> None:
    """A kernel layer whose output is wrong (here: the final norm's, scaled) never reaches the user."""
    layer = norm_layer()
    right = layer.forward
    monkeypatch.setattr(layer, "forward", lambda self, hidden_states: right(self, hidden_states) * 1.01)
    eager = tiny_model("mistral")
    ids, mask = zoo.padded_batch()
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)["model.norm"]
        assert choice.fallback == FallbackReason.VERIFY and "differs by" in choice.reason, choice
        assert kernelize.inspect(fast)["model.layers.0.mlp"].uses_kernel
        assert_same_logits(eager, fast, ids, mask)


def test_a_kernel_that_raises_is_refused(monkeypatch) -> None:
    def broken(self, hidden_states):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(norm_layer(), "forward", broken)
    eager = tiny_model("llama")
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)["model.norm"]
        assert (
            choice.fallback == FallbackReason.VERIFY
            and "raised RuntimeError: no kernel today" in choice.reason
        )


class ExtraPositionIds(llama.LlamaAttention):
    """A Llama attention whose forward takes `position_ids` too (a newer Mistral-family, StableLM)."""

    def forward(
        self, hidden_states, position_embeddings, attention_mask, position_ids=None, cache=None, **kw
    ):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (
            p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kw)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


def test_a_forward_with_another_signature_stays_eager_with_the_reason() -> None:
    eager = tiny_model("llama")
    for layer in eager.model.layers:
        layer.self_attn.__class__ = ExtraPositionIds
    ids, mask = zoo.padded_batch()
    with kernelized(eager) as fast:
        choice = kernelize.inspect(fast)["model.layers.0.self_attn"]
        assert choice.fallback == FallbackReason.INCOMPATIBLE and "forward takes" in choice.reason, choice
        assert_same_logits(eager, fast, ids, mask)


def test_a_rule_that_raises_leaves_the_module_eager() -> None:
    class ScaledNorm(torch.nn.Module):  # forward(x, scale): the plain RMSNorm probe cannot call it
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x, scale):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale

    verdict = integration.recognise(ScaledNorm())
    assert verdict.layer_name is None and verdict.reason.startswith("recognition failed: TypeError"), verdict


def test_without_verify_the_kernels_are_installed_unprobed(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(integration, "verify_replacements", lambda *a: calls.append(a) or ({}, set()))
    with kernelized(tiny_model("llama"), verify=False) as fast:
        assert kernelize.inspect(fast)["model.norm"].uses_kernel
    assert calls == []


class _MoELayer(torch.nn.Module):
    """A top-1 router and transformers' Qwen3-MoE experts module; experts 0 and 1 score the same, and more
    than the others, for every (positive) input, so top-k breaks the tie by index."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

        config = transformers.Qwen3MoeConfig(
            hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=1
        )
        config._experts_implementation = "eager"
        torch.manual_seed(0)
        self.experts = qwen3_moe.Qwen3MoeExperts(config)
        for p in self.experts.parameters():
            torch.nn.init.normal_(p, std=0.2)
        self.gate = torch.nn.Linear(32, 4, bias=False)
        with torch.no_grad():
            self.gate.weight.uniform_(-0.1, 0.1)
            self.gate.weight[:2] = 1.0

    def route(self, x: torch.Tensor, lift: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, expert index per token); `lift`: that expert's score for token 0 a hair higher (as a
        rounding difference upstream would make it)."""
        logits = self.gate(x)
        if lift is not None:
            logits[0, lift] += 1e-4
        weights, index = logits.softmax(-1).topk(1, dim=-1)
        return self.experts(x, index, weights), index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.route(x)[0]


def test_a_layer_whose_routing_flips_at_a_near_tie_is_judged_on_the_routing_its_own_forward_took() -> None:
    """Inside an MoE layer the kernel forward's experts take the routing the module's own forward gave
    them: a token that a rounding difference sends to the other of two tied experts is no kernel's error,
    while a kernel forward that is wrong is still refused."""
    import types

    from kernelize.integrations.verify import verify_replacements

    layer = _MoELayer().eval()
    x = torch.rand(6, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, index = layer.route(x)
        other = 1 - index[0].item()  # the tied expert top-k did not pick for token 0
        got, flipped_index = layer.route(x, lift=other)
    assert index[0].item() in (0, 1) and flipped_index[0].item() == other
    assert torch.equal(index[1:], flipped_index[1:])
    assert "differs by" in difference(got, want)  # unpinned, the flip alone refuses the layer

    def flipped(self, x):  # the same math, token 0 routed to the other tied expert
        return self.route(x, lift=other)[0]

    def wrong(self, x):
        return self.route(x, lift=other)[0] * 1.1

    for kernel, refused in ((flipped, False), (wrong, True)):
        layer.forward = types.MethodType(kernel, layer)  # the installed kernel forward
        found, ran = verify_replacements(layer, {"layer": layer}, lambda: layer(x))
        del layer.forward
        assert ran == {"layer"}
        assert ("layer" in found) is refused, found
