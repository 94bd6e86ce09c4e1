"""kernelize_model(model, quantize=...): packed projections on a tiny Llama, kernels around them."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from kernelize.integrations.transformers import kernelize_model
from kernelize.layer.record import inspect
from kernelize.quant.experts import QuantizedExperts
from kernelize.quant.model import packed_reason, quantize_for_kernelize
from kernelize.quant.module import QuantizedLinear

transformers = pytest.importorskip("transformers")


def _llama(seed: int = 0, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("fmt, floor", [("q8_0", 0.999), ("q4_0", 0.98), ("q4_k", 0.98), ("q6_k", 0.999)])
def test_quantized_kernelize_model(fmt: str, floor: float) -> None:
    model = _llama(hidden=256 if fmt.endswith("_k") else 64)  # the k-quants take K a multiple of 256
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    before = _bytes(model)
    kernelize_model(model, quantize=fmt)
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(
        model.model.layers[0].mlp.up_proj, QuantizedLinear
    )
    assert type(model.model.embed_tokens) is nn.Embedding
    assert _bytes(model) < 0.6 * before  # the float projection weights are gone
    with torch.no_grad():
        got = model(ids).logits
    assert _cosine(got, want) > floor
    choices = inspect(model)
    attn, mlp = choices["model.layers.0.self_attn"], choices["model.layers.0.mlp"]
    assert attn.uses_kernel and attn.kernel_layer == "CausalSelfAttention"  # packed q|k|v as one call
    assert mlp.uses_kernel and mlp.kernel_layer == "GatedMLP"  # gate|up as one call, act * up fused
    assert choices["model.norm"].uses_kernel  # the norms keep their kernels
    assert not any("withdrawn" in n or "differs" in n for c in choices.values() for n in c.notes)
    out = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)


@pytest.mark.parametrize("fmt", ["q4_0", "int8", "q4_k"])
def test_merged_packed_layers_match_own_forward(fmt: str) -> None:
    """The packed model under kernelize_model (q|k|v and gate|up merged, rotary, the attention kernel, the
    gate|up epilogue) against the same packed model's own forward: greedy tokens equal, logits close."""
    import copy

    model = _llama(hidden=256 if fmt.endswith("_k") else 64)
    quantize_for_kernelize(model, fmt)
    served = kernelize_model(copy.deepcopy(model), quantize=None)
    choices = inspect(served)
    assert choices["model.layers.1.mlp"].uses_kernel and choices["model.layers.1.self_attn"].uses_kernel
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        want, got = model.generate(ids, **kw), served.generate(ids, **kw)
    assert torch.equal(want.sequences, got.sequences)
    # the decoder layers ran the packed block (a layer falling back to its submodules notes why)
    assert not any("own forwards" in n for n in inspect(served)["model.layers.0"].notes)
    for a, b in zip(want.scores, got.scores):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # the merged buffers are views: state_dict() is the unmerged model's, a load lands in the kernels
    ref = model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in served.state_dict().items() if torch.is_tensor(v))
    other = _llama(seed=4, hidden=256 if fmt.endswith("_k") else 64)
    quantize_for_kernelize(other, fmt)
    served.load_state_dict(other.state_dict())
    fresh = kernelize_model(copy.deepcopy(other), quantize=None)
    with torch.inference_mode():
        got, want, own = served(ids).logits, fresh(ids).logits, other(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the kernels read the loaded weights
    # against the packed model's own forward: the fused norms may round x an ulp apart, and one activation
    # rounded to the other int8 neighbour moves these random logits by up to ~1% (seed 4, q4_k)
    assert (got - own).abs().max() < 0.03 * own.abs().max()


def test_state_dict_round_trip() -> None:
    model = _llama()
    quantize_for_kernelize(model, "q4_0")
    fresh = _llama(seed=1)
    quantize_for_kernelize(fresh, "q8_0")  # another format: the loaded buffers take the stored ones'
    fresh.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert fresh.model.layers[1].self_attn.q_proj.format == "q4_0"


def test_skipped_and_reasons() -> None:
    model = nn.Module()
    model.up_proj, model.odd = nn.Linear(64, 8), nn.Linear(40, 8)
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("kernelize.quant.model")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # (not `log.level =`: that keeps isEnabledFor's cached answers)
    try:
        summary = quantize_for_kernelize(model, "int8")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert summary.replaced == ["up_proj"] and any("odd stays float" in r for r in records)
    assert (
        packed_reason(model)
        == "packed int8 weights: the module runs its QuantizedLinear projections (up_proj)"
    )
    assert packed_reason(nn.Linear(4, 4)) is None
    with pytest.raises(ValueError, match="unknown quantized format 'q5_k'"):
        quantize_for_kernelize(model, "q5_k")


def test_gpt2_conv1d_projections_are_packed_and_its_attention_serves_them() -> None:
    """GPT-2's `Conv1D` projections (weight stored `(in, out)`) are packed like linears: none stays float.
    Its attention layer runs the packed c_attn / c_proj around the attention kernel; its MLP runs its own
    forward over the packed projections, with the reason."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    before = _bytes(model)
    kernelize_model(model, quantize="q8_0")
    assert not [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert isinstance(model.transformer.h[0].attn.c_attn, QuantizedLinear)
    assert _bytes(model) < 0.75 * before  # the float projection weights are gone (embeddings stay)
    with torch.no_grad():
        got = model(ids).logits
    assert _cosine(got, want) > 0.999
    choices = inspect(model)
    attn = choices["transformer.h.0.attn"]
    assert attn.uses_kernel and attn.kernel_layer == "FusedQKVAttention"
    assert "packed q8_0 weights" in choices["transformer.h.0.mlp"].reason
    out = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)


@pytest.mark.parametrize(
    "family", ["phimoe", "falcon", "gpt2", "qwen3_moe", "gpt_oss", "deepseek_v32", "rwkv", "deepseek_v4"]
)
def test_families_quantized(family: str) -> None:
    """The one call with quantize= on families whose linear layers are not all plain: Phi-MoE's router (a
    linear subclass returning scores and choices) stays float, Falcon's FalconLinear (a product of its own)
    is packed, GPT-2's Conv1D projections are packed, the MoE families' experts are packed; a projection
    whose weight the model's code uses itself stays float (DeepSeek-V3.2's indexer reads its dtype, RWKV
    rescales weights in place, DeepSeek-V4's grouped o_proj is a product of its own); logits equal the
    packed model's own forward."""
    import copy

    from kernelize.models import zoo

    eager = zoo.tiny_causal_lm(family)
    ids, mask = zoo.padded_batch(eager.get_input_embeddings().num_embeddings)
    own = copy.deepcopy(eager)
    summary = quantize_for_kernelize(own, "q8_0")
    assert summary.replaced
    served = kernelize_model(copy.deepcopy(eager), quantize="q8_0")
    packed = (QuantizedLinear, QuantizedExperts)
    assert {n for n, m in served.named_modules() if isinstance(m, packed)} == set(summary.replaced)
    if family.endswith("moe"):  # the experts are packed too
        assert any(isinstance(m, QuantizedExperts) for m in served.modules())
    want, got = zoo.logits(own, ids, mask), zoo.logits(served, ids, mask)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() <= 1e-4 * want[real].abs().max()
    if family == "phimoe":
        assert all("router" in n for n in summary.skipped) and summary.skipped
    uses = {"deepseek_v32": "weights_proj", "rwkv": "output"}.get(family)
    if uses:
        assert any(f"uses {uses}.weight itself" in why for why in summary.skipped.values()), summary.skipped
