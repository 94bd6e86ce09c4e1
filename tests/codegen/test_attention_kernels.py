"""The generated attention kernels of the GPU backends, without a GPU: Triton under the interpreter and
lowered to PTX / cubin for sm_80 and sm_90, CUDA C through the host emulation and NVRTC cubins for sm_80 and
sm_90. Sizes stay small (the interpreter and the emulation are slow); the CPU kernel's long shapes are in
tests/test_attention.py. The oracle is the reference executor's attention.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from cuda_emu import emulate_attention

from kernelize.autokernel.kernels import Kernel, KernelKind
from kernelize.autokernel.plan import plan
from kernelize.codegen.triton import TritonBackend
from kernelize.ir.attention import reference_attention, split_operands
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph
from kernelize.ir.score_mod import alibi, chain, sliding_window, softcap

TOL = {DType.F32: 2e-5, DType.F16: 3e-3, DType.BF16: 2e-2}


def _kernel(hq, hkv, d, dv, dtype, causal=False, mask=None, score_mod=None, sinks=False) -> Kernel:
    g = Graph()
    q = g.input("q", ("b", hq, "s", d), dtype)
    k = g.input("k", ("b", hkv, "t", d), dtype)
    v = g.input("v", ("b", hkv, "t", dv), dtype)
    m = g.input("m", ("b", 1, "s", "t"), mask) if mask else None
    sn = g.input("sinks", (hq,), DType.F32) if sinks else None
    g.output(g.attention(q, k, v, m, causal=causal, gqa=hq != hkv, score_mod=score_mod, sinks=sn))
    (kernel,) = plan(g).kernels
    assert kernel.kind is KernelKind.ATTENTION
    return kernel


def _inputs(kernel: Kernel, b: int, lq: int, lk: int, seed: int = 0, transposed: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = kernel.node.src[:3]
    dt = kernel.node.dtype.torch

    def make(n, heads, length, dim):
        if transposed:  # [B, L, H, D] seen as [B, H, L, D], as transformers passes them
            return torch.randn(b, length, heads, dim, generator=gen).to(dt).transpose(1, 2)
        return torch.randn(b, heads, length, dim, generator=gen).to(dt)

    ins = [
        make("q", q.shape[1], lq, q.shape[3]),
        make("k", k.shape[1], lk, k.shape[3]),
        make("v", v.shape[1], lk, v.shape[3]),
    ]
    args = kernel.node.arg
    if args.mask == "bool":
        mask = torch.rand(b, 1, lq, lk, generator=gen) > 0.4
        mask[..., 0, :] = False  # a fully masked row
        ins.append(mask.expand(b, q.shape[1], lq, lk))
    elif args.mask == "add":
        ins.append(
            torch.randn(b, 1, lq, lk, generator=gen)
            .to(kernel.node.src[3].dtype.torch)
            .expand(b, q.shape[1], lq, lk)
        )
    return ins


def _oracle(kernel: Kernel, ins):
    q, k, v, mask, sinks = split_operands(ins, kernel.node.arg)
    return reference_attention(q, k, v, mask, kernel.node.arg, sinks)


def _check(kernel: Kernel, out, ref):
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert err <= TOL[kernel.node.dtype] * max(1.0, ref.float().abs().max().item()), err


# (heads q, heads kv, head dim, dtype, causal, mask, batch, q len, k len)
CASES = [
    (2, 2, 32, DType.F32, False, None, 1, 7, 7),
    (4, 1, 64, DType.F32, True, None, 1, 1, 1),
    (8, 2, 80, DType.F32, True, None, 2, 33, 33),
    (8, 1, 64, DType.F32, False, None, 1, 1, 129),  # gqa 8, decode
    (2, 2, 128, DType.F32, False, "bool", 1, 9, 40),
    (2, 2, 32, DType.F32, False, "f32", 2, 7, 20),
    (4, 1, 64, DType.BF16, True, None, 1, 17, 17),
    (2, 2, 64, DType.F16, False, "bool", 1, 5, 30),
    (2, 1, 64, DType.BF16, False, "bf16", 1, 3, 24),
]
IDS = [f"h{c[0]}/{c[1]}-d{c[2]}-{c[3]}-{'causal' if c[4] else c[5] or 'none'}-{c[7]}x{c[8]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_interpreter_matches_reference(case):
    hq, hkv, d, dtype, causal, mask, b, lq, lk = case
    kernel = _kernel(hq, hkv, d, d, dtype, causal, mask)
    ins = _inputs(kernel, b, lq, lk, transposed=hq == 8)
    out = torch.empty(b, hq, lq, d, dtype=dtype.torch)
    TritonBackend().compile(kernel).launch(ins, [out], None)
    _check(kernel, out, _oracle(kernel, ins))


def test_triton_decode_splits_keys_and_combines():
    from kernelize.codegen.triton_attention import plan_launch

    kernel = _kernel(2, 2, 32, 32, DType.F32)
    assert plan_launch(1, 600, 2, 8)[1] == 2  # two key splits: the combine kernel runs
    ins = _inputs(kernel, 1, 1, 600)
    out = torch.empty(1, 2, 1, 32)
    TritonBackend().compile(kernel).launch(ins, [out], None)
    _check(kernel, out, _oracle(kernel, ins))


def test_triton_lowers_to_ptx_and_cubin_for_sm80_and_sm90():
    from kernelize.codegen.triton_aot import compile_attention_ahead

    kernel = _kernel(8, 2, 64, 64, DType.BF16, False, "bool")
    results = compile_attention_ahead(kernel, (80, 90), nsplit=4)
    assert [(r["name"], r["arch"]) for r in results] == [
        ("k0", 80),
        ("k0_combine", 80),
        ("k0", 90),
        ("k0_combine", 90),
    ]
    for r in results:
        assert r["cubin"][:4] == b"\x7fELF" and f".target sm_{r['arch']}" in r["ptx"]
    assert "mma" in results[0]["ptx"]  # q @ k^T and p @ v run on tensor cores


# score modifications (attention variants as subgraphs), spliced into each backend's template
MODS = {
    "softcap": softcap(3.0),
    "window": sliding_window(5),
    "softcap+window": chain(softcap(2.0), sliding_window(9)),
    "alibi": alibi(3),  # a slope per head from the head index; heads past 3 continue the formula
    "alibi_bloom+window": chain(alibi(4, 4.0, slopes="bloom"), sliding_window(6)),
}
# (heads q, heads kv, head dim, dtype, causal, mask, batch, q len, k len)
MOD_CASES = [
    (4, 2, 32, DType.F32, True, None, 1, 13, 13),
    (2, 1, 64, DType.BF16, False, "bool", 1, 3, 24),
    (2, 2, 32, DType.F32, False, None, 1, 1, 40),
]


@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("case", MOD_CASES, ids=lambda c: f"{c[3]}-{c[7]}x{c[8]}")
def test_score_mods_match_reference_in_triton_and_cuda_emulation(case, mod):
    hq, hkv, d, dtype, causal, mask, b, lq, lk = case
    kernel = _kernel(hq, hkv, d, d, dtype, causal, mask, MODS[mod])
    ins = _inputs(kernel, b, lq, lk)
    ins[0] = ins[0] * 4  # scores past the cap
    _triton_and_emulation(kernel, ins, torch.empty(b, hq, lq, d, dtype=dtype.torch))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("case", MOD_CASES, ids=lambda c: f"{c[3]}-{c[7]}x{c[8]}")
def test_sinks_match_reference_in_triton_and_cuda_emulation(case, split):
    """Attention sinks (gpt-oss): a logit per query head in every softmax; with key splits only the first
    split carries it."""
    hq, hkv, d, dtype, causal, mask, b, lq, lk = case
    lk = 600 if split else lk
    lq = lq if lq < lk else lk
    kernel = _kernel(hq, hkv, d, d, dtype, causal and lq == lk, mask, sliding_window(7), sinks=True)
    ins = [*_inputs(kernel, b, lq, lk), torch.randn(hq) * 2]
    _triton_and_emulation(kernel, ins, torch.empty(b, hq, lq, d, dtype=dtype.torch), nsplit=3 if split else 1)


def _triton_and_emulation(kernel: Kernel, ins, out: torch.Tensor, nsplit: int = 1) -> None:
    """The kernel through the Triton interpreter and (with g++) CUDA host emulation, against the oracle."""
    ref = _oracle(kernel, ins)
    TritonBackend().compile(kernel).launch(ins, [out], None)
    _check(kernel, out, ref)
    if shutil.which("g++"):
        out.zero_()
        emulate_attention(kernel, ins, out, nsplit=nsplit)
        _check(kernel, out, ref)


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="host emulation needs g++")


@needs_gxx
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_emulated_matches_reference(case):
    hq, hkv, d, dtype, causal, mask, b, lq, lk = case
    kernel = _kernel(hq, hkv, d, d, dtype, causal, mask)
    ins = _inputs(kernel, b, lq, lk, transposed=hq == 8)
    out = torch.empty(b, hq, lq, d, dtype=dtype.torch)
    emulate_attention(kernel, ins, out)
    _check(kernel, out, _oracle(kernel, ins))


@needs_gxx
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_emulated_key_splits_combine(causal):
    kernel = _kernel(2, 1, 32, 48, DType.F32, causal)
    ins = _inputs(kernel, 1, 3, 300)
    out = torch.empty(1, 2, 3, 48)
    emulate_attention(kernel, ins, out, nsplit=3)
    _check(kernel, out, _oracle(kernel, ins))


def test_cuda_nvrtc_cubins_for_sm80_and_sm90(tmp_path, monkeypatch):
    nvrtc = pytest.importorskip("kernelize.codegen.nvrtc")
    pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python")
    from kernelize.codegen.cuda_attention import render_attention

    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path))
    for dtype, mask, mod in (
        (DType.F32, None, None),
        (DType.BF16, "bool", MODS["softcap+window"]),
        (DType.F16, "f16", MODS["alibi"]),
    ):
        source, name = render_attention(
            _kernel(8, 2, 80, 64, dtype, mask is None, mask, mod, sinks=mod is not None)
        )
        for arch in ("sm_80", "sm_90"):
            cubin = nvrtc.compile_cubin(source, name, arch, cache=False)
            assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_matches_sdpa(backend, monkeypatch):
    import torch.nn.functional as F

    from kernelize.attention import scaled_dot_product_attention

    monkeypatch.setenv("KERNELIZE_CUDA_BACKEND", backend)
    q, k, v = (torch.randn(2, 8, 300, 64, device="cuda") for _ in range(3))
    for lq in (1, 300):
        out = scaled_dot_product_attention(q[:, :, :lq], k, v, is_causal=lq > 1)
        ref = F.scaled_dot_product_attention(q[:, :, :lq], k, v, is_causal=lq > 1)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("mod", list(MODS))
def test_gpu_score_mods_match_reference(backend, mod, monkeypatch):
    from kernelize.attention import scaled_dot_product_attention
    from kernelize.ir.ops import AttentionArgs

    monkeypatch.setenv("KERNELIZE_CUDA_BACKEND", backend)
    q, k, v = (torch.randn(2, 8, 700, 64, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3))
    for lq in (1, 700):  # decode (key splits) and prefill
        args = AttentionArgs(scale=0.125, causal=lq > 1, score_mod=MODS[mod])
        out = scaled_dot_product_attention(q[:, :, :lq], k, v, is_causal=lq > 1, score_mod=MODS[mod])
        ref = reference_attention(q[:, :, :lq], k, v, None, args)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
