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

# gpt-oss: transposed weights, biases, interleaved gate/up rows, a clamped SwiGLU; HY-V4: clamps before silu;
# DeepSeek-V4: its attention needs eager masks (the whole-model check takes back the attention, not experts)
SERVED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss", "hy_v4", "deepseek_v4")


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


def test_a_gate_the_kernel_lacks_keeps_the_models_implementation_with_the_reason(monkeypatch) -> None:
    eager = family("qwen3_moe")
    experts = type(next(iter(model_experts.experts_modules(eager).values())))

    def tanh_gate(self, gate_up):  # a gate none of the kernel's forms computes
        gate, up = gate_up.chunk(2, dim=-1)
        return gate * torch.tanh(up)

    monkeypatch.setattr(experts, "_apply_gate", tanh_gate)
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        choices = experts_choices(fast)
        assert choices and not any(c.uses_kernel for c in choices.values())
        assert all("matches none of the kernel's forms" in c.reason for c in choices.values()), choices
        assert fast.config._experts_implementation != model_experts.EXPERTS_NAME
        torch.testing.assert_close(
            zoo.logits(fast, ids, mask)[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4
        )


class _Gate(torch.nn.Module):
    """An experts module's `_apply_gate` alone, with the attributes the probe reads."""

    def __init__(self, gate, **attributes) -> None:
        super().__init__()
        self.gate, self.act_fn = gate, torch.nn.SiLU()
        self.__dict__.update(attributes)

    def _apply_gate(self, gate_up):
        return self.gate(self, gate_up)


def _oss(self, gate_up):
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
    return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def _clamp_after_act(self, gate_up):  # Step-3.7
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)


def _clamp_before_act(self, gate_up):  # DeepSeek-V4, HY-V4
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate.clamp(max=self.swiglu_limit)) * up.clamp(-self.swiglu_limit, self.swiglu_limit)


@pytest.mark.parametrize(
    "gate, attributes, interleaved",
    [(_oss, dict(limit=7.0, alpha=1.702), True), (_clamp_after_act, dict(limit=5.0), False)]
    + [(_clamp_before_act, dict(swiglu_limit=20.0), False)],
    ids=["gpt-oss", "clamp-after-act", "clamp-before-act"],
)
def test_own_gates_are_recognised_by_probing(gate, attributes, interleaved) -> None:
    from kernelize.ir.experts import split_gate
    from kernelize.ir.ops import ExpertsArgs

    module = _Gate(gate, **attributes)
    form = model_experts.gate_form(module)
    assert form is not None and form["interleaved"] == interleaved
    limit = max(attributes.values())
    assert limit in (form["gate_limit"], form["act_limit"]) and form["up_limit"] == limit
    # forms equal in f32 may be told apart by neither the probe nor this check (silu(min(g, 20)) and
    # min(silu(g), 20)): what matters is that the kernel computes the module's values, past every clamp
    gate_up = torch.linspace(-3 * limit, 3 * limit, 50 * 24).reshape(24, 50).T.contiguous()
    args = ExpertsArgs(form.pop("act"), True, **form)
    torch.testing.assert_close(split_gate(gate_up, args), module._apply_gate(gate_up), rtol=1e-6, atol=1e-6)


def test_a_gate_with_other_inputs_or_values_is_not_recognised() -> None:
    assert (
        model_experts.gate_form(_Gate(lambda self, gu: gu.chunk(2, -1)[0] * torch.tanh(gu.chunk(2, -1)[1])))
        is None
    )
    assert model_experts.gate_form(_Gate(lambda self, gu, other: gu)) is None


def test_transposed_experts_are_stored_once_in_the_kernels_layout_with_their_values() -> None:
    eager = family("gpt_oss")
    before = {k: v.clone() for k, v in eager.state_dict().items() if "experts" in k}
    with kernelized(eager) as fast:
        after = {k: v for k, v in fast.state_dict().items() if "experts" in k}
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        module = next(iter(model_experts.experts_modules(fast).values()))
        assert (
            module.gate_up_proj.stride(1) == 1 and module.down_proj.stride(1) == 1
        )  # [E, H, N]: H unit-stride


def test_training_keeps_the_models_experts_implementation() -> None:
    eager = family("qwen3_moe")
    with kernelized(eager, mode=kernelize.Mode.TRAINING) as fast:
        assert fast.config._experts_implementation == eager.config._experts_implementation
        reasons = {c.reason for c in experts_choices(fast).values()}
        assert reasons and all("no backward" in r for r in reasons), reasons


def test_a_call_with_gradients_takes_the_previous_implementation_and_says_so() -> None:
    eager = family("qwen3_moe")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    ids, mask = ids[:, -8:], mask[:, -8:]  # a call the kernel takes without gradients (16 tokens)
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


@pytest.mark.parametrize("tiles", [False, True], ids=["onednn-gemms", "generated-tiles"])
def test_long_f32_calls_take_the_previous_implementation_unless_the_tiles_run_the_gemms(
    monkeypatch, tiles: bool
) -> None:
    """Past a few tokens an f32 call runs the model's implementation where `KERNELIZE_CPU_GEMM` names a
    library, and the kernel (its transposed GEMM path) where the generated tiles run; short calls always
    run the kernel."""
    import kernelize.experts

    monkeypatch.setattr(model_experts, "_tiles", lambda: tiles)
    eager = family("qwen3_moe")
    with kernelized(eager) as fast:
        module = next(iter(model_experts.experts_modules(fast).values()))
        hidden = fast.config.hidden_size
        short, long = model_experts.LIBRARY_TOKENS, model_experts.LIBRARY_TOKENS + 1

        def no_kernel(*args, **kwargs):
            raise AssertionError("the kernel ran")

        monkeypatch.setattr(kernelize.experts, "grouped_experts", no_kernel)
        for tokens, kernel in ((long, tiles), (short, True)):
            x = torch.randn(tokens, hidden)
            index = torch.stack([torch.randperm(module.num_experts)[:2] for _ in range(tokens)])
            weights = torch.rand(tokens, 2)
            with torch.no_grad():
                if kernel:
                    with pytest.raises(AssertionError, match="the kernel ran"):
                        model_experts.experts_forward(module, x, index, weights)
                else:
                    want = model_experts.fallback_forward(module, "grouped_mm")(module, x, index, weights)
                    torch.testing.assert_close(model_experts.experts_forward(module, x, index, weights), want)


@pytest.mark.parametrize("amx", [False, True])
def test_long_bf16_calls_take_the_previous_implementation_where_the_cpu_has_bf16_dot_products(
    monkeypatch, amx: bool
) -> None:
    """Unless the kernel's products run on AMX tiles (`cpu_experts.amx_products`)."""
    from kernelize.codegen import cpu_experts

    monkeypatch.setattr(cpu_experts, "amx_products", lambda *args: amx)
    long = model_experts.LIBRARY_TOKENS + 1
    down = torch.zeros(4, 8, 32, dtype=torch.bfloat16)
    for native in (True, False):
        monkeypatch.setattr(model_experts, "_native_bf16", lambda native=native: native)
        for tokens, want in ((long, native and not amx), (long - 1, False)):
            x = torch.zeros(tokens, 8, dtype=torch.bfloat16)
            index = torch.zeros(tokens, 2, dtype=torch.long)
            assert model_experts._library_wins(x, index, "grouped_mm", down) is want, (native, tokens)
            assert not model_experts._library_wins(x, index, model_experts.EXPERTS_NAME, down)


def test_moe_decoder_layers_run_the_attention_block_around_their_own_mlp_forward() -> None:
    """The decoder block's two graphs (norm -> q|k|v -> q/k norms -> rotary; o_proj -> residual -> norm) run
    around an MLP outside its math (an MoE block), whose own forward then runs the experts kernel."""
    eager = family("qwen3_moe")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        got = zoo.logits(fast, ids, mask)
        blocks = [layer.__dict__.get("_kernelize_block", (None, None))[1] for layer in fast.model.layers]
        assert blocks and all(not isinstance(b, str) and b is not None for b in blocks), blocks
        assert all("not a GatedMLP" in b.own_mlp for b in blocks), blocks
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
        assert all(c.kernels for c in experts_choices(fast).values())


def test_the_one_calls_probe_forward_takes_the_experts_kernel() -> None:
    from kernelize.integrations import transformers as integration

    assert integration._PROBE_BATCH * integration._PROBE_SEQ <= model_experts.LIBRARY_TOKENS
