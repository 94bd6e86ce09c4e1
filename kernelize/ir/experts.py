"""The ``EXPERTS`` op: a mixture-of-experts layer's routed MLPs and their weighted combine, as one node.

``experts(x, index, weights, up, down)`` with x ``[T, H]`` (T tokens), ``index`` ``[T, K]`` (the experts
each token was routed to, integers in ``[0, E)``), ``weights`` ``[T, K]`` (their routing weights),
``up`` ``[E, 2I, H]`` (``gated``: the gate rows then the up rows, as transformers' ``gate_up_proj``) or
``[E, I, H]``, and ``down`` ``[E, H, I]`` is, per token ``t``::

    out[t] = sum_k weights[t, k] * mlp(index[t, k], x[t])
    mlp(e, x) = down[e] @ (act(up[e][:I] @ x) * (up[e][I:] @ x))     (gated; else down[e] @ act(up[e] @ x))

which is transformers' experts module (``Qwen3MoeExperts``, ``MixtralExperts``, ...): the router that
picks ``index`` and ``weights`` is ordinary graph math before the node. An index equal to E is a
sentinel (expert parallelism's "not on this rank") and adds nothing. Kernels sort the (token, slot) pairs
by expert once and run each selected expert's MLP over its own tokens, so a token reads only the weights of
its K experts: the node is what lets a decode step read K of E experts' bytes.

Example:
    >>> from kernelize.ir.graph import Graph
    >>> g = Graph()
    >>> x = g.input("x", ("tokens", 64), "f32")
    >>> idx = g.input("index", ("tokens", 2), "i64"); w = g.input("weights", ("tokens", 2), "f32")
    >>> up = g.input("up", (8, 64, 64), "f32"); down = g.input("down", (8, 64, 32), "f32")
    >>> g.experts(x, idx, w, up, down, act="silu").shape[1]
    64
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kernelize.ir.errors import DTypeError
from kernelize.ir.ops import ExpertsArgs, Op
from kernelize.ir.shapes import ShapeError, Sym, shape_str

if TYPE_CHECKING:
    from kernelize.ir.graph import Graph, Node

# the activation formulas (f32 in, f32 out); the kernels' C++ / Triton / CUDA spell the same formulas
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Nemotron-H, Primer)
}


def build_experts(
    g: Graph,
    x: Node,
    index: Node,
    weights: Node,
    up: Node,
    down: Node,
    *,
    act: str,
    gated: bool = True,
    up_bias: Node | None = None,
    down_bias: Node | None = None,
    **form: Any,
) -> Node:
    """Append an ``EXPERTS`` node (see the module docstring); checks shapes and dtypes as it builds.

    ``up_bias`` ``[E, N]`` and ``down_bias`` ``[E, H]`` come together or not at all; ``form``: the other
    fields of :class:`~kernelize.ir.ops.ExpertsArgs` (interleaved rows, the gate's clamps).
    """
    if (up_bias is None) != (down_bias is None):
        raise ShapeError("experts: give both biases (up [E, N] and down [E, H]) or neither")
    args = ExpertsArgs(act, gated, bias=up_bias is not None, **form)
    biases = () if up_bias is None else (up_bias, down_bias)

    def where() -> str:
        ops = (x, index, weights, up, down, *biases)
        named = zip(_NAMES, ops, strict=False)
        return "experts of " + ", ".join(f"{n} {shape_str(o.shape)}" for n, o in named)

    if (x.rank, index.rank, weights.rank, up.rank, down.rank) != (2, 2, 2, 3, 3):
        raise ShapeError(
            f"{where()}: expected x [T, H], index and weights [T, K], up [E, N, H], down [E, H, I]"
        )
    if not x.dtype.is_float or any(o.dtype != x.dtype for o in (up, down, *biases)):
        raise DTypeError(
            f"{where()}: x, up, down (and the biases) must share one float dtype, got "
            f"{', '.join(str(o.dtype) for o in (x, up, down, *biases))}"
        )
    if not index.dtype.is_int or not weights.dtype.is_float:
        raise DTypeError(
            f"{where()}: index must be integer and weights float, got {index.dtype}, {weights.dtype}"
        )
    (t, h), (ti, k), (tw, kw) = x.shape, index.shape, weights.shape
    (e, n, hu), (ed, hd, i) = up.shape, down.shape
    static = (h, k, e, n, i)
    if any(isinstance(d, Sym) for d in static):
        raise ShapeError(f"{where()}: the hidden size, K, the expert count and the MLP sizes must be static")
    if not (t == ti == tw and k == kw and e == ed and h == hu == hd and n == (2 * i if gated else i)):
        raise ShapeError(f"{where()}: sizes disagree (up's rows must be {'2 * ' if gated else ''}down's I)")
    if biases and (tuple(up_bias.shape) != (e, n) or tuple(down_bias.shape) != (e, h)):
        raise ShapeError(f"{where()}: the biases must be up [E, N] = [{e}, {n}] and down [E, H] = [{e}, {h}]")
    return g.push(Op.EXPERTS, x.dtype, x.shape, (x, index, weights, up, down, *biases), args)


_NAMES = ("x", "index", "weights", "up", "down", "up_bias", "down_bias")


def split_gate(h: torch.Tensor, args: ExpertsArgs) -> torch.Tensor:
    """The activations of the up projection's output ``h`` ``[..., N]`` (bias added): ``act(h)`` ungated,
    else the gate half against the up half in the node's gate form (see
    :class:`~kernelize.ir.ops.ExpertsArgs`)."""
    act = ACTIVATIONS[args.act]
    if not args.gated:
        return act(h)
    gate, lin = (h[..., 0::2], h[..., 1::2]) if args.interleaved else h.chunk(2, dim=-1)
    if args.gate_limit is not None:
        gate = gate.clamp(max=args.gate_limit)
    a = gate * torch.sigmoid(gate * args.alpha) if args.alpha != 1.0 else act(gate)
    if args.act_limit is not None:
        a = a.clamp(max=args.act_limit)
    if args.up_limit is not None:
        lin = lin.clamp(-args.up_limit, args.up_limit)
    return a * (lin + args.up_shift) if args.up_shift else a * lin


def reference_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    args: ExpertsArgs,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: each expert's MLP over its tokens in f32 (f64 stays f64), the sum in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, wf = x.to(acc), weights.to(acc)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    experts = up.shape[0]
    for e in torch.unique(index).tolist():
        if e == experts:  # the expert-parallel sentinel
            continue
        if not 0 <= e < experts:
            raise IndexError(f"experts: expert index {e} is outside [0, {experts}]")
        tok, slot = torch.where(index == e)
        h = xf[tok] @ up[e].to(acc).T
        y = split_gate(h if up_bias is None else h + up_bias[e].to(acc), args) @ down[e].to(acc).T
        y = y if down_bias is None else y + down_bias[e].to(acc)
        out.index_add_(0, tok, y * wf[tok, slot, None])
    return out.to(x.dtype)


def expert_flops(tokens: int, top_k: int, hidden: int, inter: int, gated: bool = True) -> int:
    """Multiply-adds x 2 of one call: each (token, slot) pair runs one MLP."""
    return 2 * tokens * top_k * hidden * inter * (3 if gated else 2)


def expert_bytes(index: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> int:
    """The weight bytes a call needs: the selected experts' up and down matrices, each once."""
    chosen = torch.unique(index[index < up.shape[0]]).numel()
    per_expert = math.prod(up.shape[1:]) * up.element_size() + math.prod(down.shape[1:]) * down.element_size()
    return chosen * per_expert


__all__ = ["ACTIVATIONS", "build_experts", "expert_bytes", "expert_flops", "reference_experts", "split_gate"]
