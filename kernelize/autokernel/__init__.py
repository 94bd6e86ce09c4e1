"""Autokernel: cut a graph into fused kernels (:func:`plan`) described by code-generator-neutral specs.

Example:
    >>> from kernelize.ir import Graph
    >>> from kernelize.autokernel import plan
    >>> g = Graph(); x = g.input("x", ("tokens", 64), "f32"); g.output(g.softmax(g.mul(x, 0.125)))
    >>> print(plan(g))  # doctest: +SKIP
"""

from kernelize.autokernel.dot import plan_to_dot, plan_to_svg
from kernelize.autokernel.kernels import Compute, Indirect, Kernel, KernelKind, Load, Store, row_invariant
from kernelize.autokernel.legality import can_absorb
from kernelize.autokernel.plan import Plan, PlanSettings, plan

__all__ = [
    "Compute",
    "Indirect",
    "Kernel",
    "KernelKind",
    "Load",
    "Plan",
    "PlanSettings",
    "Store",
    "can_absorb",
    "plan",
    "plan_to_dot",
    "plan_to_svg",
    "row_invariant",
]
