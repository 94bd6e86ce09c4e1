"""Projection merging (`kernelize.merge`) and the GatedMLP hub layer reading the merged gate|up weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kernelize
from kernelize import Mode, hub
from kernelize.merge import linear_layout, merge_cost_bytes, merged_parameter


class MLP(nn.Module):
    """A Llama-style MLP (the GatedMLP hub layer's contract: gate_proj, up_proj, down_proj, hidden_act)."""

    def __init__(self, hidden: int = 24, inter: int = 40, dtype=torch.float32):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.hidden_act = "silu"
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def eager(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    return MLP.forward(mlp, x)


def kernelized(mlp: MLP) -> MLP:
    kernelize.replace_kernel_forward_from_hub(MLP, "LlamaMLP")
    with kernelize.use_kernel_mapping(hub.default_mapping(), inherit_mapping=False):
        return kernelize.kernelize(mlp, device="cpu", mode=Mode.INFERENCE)


def test_parameters_become_views_of_one_tensor():
    torch.manual_seed(0)
    mlp = MLP()
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    w = merged_parameter(mlp, ("gate_proj", "up_proj"))
    assert w.shape == (80, 24)
    assert mlp.gate_proj.weight is gate and mlp.up_proj.weight is up  # same Parameter objects
    assert gate.data_ptr() == w.data_ptr() and up.data_ptr() == w[40:].data_ptr()
    after = mlp.state_dict()
    assert list(after) == list(before)
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    assert merge_cost_bytes(mlp) == 0
    assert merged_parameter(mlp, ("gate_proj", "up_proj")) is w  # merged once
    assert dict(mlp.named_parameters())["gate_proj.weight"] is gate


def test_rejects_mismatched_projections():
    mlp = MLP()
    mlp.up_proj.to(torch.float64)
    with pytest.raises(ValueError, match="up_proj.weight.*differ"):
        merged_parameter(mlp, ("gate_proj", "up_proj"))
    with pytest.raises(ValueError, match="no tensor `bias`"):
        merged_parameter(mlp, ("gate_proj", "up_proj"), attr="bias")


@pytest.mark.parametrize("rows", [1, 20])
def test_gated_mlp_reads_merged_weight(rows):
    torch.manual_seed(1)
    mlp = kernelized(MLP())
    x = torch.randn(rows, 24)
    with torch.no_grad():
        got = mlp(x)
    torch.testing.assert_close(got, eager(mlp, x), atol=1e-5, rtol=1e-5)
    assert "_kernelize_merged" in mlp.__dict__
    plan = hub.compiled_ran(mlp).plan  # the down projection; the gate|up kernel ran first
    assert plan is not None
    kinds = {str(k.kind) for e in hub.records.RAN[mlp].entries for k in e.compiled.plan.kernels}
    assert kinds == {"matmul"}


def test_load_state_dict_after_kernelize_updates_what_kernels_read():
    torch.manual_seed(2)
    mlp = kernelized(MLP())
    x = torch.randn(1, 24)
    with torch.no_grad():
        mlp(x)  # merges
        fresh = MLP()
        mlp.load_state_dict(fresh.state_dict())  # copies into the views
        torch.testing.assert_close(mlp(x), eager(fresh, x), atol=1e-5, rtol=1e-5)
        other = MLP()
        mlp.load_state_dict(other.state_dict(), assign=True)  # replaces the tensors: merged again
        torch.testing.assert_close(mlp(x), eager(other, x), atol=1e-5, rtol=1e-5)
        assert mlp.gate_proj.weight.data_ptr() == merged_parameter(mlp, ("gate_proj", "up_proj")).data_ptr()


def test_training_keeps_separate_projections_and_gradients():
    torch.manual_seed(3)
    mlp = kernelized(MLP())
    x = torch.randn(2, 24)
    mlp(x).sum().backward()
    ref = MLP()
    ref.load_state_dict(mlp.state_dict())
    eager(ref, x).sum().backward()
    torch.testing.assert_close(mlp.gate_proj.weight.grad, ref.gate_proj.weight.grad, atol=1e-5, rtol=1e-5)


def test_bf16_weights():
    torch.manual_seed(4)
    mlp = kernelized(MLP(64, 96, torch.bfloat16))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x).float(), eager(mlp, x).float(), atol=3e-2, rtol=3e-2)


def test_linear_layout_relays_an_in_out_weight_in_place():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(24, 40))
    before, obj = p.detach().clone(), p
    w = linear_layout(p)
    assert p is obj and p.shape == (24, 40) and torch.equal(p, before)  # same parameter, shape and values
    assert w.shape == (40, 24) and w.is_contiguous() and w.data_ptr() == p.data_ptr()
    assert p.untyped_storage().nbytes() == p.numel() * 4  # no second copy held
    assert linear_layout(p).data_ptr() == w.data_ptr()  # later calls: as it is


def test_linear_layout_leaves_views_of_a_larger_storage():
    merged = torch.randn(8, 10)
    part = nn.Parameter(merged[:4])  # a slice (a merged or shared weight): re-laying would unshare it
    assert linear_layout(part) is None
    assert part.data_ptr() == merged.data_ptr() and part.stride() == (10, 1)


def test_linear_layout_relays_again_after_the_weight_is_replaced():
    p = nn.Parameter(torch.randn(6, 5))
    linear_layout(p)
    p.data = torch.randn(6, 5)  # load_state_dict(assign=True), model.to(...)
    assert p.t().is_contiguous() is False
    assert linear_layout(p).is_contiguous() and p.t().is_contiguous()
