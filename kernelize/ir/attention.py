"""The ``ATTENTION`` op: builder checks and the reference semantics (``torch.nn.functional.
scaled_dot_product_attention`` without dropout).

``attention(q, k, v, mask)`` with q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v ``[B, Hkv, Lk, Dv]`` and
``Hq = groups * Hkv`` is ``softmax(scale * q @ k^T + mask) @ v`` where query head ``h`` reads key/value
head ``h // groups`` (torch's ``enable_gqa``: ``repeat_interleave`` of the key heads). A boolean mask keeps
a score where True, a float mask is added; the mask operand is broadcast to ``[B, Hq, Lq, Lk]`` in the
graph (a layout view, so kernels read it with stride 0 on the broadcast axes). A query row whose every
key is masked gives zeros, as torch's CPU kernels do (the math formula would give NaN).

Example:
    >>> g = Graph()
    >>> q = g.input("q", (1, 8, "seq", 64), "f32"); k = g.input("k", (1, 2, "seq", 64), "f32")
    >>> o = g.attention(q, k, k, causal=True, gqa=True)
    >>> o.arg
    AttentionArgs(scale=0.125, causal=True, mask='none', groups=4, score_mod=None, sinks=False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.errors import DTypeError
from kernelize.ir.ops import AttentionArgs, Op
from kernelize.ir.shapes import ShapeError, Sym, broadcast_shapes, shape_str

T = TypeVar("T")

if TYPE_CHECKING:
    from kernelize.ir.graph import Graph, Node
    from kernelize.ir.score_mod import ScoreMod


def build_attention(
    g: Graph,
    q: Node,
    k: Node,
    v: Node,
    mask: Node | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    gqa: bool = False,
    score_mod: ScoreMod | None = None,
    sinks: Node | None = None,
) -> Node:
    """Append an ``ATTENTION`` node (see the module docstring); checks shapes and dtypes as it builds."""

    def where() -> str:
        return f"attention of q {shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)}"

    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ShapeError(f"{where()}: q, k and v must be [batch, heads, seq, head_dim]")
    if not q.dtype.is_float or q.dtype != k.dtype or q.dtype != v.dtype:
        raise DTypeError(
            f"{where()}: q, k and v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    (b, hq, lq, d), (bk, hkv, lk, dk), (bv, hv, lv, dv) = q.shape, k.shape, v.shape
    if b != bk or b != bv or hkv != hv or lk != lv or d != dk:
        raise ShapeError(f"{where()}: batch, key heads, key length and head dim must agree")
    if any(isinstance(x, Sym) for x in (d, dv)):
        raise ShapeError(f"{where()}: the head dims must be static")
    groups = 1
    if hq != hkv:
        if not gqa or isinstance(hq, Sym) or isinstance(hkv, Sym) or hq % hkv:
            raise ShapeError(
                f"{where()}: query heads {hq} differ from key heads {hkv}; grouped-query attention needs "
                "gqa=True and static head counts with query heads a multiple of key heads"
            )
        groups = hq // hkv
    src = [q, k, v]
    kind = "none" if mask is None else _mask_kind(mask, (b, hq, lq, lk), where)
    if mask is not None:
        src.append(g.broadcast(mask, (b, hq, lq, lk)))
    if sinks is not None:
        if sinks.shape != (hq,) or sinks.dtype is not DType.F32:
            raise ShapeError(f"{where()}: sinks must be f32[{hq}] (one logit per query head), got {sinks}")
        src.append(sinks)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    args = AttentionArgs(scale, bool(causal), kind, groups, score_mod, sinks is not None)
    return g.push(Op.ATTENTION, q.dtype, (b, hq, lq, dv), tuple(src), args)


def _mask_kind(mask: Node, full: tuple, where: Callable[[], str]) -> str:
    """``"bool"`` or ``"add"`` for a mask that broadcasts to ``full``; raises for any other."""
    if mask.rank > 4:
        raise ShapeError(f"{where()}: mask {shape_str(mask.shape)} has rank > 4")
    try:
        if broadcast_shapes(mask.shape, full) != full:
            raise ShapeError("")
    except ShapeError:
        raise ShapeError(
            f"{where()}: mask {shape_str(mask.shape)} does not broadcast to {shape_str(full)}"
        ) from None
    if mask.dtype is DType.BOOL:
        return "bool"
    if mask.dtype.is_float:
        return "add"
    raise DTypeError(f"{where()}: mask must be bool or float, got {mask.dtype}")


def split_operands(operands: Sequence[T], args: AttentionArgs) -> tuple[T, T, T, T | None, T | None]:
    """(q, k, v, mask, sinks) of an attention node's operands (or of the tensors bound to them)."""
    q, k, v, *rest = operands
    mask = rest.pop(0) if args.mask != "none" else None
    return q, k, v, mask, rest[0] if args.sinks else None


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    args: AttentionArgs,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: plain torch math in f32 (f64 stays f64), the result in q's dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    if args.groups > 1:
        kf = kf.repeat_interleave(args.groups, dim=1)
        vf = vf.repeat_interleave(args.groups, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * args.scale
    if args.score_mod is not None:
        s = args.score_mod.apply(s).to(acc)
    lq, lk = s.shape[-2], s.shape[-1]
    if args.causal:
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(), -math.inf)
    if args.mask == "bool":
        s = s.masked_fill(~mask, -math.inf)
    elif args.mask == "add":
        s = s + mask.to(acc)
    if sinks is not None:  # one more key per head, of logit `sink` and value zero
        sink = sinks.to(acc).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        return torch.matmul(torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1], vf).to(q.dtype)
    p = torch.softmax(s, dim=-1)
    # a fully masked row: softmax gives NaN, torch's kernels give zeros
    p = torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), torch.zeros_like(p), p)
    return torch.matmul(p, vf).to(q.dtype)


__all__ = ["build_attention", "reference_attention", "split_operands"]
