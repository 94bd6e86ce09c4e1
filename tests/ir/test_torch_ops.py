"""The aten table of the torch front end, op by op: each case is traced and evaluated against eager torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernelize import ir
from kernelize.ir.torch_ops import ATEN, Lazy


def f32(*shape):
    return torch.randn(*shape)


def ints(*shape, lo=-6, hi=7, dtype=torch.int64):
    return torch.randint(lo, hi, shape, dtype=dtype)


def pos(*shape):
    return torch.rand(*shape) + 0.1


# id -> (fn, inputs); inputs are built inside the test so the seed fixture makes them reproducible
CASES = {
    "unary_float": (
        lambda x: (
            x.exp()
            + x.sin()
            + x.cos()
            + x.tanh()
            + x.sigmoid()
            + x.erf()
            + x.abs().sqrt()
            + x.abs().rsqrt().clamp(max=5)
            + x.neg()
            + x.sign()
            + x.sgn()
            + x.reciprocal().clamp(-9, 9)
        ),
        lambda: [f32(3, 5)],
    ),
    "rounding": (lambda x: x.floor() + x.ceil() + x.round() + x.trunc(), lambda: [f32(4, 4) * 3]),
    "logs": (
        lambda x: x.log() + x.log1p() + x.log2() + x.log10() + x.expm1() + x.exp2() + x.erfc(),
        lambda: [pos(6)],
    ),
    "int_unary_promotes": (lambda i: i.exp() + i.abs().sqrt(), lambda: [ints(5)]),
    "arith": (
        lambda a, b: a + b - a * b / (b.abs() + 1) + torch.add(a, b, alpha=2) + torch.sub(a, b, alpha=0.5),
        lambda: [f32(3, 4), f32(4)],
    ),
    "rsub_pow": (
        lambda a, b: 1 - a + torch.rsub(a, b) + a**2 + 2**a + b.abs() ** b,
        lambda: [f32(3), f32(3)],
    ),
    "min_max": (lambda a, b: torch.minimum(a, b) + torch.maximum(a, b), lambda: [f32(2, 3), f32(3)]),
    "compare": (
        lambda a, b: ((a < b) | (a >= 0.5)) & ~(a == b) ^ (a != 0) | (a > b) & (b <= a),
        lambda: [f32(3, 3), f32(3, 3)],
    ),
    "compare_int_float": (
        lambda i, x: (i > x).float() + (i == 2).float() + torch.logical_xor(i, x),
        lambda: [ints(4), f32(4)],
    ),
    "div_modes": (
        lambda a, b: torch.div(a, b, rounding_mode="floor") + torch.div(a, b, rounding_mode="trunc"),
        lambda: [f32(8) * 4, pos(8)],
    ),
    "int_div_modes": (
        lambda a, b: (
            torch.div(a, b, rounding_mode="floor"),
            torch.div(a, b, rounding_mode="trunc"),
            a / b,
            a // 3,
        ),
        lambda: [ints(12), ints(12, lo=1, hi=4) * (1 - 2 * (ints(12) % 2))],
    ),
    "remainder_fmod": (lambda a, b: (a % b, torch.fmod(a, b)), lambda: [f32(6) * 5, pos(6) * 2]),
    "int_remainder_fmod": (
        lambda a, b: (a % b, torch.fmod(a, b), a % 4),
        lambda: [ints(8), ints(8, lo=1, hi=5)],
    ),
    "where_masked_fill": (
        lambda x: torch.where(x > 0, x, 0.1) + x.masked_fill(x < -1, 0.0) + torch.where(x > 0, 1.0, x),
        lambda: [f32(3, 4)],
    ),
    "logical_not_bool": (
        lambda x: torch.logical_not(x > 0).int() + (~(x > 0)).int() + torch.isnan(x).int(),
        lambda: [f32(5)],
    ),
    "activations": (
        lambda x: (
            F.relu(x)
            + F.relu6(x)
            + F.hardtanh(x, -2, 2)
            + x.clamp(min=-1)
            + x.clamp(max=1)
            + F.leaky_relu(x, 0.2)
            + F.elu(x)
            + F.silu(x)
            + F.hardsigmoid(x)
            + F.hardswish(x)
            + F.mish(x)
            + F.softplus(x)
            + F.softplus(x, beta=2, threshold=5)
            + F.gelu(x)
            + F.selu(x)
        ),
        lambda: [f32(4, 8) * 3],
    ),
    "clamp_tensor": (lambda x, lo, hi: torch.clamp(x, lo, hi), lambda: [f32(3, 4), f32(4) - 1, f32(4) + 1]),
    "casts": (
        lambda x: (
            x.half().float() + x.to(torch.float64).float(),
            x.int(),
            x.long().float(),
            x.bool(),
            x.type_as(torch.ones(1, dtype=torch.float64)),
        ),
        lambda: [f32(5) * 4],
    ),
    "creation": (
        lambda x: (
            x
            + torch.zeros_like(x)
            + torch.ones_like(x)
            + torch.full((4,), 2.0)
            + torch.arange(4)
            + x.new_full((4,), 3.0)
            + torch.tensor(0.5)
            + torch.zeros(4)
            + torch.ones(3, 1)
        ),
        lambda: [f32(3, 4)],
    ),
    "views": (
        lambda x: (
            x.view(6, 4),
            x.reshape(-1),
            x.t(),
            x.transpose(0, 1),
            x.permute(1, 0),
            x.unsqueeze(1),
            x.unsqueeze(-1).squeeze(-1),
            x[None].squeeze(0),
            x.flatten(),
            x.unflatten(1, (2, 2)),
            x.movedim(0, 1),
            x.expand(2, 6, 4),
            x[:, None].expand(-1, 3, -1),
        ),
        lambda: [f32(6, 4)],
    ),
    "slices": (
        lambda x: (x[1:5:2], x[:, -2:], x[-1], x[:, 0], x.narrow(1, 1, 2), x[2:2]),
        lambda: [f32(6, 4)],
    ),
    "splits": (
        lambda x: (
            *x.split(4, -1),
            *x.split([1, 5], -1),
            *x.chunk(3, 0),
            *x.unbind(0),
            *x.tensor_split(4, dim=1),
            *x.tensor_split([1, 3], dim=1),
        ),
        lambda: [f32(3, 6)],
    ),
    "cat_stack": (
        lambda a, b: (
            torch.cat([a, b], 0),
            torch.cat([a, b.int()], 1),
            torch.stack([a, b], 1),
            torch.cat([a, torch.zeros(0)], 0),
        ),
        lambda: [f32(2, 3), f32(2, 3)],
    ),
    "flip_pad_repeat": (
        lambda x: (
            x.flip(0),
            x.flip(0, 1),
            F.pad(x, (1, 2)),
            F.pad(x, (0, 0, 2, 1), value=3.0),
            F.pad(x, (-1, 1)),
            x.repeat(2, 3),
            x.repeat(2, 1, 1),
        ),
        lambda: [f32(3, 4)],
    ),
    "gather": (
        lambda x, i: (x.index_select(0, i), x.index_select(1, i[:2]), x[i], x[:, i[:2]], F.embedding(i, x)),
        lambda: [f32(5, 4), ints(7, lo=0, hi=4)],
    ),
    "reductions": (
        lambda x: (
            x.sum(),
            x.sum(-1),
            x.sum((0, 2), keepdim=True),
            x.mean(),
            x.mean(1),
            x.amax(-1),
            x.amin((0, 1)),
            x.max(),
            x.min(),
            x.prod(-1),
            x.prod(),
            x.argmax(),
            x.argmax(-1),
            x.argmin(1, keepdim=True),
        ),
        lambda: [f32(2, 3, 4)],
    ),
    "max_min_dim": (lambda x: (*x.max(-1), *x.min(0, keepdim=True)), lambda: [f32(3, 5)]),
    "int_reductions": (
        lambda i: (i.sum(-1), (i > 0).sum(), i.amax(0), i.prod(0)),
        lambda: [ints(3, 4, lo=-3, hi=3)],
    ),
    "variance": (
        lambda x: (
            x.var(-1),
            x.var(-1, unbiased=False, keepdim=True),
            x.std(0),
            x.var(),
            *torch.var_mean(x, 1, correction=0),
            *torch.std_mean(x, -1),
        ),
        lambda: [f32(4, 6)],
    ),
    "softmaxes": (
        lambda x: (
            x.softmax(-1),
            x.softmax(0),
            x.log_softmax(1),
            x.softmax(-1, dtype=torch.float64),
            x.half().softmax(-1),
        ),
        lambda: [f32(3, 5)],
    ),
    "norms": (
        lambda x, w, b: (
            F.layer_norm(x, (6,), w, b),
            F.layer_norm(x, (6,)),
            F.layer_norm(x, (3, 6)),
            F.rms_norm(x, (6,), w),
            F.rms_norm(x, (6,), None, 1e-3),
        ),
        lambda: [f32(2, 3, 6), f32(6), f32(6)],
    ),
    "batch_norm": (
        lambda x, m, v, w, b: (F.batch_norm(x, m, v, w, b), F.batch_norm(x, m, v)),
        lambda: [f32(2, 3, 4, 4), f32(3), pos(3), f32(3), f32(3)],
    ),
    "matmuls": (
        lambda a, b, c: (
            a @ b,
            torch.mm(a, b),
            torch.bmm(c, c.transpose(1, 2)),
            c @ b,
            b[:, 0] @ b[:, 1],
            torch.mv(a, b[:, 0]),
            torch.addmm(b[0], a, b),
            torch.addmm(b[0], a, b, beta=0.5, alpha=2),
            torch.baddbmm(c, c, c.transpose(1, 2)[:, :, :4]),
            F.linear(c, a, b[0]),
            a[0] @ c,
        ),
        lambda: [f32(4, 4), f32(4, 4), f32(2, 4, 4)],
    ),
    "conv2d": (
        lambda x, w, b, wg: (
            F.conv2d(x, w, b),
            F.conv2d(x, w, None, stride=2, padding=1),
            F.conv2d(x, w, b, padding=(2, 1), dilation=2),
            F.conv2d(x, wg, groups=2),
        ),
        lambda: [f32(2, 4, 9, 9), f32(6, 4, 3, 3), f32(6), f32(6, 2, 3, 3)],
    ),
    "conv1d": (
        lambda x, w: (F.conv1d(x, w, padding=1), F.conv1d(x, w, stride=2)),
        lambda: [f32(2, 3, 10), f32(5, 3, 3)],
    ),
    "pools": (
        lambda x: (
            F.max_pool2d(x, 3, 2, 1),
            F.max_pool2d(x, 2),
            F.max_pool2d(x, 3, 2, ceil_mode=True),
            F.avg_pool2d(x, 3, 2, 1),
            F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
            F.avg_pool2d(x, 2),
            F.adaptive_avg_pool2d(x, 1),
            F.adaptive_avg_pool2d(x, (2, 4)),
        ),
        lambda: [f32(2, 3, 8, 8)],
    ),
    "any_all": (
        lambda x: (x.any(-1), x.all(), (x > 0).any(0), (x > -1).all(1, keepdim=True)),
        lambda: [f32(3, 4)],
    ),
    "sdpa": (
        lambda q, k, v: (
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
        ),
        lambda: [f32(2, 3, 5, 8), f32(2, 3, 5, 8), f32(2, 3, 5, 8)],
    ),
    "sizes": (lambda x: x.view(x.size(0), -1).sum(-1) * x.size(-1) + x.shape[1], lambda: [f32(2, 3, 4)]),
    "dropout_eval": (
        lambda x: (
            F.dropout(x, 0.3, training=False)
            + F.dropout2d(x, 0.3, training=False)
            + x.clone()
            + x.contiguous()
            + x.detach()
        ),
        lambda: [f32(2, 3, 4, 4)],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_case_matches_eager(name):
    fn, make = CASES[name]
    inputs = make()
    g = ir.trace(fn, *inputs)
    ir.verify(g)
    want = torch.utils._pytree.tree_leaves(fn(*inputs))
    got = ir.evaluate(g, inputs)
    assert len(got) == len(want)
    for i, (w, o) in enumerate(zip(want, got)):
        assert o.dtype == w.dtype, f"output {i}: {o.dtype} vs torch {w.dtype}"
        tol = 1e-2 if w.dtype in (torch.float16, torch.bfloat16) else 1e-5
        torch.testing.assert_close(o, w, atol=tol, rtol=tol, msg=f"output {i} of {name}")


def test_table_entries_are_callables_keyed_by_aten_ops():
    assert len(ATEN) > 150
    for op, fn in ATEN.items():
        assert isinstance(op, torch._ops.OpOverload), op
        assert callable(fn)


def test_lazy_results_build_only_when_read():
    g = ir.trace(lambda x: x.chunk(4, -1)[2], torch.randn(3, 8))
    assert dict(ir.op_counts(g)) == {"input": 1, "slice": 1}
    built = []
    lazy = Lazy(lambda: built.append(1) or 7)
    assert built == [] and lazy() == 7 and built == [1]


def test_secondary_outputs_that_are_not_supported_say_so():
    with pytest.raises(ir.UnsupportedOpError, match="max pool indices"):
        ir.trace(lambda x: F.max_pool2d(x, 2, return_indices=True)[1], torch.randn(1, 1, 4, 4))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_embedding_and_index_select_raise_on_negative_indices_like_torch(backend, dtype):
    """torch's embedding / index_select raise on a negative index; the graph's gather would count it from
    the end (as ``x[i]`` does, which keeps wrapping)."""
    from kernelize.runtime.compiled import compile_graph

    x, ok, neg = f32(5, 4), torch.tensor([0, 4, 2], dtype=dtype), torch.tensor([0, -1, 2], dtype=dtype)
    for fn in (lambda x, i: F.embedding(i, x), lambda x, i: x.index_select(0, i)):
        with pytest.raises(IndexError):
            fn(x, neg)
        cg = compile_graph(ir.trace(fn, x, ok), backend=backend, cache=False)
        torch.testing.assert_close(cg(x, ok)[0], fn(x, ok))
        with pytest.raises(IndexError, match="out of range"):
            cg(x, neg)
    wraps = compile_graph(ir.trace(lambda x, i: x[i], x, ok), backend=backend, cache=False)
    torch.testing.assert_close(wraps(x, neg)[0], x[neg])
