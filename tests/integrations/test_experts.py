"""Mixture-of-experts families through transformers' experts interface: `kernelize_model` switches them to
the grouped-expert kernel (`kernelize.model_experts`), the logits and greedy tokens stay the model's own,
and every module it cannot serve keeps the model's implementation with the reason in `inspect`."""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize import model_experts
from kernelize.layer.record import FallbackReason
from kernelize.models import zoo

from .test_transformers import kernelized

transformers = pytest.importorskip("transformers")

SERVED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3")


def experts_choices(model) -> dict:
    return {p: c for p, c in kernelize.inspect(model).items() if c.layer_name == model_experts.EXPERTS_LAYER}


def family(model_type: str):
    model = zoo.tiny_causal_lm(model_type)
    with torch.no_grad():  # spread the routers so that top-k picks are not near-ties
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2:
                p.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("model_type", SERVED)
def test_moe_families_run_the_grouped_expert_kernel_with_their_own_logits(model_type: str) -> None:
    eager = family(model_type)
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        assert fast.config._experts_implementation == model_experts.EXPERTS_NAME
        choices = experts_choices(fast)
        assert choices and all(c.uses_kernel for c in choices.values()), choices
        got = zoo.logits(fast, ids, mask)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
        ran = experts_choices(fast)
        assert all(c.backend == "cpu" and c.kernels for c in ran.values()), ran
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert torch.equal(fast.generate(ids, **kw), eager.generate(ids, **kw))


def test_an_experts_layout_the_kernel_lacks_keeps_the_models_implementation_with_the_reason() -> None:
    eager = family("gpt_oss")  # biases, interleaved gate/up rows, its own clamped gate
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        choices = experts_choices(fast)
        assert choices and not any(c.uses_kernel for c in choices.values())
        assert all("expert biases" in c.reason for c in choices.values()), choices
        assert fast.config._experts_implementation != model_experts.EXPERTS_NAME
        torch.testing.assert_close(
            zoo.logits(fast, ids, mask)[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4
        )


def test_training_keeps_the_models_experts_implementation() -> None:
    eager = family("qwen3_moe")
    with kernelized(eager, mode=kernelize.Mode.TRAINING) as fast:
        assert fast.config._experts_implementation == eager.config._experts_implementation
        reasons = {c.reason for c in experts_choices(fast).values()}
        assert reasons and all("no backward" in r for r in reasons), reasons


def test_a_call_with_gradients_takes_the_previous_implementation_and_says_so() -> None:
    eager = family("qwen3_moe")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    with kernelized(eager) as fast:
        fast(input_ids=ids, attention_mask=mask).logits.sum().backward()
        experts = next(iter(model_experts.experts_modules(fast).values()))
        assert experts.gate_up_proj.grad is not None
        notes = kernelize.inspect(fast)[next(iter(experts_choices(fast)))].notes
        assert any("needs gradients" in n for n in notes), notes


def test_an_experts_kernel_that_changes_the_output_is_withdrawn(monkeypatch) -> None:
    import kernelize.experts

    eager = family("mixtral")
    real = kernelize.experts.grouped_experts
    monkeypatch.setattr(kernelize.experts, "grouped_experts", lambda *a, **k: real(*a, **k) * 1.5)
    with kernelized(eager) as fast:
        assert fast.config._experts_implementation == eager.config._experts_implementation
        choices = experts_choices(fast)
        assert choices and all(c.fallback == FallbackReason.VERIFY for c in choices.values()), choices


@pytest.mark.parametrize(
    "act, name",
    [
        (torch.nn.SiLU(), "silu"),
        (torch.nn.GELU(), "gelu"),
        (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
        (torch.nn.ReLU(), "relu"),
        (torch.nn.Tanh(), None),
        (lambda x: torch.relu(x) ** 2, "relu2"),
        (lambda x: torch.relu(x) ** 3, None),
    ],
)
def test_the_activation_is_recognised_by_its_values(act, name) -> None:
    assert model_experts.experts_activation(act) == name


def test_bf16_routing_flips_do_not_withdraw_a_correct_kernel_but_a_wrong_one_still_goes(monkeypatch) -> None:
    """The whole-model check replays the reference forward's routing (`model_experts.Routing`): in bf16 a
    rounding difference upstream flips near-tie tokens to other experts, which moved the logits past the
    tolerance and withdrew every kernel; with the routing pinned a correct model keeps its kernels and a
    wrong experts kernel is still caught."""
    import kernelize.experts

    eager = family("qwen3_moe").to(torch.bfloat16)
    with kernelized(eager) as fast:
        assert fast.config._experts_implementation == model_experts.EXPERTS_NAME
        assert all(c.uses_kernel for c in experts_choices(fast).values())
    real = kernelize.experts.grouped_experts
    monkeypatch.setattr(kernelize.experts, "grouped_experts", lambda *a, **k: real(*a, **k) * 1.5)
    with kernelized(eager) as fast:
        assert fast.config._experts_implementation != model_experts.EXPERTS_NAME


def test_the_routing_replay_pins_what_the_reference_forward_chose() -> None:
    eager = family("mixtral")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    routing = model_experts.Routing(eager)
    with routing.recording(), torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
    assert len(routing.calls) == len(model_experts.experts_modules(eager))
    seen = []
    experts = next(iter(model_experts.experts_modules(eager).values()))
    handle = experts.register_forward_hook(lambda m, args, out: seen.append(args[1].clone()))
    try:
        with torch.no_grad():  # other inputs: the replay still hands the first forward's routing
            routing.pinning(lambda: eager(input_ids=ids.flip(1), attention_mask=mask))()
    finally:
        handle.remove()
    assert torch.equal(seen[0], routing.calls[0][1]) and want.isfinite().all()


def test_on_a_gpu_the_one_call_keeps_grouped_mm_unless_asked(monkeypatch) -> None:
    """The H200 measured transformers' grouped_mm faster than the generated kernel: a model on a GPU keeps
    it, with the reason and the opt-in; `KERNELIZE_GPU_EXPERTS=1` takes the kernel."""
    model = family("qwen3_moe")
    monkeypatch.delenv(model_experts.GPU_EXPERTS_ENV, raising=False)
    what, previous = model_experts.use_experts_function(model, kernelize.Mode.INFERENCE, device="cuda")
    assert previous is None and "unchanged" in what
    reasons = {c.reason for c in experts_choices(model).values()}
    assert reasons and all("grouped_mm" in r and model_experts.GPU_EXPERTS_ENV in r for r in reasons), reasons
    monkeypatch.setenv(model_experts.GPU_EXPERTS_ENV, "1")
    what, previous = model_experts.use_experts_function(model, kernelize.Mode.INFERENCE, device="cuda")
    assert previous is not None and all(c.uses_kernel for c in experts_choices(model).values()), what
