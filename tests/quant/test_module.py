"""QuantizedLinear and quantize_model: forward, state_dict round trip, the float weight freed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernelize.quant.formats import FORMATS, dequantize, quantize
from kernelize.quant.module import QuantizedLinear, quantize_model


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_from_linear_and_state_dict_round_trip(fmt: str) -> None:
    k = 96 if FORMATS[fmt].block_size == 32 else 256
    lin = nn.Linear(k, 40)
    q = QuantizedLinear.from_linear(lin, fmt)
    assert not hasattr(q, "weight") and q.qweight.dtype == torch.uint8
    x = torch.randn(3, k)
    p = quantize(lin.weight, fmt)
    assert torch.equal(q.qweight, p.data)
    torch.testing.assert_close(q(x), x @ dequantize(p).T + lin.bias, rtol=2e-2, atol=2e-2)
    fresh = QuantizedLinear(32, 4, "q4_0" if fmt != "q4_0" else "q8_0")  # another format and shape
    fresh.load_state_dict(q.state_dict())
    assert (fresh.format, fresh.in_features, fresh.out_features) == (fmt, k, 40)
    assert torch.equal(fresh(x), q(x))
    x9 = torch.randn(9, k).bfloat16()  # prefill path, bf16
    assert torch.equal(fresh(x9), q(x9)) and q(x9).dtype == torch.bfloat16


def test_no_bias_and_torch_save(tmp_path) -> None:  # noqa: ANN001
    q = QuantizedLinear.from_linear(nn.Linear(64, 8, bias=False), "int8")
    assert q.bias is None and "bias" not in q.state_dict()
    torch.save(q.state_dict(), tmp_path / "q.pt")
    fresh = QuantizedLinear(64, 8, "int8", bias=False)
    fresh.load_state_dict(torch.load(tmp_path / "q.pt"))
    x = torch.randn(1, 64)
    assert torch.equal(fresh(x), q(x))


def test_quantize_model_replaces_every_linear() -> None:
    model = nn.ModuleDict(
        {"emb": nn.Embedding(10, 64), "body": nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48)),
         "odd": nn.Linear(40, 8), "lm_head": nn.Linear(64, 10)}
    )  # fmt: skip
    s = quantize_model(model, "q4_0", skip=("odd",))
    assert s.replaced == ["body.0", "body.2", "lm_head"] and set(s.skipped) == {"odd"}
    assert isinstance(model["lm_head"], QuantizedLinear) and isinstance(model["emb"], nn.Embedding)
    assert s.bytes_before == 4 * (64 * 64 + 64 * 48 + 64 * 10)
    assert s.bytes_after == 18 * (64 * 2 + 48 * 2 + 10 * 2)
    s2 = quantize_model(nn.Sequential(nn.Linear(40, 8)), "q8_0")
    assert s2.replaced == [] and "not a multiple of 32" in s2.skipped["0"]


class _Router(nn.Linear):
    """A linear layer whose forward returns more than its product (as Phi-MoE's router does)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = super().forward(x)
        return scores, scores.topk(2, dim=-1).indices


class _MatmulLinear(nn.Linear):
    """A product of its own (as Falcon's FalconLinear): still ``x @ W.T + b``, so it is packed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def test_quantize_model_leaves_linears_with_their_own_forward() -> None:
    m = nn.Sequential(nn.Linear(64, 64), _Router(64, 8), _MatmulLinear(64, 16))
    m.add_module("patched", nn.Linear(64, 4))
    m.patched.forward = lambda x: nn.functional.linear(x, m.patched.weight) * 2  # an instance's own forward
    s = quantize_model(m, "q8_0")
    assert s.replaced == ["0", "2"] and set(s.skipped) == {"1", "patched"}
    assert "_Router has a forward of its own" in s.skipped["1"]
    scores, picked = m[1](torch.randn(3, 64))  # still the router
    assert scores.shape == (3, 8) and picked.shape == (3, 2)


def test_constructor_error() -> None:
    with pytest.raises(ValueError, match="in_features = 40 is not a multiple of q8_0's block of 32"):
        QuantizedLinear(40, 8, "q8_0")


def test_a_dtype_cast_keeps_the_f32_scales_and_bias() -> None:
    """`model.to(torch.bfloat16)` moves a packed layer's row scales and bias but keeps them f32, the type the
    kernels read (cast, an int8 layer's outputs were ~1e36)."""
    from kernelize.quant.experts import QuantizedExperts

    q = QuantizedLinear.from_linear(torch.nn.Linear(64, 32), "int8")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    want = q(x)
    q.to(torch.bfloat16)
    assert q.qscales.dtype == torch.float32 and q.bias.dtype == torch.float32
    torch.testing.assert_close(q(x.bfloat16()).float(), want, rtol=3e-2, atol=3e-2)
    experts = QuantizedExperts(4, 64, 64, "int8", bias=True)
    experts.gate_up_qscales.fill_(0.01)
    experts.down_qscales.fill_(0.01)
    experts.gate_up_bias.fill_(0.5)
    index, weights = torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
    want = experts(x[:2], index, weights)
    experts.to(torch.bfloat16)
    assert {b.dtype for n, b in experts.named_buffers() if "qweight" not in n} == {torch.float32}
    torch.testing.assert_close(
        experts(x[:2].bfloat16(), index, weights.bfloat16()).float(), want, rtol=3e-2, atol=3e-2
    )
