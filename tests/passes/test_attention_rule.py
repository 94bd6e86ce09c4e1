"""Recognition of ``softmax(q @ k^T * scale + mask) @ v`` as one attention op, and what is left alone."""

from __future__ import annotations

import torch

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.plan import plan
from kernelize.ir import optimize, trace
from kernelize.ir.graph import Op
from kernelize.ir.reference import evaluate
from kernelize.ir.verify import verify


def _ops(g):
    return [n.op for n in g.nodes]


def _check(fn, *args, recognised=True):
    g = optimize(trace(fn, *args))
    verify(g)
    assert (Op.ATTENTION in _ops(g)) is recognised, g
    if recognised:
        assert Op.SOFTMAX not in _ops(g) and Op.MATMUL not in _ops(g)
    (out,) = evaluate(g, list(args))
    torch.testing.assert_close(out, fn(*args), atol=1e-5, rtol=1e-5)
    return g


def _qkv(lq=8, lk=8):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 4, lq, 32, generator=g),
        torch.randn(2, 4, lk, 32, generator=g),
        torch.randn(2, 4, lk, 16, generator=g),
    )


def test_scaled_additive_mask():
    def f(q, k, v, m):
        return torch.softmax((q @ k.transpose(-1, -2)) * 0.125 + m, dim=-1) @ v

    g = _check(f, *_qkv(8, 11), torch.randn(8, 11))
    (att,) = [n for n in g.nodes if n.op is Op.ATTENTION]
    assert att.arg.scale == 0.125 and att.arg.mask == "add"
    assert [k.kind for k in plan(g).kernels] == [KernelKind.ATTENTION]


def test_divided_scores_bool_mask_and_no_mask():
    def fb(q, k, v, m):
        s = q @ k.transpose(-1, -2) / 4.0
        return torch.softmax(torch.where(m, s, float("-inf")), dim=-1) @ v

    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v

    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True  # no fully masked row: the template would give NaN there, the op zeros
    g = _check(fb, *_qkv(), mask)
    assert [n.arg.mask for n in g.nodes if n.op is Op.ATTENTION] == ["bool"]
    g = _check(fn, *_qkv())
    assert [n.arg.scale for n in g.nodes if n.op is Op.ATTENTION] == [1.0]


def test_query_and_key_scaled_apart():
    """torch's attention as ONNX exports it: q and k^T each times sqrt(scale), then matmul, softmax, matmul
    (DeiT, BERT, Swin in the ONNX benchmark); the factors multiply into the op's scale."""

    def f(q, k, v, m):
        s = (q * 0.5) @ (k.transpose(-1, -2) * 0.25)
        return torch.softmax(s + m, dim=-1) @ v

    g = _check(f, *_qkv(8, 11), torch.randn(8, 11))
    (att,) = [n for n in g.nodes if n.op is Op.ATTENTION]
    assert att.arg.scale == 0.125 and att.arg.mask == "add"
    g = _check(lambda q, k, v: torch.softmax((q * 2.0) @ k.transpose(-1, -2) / 4.0, dim=-1) @ v, *_qkv())
    assert [n.arg.scale for n in g.nodes if n.op is Op.ATTENTION] == [0.5]


def test_left_alone_when_probabilities_are_used_or_softmax_is_not_over_keys():
    def returns_probs(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return p @ v, p

    def softmax_over_queries(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v

    q, k, v = _qkv()
    g = optimize(trace(returns_probs, q, k, v))
    assert Op.ATTENTION not in _ops(g)
    _check(softmax_over_queries, q, k, v, recognised=False)
    g = optimize(trace(lambda a, b, c: torch.softmax(a @ b, dim=-1) @ c, q, k.transpose(-1, -2), v))
    assert Op.ATTENTION not in _ops(g)  # k^T is an input, not a transposed key tensor: no k to hand over


def test_16_bit_with_casts_is_left_alone():
    def f(q, k, v):
        s = (q @ k.transpose(-1, -2)).float() * 0.125
        return torch.softmax(s, dim=-1).to(q.dtype) @ v

    q, k, v = (t.bfloat16() for t in _qkv())
    g = optimize(trace(f, q, k, v))
    assert Op.ATTENTION not in _ops(g)  # the casts round the scores: not the op's f32 accumulation


def test_16_bit_scores_times_an_inexact_scale_are_recognised():
    def f(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)) * 0.1, dim=-1) @ v  # 0.1 is not an f16 value

    q, k, v = (t.half() for t in _qkv())
    g = optimize(trace(f, q, k, v))
    (att,) = [n for n in g.nodes if n.op is Op.ATTENTION]
    assert abs(att.arg.scale - 0.1) < 1e-7
    torch.testing.assert_close(evaluate(g, [q, k, v])[0], f(q, k, v), atol=2e-3, rtol=2e-3)


def test_keys_transposed_in_one_permute_and_soft_capping():
    """Keys laid out `[B, S, H, D]` transposed by one permute (ONNX exports), and Gemma 2's soft-capping
    after a chain of scalings: one attention op with the `softcap` score modification."""

    def f(q, k, v, m):
        s = q @ k.permute(0, 2, 3, 1) * 0.5 / 2.0
        return torch.softmax(torch.tanh(s / 3.0) * 3.0 + m, dim=-1) @ v

    q, k, v = _qkv(8, 11)
    g = _check(f, q * 4, k.permute(0, 2, 1, 3).contiguous() * 4, v, torch.randn(8, 11))
    (att,) = [n for n in g.nodes if n.op is Op.ATTENTION]
    assert att.arg.scale == 0.25 and att.arg.score_mod.name == "softcap(3.0)", att.arg
    assert [k.kind for k in plan(g).kernels] == [KernelKind.ATTENTION]


def test_onnx_exported_attention_with_soft_capping_is_one_kernel(tmp_path):
    from kernelize.ir import load_onnx
    from kernelize.runtime.compiled import compile_graph

    class Capped(torch.nn.Module):
        def forward(self, q, k, v, mask):
            s = torch.tanh(q @ k.permute(0, 2, 3, 1) * 0.25 / 20.0) * 20.0 + mask
            return torch.softmax(s, -1) @ v

    q, k, v = _qkv(7, 7)
    k = k.permute(0, 2, 1, 3).contiguous()
    mask = torch.zeros(2, 1, 7, 7)
    mask[0, ..., 0] = -1e9
    torch.onnx.export(Capped(), (q, k, v, mask), tmp_path / "m.onnx", dynamo=False)
    g = optimize(load_onnx(str(tmp_path / "m.onnx")))
    assert [n.op for n in g.nodes if n.op not in (Op.INPUT, Op.BROADCAST, Op.PERMUTE)] == [Op.ATTENTION]
    (got,) = compile_graph(g, backend="cpu")(q, k, v, mask)
    torch.testing.assert_close(got, Capped()(q, k, v, mask), atol=1e-5, rtol=1e-5)
