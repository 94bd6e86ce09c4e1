"""The public ``kernelize.attention.scaled_dot_product_attention`` against torch's, on the CPU kernel."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernelize.attention import AttentionUnsupported, scaled_dot_product_attention
from kernelize.ir.attention import reference_attention
from kernelize.ir.ops import AttentionArgs

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, dv, generator=g).to(dtype)
    return q, k, v


def _oracle(q, k, v, mask=None, causal=False, scale=None, gqa=False):
    """torch SDPA computed in f32 (the kernels accumulate in f32), cast like the kernel's output."""
    f = [t.float() for t in (q, k, v)]
    m = mask.float() if mask is not None and mask.dtype != torch.bool else mask
    return F.scaled_dot_product_attention(*f, attn_mask=m, is_causal=causal, scale=scale, enable_gqa=gqa)


def _close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (129, 129), (1, 1000), (7, 129), (129, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_causal(lq, lk, causal):
    q, k, v = _qkv(2, 4, 4, lq, lk, 64, 64, torch.float32)
    out = scaled_dot_product_attention(q, k, v, is_causal=causal)
    _close(out, _oracle(q, k, v, causal=causal), torch.float32)
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), atol=1e-5, rtol=0
    )


@pytest.mark.slow
def test_long_causal_1000():
    q, k, v = _qkv(1, 2, 2, 1000, 1000, 64, 64, torch.float32)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    _close(out, _oracle(q, k, v, causal=True), torch.float32)


@pytest.mark.parametrize("d", [32, 64, 80, 128])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("lq", [1, 33])
def test_head_dims_and_gqa(d, ratio, lq):
    q, k, v = _qkv(1, 8, 8 // ratio, lq, 70, d, d, torch.float32)
    out = scaled_dot_product_attention(q, k, v, is_causal=lq > 1, enable_gqa=True)
    _close(out, _oracle(q, k, v, causal=lq > 1, gqa=True), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lq", [1, 7, 129])
def test_16_bit(dtype, lq):
    q, k, v = _qkv(1, 4, 2, lq, 129, 64, 64, dtype)
    out = scaled_dot_product_attention(q, k, v, is_causal=lq > 1, enable_gqa=True)
    _close(out, _oracle(q, k, v, causal=lq > 1, gqa=True), dtype)


@pytest.mark.parametrize("kind", ["bool", "add", "padding", "bool_full_rows", "add_2d"])
@pytest.mark.parametrize("lq", [1, 7, 129])
def test_masks(kind, lq):
    lk = 129
    q, k, v = _qkv(2, 4, 2, lq, lk, 32, 32, torch.float32)
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        mask = torch.rand(2, 4, lq, lk, generator=g) > 0.3
    elif kind == "add":
        mask = torch.randn(2, 1, lq, lk, generator=g)
    elif kind == "add_2d":
        mask = torch.randn(lq, lk, generator=g)
    elif kind == "padding":  # left padding of a batch: the first keys of batch 1 are masked for every query
        keep = torch.ones(2, lk, dtype=torch.bool)
        keep[1, :50] = False
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    else:
        mask = torch.rand(2, 4, lq, lk, generator=g) > 0.3
        mask[:, :, 0] = False  # a fully masked query row gives zeros, as torch does
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    _close(out, ref, torch.float32)
    if kind == "bool_full_rows":
        assert out[:, :, 0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mask_16_bit(dtype):
    q, k, v = _qkv(1, 2, 2, 9, 40, 64, 64, dtype)
    mask = torch.randn(1, 1, 9, 40).to(dtype)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    _close(out, _oracle(q, k, v, mask), dtype)


def test_non_contiguous_views_are_read_in_place():
    """transformers passes q/k/v as [B, L, H, D] transposed to [B, H, L, D]; value with a different Dv."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 37, 8, 64, generator=g).transpose(1, 2)
    kv = torch.randn(2, 37, 2, 2, 64, generator=g)  # k and v interleaved in one tensor
    k, v = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    _close(out, _oracle(q, k, v, causal=True, gqa=True), torch.float32)
    vt = torch.randn(2, 2, 16, 37, generator=g).transpose(-1, -2)  # unit stride missing on the head dim
    out = scaled_dot_product_attention(q, k, vt, enable_gqa=True)
    _close(out, _oracle(q, k, vt, gqa=True), torch.float32)


def test_three_dim_scale_dv_and_empty():
    q, k, v = _qkv(1, 3, 3, 5, 9, 32, 48, torch.float32)
    out = scaled_dot_product_attention(q[0], k[0], v[0], scale=0.3)
    _close(out, _oracle(q[0], k[0], v[0], scale=0.3), torch.float32)
    assert scaled_dot_product_attention(q[:, :, :0], k, v).shape == (1, 3, 0, 48)
    empty = scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0])
    torch.testing.assert_close(empty, F.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0]))


def test_decode_split_over_keys_matches_many_threads():
    q, k, v = _qkv(1, 8, 8, 1, 2048, 64, 64, torch.float32)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 7):  # the number of key splits follows the thread count
            torch.set_num_threads(n)
            outs.append(scaled_dot_product_attention(q, k, v))
    finally:
        torch.set_num_threads(threads)
    for out in outs:
        _close(out, _oracle(q, k, v), torch.float32)


@pytest.mark.parametrize(
    "call, reason",
    [
        (lambda q: scaled_dot_product_attention(q, q, q, dropout_p=0.1), "dropout"),
        (lambda q: scaled_dot_product_attention(q.double(), q.double(), q.double()), "dtypes"),
        (lambda q: scaled_dot_product_attention(q.int(), q.int(), q.int()), "dtypes"),
        (
            lambda q: scaled_dot_product_attention(q[:, :2], q[:, :1].repeat(1, 1, 1, 1)[:, :, :3], q),
            "shapes",
        ),
        (lambda q: scaled_dot_product_attention(q, q[:, :1], q[:, :1]), "enable_gqa"),
        (lambda q: scaled_dot_product_attention(q, q[:, :3], q[:, :3], enable_gqa=True), "whole number"),
        (
            lambda q: scaled_dot_product_attention(
                q, q, q, torch.ones(4, 4, dtype=torch.bool), is_causal=True
            ),
            "is_causal",
        ),
        (lambda q: scaled_dot_product_attention(q, q, q, torch.ones(4, 4, dtype=torch.int32)), "mask dtype"),
        (lambda q: scaled_dot_product_attention(q, q, q, torch.ones(3, 4, dtype=torch.bool)), "broadcast"),
        (lambda q: scaled_dot_product_attention(q[0, 0], q[0, 0], q[0, 0]), "batch, heads"),
        (lambda q: scaled_dot_product_attention(q.requires_grad_(), q, q), "grad"),
    ],
)
def test_unsupported_raise_with_reason(call, reason):
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(AttentionUnsupported, match=reason):
        call(q)
    assert issubclass(AttentionUnsupported, ValueError)


def test_reference_attention_matches_sdpa_and_zeroes_masked_rows():
    q, k, v = _qkv(1, 4, 2, 6, 6, 16, 16, torch.float32)
    mask = torch.rand(1, 4, 6, 6) > 0.5
    mask[..., 2, :] = False
    args = AttentionArgs(scale=1 / math.sqrt(16), mask="bool", groups=2)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(reference_attention(q, k, v, mask, args), ref)


@pytest.mark.parametrize("lq,lk,hq,hkv", [(3, 40, 2, 2), (2, 600, 4, 2), (4, 4, 1, 1), (3, 1, 2, 2)])
def test_decode_shape_with_causal_mask(lq, lk, hq, hkv):
    """A few query rows per key head take the split-key decode path; the causal cut still applies per row."""
    q, k, v = _qkv(1, hq, hkv, lq, lk, 64, 64, torch.float32)
    threads = torch.get_num_threads()
    try:
        for n in (1, 5):
            torch.set_num_threads(n)
            out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            _close(out, _oracle(q, k, v, causal=True, gqa=True), torch.float32)
    finally:
        torch.set_num_threads(threads)


def _eager_scores(q, k, v, cap, window, causal):
    """Gemma / gpt-oss eager attention's scores written out (not through ScoreMod), and the f32 values:
    softcap, then the window and causal cuts as transformers' masks make them (key j kept for the query at
    position i iff i - window < j)."""
    g = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if cap:
        s = cap * torch.tanh(s / cap)
    lq, lk = s.shape[-2:]
    i, j = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if window:
        keep &= j > i - window
    if causal:
        keep &= j <= torch.arange(lq)[:, None]
    return s.masked_fill(~keep, -math.inf), vf


def _eager_variant(q, k, v, cap, window, causal, mask=None):
    s, vf = _eager_scores(q, k, v, cap, window, causal)
    if mask is not None:
        s = s + mask.float()
    return torch.softmax(s, -1).nan_to_num(0.0) @ vf


@pytest.mark.parametrize("cap,window", [(5.0, None), (None, 6), (3.0, 100), (2.0, 17)])
@pytest.mark.parametrize(
    "lq,lk,causal", [(1, 1, False), (7, 7, True), (129, 129, True), (1, 300, False), (4, 40, False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_mods_softcap_and_sliding_window(cap, window, lq, lk, causal, dtype):
    from kernelize.ir.score_mod import chain, sliding_window, softcap

    mod = chain(softcap(cap) if cap else None, sliding_window(window) if window else None)
    q, k, v = _qkv(2, 4, 2, lq, lk, 64, 64, dtype)
    q = q * 3  # scores past the cap
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, score_mod=mod)
    _close(out, _eager_variant(q, k, v, cap, window, causal).to(dtype), dtype)
    # with an additive mask too (padding of the first key)
    mask = torch.zeros(2, 1, lq, lk, dtype=dtype)
    mask[0, ..., 0] = -math.inf
    if not causal and lk > 1:
        out = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, score_mod=mod)
        _close(out, _eager_variant(q, k, v, cap, window, False, mask).to(dtype), dtype)


def _eager_sinks(q, k, v, sinks, causal=False, window=None):
    """gpt-oss's eager attention written out: the sink logit joins the softmax, its column is dropped."""
    s, vf = _eager_scores(q, k, v, None, window, causal)
    logits = torch.cat([s, sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    probs = torch.softmax(logits - logits.max(-1, keepdim=True).values, -1)[..., :-1]
    return probs @ vf


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lq,lk,causal", [(1, 1, False), (9, 9, True), (129, 129, True), (1, 300, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks(window, lq, lk, causal, dtype):
    from kernelize.ir.score_mod import sliding_window

    q, k, v = _qkv(2, 4, 2, lq, lk, 64, 64, dtype)
    sinks = torch.tensor([-1.0, 0.0, 2.0, 5.0])
    mod = sliding_window(window) if window else None
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, score_mod=mod, sinks=sinks)
    _close(out, _eager_sinks(q, k, v, sinks, causal, window).to(dtype), dtype)
    with pytest.raises(AttentionUnsupported, match="one float logit per query head"):
        scaled_dot_product_attention(q, k, v, enable_gqa=True, sinks=sinks[:2])


def _alibi_eager(q, k, v, bias, keep):
    """BLOOM / MPT eager attention written out: the family's own bias tensor added to the scaled scores."""
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias.float()
    return torch.softmax(s.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0) @ v.float()


@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("lq,lk", [(9, 9), (1, 130), (5, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_matches_bloom_and_mpt_bias_tensors(heads, lq, lk, dtype):
    """ALiBi as a score modification against BLOOM's bias (slope * key position over the unpadded keys, a
    left-padded row) and MPT's (slope * (key - last key)): the same attention on every row with a key."""
    mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from kernelize.ir.score_mod import alibi

    q, k, v = _qkv(2, heads, heads, lq, lk, 32, 32, dtype)
    pad = torch.ones(2, lk, dtype=torch.long)
    pad[0, :3] = 0
    i, j = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
    keep = (j <= i) & pad.bool()[:, None, None, :]
    rows = keep.any(-1, keepdim=True)  # a padded query sees no key: torch and the kernel differ there
    biases = {
        "bloom": build_alibi_tensor(pad, heads, torch.float32).view(2, heads, 1, lk),
        "mpt": mpt.build_mpt_alibi_tensor(heads, lk)[None],
    }
    for slopes, bias in biases.items():
        out = scaled_dot_product_attention(q, k, v, keep, score_mod=alibi(heads, slopes=slopes))
        want = _alibi_eager(q, k, v, bias, keep)
        _close(out * rows, (want * rows).to(dtype), dtype)
