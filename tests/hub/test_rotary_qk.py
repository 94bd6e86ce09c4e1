"""`apply_rotary_qk`: the query and key heads of one tensor rotated by one kernel, in the attention layout."""

from __future__ import annotations

import pytest
import torch

from kernelize import hub


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("batch, seq, rot", [(1, 1, 16), (2, 7, 16), (3, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_qk_matches_rotating_q_and_k_apart(hub_pkg, neox, batch, seq, rot, dtype) -> None:
    rotary = hub_pkg["rotary"]
    heads, kv_heads, dim = 4, 2, 16
    qk = torch.randn(batch, seq, (heads + kv_heads) * dim).to(dtype)
    cos, sin = torch.randn(batch, seq, rot).to(dtype), torch.randn(batch, seq, rot).to(dtype)
    got = rotary.apply_rotary_qk(qk, cos, sin, heads + kv_heads, dim, neox)
    assert got.shape == (batch, heads + kv_heads, seq, dim) and got.is_contiguous()
    one = rotary.rotary_neox_one if neox else rotary.rotary_interleaved_one
    x = qk.float().view(batch, seq, heads + kv_heads, dim)
    c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    want = torch.cat((one(x[..., :rot], c, s), x[..., rot:]), dim=-1).transpose(1, 2)  # partial: rest passes
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_rotary_qk_is_one_kernel(hub_pkg) -> None:
    rotary = hub_pkg["rotary"]
    owner = torch.nn.Module()
    qk, cos, sin = torch.randn(2, 9, 6 * 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    rotary.apply_rotary_qk(qk, cos, sin, 6, 16, True, owner=owner)
    assert len(hub.compiled_ran(owner).kernels) == 1
