"""Why the planner plans again: a value it must write to memory, or a buffer it must keep dense.

Lowering a group to a kernel body (:mod:`kernelize.autokernel.body`) or reading NHWC buffers
(:mod:`kernelize.autokernel.layout`) can find that the plan asks for an access no strided load can make: a
view splitting an index a permute reordered, a concat along a computed axis, a matmul operand laid out
NHWC. The lowering then returns a :class:`Rejection` naming the node and the change that makes the access
possible, instead of a kernel; the planner (:func:`kernelize.autokernel.plan.plan`) adds the round's nodes
to the values it materializes or keeps dense and plans again, and keeps the reasons in ``Plan.reasons``
(Inductor's scheduler reports its refusals as ``WhyNoFuse`` values the same way).

Example:
    >>> r = Rejection.materialize(node, "axis 0 is not a plain domain axis here")  # doctest: +SKIP
    >>> str(r)  # doctest: +SKIP
    'materialize Node(concat, f32[4, 6]): axis 0 is not a plain domain axis here'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kernelize.ir.graph import Node

RejectionKind = Literal["materialize", "dense"]


@dataclass(frozen=True)
class Rejection:
    """A plan the lowering cannot follow, and the change that fixes it.

    Attributes:
        node: the value to change.
        kind: ``"materialize"``: write ``node`` to memory (a layout value gets a copy kernel);
            ``"dense"``: lay the buffer ``node`` out row-major instead of NHWC.
        why: the access that failed, for logs and ``str(plan)``.
    """

    node: Node
    kind: RejectionKind
    why: str

    @classmethod
    def materialize(cls, node: Node, why: str) -> Rejection:
        return cls(node, "materialize", why)

    @classmethod
    def dense(cls, node: Node, why: str) -> Rejection:
        return cls(node, "dense", why)

    def __str__(self) -> str:
        return f"{'materialize' if self.kind == 'materialize' else 'keep dense'} {self.node}: {self.why}"


__all__ = ["Rejection", "RejectionKind"]
