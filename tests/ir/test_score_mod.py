"""Score modifications (`kernelize.ir.score_mod`): ALiBi's slopes against the families' own functions."""

from __future__ import annotations

import pytest
import torch

from kernelize.ir.score_mod import alibi, chain, sliding_window

HEADS = [1, 2, 3, 5, 8, 12, 16, 20, 32, 40, 71, 112]


def _slopes(mod, heads: int) -> torch.Tensor:
    """The slope of each head: minus the bias of the key one position before the query."""
    return -mod.apply(torch.zeros(1, heads, 1, 2))[0, :, 0, 0]


@pytest.mark.parametrize("heads", HEADS)
def test_alibi_slopes_are_bloom_mpt_and_falcon_slopes_bit_for_bit(heads):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    as_bloom = _slopes(alibi(heads, slopes="bloom"), heads)
    assert torch.equal(as_bloom, bloom._get_alibi_slopes(heads, torch.device("cpu")))
    falcon = falcon_alibi(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1]  # position 1
    assert torch.equal(as_bloom.bfloat16().float(), falcon)
    mpt = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0]
    assert torch.equal(_slopes(alibi(heads), heads), mpt)
    for bias_max in (4, 16):  # libm's pow may round one of them the other way (torch's vector or scalar path)
        mpt = -build_mpt_alibi_tensor(heads, 2, alibi_bias_max=bias_max)[:, 0, 0]
        torch.testing.assert_close(_slopes(alibi(heads, bias_max), heads), mpt, rtol=1.2e-7, atol=0)


def test_alibi_is_relative_and_chains():
    mod = alibi(2)
    s = torch.randn(1, 2, 3, 5)
    bias = mod.apply(s) - s
    i, j = torch.arange(2, 5)[:, None], torch.arange(5)[None, :]
    torch.testing.assert_close(
        bias[0], torch.tensor([1 / 16, 1 / 256]).view(2, 1, 1) * (j - i), rtol=0, atol=1e-6
    )
    both = chain(alibi(2), sliding_window(2)).apply(s)
    assert both.isinf().sum() == 2 * 6 and torch.equal(both[both.isfinite()], (s + bias)[both.isfinite()])
    assert alibi(2).name == "alibi(2, 8.0)" and alibi(2, slopes="bloom").name == "alibi(2, 8.0, bloom)"


@pytest.mark.parametrize("bad", [dict(heads=0), dict(heads=4, max_bias=0.0), dict(heads=4, slopes="t5")])
def test_alibi_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match="alibi needs"):
        alibi(**bad)
