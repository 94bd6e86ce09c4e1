"""``scaled_dot_product_attention`` as a generated kernel: a drop-in for
``torch.nn.functional.scaled_dot_product_attention`` (without dropout).

Each call builds (once per signature) a graph of one ``ATTENTION`` node, plans it into one fused attention
kernel and compiles it with the backend for the tensors' device (:func:`kernelize.hub.backend_for`:
cpu -> C++, cuda -> Triton, or CUDA C with ``KERNELIZE_CUDA_BACKEND=cuda``). The kernel reads q, k, v and
the mask through their strides, so the transposed views transformers passes are not copied, and a mask
broadcast over heads or queries is read with stride 0.

Semantics are torch's: q ``[B, Hq, Lq, D]`` (or ``[Hq, Lq, D]``), k / v ``[B, Hkv, Lk, D]`` /
``[B, Hkv, Lk, Dv]``; a bool mask keeps where True, a float mask is added, masks broadcast;
``is_causal`` keeps key ``j`` for query ``i`` iff ``j <= i`` (top-left aligned); ``enable_gqa`` lets
``Hq`` be a multiple of ``Hkv`` (query head ``h`` reads key head ``h // (Hq // Hkv)``). A query row whose
every key is masked gives zeros, as torch's CPU kernels do.

What the kernels do not do raises :class:`AttentionUnsupported` (a ``ValueError``) with the reason, so a
caller can fall back to torch: dropout, dtypes other than f32 / f16 / bf16, gradients, a mask together with
``is_causal``, operands on different devices, ranks other than 3 and 4, shapes torch would reject.

Example:
    >>> q = torch.randn(1, 8, 16, 64); k = torch.randn(1, 2, 16, 64)
    >>> out = scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    >>> out.shape
    torch.Size([1, 8, 16, 64])
"""

from __future__ import annotations

import math
import threading

import torch

from kernelize.ir.attention import reference_attention, split_operands
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph
from kernelize.ir.ops import AttentionArgs
from kernelize.ir.score_mod import ScoreMod

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, *FLOATS)


class AttentionUnsupported(ValueError):
    """The generated attention kernels cannot run these inputs; the message says why (fall back to torch)."""


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    score_mod: ScoreMod | None = None,
    sinks: torch.Tensor | None = None,
    owner: torch.nn.Module | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` as a generated fused kernel (``owner``: a hub
    layer whose ``kernelize.inspect`` record then lists the kernel).

    ``score_mod`` (:mod:`kernelize.ir.score_mod`: soft-capping, a sliding window, ...) modifies the scaled
    scores before the causal cut and the mask; it is compiled into the kernel. ``sinks`` (``[Hq]``, one
    logit per query head, gpt-oss) joins every row's softmax as a key whose value is zero.

    Raises:
        AttentionUnsupported: inputs the kernels do not handle (see the module docstring), with the reason.

    Example:
        >>> q = torch.randn(2, 4, 7, 32)
        >>> torch.allclose(scaled_dot_product_attention(q, q, q),
        ...                torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-5)
        True
        >>> scaled_dot_product_attention(q[0], q[0], q[0], is_causal=True).shape  # no batch axis
        torch.Size([4, 7, 32])
    """
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    _check(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    b, hq, lq, d = query.shape
    if sinks is not None and (sinks.shape != (hq,) or not sinks.is_floating_point() or sinks.requires_grad):
        raise AttentionUnsupported(f"sinks must be one float logit per query head, [{hq}], without gradients")
    hkv, lk, dv = key.shape[1], key.shape[2], value.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mask = None if attn_mask is None else _expanded(attn_mask, (b, hq, lq, lk))
    out = torch.empty((b, hq, lq, dv), dtype=query.dtype, device=query.device)
    if out.numel():
        args = AttentionArgs(
            scale=scale,
            causal=bool(is_causal),
            mask="none" if mask is None else ("bool" if mask.dtype == torch.bool else "add"),
            groups=hq // hkv,
            score_mod=score_mod,
            sinks=sinks is not None,
        )
        launch, record = _launcher(query, key, value, mask, args)
        if owner is not None:
            from kernelize.hub import note_kernels

            note_kernels(owner, record)
        operands = [t for t in (query, key, value, mask, sinks) if t is not None]
        _launch(launch, operands, out, args)
    return out.squeeze(0) if squeeze else out


def _launch(launch, operands: list[torch.Tensor], out: torch.Tensor, args: AttentionArgs) -> None:
    """Run the kernel, named in the profiler's trace when one records."""
    if not torch.autograd.profiler._is_profiler_enabled:
        launch(operands, [out], None)
        return
    mod = f", {args.score_mod.name}" if args.score_mod is not None else ""
    with torch.profiler.record_function(f"kernelize::attention[{args.mask}, causal={args.causal}{mod}]"):
        launch(operands, [out], None)


def _expanded(mask: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        return mask.expand(shape)  # a view: broadcast axes get stride 0
    except RuntimeError:
        raise AttentionUnsupported(
            f"attn_mask of shape {list(mask.shape)} does not broadcast to {list(shape)}"
        ) from None


def _check(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> None:
    """Raise AttentionUnsupported for anything the kernels do not run exactly as torch would."""
    if dropout_p != 0.0:
        raise AttentionUnsupported(f"dropout_p={dropout_p}: the attention kernels do not apply dropout")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise AttentionUnsupported("query, key and value must be tensors")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise AttentionUnsupported(
            f"query, key and value must be [batch, heads, seq, head_dim] (or without batch), got shapes "
            f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    if q.dtype not in FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionUnsupported(
            f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernels take one of f32, f16, bf16 for all three"
        )
    if k.device != q.device or v.device != q.device or (mask is not None and mask.device != q.device):
        raise AttentionUnsupported("query, key, value and attn_mask must be on one device")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mask) if t is not None):
        raise AttentionUnsupported("the attention kernels have no backward; inputs require grad")
    (b, hq, _, d), (bk, hkv, lk, dk), (bv, hv, lv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv and hkv == hv and lk == lv and d == dk):
        raise AttentionUnsupported(
            f"shapes {list(q.shape)}, {list(k.shape)}, {list(v.shape)} do not fit [B, Hq, Lq, D], "
            "[B, Hkv, Lk, D], [B, Hkv, Lk, Dv]"
        )
    if hq != hkv and not (enable_gqa and hkv and hq % hkv == 0):
        raise AttentionUnsupported(
            f"{hq} query heads and {hkv} key heads need enable_gqa=True and a whole number of query heads "
            "per key head"
        )
    if mask is not None:
        if is_causal:
            raise AttentionUnsupported("attn_mask together with is_causal=True")
        if mask.dtype not in MASK_DTYPES or (
            mask.dtype != torch.bool and mask.dtype not in (q.dtype, torch.float32)
        ):
            raise AttentionUnsupported(f"attn_mask dtype {mask.dtype} with query dtype {q.dtype}")
        if mask.dim() > 4:
            raise AttentionUnsupported(f"attn_mask of rank {mask.dim()} > 4")


# (backend, device, dtypes, static shapes, args) -> (launch function, what ran for kernelize.inspect)
_LAUNCHERS: dict[tuple, tuple] = {}
_LOCK = threading.Lock()


def _launcher(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, args: AttentionArgs
):
    from kernelize.hub import backend_for

    backend = backend_for(q.device)
    key = (
        backend,
        q.device,
        q.dtype,
        None if mask is None else mask.dtype,
        q.shape[1],
        k.shape[1],
        q.shape[3],
        v.shape[3],
        args,
    )
    fn = _LAUNCHERS.get(key)
    if fn is None:
        with _LOCK:
            fn = _LAUNCHERS.get(key)
            if fn is None:
                fn = _LAUNCHERS[key] = _build(backend, q, k, v, mask, args)
    return fn


def _build(backend: str, q, k, v, mask, args: AttentionArgs):
    """Graph of one attention node -> plan -> one compiled ATTENTION kernel: (launch, record)."""
    from kernelize.hub import KernelRecord

    sig = (
        f"attention({str(q.dtype).removeprefix('torch.')}[b, {q.shape[1]}, q_len, {q.shape[3]}], "
        f"kv heads {k.shape[1]}, dv {v.shape[3]}, causal={args.causal}, mask={args.mask}"
        + (f", {args.score_mod.name})" if args.score_mod is not None else ")")
    )
    if backend == "reference":

        def launch(operands, writes, sizes):
            q, k, v, m, sinks = split_operands(operands, args)
            writes[0].copy_(reference_attention(q, k, v, m, args, sinks))

        return launch, KernelRecord("reference", (), sig)
    from kernelize.autokernel.kernels import KernelKind
    from kernelize.autokernel.plan import plan
    from kernelize.runtime.compiled import make_backend

    impl = make_backend(backend)
    if not impl.device_ok(q.device):
        raise AttentionUnsupported(f"backend {backend!r} cannot run on device {q.device}")
    dt = DType.from_torch(q.dtype)
    g = Graph()
    qn = g.input("q", ("batch", q.shape[1], "q_len", q.shape[3]), dt)
    kn = g.input("k", ("batch", k.shape[1], "k_len", k.shape[3]), dt)
    vn = g.input("v", ("batch", k.shape[1], "k_len", v.shape[3]), dt)
    mn = (
        None
        if mask is None
        else g.input("mask", ("batch", q.shape[1], "q_len", "k_len"), DType.from_torch(mask.dtype))
    )
    sn = g.input("sinks", (q.shape[1],), DType.F32) if args.sinks else None
    kw = dict(scale=args.scale, causal=args.causal, gqa=args.groups > 1, score_mod=args.score_mod, sinks=sn)
    g.output(g.attention(qn, kn, vn, mn, **kw))
    (kernel,) = plan(g, impl.plan_settings).kernels
    assert kernel.kind is KernelKind.ATTENTION, kernel
    compiled = impl.compile(kernel)
    return compiled.launch, KernelRecord(backend, ((compiled.name, compiled.source_hash),), sig)


__all__ = ["AttentionUnsupported", "scaled_dot_product_attention"]
