"""Mixture-of-experts MLPs as one generated grouped-expert kernel (:mod:`kernelize.ir.experts`).

``grouped_experts(x, index, weights, up, down, act="silu")`` computes, for tokens x ``[T, H]`` routed to
experts ``index`` ``[T, K]`` with routing weights ``weights`` ``[T, K]``::

    out[t] = sum_k weights[t, k] * down[e] @ (act(gate[e] @ x[t]) * up_[e] @ x[t]),   e = index[t, k]

with ``up`` ``[E, 2I, H]`` holding each expert's gate rows then its up rows (transformers' ``gate_up_proj``;
``gated=False``: ``[E, I, H]`` and ``act(up[e] @ x[t])``) and ``down`` ``[E, H, I]``. Each call builds (once
per signature) a graph of one ``EXPERTS`` node, plans it into one grouped-expert kernel and compiles it with
the backend for the tensors' device (:func:`kernelize.hub.backend_for`). A token reads only its K experts'
weights; decode reads each selected expert's bytes once.

What the kernels do not do raises :class:`ExpertsUnsupported` (a ``ValueError``) with the reason, so a
caller can fall back: gradients, dtypes other than f32 / f16 / bf16, operands on different devices, shapes
that do not fit.

Example:
    >>> x = torch.randn(3, 64); up = torch.randn(8, 2 * 32, 64); down = torch.randn(8, 64, 32)
    >>> index = torch.tensor([[0, 5], [5, 7], [1, 2]]); weights = torch.rand(3, 2)
    >>> grouped_experts(x, index, weights, up, down).shape
    torch.Size([3, 64])
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.experts import reference_experts
from kernelize.ir.graph import Graph
from kernelize.ir.ops import EXPERT_ACTIVATIONS, ExpertsArgs

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)


class ExpertsUnsupported(ValueError):
    """The generated experts kernels cannot run these inputs; the message says why (fall back to torch)."""


def grouped_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    act: str = "silu",
    gated: bool = True,
    *,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    owner: torch.nn.Module | None = None,
    **form: float | bool | None,
) -> torch.Tensor:
    """The routed experts' weighted sum per token (see the module docstring) by the generated kernel
    (``owner``: a module whose ``kernelize.inspect`` record then lists the kernel). ``up_bias`` ``[E, N]``
    and ``down_bias`` ``[E, H]`` (both or neither) and ``form`` (``interleaved`` rows, the gate's clamps:
    :class:`~kernelize.ir.ops.ExpertsArgs`) describe gpt-oss-style experts.

    Raises:
        ExpertsUnsupported: inputs the kernels do not handle, with the reason.

    Example:
        >>> x = torch.randn(2, 16); up = torch.randn(4, 16, 16); down = torch.randn(4, 16, 8)
        >>> out = grouped_experts(x, torch.tensor([[1], [3]]), torch.ones(2, 1), up, down)
        >>> h = torch.nn.functional.silu(up[1][:8] @ x[0]) * (up[1][8:] @ x[0])
        >>> torch.allclose(out[0], down[1] @ h, atol=1e-4)
        True
    """
    if (up_bias is None) != (down_bias is None):
        raise ExpertsUnsupported("give both biases (up_bias [E, N] and down_bias [E, H]) or neither")
    try:
        args = _args(act, gated, up_bias is not None, tuple(sorted(form.items())))
    except (TypeError, ValueError) as exc:
        raise ExpertsUnsupported(str(exc)) from exc
    ops = (x, index, weights, up, down) + (() if up_bias is None else (up_bias, down_bias))
    # a signature seen before was checked then: per call, only what its key does not pin down
    built = _LAUNCHERS.get(_key(ops, args)) if _cheap_ok(*ops[:5]) else None
    if built is None:
        _check(*ops[:5], act, gated)
        _check_biases(ops)
    if torch.is_grad_enabled() and any(t.requires_grad for t in ops if t.is_floating_point()):
        raise ExpertsUnsupported("the experts kernels have no backward; inputs require grad")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        launch, record = built or _launcher(ops, args)
        if owner is not None:
            from kernelize.hub import note_kernels

            note_kernels(owner, record)
        launch(list(ops), [out], {"tokens": x.shape[0]})
    return out


@functools.lru_cache(maxsize=64)
def _args(act: str, gated: bool, bias: bool, form: tuple) -> ExpertsArgs:
    """The node's attributes, built once per distinct call form (a decode step makes one call per layer)."""
    return ExpertsArgs(act, gated, bias=bias, **dict(form))


def _check_biases(ops: tuple) -> None:
    if len(ops) == 5:
        return
    x, _, _, up, _, up_bias, down_bias = ops
    (e, n, h) = up.shape
    if tuple(up_bias.shape) != (e, n) or tuple(down_bias.shape) != (e, h):
        raise ExpertsUnsupported(
            f"biases {list(up_bias.shape)} and {list(down_bias.shape)}: expected up [E, N] = [{e}, {n}] and "
            f"down [E, H] = [{e}, {h}]"
        )
    if up_bias.dtype != x.dtype or down_bias.dtype != x.dtype or any(b.device != x.device for b in ops[5:]):
        raise ExpertsUnsupported("the biases must have x's dtype and device")


def _check(x, index, weights, up, down, act: str, gated: bool) -> None:
    """Raise ExpertsUnsupported for anything the kernels do not run exactly as the reference would."""
    ops = (x, index, weights, up, down)
    if not all(isinstance(t, torch.Tensor) for t in ops):
        raise ExpertsUnsupported("x, index, weights, up and down must be tensors")
    shapes = ", ".join(str(list(t.shape)) for t in ops)
    if act not in EXPERT_ACTIVATIONS:
        raise ExpertsUnsupported(f"activation {act!r} is not one of the kernels' {EXPERT_ACTIVATIONS}")
    if (x.dim(), index.dim(), weights.dim(), up.dim(), down.dim()) != (2, 2, 2, 3, 3):
        raise ExpertsUnsupported(
            f"shapes {shapes}: expected x [T, H], index and weights [T, K], up [E, N, H], down [E, H, I]"
        )
    (t, h), (e, n, hu), (ed, hd, i) = x.shape, up.shape, down.shape
    if not (
        index.shape == weights.shape
        and index.shape[0] == t
        and e == ed
        and h == hu == hd
        and n == (2 * i if gated else i)
    ):
        raise ExpertsUnsupported(
            f"shapes {shapes} do not fit x [T, H], index [T, K], up [E, N, H], down [E, H, I]"
        )
    if x.dtype not in FLOATS or up.dtype != x.dtype or down.dtype != x.dtype or weights.dtype not in FLOATS:
        raise ExpertsUnsupported(
            f"dtypes {x.dtype}, {up.dtype}, {down.dtype} (x, up, down) and {weights.dtype} (weights): the "
            "kernels take one of f32, f16, bf16"
        )
    if index.dtype not in INDEX_DTYPES:
        raise ExpertsUnsupported(f"index dtype {index.dtype}: the kernels take int64 or int32")
    if any(o.device != x.device for o in ops):
        raise ExpertsUnsupported("x, index, weights, up and down must be on one device")


# (backend, device, dtypes, static sizes, args) -> (launch function, what ran for kernelize.inspect)
_LAUNCHERS: dict[tuple, tuple] = {}
_LOCK = threading.Lock()


def _cheap_ok(x, index, weights, up, down) -> bool:
    """Whether the operands are tensors whose token counts agree, on x's device: what a launcher's key (the
    devices, the dtypes, every static size) leaves open."""
    return (
        all(isinstance(t, torch.Tensor) for t in (x, index, weights, up, down))
        and x.dim() == 2
        and index.shape == weights.shape
        and index.dim() == 2
        and index.shape[0] == x.shape[0]
        and index.device == x.device == weights.device
    )


def _key(ops: tuple, args: ExpertsArgs) -> tuple:
    """What one compiled launcher serves: the backend, the devices, the dtypes, every static size, the
    node's attributes."""
    from kernelize.hub import backend_for

    x, index, weights = ops[:3]
    return (
        backend_for(x.device),
        x.device,
        x.dtype,
        index.dtype,
        weights.dtype,
        x.shape[1],
        index.shape[1],
        *((t.shape, t.dtype, t.device) for t in ops[3:]),
        args,
    )


def experts_launcher_for(ops: tuple, act: str, gated: bool, form: dict) -> tuple[Any, Any]:
    """``(launch, record)`` of the compiled kernel :func:`grouped_experts` runs for operands ``ops``
    (``x, index, weights, up, down[, up_bias, down_bias]``), built on first use; ``launch.c_call`` (where
    the backend has one) is its C call for a replay program.

    Raises:
        ExpertsUnsupported: a form or backend the kernels do not take.
    """
    try:
        args = _args(act, gated, len(ops) == 7, tuple(sorted(form.items())))
    except (TypeError, ValueError) as exc:
        raise ExpertsUnsupported(str(exc)) from exc
    return _launcher(ops, args)


def _launcher(ops: tuple, args: ExpertsArgs):
    key = _key(ops, args)
    backend = key[0]
    fn = _LAUNCHERS.get(key)
    if fn is None:
        with _LOCK:
            fn = _LAUNCHERS.get(key)
            if fn is None:
                fn = _LAUNCHERS[key] = _build(backend, *ops, args=args)
    return fn


def _build(backend: str, x, index, weights, up, down, *biases, args: ExpertsArgs):
    """Graph of one experts node -> plan -> one compiled EXPERTS kernel: (launch, record)."""
    from kernelize.hub import KernelRecord

    e, _, h = up.shape
    sig = (
        f"experts({str(x.dtype).removeprefix('torch.')}[tokens, {h}], {e} experts, top-{index.shape[1]}, "
        f"intermediate {down.shape[2]}, {args.act}{'' if args.gated else ', not gated'})"
    )
    if backend == "reference":

        def launch(operands, writes, sizes):
            writes[0].copy_(reference_experts(*operands[:5], args, *operands[5:]))

        return launch, KernelRecord("reference", (), sig)
    from kernelize.autokernel.kernels import ExpertsKernel
    from kernelize.autokernel.plan import plan
    from kernelize.runtime.compiled import make_backend

    impl = make_backend(backend)
    if not impl.device_ok(x.device):
        raise ExpertsUnsupported(f"backend {backend!r} cannot run on device {x.device}")
    g = Graph()
    nodes = [
        g.input(name, shape, DType.from_torch(t.dtype))
        for name, shape, t in (
            ("x", ("tokens", h), x),
            ("index", ("tokens", index.shape[1]), index),
            ("weights", ("tokens", index.shape[1]), weights),
            ("up", tuple(up.shape), up),
            ("down", tuple(down.shape), down),
            *((name, tuple(b.shape), b) for name, b in zip(("up_bias", "down_bias"), biases, strict=False)),
        )
    ]
    biased = dict(zip(("up_bias", "down_bias"), nodes[5:], strict=False))
    g.output(g.experts(*nodes[:5], act=args.act, gated=args.gated, **biased, **args.form))
    (kernel,) = plan(g, impl.plan_settings).kernels
    assert isinstance(kernel, ExpertsKernel), kernel
    try:
        compiled = impl.compile(kernel)
    except ValueError as exc:  # a backend without code for the kind, or a dtype it does not take
        raise ExpertsUnsupported(str(exc)) from exc
    return compiled.launch, KernelRecord(backend, ((compiled.name, compiled.source_hash),), sig)


__all__ = ["ExpertsUnsupported", "experts_launcher_for", "grouped_experts"]
