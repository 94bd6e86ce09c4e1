"""The EXPERTS op: builder checks, verify, and the reference against transformers' own experts loop."""

from __future__ import annotations

import pytest
import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.errors import DTypeError
from kernelize.ir.experts import expert_bytes, reference_experts
from kernelize.ir.graph import Graph
from kernelize.ir.ops import ExpertsArgs
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import ShapeError
from kernelize.ir.verify import verify


def graph(h=16, i=8, e=4, k=2, dtype="f32", gated=True, act="silu"):
    g = Graph()
    x = g.input("x", ("t", h), dtype)
    idx = g.input("index", ("t", k), "i64")
    w = g.input("weights", ("t", k), "f32")
    up = g.input("up", (e, 2 * i if gated else i, h), dtype)
    down = g.input("down", (e, h, i), dtype)
    g.output(g.experts(x, idx, w, up, down, act=act, gated=gated))
    return g


def test_the_node_keeps_its_args_and_verifies() -> None:
    g = graph(gated=False, act="gelu")
    (out,) = g.outputs
    assert out.arg == ExpertsArgs("gelu", gated=False) and out.dtype is DType.F32
    verify(g)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(up=(4, 15, 16)), ShapeError, "sizes disagree"),
        (dict(index=("t", 3)), ShapeError, "sizes disagree"),
        (dict(x=("t", "h")), ShapeError, "must be static"),
        (dict(index_dtype="f32"), DTypeError, "index must be integer"),
        (dict(up_dtype="bf16"), DTypeError, "share one float dtype"),
    ],
)
def test_the_builder_names_what_does_not_fit(change, error, words) -> None:
    g = Graph()
    x = g.input("x", change.get("x", ("t", 16)), "f32")
    idx = g.input("index", change.get("index", ("t", 2)), change.get("index_dtype", "i64"))
    w = g.input("weights", ("t", 2), "f32")
    up = g.input("up", change.get("up", (4, 16, 16)), change.get("up_dtype", "f32"))
    down = g.input("down", (4, 16, 8), "f32")
    with pytest.raises(error, match=words):
        g.experts(x, idx, w, up, down, act="silu")


def test_an_unknown_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="act must be one of"):
        graph(act="swiglu")


def test_the_reference_is_transformers_experts_loop_and_skips_the_sentinel() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    config._experts_implementation = "eager"
    experts = MixtralExperts(config)
    torch.manual_seed(0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(7, 16)
    index = torch.randint(0, 4, (7, 2))
    weights = torch.rand(7, 2)
    with torch.no_grad():
        want = experts(x, index, weights)
    args = ExpertsArgs("silu")
    got = reference_experts(x, index, weights, experts.gate_up_proj, experts.down_proj, args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g = graph(h=16, i=8, e=4, k=2)
    ops = [x, index, weights, experts.gate_up_proj.detach(), experts.down_proj.detach()]
    torch.testing.assert_close(evaluate(g, ops)[0], want, atol=1e-5, rtol=1e-5)
    sentinel = index.clone()
    sentinel[0, 1] = 4  # expert parallelism's "not here": adds nothing
    alone = reference_experts(x[:1], index[:1, :1], weights[:1, :1], *ops[3:], args)
    torch.testing.assert_close(reference_experts(x, sentinel, weights, *ops[3:], args)[0], alone[0])
    assert expert_bytes(sentinel[:1], ops[3], ops[4]) == 16 * 16 * 4 + 16 * 8 * 4
