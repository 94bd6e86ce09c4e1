"""Packed routed experts (kernelize/quant/experts.py): the few-token kernel against the few-row kernel run
expert by expert, prefill's dequantized groups against the float product, the state dict, the reasons an
experts module stays float, and `kernelize_model(quantize=...)` on an MoE model."""

from __future__ import annotations

import pytest
import torch

from kernelize.quant import experts as qexperts
from kernelize.quant import kernels
from kernelize.quant.experts import QuantizedExperts, experts_reason
from kernelize.quant.formats import FORMATS, dequantize, quantize

E = 5  # experts; index E is the sentinel (a pair routed to no expert here)


def _experts(
    fmt: str, hidden: int, inter: int, seed: int = 0, down_fmt: str | None = None
) -> tuple[QuantizedExperts, tuple]:
    """A packed experts module of random weights, and its float gate|up [E, 2I, H] and down [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    up, down = torch.randn(E, 2 * inter, hidden, generator=gen), torch.randn(E, hidden, inter, generator=gen)
    q = QuantizedExperts(E, hidden, inter, fmt, down_fmt=down_fmt)
    for name, w in (("gate_up", up), ("down", down)):
        parts = [quantize(w[e], fmt if name == "gate_up" else q.down_format) for e in range(E)]
        setattr(q, f"{name}_qweight", torch.cat([p.data for p in parts]))
        if parts[0].scales is not None:
            setattr(q, f"{name}_qscales", torch.cat([p.scales for p in parts]))
    return q, (up, down)


def _routing(tokens: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct picks of [0, E] per token (E: the sentinel) and positive weights."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E + 1, generator=gen)[:k] for _ in range(tokens)])
    return index, torch.rand(tokens, k, generator=gen) + 0.1


def _sizes(fmt: str) -> tuple[int, int]:
    """hidden, intermediate: multiples of the format's block (the k-quants' 256), H over one stage-two item"""
    return (512, 256) if FORMATS[fmt].block_size == 256 else (96, 160)


@pytest.mark.parametrize("fmt", [*sorted(FORMATS), "q4_k/q6_k", "q4_0/q8_0"])
@pytest.mark.parametrize("tokens,k", [(1, 2), (3, 3), (8, 4)])
def test_few_tokens_match_the_few_row_kernel_expert_by_expert(fmt: str, tokens: int, k: int) -> None:
    """Each pair through the tested few-row kernel (gate|up with act(gate) * up in its epilogue, then down,
    both on activations quantized the same way), weighted and summed: the kernel agrees to f32 rounding
    (gate|up and down in two formats, as llama.cpp's Q4_K_M files mix them: two calls, one per format's
    library); pairs routed to the sentinel add nothing."""
    fmt, down_fmt = (fmt.split("/") * 2)[:2]
    h, i = _sizes(fmt)
    q, _ = _experts(fmt, h, i, down_fmt=down_fmt)
    assert q.down_format == down_fmt
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(2))
    index, weights = _routing(tokens, k)
    out = q(x, index, weights)
    want = torch.zeros(tokens, h, dtype=torch.float64)
    for t in range(tokens):
        for s in range(k):
            e = int(index[t, s])
            if e == E:
                continue
            up, down = q.expert(e)
            g, y = torch.empty(1, i), torch.empty(1, h)
            kernels.gemv(x[t : t + 1], up, None, g, "silu")
            kernels.gemv(g, down, None, y)
            want[t] += float(weights[t, s]) * y[0].double()
    scale = want.abs().max()
    assert ((out.double() - want).abs().max() / scale) < 1e-5
    # and the float product of the packed values, off by the activations' 8-bit rounding only
    up_f = torch.stack([dequantize(q.expert(e)[0]) for e in range(E)])
    down_f = torch.stack([dequantize(q.expert(e)[1]) for e in range(E)])
    loose = _float_experts(x, index, weights, up_f, down_f)
    assert ((out.double() - loose).abs().max() / scale) < 5e-2


def _float_experts(x, index, weights, up, down) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e = int(index[t, s])
            if e < up.shape[0]:
                gate, u = (up[e].double() @ x[t].double()).chunk(2)
                out[t] += float(weights[t, s]) * (down[e].double() @ (torch.nn.functional.silu(gate) * u))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_and_threads(dtype: torch.dtype, monkeypatch) -> None:
    """bf16 activations, weights and output (h kept in f32 between the stages); one thread and two give
    the same bits (each output column's sum takes the experts in one order)."""
    from kernelize.codegen import cpu_build

    q, _ = _experts("q4_0", 96, 160)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    index, weights = _routing(4, 2)
    outs = []
    for threads in (1, 2):
        monkeypatch.setattr(cpu_build, "threads", lambda n=threads: n)
        outs.append(q(x, index, weights.to(dtype)))
    assert outs[0].dtype == dtype and torch.equal(outs[0], outs[1])
    want = q(x.float(), index, weights.to(dtype).float())
    torch.testing.assert_close(outs[0].float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "int8", "q4_k/q6_k"])
def test_prefill_groups_are_the_float_product(fmt: str, monkeypatch) -> None:
    """Past FEW_ROWS tokens the selected experts are dequantized into scratch in groups (here two at a time)
    and run by the float grouped-expert kernel: the float product of the packed values."""
    fmt, down_fmt = (fmt.split("/") * 2)[:2]
    h, i = _sizes(fmt)
    q, _ = _experts(fmt, h, i, down_fmt=down_fmt)
    monkeypatch.setattr(qexperts, "PREFILL_BYTES", 2 * 3 * h * i * 4)
    x = torch.randn(21, h, generator=torch.Generator().manual_seed(4))
    index, weights = _routing(21, 3)
    up_f = torch.stack([dequantize(q.expert(e)[0]) for e in range(E)])
    down_f = torch.stack([dequantize(q.expert(e)[1]) for e in range(E)])
    want = _float_experts(x, index, weights, up_f, down_f)
    got = q(x, index, weights)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-5
    assert ((q._per_expert(x, index, weights).double() - want).abs().max() / want.abs().max()) < 1e-5


def test_an_index_out_of_range_is_named() -> None:
    q, _ = _experts("q8_0", 64, 64)
    x = torch.randn(2, 64)
    for tokens in (2, 12):  # the kernel and the prefill groups
        index = torch.full((tokens, 2), E + 1)
        with pytest.raises(IndexError, match=r"top_k_index holds 6\.\.6, outside \[0, 5\]"):
            q(x.repeat(tokens // 2, 1), index, torch.ones(tokens, 2))
    with pytest.raises(ValueError, match=r"must be \[T, 64\]"):
        q(torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))


def test_state_dict_round_trip() -> None:
    """Another format and shape load the stored buffers and formats; the outputs are then equal."""
    q, _ = _experts("q4_0", 64, 96, down_fmt="q8_0")
    other = QuantizedExperts(2, 32, 32, "q8_0")
    other.load_state_dict(q.state_dict())
    assert (other.format, other.down_format, other.num_experts) == ("q4_0", "q8_0", E)
    assert (other.hidden_dim, other.intermediate_dim) == (64, 96)
    x = torch.randn(3, 64)
    index, weights = _routing(3, 2)
    assert torch.equal(other(x, index, weights), q(x, index, weights))


transformers = pytest.importorskip("transformers")


def _qwen3_moe(hidden: int = 64, inter: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=inter,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # spread the router's logits: routing is then no tie between experts
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def test_kernelize_model_packs_the_experts() -> None:
    """The one call with quantize= packs the experts (the largest weights of an MoE model) beside the
    projections: bytes down, logits near the float model's, generate runs; an experts module whose sizes
    are not multiples of the format's block stays float with the reason."""
    from kernelize.integrations.transformers import kernelize_model
    from kernelize.quant.model import quantize_for_kernelize

    model = _qwen3_moe()
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    experts = model.model.layers[0].mlp.experts
    before = sum(p.numel() * p.element_size() for p in experts.parameters())
    kernelize_model(model, quantize="q8_0")
    packed = model.model.layers[0].mlp.experts
    assert isinstance(packed, QuantizedExperts) and packed.act == "silu"
    assert sum(b.numel() for b in packed.buffers()) < 0.3 * before
    with torch.no_grad():
        got = model(ids).logits
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), dim=0)
    assert cos > 0.999
    with torch.inference_mode():
        assert model.generate(ids[:, :4], max_new_tokens=5, do_sample=False).shape == (1, 9)
    odd = _qwen3_moe(inter=48)
    summary = quantize_for_kernelize(odd, "q8_0")
    assert summary.skipped["model.layers.0.mlp.experts"] == (
        "hidden 64 and intermediate 48 are not multiples of q8_0's block of 32"
    )
    assert not isinstance(odd.model.layers[0].mlp.experts, QuantizedExperts)


def _gpt_oss_experts() -> torch.nn.Module:
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    experts = transformers.GptOssForCausalLM(config).model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # gate and up values past the clamps (7) on both sides
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() == 3 else 4.0))
    return experts


@pytest.mark.parametrize("tokens", [3, 20])
def test_gpt_oss_experts_pack_with_their_gate_form_and_biases(tokens: int) -> None:
    """gpt-oss's experts (interleaved gate|up rows, biases, the clamped SwiGLU with alpha and the up shift):
    packed with the rows reordered gate-then-up and the form kept; the few-token kernel and the prefill
    groups against the reference experts over the packed values, and the module's own float forward."""
    from kernelize.ir.experts import reference_experts
    from kernelize.ir.ops import ExpertsArgs

    experts = _gpt_oss_experts()
    q = QuantizedExperts.from_experts(experts, "q8_0")
    assert q.form == {"alpha": 1.702, "gate_limit": 7.0, "up_limit": 7.0, "up_shift": 1.0}
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(7)  # no sentinel: transformers' biased grouped_mm does not take one
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen) + 0.1
    with torch.no_grad():
        got = q(x, index, weights)
        own = experts(x, index, weights)
    up = torch.stack([dequantize(q.expert(e)[0]) for e in range(4)])
    down = torch.stack([dequantize(q.expert(e)[1]) for e in range(4)])
    args = ExpertsArgs("silu", True, bias=True, **q.form)
    want = reference_experts(
        x, index, weights, up, down, args, q.gate_up_bias.view(4, -1), q.down_bias.view(4, -1)
    )
    scale = want.abs().max()
    # the prefill groups: the float product; the few-token kernel: x and h rounded to 8-bit blocks too
    assert (got - want).abs().max() / scale < (1e-5 if tokens > 8 else 3e-2)
    assert (got - own).abs().max() / own.abs().max() < 3e-2  # q8_0 against the float weights
    ignored = reference_experts(x, index, weights, up, down, ExpertsArgs("silu", True, bias=True))
    assert (ignored - want).abs().max() / scale > 0.1  # the form matters on these values


def test_reasons_for_experts_that_stay_float() -> None:
    """An experts module whose sizes are not multiples of the format's block stays float."""
    experts = _gpt_oss_experts()
    assert experts_reason(experts, "q4_k") == (
        "hidden 64 and intermediate 64 are not multiples of q4_k's block of 256"
    )
    with pytest.raises(ValueError, match=r"QuantizedExperts.from_experts\(GptOssExperts\): hidden 64"):
        QuantizedExperts.from_experts(experts, "q4_k")


def test_gradients_flow_to_the_activations() -> None:
    """Where x needs a gradient (an adapter trained over a packed model) the experts and a packed linear run
    differentiable products over the dequantized weights: x's gradient is the float model's on those values
    (the kernels have no backward; their output would silently cut the graph)."""
    from kernelize.quant.module import QuantizedLinear

    q, _ = _experts("q8_0", 64, 64)
    index, weights = _routing(3, 2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8), requires_grad=True)
    q(x, index, weights).square().sum().backward()
    up = torch.stack([dequantize(q.expert(e)[0]) for e in range(E)])
    down = torch.stack([dequantize(q.expert(e)[1]) for e in range(E)])
    ref = x.detach().double().requires_grad_()
    y = torch.zeros(3, 64, dtype=torch.float64)
    for t in range(3):
        for s in range(2):
            e = int(index[t, s])
            if e < E:
                gate, u = (up[e].double() @ ref[t]).chunk(2)
                y = y.index_add(
                    0,
                    torch.tensor([t]),
                    (weights[t, s] * (down[e].double() @ (torch.nn.functional.silu(gate) * u)))[None],
                )
    y.square().sum().backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, rtol=1e-4, atol=1e-4 * float(ref.grad.abs().max()))
    lin = QuantizedLinear.from_linear(torch.nn.Linear(64, 16), "q4_0")
    x1 = torch.randn(2, 64, requires_grad=True)
    lin(x1).sum().backward()
    torch.testing.assert_close(x1.grad, dequantize(lin.packed).sum(0).expand(2, 64), rtol=1e-5, atol=1e-5)
