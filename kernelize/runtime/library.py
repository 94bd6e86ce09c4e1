"""Values the runtime computes with torch rather than a generated kernel: layout views and constants of
buffers (:func:`materialize`), and LIBRARY / CONV kernels run op by op with the reference executor's
implementations (:func:`run_library`, what the plan interpreters of the tests use as the oracle; the
runtime's own library path in :mod:`kernelize.runtime.compiled` adds device choices such as cuBLAS and
channels-last buffers).

Example:
    >>> vals = {x: torch.randn(4, 8)}  # doctest: +SKIP
    >>> materialize(g.transpose(x), vals, {})  # the view, computed from the buffer  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import Kernel
from kernelize.ir.graph import LAYOUT, Node, Op, reach
from kernelize.ir.reference import EVAL


def view_bases(nodes: Sequence[Node]) -> set[Node]:
    """`nodes` and every node they view through layout ops (what materialising them reads)."""
    return reach(nodes, lambda n: n.op in LAYOUT)


def materialize(node: Node, vals: dict[Node, torch.Tensor], env: dict[str, int]) -> torch.Tensor:
    """The tensor of ``node``: a buffer, or a layout view / constant computed from buffers (no recursion).
    What it computes on the way is added to ``vals``."""
    stack = [node]
    while stack:
        n = stack[-1]
        if n in vals:
            stack.pop()
            continue
        missing = [s for s in n.src if s not in vals]
        if missing:
            assert n.op in LAYOUT or n.op is Op.CONST, f"{n} is neither computed by a kernel nor a view"
            stack.extend(missing)
            continue
        stack.pop()
        vals[n] = EVAL[n.op](n, [vals[s] for s in n.src], env)
    return vals[node]


def materialize_view(
    node: Node, vals: dict[Node, torch.Tensor], env: dict[str, int], geometry: dict[Node, tuple]
) -> torch.Tensor:
    """:func:`materialize` for a graph output, remembering in ``geometry`` (one dict per input signature)
    where a view of one buffer lies in that buffer, so the next call rebuilds it with one ``as_strided``
    instead of the reference executor's walk through the layout ops (~30 us per output per call).

    A remembered view is used only while its buffer has the shape and strides it was measured on; a layout
    op that copies (``flip``, a ``view`` that cannot view) leaves nothing to remember.
    """
    t = vals.get(node)
    if t is not None:
        return t
    held = geometry.get(node)
    if held is not None:
        base_node, base_layout, size, stride, offset = held
        base = vals.get(base_node)
        if base is not None and (base.shape, base.stride()) == base_layout:
            return base.as_strided(size, stride, base.storage_offset() + offset)
    base_node = node
    while base_node not in vals and base_node.op in LAYOUT and len(base_node.src) == 1:
        base_node = base_node.src[0]
    t = materialize(node, vals, env)
    base = vals.get(base_node)
    if base is not None and base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        layout = (base.shape, base.stride())
        geometry[node] = (base_node, layout, t.shape, t.stride(), t.storage_offset() - base.storage_offset())
    return t


def library_operands(
    kernel: Kernel, values: Mapping[Node, torch.Tensor], env: Mapping[str, int]
) -> list[torch.Tensor]:
    """The operand tensors of a LIBRARY kernel: its buffers seen through the node's layout views (also
    the operands of any node whose operands are buffers, views of buffers or constants)."""
    vals = dict(values)
    return [materialize(s, vals, dict(env)) for s in kernel.node.src]


def run_library(kernel: Kernel, values: Mapping[Node, torch.Tensor], env: Mapping[str, int]) -> torch.Tensor:
    """Run a LIBRARY, CONV or CONV_CHAIN kernel with the reference implementation of its op (a CONV
    kernel's epilogue op by op: conv, bias, residual, activation; a chain's stages one after another)."""
    vals = dict(values)
    for n in kernel.computes or (kernel.node,):
        operands = [materialize(s, vals, dict(env)) for s in n.src]
        vals[n] = EVAL[n.op](n, operands, dict(env)).to(n.dtype.torch)
    return vals[kernel.writes[0]].contiguous()


__all__ = ["library_operands", "materialize", "materialize_view", "run_library", "view_bases"]
