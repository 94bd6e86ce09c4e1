"""Top-k selection and mixture-of-experts routers as graph ops: ``TOPK`` and ``ROUTE``.

``g.topk(x, k)`` is ``torch.topk(x, k, dim=-1)`` (largest, sorted): two nodes, the values (x's dtype) and
the int64 indices, each ``[..., k]``. ``g.route(x, k, ...)`` is a router's whole row part on logits
``x [..., E]`` (see :class:`~kernelize.ir.ops.RouteArgs`): score (softmax / sigmoid / none), an optional
bias for the choice, top-k, renormalisation of the K chosen scores, a scale and the cast, again as a
weights node and an indices node. ``passes.router`` folds the traced form of transformers' routers
(``softmax(dtype=float) -> topk -> /= sum -> .to(dtype)``) into ``ROUTE``; the planner runs the two
nodes of one router as one ROUTER kernel.

The tie rule (every backend and the reference): among equal values the lower index comes first, so the
chosen set and its order are those of a stable descending sort (``torch.sort(stable=True,
descending=True)``); NaN counts as the largest value, as in torch. ``torch.topk`` on the CPU does not
promise an order for ties (``topk([1, 3, 3, 2, 3], 3)`` gives indices ``[1, 4, 2]`` on torch 2.13), so
code compared with it must accept index differences between equal values (:func:`same_choice`).

Example:
    >>> from kernelize.ir.graph import Graph
    >>> g = Graph(); x = g.input("x", ("tokens", 60), "f32")
    >>> w, i = g.route(x, 4, renorm="sum")
    >>> w.shape[1], w.dtype, i.dtype
    (4, <DType.F32: 'f32'>, <DType.I64: 'i64'>)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.errors import DTypeError
from kernelize.ir.ops import Op, RouteArgs, TopkArgs
from kernelize.ir.shapes import ShapeError, Sym, shape_str

if TYPE_CHECKING:
    from kernelize.ir.graph import Graph, Node


def _rows(x: Node, k: int, what: str) -> None:
    if x.rank < 1 or isinstance(x.shape[-1], Sym):
        raise ShapeError(f"{what} of {shape_str(x.shape)}: the last axis must be static")
    if not 1 <= k <= x.shape[-1]:
        raise ShapeError(f"{what} of {shape_str(x.shape)}: k={k} must be in [1, {x.shape[-1]}]")


def build_topk(g: Graph, x: Node, k: int) -> tuple[Node, Node]:
    """(values, indices) of the ``k`` largest along the last axis (see the module docstring)."""
    _rows(x, k, "topk")
    shape = (*x.shape[:-1], k)
    values = g.push(Op.TOPK, x.dtype, shape, (x,), TopkArgs(k))
    return values, g.push(Op.TOPK, DType.I64, shape, (x,), TopkArgs(k, indices=True))


def build_route(
    g: Graph,
    x: Node,
    k: int,
    bias: Node | None = None,
    dtype: DType | str = DType.F32,
    **fields: object,
) -> tuple[Node, Node]:
    """(weights, indices) of a router over logits ``x [..., E]`` (fields: :class:`RouteArgs`'s score,
    renorm, eps, scale); ``bias`` ``[E]`` joins the scores for the choice only."""
    _rows(x, k, "route")
    dtype = DType(dtype)
    if not x.dtype.is_float or not dtype.is_float:
        raise DTypeError(f"route: logits and weights must be floats, got {x.dtype} and {dtype}")
    if bias is not None and (tuple(bias.shape) != (x.shape[-1],) or not bias.dtype.is_float):
        raise ShapeError(
            f"route: the bias must be a float [{x.shape[-1]}], got {bias.dtype}{shape_str(bias.shape)}"
        )
    args = RouteArgs(k, bias=bias is not None, **fields)
    src = (x,) if bias is None else (x, bias)
    shape = (*x.shape[:-1], k)
    weights = g.push(Op.ROUTE, dtype, shape, src, args)
    index_args = RouteArgs(k, args.score, args.bias, indices=True)
    return weights, g.push(Op.ROUTE, DType.I64, shape, src, index_args)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The tie rule's indices: the first ``k`` of a stable descending sort along the last axis."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def reference_topk(x: torch.Tensor, args: TopkArgs) -> torch.Tensor:
    index = topk_indices(x, args.k)
    return index if args.indices else x.gather(-1, index)


SCORES = {
    "softmax": lambda s: torch.softmax(s, -1),
    "sigmoid": torch.sigmoid,
    "none": lambda s: s,
}


def reference_route(x: torch.Tensor, bias: torch.Tensor | None, args: RouteArgs) -> torch.Tensor:
    """The oracle of one ``ROUTE`` node, in f32 (f64 stays f64): the indices or the weights."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = SCORES[args.score](x.to(acc))
    index = topk_indices(s if bias is None else s + bias.to(acc), args.k)
    if args.indices:
        return index
    w = s.gather(-1, index)
    if args.renorm == "sum":
        w = w / (w.sum(-1, keepdim=True) + args.eps)
    elif args.renorm == "softmax":
        w = torch.softmax(w, -1)
    return w * args.scale if args.scale != 1.0 else w


def same_choice(scores: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two index sets ``[..., K]`` over ``scores [..., E]`` pick equal scores position by position:
    equal indices, or indices that differ only between tied scores (torch's CPU topk orders ties freely)."""
    if got.shape != want.shape:
        return False
    if torch.equal(got, want):
        return True
    a, b = scores.gather(-1, got.long()), scores.gather(-1, want.long())
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


__all__ = [
    "SCORES",
    "build_route",
    "build_topk",
    "reference_route",
    "reference_topk",
    "same_choice",
    "topk_indices",
]
