"""``passes.router``: transformers' router math folds into the two ROUTE nodes of one router, and what is not
a router keeps its ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernelize.autokernel.kernels import RouterKernel
from kernelize.autokernel.plan import plan
from kernelize.ir import trace
from kernelize.ir.graph import Op
from kernelize.ir.reference import evaluate
from kernelize.passes.optimize import OptimizerSettings, optimize


def qwen3(x, w):  # Qwen3-MoE / Mixtral / OLMoE: softmax in f32, top-k, renormalise, back to the dtype
    logits = F.linear(x, w)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, index = torch.topk(probs, 3, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def gpt_oss(x, w):  # top-k of the logits, softmax over the K
    logits = F.linear(x, w)
    top, index = torch.topk(logits, 4, dim=-1)
    return logits, F.softmax(top, dim=1, dtype=top.dtype), index


def scaled_sigmoid(x, w):
    top, index = torch.topk(torch.sigmoid(F.linear(x, w)), 2, dim=-1)
    return (top * 2.5).to(torch.bfloat16), index


def counts(g):
    return {op: sum(n.op is op for n in g.nodes) for op in (Op.ROUTE, Op.TOPK, Op.SOFTMAX, Op.DIV, Op.CAST)}


def check(fn, dtype, want_args):
    x, w = torch.randn(5, 16, dtype=dtype), torch.randn(11, 16, dtype=dtype)
    traced = trace(fn, x, w, dynamic_dims=[{0: "tokens"}, None])
    g = optimize(traced, OptimizerSettings(verify=True))
    c = counts(g)
    assert c[Op.ROUTE] == 2 and c[Op.TOPK] == c[Op.SOFTMAX] == c[Op.DIV] == 0, c
    weights = next(n for n in g.nodes if n.op is Op.ROUTE and not n.arg.indices)
    assert {k: getattr(weights.arg, k) for k in want_args} == want_args
    routers = [k for k in plan(g).kernels if isinstance(k, RouterKernel)]
    assert len(routers) == 1 and len(routers[0].writes) == 2
    for got, want in zip(evaluate(g, [x, w]), evaluate(traced, [x, w]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    return weights


def test_qwen3_router_folds_softmax_topk_renorm_and_cast():
    weights = check(qwen3, torch.bfloat16, {"score": "softmax", "renorm": "sum"})
    assert weights.dtype.torch == torch.bfloat16 and weights.src[0].dtype.torch == torch.bfloat16  # no cast


def test_gpt_oss_router_folds_topk_then_softmax():
    check(gpt_oss, torch.float32, {"score": "none", "renorm": "softmax"})


def test_sigmoid_scale_and_cast_fold():
    check(scaled_sigmoid, torch.float32, {"score": "sigmoid", "scale": 2.5})


def test_a_topk_under_other_math_keeps_the_rest_and_the_switch_turns_it_off():
    fn = lambda x: torch.topk(x.exp(), 2).values * x[..., :2]  # noqa: E731
    x = torch.randn(3, 8)
    g = optimize(trace(fn, x))
    assert counts(g)[Op.ROUTE] == 1 and any(n.op is Op.EXP for n in g.nodes)  # exp is not a score
    torch.testing.assert_close(evaluate(g, [x])[0], fn(x))
    off = optimize(trace(qwen3, x, torch.randn(11, 8)), OptimizerSettings(router=False))
    assert counts(off)[Op.ROUTE] == 0 and counts(off)[Op.TOPK] == 2
