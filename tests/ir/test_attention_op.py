"""The ATTENTION op: builder checks, verify, printer, reference executor, planner and the compiled graph."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.plan import plan
from kernelize.ir.graph import DTypeError, Graph
from kernelize.ir.ops import AttentionArgs, Op
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import ShapeError
from kernelize.ir.verify import verify
from kernelize.runtime.compiled import compile_graph


def _graph(mask_dtype=None, causal=False, hkv=2):
    g = Graph()
    q = g.input("q", (1, 8, "s", 32), "f32")
    k = g.input("k", (1, hkv, "t", 32), "f32")
    v = g.input("v", (1, hkv, "t", 16), "f32")
    m = g.input("m", ("s", "t"), mask_dtype) if mask_dtype else None
    g.output(g.attention(q, k, v, m, causal=causal, gqa=True))
    return g


def test_builder_shape_dtype_args_and_printer():
    g = _graph("bool", causal=False)
    (o,) = g.outputs
    assert o.op is Op.ATTENTION and o.shape == (1, 8, o.shape[2], 16)
    assert o.arg == AttentionArgs(scale=1 / math.sqrt(32), causal=False, mask="bool", groups=4)
    assert o.src[3].op is Op.BROADCAST  # the mask is broadcast to [B, Hq, Lq, Lk] as a view
    assert (
        "attention(%0, %1, %2, %5) {AttentionArgs(scale=0.1767767, causal=False, mask='bool', groups=4)}"
        in str(g)
    )
    verify(g)


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda g, q, k: g.attention(q, k, k), ShapeError, "gqa=True"),
        (lambda g, q, k: g.attention(q, g.input("k3", (1, 8, "t", 31), "f32"), k), ShapeError, "head dim"),
        (lambda g, q, k: g.attention(g.input("q3", (8, "s", 32), "f32"), k, k), ShapeError, "must be"),
        (
            lambda g, q, k: g.attention(
                q, g.input("h", (1, 3, "t", 32), "f32"), g.input("h2", (1, 3, "t", 32), "f32"), gqa=True
            ),
            ShapeError,
            "multiple",
        ),
        (lambda g, q, k: g.attention(q, g.input("i", (1, 8, "t", 32), "i32"), k), DTypeError, "float dtype"),
        (
            lambda g, q, k: g.attention(q, k, k, g.input("m", ("s", 5, 1), "f32"), gqa=True),
            ShapeError,
            "broadcast",
        ),
        (
            lambda g, q, k: g.attention(q, k, k, g.input("m", ("s", "t"), "i64"), gqa=True),
            DTypeError,
            "bool or float",
        ),
    ],
)
def test_builder_rejects(make, err, match):
    g = Graph()
    q = g.input("q", (1, 8, "s", 32), "f32")
    k = g.input("k", (1, 2, "t", 32), "f32")
    with pytest.raises(err, match=match):
        make(g, q, k)


def test_args_validate():
    with pytest.raises(ValueError, match="mask"):
        AttentionArgs(scale=1.0, mask="alibi")
    with pytest.raises(ValueError, match="groups"):
        AttentionArgs(scale=1.0, groups=0)


@pytest.mark.parametrize("mask_dtype", [None, "bool", "f32"])
def test_reference_matches_sdpa(mask_dtype):
    g = _graph(mask_dtype, causal=mask_dtype is None)
    q, k, v = torch.randn(1, 8, 5, 32), torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 16)
    ins = [q, k, v]
    m = None
    if mask_dtype:
        m = torch.rand(5, 9) > 0.4 if mask_dtype == "bool" else torch.randn(5, 9)
        ins.append(m)
    (out,) = evaluate(g, ins)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=mask_dtype is None, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_plan_one_attention_kernel_reading_views_in_place():
    """q/k/v arrive as [B, L, H, D] and are transposed in the graph: the plan copies nothing."""
    g = Graph()
    xs = [g.input(n, (1, "s", h, 32), "f32") for n, h in (("q", 4), ("k", 2), ("v", 2))]
    q, k, v = (g.transpose(x, 1, 2) for x in xs)
    o = g.attention(q, k, v, causal=True, gqa=True)
    g.output(o)
    p = plan(g)
    assert [kk.kind for kk in p.kernels] == [KernelKind.ATTENTION]
    assert p.kernels[0].reads == tuple(g.inputs)
    cg = compile_graph(g, backend="cpu")
    ins = [torch.randn(1, 11, h, 32).transpose(1, 2).transpose(1, 2) for h in (4, 2, 2)]
    (out,) = cg(*ins)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ins), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_plan_attention_between_other_kernels():
    """A scale before and a residual after stay their own kernels around the attention kernel."""
    g = Graph()
    q = g.input("q", (2, 2, "s", 16), "f32")
    o = g.attention(g.mul(q, 2.0), q, q, causal=True)
    g.output(g.add(o, q))
    p = plan(g)
    assert [kk.kind for kk in p.kernels] == [KernelKind.POINTWISE, KernelKind.ATTENTION, KernelKind.POINTWISE]
    x = torch.randn(2, 2, 13, 16)
    (out,) = compile_graph(g, backend="cpu")(x)
    (ref,) = evaluate(g, [x])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
