"""Pattern tables and the rebuild driver every pass is written with.

A pass is a table of ``(Pattern, fn)`` rules. The driver walks the old graph's nodes in order (no
recursion, so 10 000-node chains are fine), copies each node into a fresh graph through an old -> new map,
and offers the copy to the rules: the first rule whose pattern matches and whose ``fn`` returns a node
replaces it, and the replacement is offered again until no rule fires (a loop is cut after
``max_steps`` and names the rule). ``fn`` receives a :class:`Context` and the pattern's captures as keyword
arguments, builds its replacement with the new graph's builder (so canonicalisation and shape checks
apply) and returns it, or None to decline.

Example:
    >>> x, c = Var("x"), Scalar("c")
    >>> RULES = [(P(Op.MUL, P(Op.MUL, x, Scalar("a")), Scalar("b")),
    ...           lambda ctx, x, a, b: ctx.g.mul(x, scalar_value(a) * scalar_value(b)))]
    >>> rewrite(graph, RULES)  # doctest: +SKIP
    before: %2 = mul(%0, %1); %4 = mul(%2, %3)     after: %2 = mul(%0, %1)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernelize.ir.graph import LAYOUT, Graph, Node, Op, scalar_value
from kernelize.ir.printer import format_node
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import is_static, numel

logger = logging.getLogger(__name__)

# binary ops whose operands may be swapped when matching
COMMUTATIVE = frozenset({Op.ADD, Op.MUL, Op.MIN, Op.MAX, Op.EQ, Op.NE, Op.AND, Op.OR})
_ANY = object()


class RewriteLoopError(RuntimeError):
    """A rule kept rewriting the same value: the table is not terminating."""


@dataclass(frozen=True, eq=False)
class Pattern:
    """Matches one node and, recursively, its operands.

    Attributes:
        op: an Op, a set of Ops, or None for any op.
        src: operand patterns (None: operands are not looked at).
        name: capture the matched node under this name; a name seen twice must bind the same node.
        arg: required ``node.arg`` (left out: any).
        where: extra predicate on the node.
        peel: also try the node under broadcasts and unit views (``x`` broadcast to an elementwise op's
            shape is still ``x``).
    """

    op: Op | frozenset[Op] | None = None
    src: tuple[Pattern, ...] | None = None
    name: str | None = None
    arg: Any = _ANY
    where: Callable[[Node], bool] | None = None
    peel: bool = False

    def match(self, node: Node) -> Iterator[dict[str, Node]]:
        """Every way ``node`` matches (commutative ops try both operand orders)."""
        yield from _match(self, node, {})


def P(
    op: Op | frozenset[Op] | None,
    *src: Pattern,
    name: str | None = None,
    arg: Any = _ANY,
    where: Callable[[Node], bool] | None = None,
    peel: bool = False,
) -> Pattern:
    """Shorthand: ``P(Op.MUL, x, y)``; without operands the node's operands are not looked at."""
    return Pattern(op, tuple(src) if src else None, name, arg, where, peel)


def Var(name: str, where: Callable[[Node], bool] | None = None) -> Pattern:
    """Any node, captured as ``name``."""
    return Pattern(None, None, name, _ANY, where)


def Scalar(name: str) -> Pattern:
    """A uniform constant (through layout ops), captured as ``name``; read it with ``scalar_value``."""
    return Pattern(None, None, name, _ANY, lambda n: scalar_value(n) is not None)


def Const(name: str) -> Pattern:
    """A constant tensor (through layout ops, any values) as ``name``; read it with ``const_value``."""
    return Pattern(None, None, name, _ANY, is_const)


def B(p: Pattern) -> Pattern:
    """``p``, possibly broadcast or unsqueezed to a larger shape."""
    return Pattern(p.op, p.src, p.name, p.arg, p.where, True)


def _peeled(node: Node) -> Iterator[Node]:
    yield node
    while node.op is Op.BROADCAST or (node.op is Op.VIEW and _unit_view(node)):
        node = node.src[0]
        yield node


def _unit_view(node: Node) -> bool:
    """A view that only adds or removes size-1 dims."""
    return [d for d in node.shape if d != 1] == [d for d in node.src[0].shape if d != 1]


def _match(p: Pattern, node: Node, caps: dict[str, Node]) -> Iterator[dict[str, Node]]:
    for cand in _peeled(node) if p.peel else (node,):
        if p.op is not None and (cand.op not in p.op if isinstance(p.op, frozenset) else cand.op is not p.op):
            continue
        if p.arg is not _ANY and cand.arg != p.arg:
            continue
        if p.where is not None and not p.where(cand):
            continue
        got = caps
        if p.name is not None:
            if p.name in caps:
                if caps[p.name] is not cand:
                    continue
            else:
                got = {**caps, p.name: cand}
        if p.src is None:
            yield got
            continue
        if len(p.src) != len(cand.src):
            continue
        yield from _match_all(p.src, cand.src, got)
        if len(p.src) == 2 and cand.op in COMMUTATIVE and cand.src[0] is not cand.src[1]:
            yield from _match_all(p.src[::-1], cand.src, got)


def _match_all(pats: Sequence[Pattern], nodes: Sequence[Node], caps: dict[str, Node]) -> Iterator[dict]:
    if not pats:
        yield caps
        return
    for c in _match(pats[0], nodes[0], caps):
        yield from _match_all(pats[1:], nodes[1:], c)


Rule = tuple[Pattern, Callable[..., Node | None]]


class Context:
    """What a rule's ``fn`` sees: the new graph ``g``, the matched node ``root`` and use counts."""

    def __init__(
        self, g: Graph, rules: Sequence[Rule], uses: Callable[[Node], int], max_steps: int, pass_name: str
    ) -> None:
        self.g, self.rules, self._uses, self.max_steps, self.pass_name = g, rules, uses, max_steps, pass_name
        self.root: Node | None = None

    def uses(self, node: Node) -> int:
        """How many nodes (and graph outputs) read ``node``'s value in the graph being rewritten."""
        return self._uses(node)

    def apply(self, node: Node) -> Node:
        """Offer a node the rule built to the rules too (so one rewrite can enable the next)."""
        root = self.root
        try:
            return _fixpoint(self, node)
        finally:
            self.root = root


def _fixpoint(ctx: Context, node: Node) -> Node:
    steps = 0
    while True:
        for pattern, fn in ctx.rules:
            out = None
            for caps in pattern.match(node):
                ctx.root = node
                out = fn(ctx, **caps)
                if out is not None:
                    break
            if out is None or out is node:
                continue
            if out.shape != node.shape or out.dtype != node.dtype:
                raise AssertionError(
                    f"rule {fn.__name__} of pass {ctx.pass_name} changed "
                    f"{format_node(ctx.g, node)} into {out}"
                )
            steps += 1
            if steps > ctx.max_steps:
                raise RewriteLoopError(
                    f"rule {fn.__name__} of pass {ctx.pass_name} rewrote one value more than "
                    f"{ctx.max_steps} times (last: {format_node(ctx.g, node)}); the rules "
                    "loop: one of them must stop returning a new node"
                )
            node = out
            break
        else:
            return node


def rewrite(graph: Graph, rules: Sequence[Rule], pass_name: str = "rewrite", max_steps: int = 64) -> Graph:
    """Rebuild ``graph`` applying ``rules`` to every node until none fires; a pure function.

    Dead nodes the rewrites leave behind stay in the result (``dce`` removes them).
    """
    new = Graph()
    live = live_nodes(graph)  # dead nodes (left by an earlier pass) are not users
    old_users: dict[Node, int] = {n: 0 for n in graph.nodes}
    for n in graph.nodes:
        for s in dict.fromkeys(n.src) if n in live else ():
            old_users[s] += 1
    for o in graph.outputs:
        old_users[o] += 1
    origin: dict[Node, Node] = {}  # new node -> the old node it stands for
    made: dict[Node, int] = {}  # nodes rules made for an earlier old node -> their users there
    start = 0

    def uses(node: Node) -> int:
        if node in origin:
            return old_users[origin[node]]
        if node in made:
            return made[node]
        # made by a rule while rewriting the current node: only the replacement reads it
        return 1 if new.index(node) >= start else 1 << 30

    ctx = Context(new, rules, uses, max_steps, pass_name)
    m: dict[Node, Node] = {}
    for n in graph.nodes:
        if n.op is Op.INPUT:
            m[n] = new.input(n.arg, n.shape, n.dtype)
            continue
        start = len(new.nodes)
        cur = new.push(n.op, n.dtype, n.shape, [m[s] for s in n.src], n.arg)
        origin.setdefault(cur, n)
        out = _fixpoint(ctx, cur) if rules else cur
        origin.setdefault(out, n)
        _count_made(new, out, start, origin, made)
        m[n] = out
    new.output(*(m[o] for o in graph.outputs))
    return new


def _count_made(g: Graph, out: Node, start: int, origin: dict[Node, Node], made: dict[Node, int]) -> None:
    """Record how many nodes of ``out``'s replacement read each node the rules made for it."""
    stack, seen = [out], {out}
    while stack:
        for s in dict.fromkeys(stack.pop().src):
            if g.index(s) >= start and s not in origin:
                made[s] = made.get(s, 0) + 1
                if s not in seen:
                    seen.add(s)
                    stack.append(s)


# -- helpers rules share ------------------------------------------------------------------------------------
def strip_broadcast(node: Node) -> Node:
    """The operand of a broadcast (same rank, size-1 dims where it was broadcast), else the node."""
    return node.src[0] if node.op is Op.BROADCAST else node


def unbroadcast(node: Node) -> Node:
    """``node`` under every broadcast and unit view (``w`` from ``broadcast(view(w, [1, 1, d]))``)."""
    for n in _peeled(node):
        node = n
    return node


def is_const(node: Node) -> bool:
    """True when ``node`` is a constant seen through layout ops."""
    while node.op in LAYOUT:
        node = node.src[0]
    return node.op is Op.CONST


def const_value(node: Node, limit: int = 1 << 24) -> torch.Tensor | None:
    """The value of a constant (through layout ops, a top broadcast left out so it stays small), else None.

    The tensor has ``node``'s rank, so it broadcasts against ``node``'s shape like the graph does.
    """
    node = strip_broadcast(node)
    chain: list[Node] = []
    n = node
    while n.op in LAYOUT:
        chain.append(n)
        n = n.src[0]
    if n.op is not Op.CONST:
        return None
    if not chain:
        return n.arg.tensor
    if not is_static(node.shape) or numel(node.shape) > limit:
        return None
    g = Graph()
    cur = g.const(n.arg.tensor)
    for c in reversed(chain):
        cur = g.push(c.op, c.dtype, c.shape, (cur,), c.arg)
    g.output(cur)
    return evaluate(g, [])[0]


def live_nodes(graph: Graph) -> set[Node]:
    """Nodes some output depends on, found with one reverse walk (no recursion)."""
    live = set(graph.outputs)
    for n in reversed(graph.nodes):
        if n in live:
            live.update(n.src)
    return live


def map_nodes(graph: Graph, keep: Callable[[Node], bool] | None = None) -> Graph:
    """Copy ``graph`` (all inputs; other nodes only where ``keep`` says so) without re-checking."""
    new = Graph()
    m: dict[Node, Node] = {}
    for n in graph.nodes:
        if n.op is Op.INPUT:
            m[n] = new.input(n.arg, n.shape, n.dtype)
        elif keep is None or keep(n):
            m[n] = new.push(n.op, n.dtype, n.shape, [m[s] for s in n.src], n.arg)
    new.output(*(m[o] for o in graph.outputs))
    return new


__all__ = [
    "B",
    "COMMUTATIVE",
    "Const",
    "Context",
    "P",
    "Pattern",
    "RewriteLoopError",
    "Rule",
    "Scalar",
    "Var",
    "const_value",
    "is_const",
    "live_nodes",
    "map_nodes",
    "rewrite",
    "strip_broadcast",
    "unbroadcast",
]
