"""The decoder block's three graphs (`kernelize/llm` block: norm + q|k|v + rotary; o_proj + residual + norm;
gated MLP + residual; GPT-2's LayerNorm / dense-MLP versions) on every backend against the reference
executor: C++ (few-row and library GEMM paths), Triton under the interpreter, CUDA C under host emulation;
their kernels compile to cubins."""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_emu import run_plan

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.plan import plan
from kernelize.ir import evaluate, optimize, trace
from kernelize.layer.hub import get_kernel
from kernelize.runtime import compile_graph

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 48


def block(module: str = "block"):
    """A module of the `kernelize/llm` hub (default: its decoder block's)."""
    import sys

    layers = get_kernel("kernelize/llm", version=1).layers
    return sys.modules[layers.__name__.rsplit(".", 1)[0] + "." + module]


# case -> (math function name, input shapes (activations first), number of activations, params)
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
ROT = dict(eps=1e-6, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
CASES = {
    "pre_attention": ("pre_attention_math", [HIDDEN, HEAD_DIM, HEAD_DIM, (HIDDEN,), (QKV, HIDDEN)], 3,
                      dict(ROT, norm="RMSNorm", neox=True)),
    "pre_attention_bias_gemma_interleaved": (
        "pre_attention_math", [HIDDEN, HEAD_DIM, HEAD_DIM, (HIDDEN,), (QKV, HIDDEN), (QKV,)], 3,
        dict(ROT, norm="GemmaRMSNorm", neox=False, bias=True)),
    "pre_attention_no_norm": ("pre_attention_math", [HIDDEN, HEAD_DIM, HEAD_DIM, (QKV, HIDDEN)], 3,
                              dict(ROT, norm=None, neox=True)),
    "pre_attention_partial_rotary": ("pre_attention_math", [HIDDEN, 8, 8, (HIDDEN,), (QKV, HIDDEN)], 3,
                                     dict(ROT, norm="RMSNorm", neox=True)),
    "post_attention": ("post_attention_math", [HIDDEN, HIDDEN, (HIDDEN, HIDDEN), (HIDDEN,)], 2,
                       dict(eps=1e-5, norm="RMSNorm")),
    "post_attention_bias": ("post_attention_math",
                            [HIDDEN, HIDDEN, (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN,)], 2,
                            dict(eps=1e-5, norm="GemmaRMSNorm", bias=True)),
    # sandwich norms (Gemma 2): a norm on the attention output, then + residual, then the pre-MLP norm
    "post_attention_sandwich": ("post_attention_math",
                                [HIDDEN, HIDDEN, (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN,)], 2,
                                dict(eps=1e-6, norm="GemmaRMSNorm", norm_post="GemmaRMSNorm", eps_post=1e-6)),
    "mlp_post_norm": ("mlp_math", [HIDDEN, HIDDEN, (2 * INTER, HIDDEN), (HIDDEN, INTER), (HIDDEN,)], 2,
                      dict(act="silu", norm="RMSNorm", eps=1e-6)),
    "mlp": ("mlp_math", [HIDDEN, HIDDEN, (2 * INTER, HIDDEN), (HIDDEN, INTER)], 2, dict(act="silu")),
    "mlp_gelu_tanh": ("mlp_math", [HIDDEN, HIDDEN, (2 * INTER, HIDDEN), (HIDDEN, INTER)], 2,
                      dict(act="gelu_pytorch_tanh")),
    # LayerNorm styles (Starcoder2, Jais2, OLMo): weight and bias, the weight only, neither
    "pre_attention_layernorm": (
        "pre_attention_math", [HIDDEN, HEAD_DIM, HEAD_DIM, (HIDDEN,), (HIDDEN,), (QKV, HIDDEN), (QKV,)], 3,
        dict(ROT, norm="LayerNorm:2", neox=True, bias=True)),
    "post_attention_layernorm_no_bias": ("post_attention_math", [HIDDEN, HIDDEN, (HIDDEN, HIDDEN), (HIDDEN,)],
                                         2, dict(eps=1e-5, norm="LayerNorm:1")),
    "post_attention_layernorm_plain": ("post_attention_math", [HIDDEN, HIDDEN, (HIDDEN, HIDDEN)], 2,
                                       dict(eps=1e-5, norm="LayerNorm:0")),
    # the non-gated MLP's two matmuls (the activation hub's DenseMLP): Linear and Conv1D weights
    "dense_up_gelu_new": ("activation.dense_up_math", [HIDDEN, (INTER, HIDDEN), (INTER,)], 1,
                          dict(act="gelu_new", transposed=False)),
    "dense_up_relu2_conv1d": ("activation.dense_up_nobias_math", [HIDDEN, (HIDDEN, INTER)], 1,
                              dict(act="relu2", transposed=True)),
    "dense_up_gelu_erf": ("activation.dense_up_math", [HIDDEN, (HIDDEN, INTER), (INTER,)], 1,
                          dict(act="gelu", transposed=True)),
    "dense_down": ("activation.dense_down_math", [INTER, (HIDDEN, INTER), (HIDDEN,)], 1,
                   dict(transposed=False)),
    # GPT-2's decoder layer (`fused_qkv.FusedQKVDecoderLayer`): LayerNorms, biased projections, no rotary
    "dense_pre": ("fused_qkv.dense_pre_math",
                  [HIDDEN, (HIDDEN,), (HIDDEN,), (3 * HIDDEN, HIDDEN), (3 * HIDDEN,)], 1,
                  dict(norm="LayerNorm:2", eps=1e-5, bias=True, heads=HEADS, head_dim=HEAD_DIM)),
    "dense_pre_no_bias": ("fused_qkv.dense_pre_math", [HIDDEN, (HIDDEN,), (3 * HIDDEN, HIDDEN)], 1,
                          dict(norm="LayerNorm:1", eps=1e-5, bias=False, heads=HEADS, head_dim=HEAD_DIM)),
    "dense_post": ("fused_qkv.dense_post_math",
                   [HIDDEN, HIDDEN, (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN,), (HIDDEN,)], 2,
                   dict(bias=True, norm="LayerNorm:2", eps=1e-5)),
    "dense_mlp_gelu_new": ("fused_qkv.dense_mlp_math",
                           [HIDDEN, HIDDEN, (INTER, HIDDEN), (INTER,), (HIDDEN, INTER), (HIDDEN,)], 2,
                           dict(up_bias=True, down_bias=True, act="gelu_new")),
    "dense_mlp_relu_no_bias": ("fused_qkv.dense_mlp_math",
                               [HIDDEN, HIDDEN, (INTER, HIDDEN), (HIDDEN, INTER)], 2,
                               dict(up_bias=False, down_bias=False, act="relu")),
}  # fmt: skip


def math_of(fn_name: str):
    """A block math function, `activation.<name>` from the activation hub's layers, or `fused_qkv.<name>`
    from the llm hub's GPT-2 layers."""
    if fn_name.startswith("activation."):
        return getattr(get_kernel("kernelize/activation", version=1).layers, fn_name.split(".", 1)[1])
    if fn_name.startswith("fused_qkv."):
        return getattr(block("fused_qkv"), fn_name.split(".", 1)[1])
    return getattr(block(), fn_name)


def _inputs(name: str, batch: int, seq: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    _, shapes, n_act, _ = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        shape = (batch, seq, s) if i < n_act else s
        out.append((torch.randn(shape, generator=gen) * (0.3 if i >= n_act else 1.0)).to(dtype))
    return out


@functools.cache
def graph(name: str, dtype: torch.dtype = torch.float32):
    fn_name, _, n_act, params = CASES[name]
    fn = functools.partial(math_of(fn_name), **params)
    xs = _inputs(name, 2, 3, dtype)
    dyn = [{0: "batch", 1: "seq"}] * n_act + [None] * (len(xs) - n_act)
    return optimize(trace(fn, *xs, dynamic_dims=dyn))


def _check(got, name: str, xs, dtype) -> None:
    """f32 against the reference executor; 16-bit against the f32 graph on the same (rounded) inputs, with
    a tolerance of bf16 rounding relative to the output's scale (intermediates between kernels are 16-bit
    in both the kernels and the 16-bit reference, rounded in another order)."""
    want = evaluate(graph(name), [x.float() for x in xs])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
        else:
            scale = float(b.abs().max())
            torch.testing.assert_close(a.double(), b.double(), rtol=2e-2, atol=2e-2 * scale)


def test_the_graphs_are_the_math() -> None:
    """The traced graph (reference executor) equals the block math run by torch, before any backend."""
    for name, (fn_name, _, _, params) in CASES.items():
        xs = _inputs(name, 2, 5, torch.float32)
        want = math_of(fn_name)(*xs, **params)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(evaluate(graph(name), xs), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 1), (3, 7)])  # decode rows (few-row kernel) and 21 rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_backend(name: str, dtype: torch.dtype, batch: int, seq: int) -> None:
    g = graph(name, dtype)
    xs = _inputs(name, batch, seq, dtype, seed=batch * 10 + seq)
    _check(compile_graph(g, backend="cpu")(*xs), name, xs, dtype)


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 3)])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreter(name: str, batch: int, seq: int) -> None:
    g = graph(name)
    xs = _inputs(name, batch, seq, torch.float32, seed=batch + seq)
    _check(compile_graph(g, backend="triton", device="cpu")(*xs), name, xs, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_host_emulation(name: str, dtype: torch.dtype) -> None:
    g = graph(name, dtype)
    xs = _inputs(name, 1, 3, dtype, seed=3)
    _check(run_plan(plan(g), xs), name, xs, dtype)


def _kernels():
    return [k for name in CASES for k in plan(graph(name)).kernels if k.kind is not KernelKind.LIBRARY]


def test_block_kernels_compile_to_cubin_with_triton_aot() -> None:
    from kernelize.codegen import triton_aot

    kernels = _kernels()
    assert {k.kind for k in kernels} >= {KernelKind.MATMUL, KernelKind.ROW, KernelKind.POINTWISE}
    for k, per_arch in zip(kernels, triton_aot.compile_ahead_many(kernels, archs=(90,))):
        assert per_arch[90]["cubin"][:4] == b"\x7fELF", k.name


def test_block_kernels_compile_to_cubin_with_nvrtc() -> None:
    pytest.importorskip(
        "cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python: pip install '.[cuda]'"
    )
    from kernelize.codegen import nvrtc
    from kernelize.codegen.cuda import render

    for k in _kernels():
        src = render(k)
        assert nvrtc.compile_cubin(src.source, src.name, "sm_80")[:4] == b"\x7fELF", k.name
