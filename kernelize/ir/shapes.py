"""Shapes with static sizes and named symbolic dimensions.

A dimension is an ``int`` or a :class:`Sym`: a product of named symbols times an integer, e.g. ``batch``,
``seq`` or ``batch*seq`` (what flattening ``[batch, seq, 64]`` to two dims gives). One compiled kernel
serves every binding of the symbols.

Example:
    >>> B, S = Sym.of("batch"), Sym.of("seq")
    >>> numel((B, S, 64))
    Sym(names=('batch', 'seq'), coef=64)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod


class ShapeError(ValueError):
    """Shapes of operands do not fit the operation."""


@dataclass(frozen=True)
class Sym:
    """A symbolic size: ``coef * names[0] * names[1] * ...`` (names sorted, repeats allowed)."""

    names: tuple[str, ...]
    coef: int = 1

    @staticmethod
    def of(name: str) -> Sym:
        if not name.isidentifier():
            raise ValueError(f"symbolic dimension name {name!r} must be an identifier")
        return Sym((name,))

    def __mul__(self, other: Dim) -> Dim:
        if isinstance(other, Sym):
            return _mk(tuple(sorted(self.names + other.names)), self.coef * other.coef)
        return _mk(self.names, self.coef * int(other))

    __rmul__ = __mul__

    def __floordiv__(self, other: Dim) -> Dim:
        """Exact division; raises ShapeError when the result is not a whole symbolic size."""
        if isinstance(other, int):
            if self.coef % other:
                raise ShapeError(f"cannot divide {self} by {other}")
            return _mk(self.names, self.coef // other)
        names = list(self.names)
        for n in other.names:
            if n not in names:
                raise ShapeError(f"cannot divide {self} by {other}")
            names.remove(n)
        if self.coef % other.coef:
            raise ShapeError(f"cannot divide {self} by {other}")
        return _mk(tuple(names), self.coef // other.coef)

    def bind(self, env: Mapping[str, int]) -> int:
        try:
            return self.coef * prod(env[n] for n in self.names)
        except KeyError as e:
            raise ShapeError(f"symbolic dimension {e.args[0]!r} is not bound (bound: {dict(env)})") from None

    def __str__(self) -> str:
        body = "*".join(self.names)
        return body if self.coef == 1 else f"{self.coef}*{body}"


Dim = int | Sym
Shape = tuple[Dim, ...]


def _mk(names: tuple[str, ...], coef: int) -> Dim:
    return Sym(names, coef) if names and coef else coef


def shape_str(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def is_static(shape: Sequence[Dim]) -> bool:
    return all(isinstance(d, int) for d in shape)


def numel(shape: Sequence[Dim]) -> Dim:
    out: Dim = 1
    for d in shape:
        out = d * out if isinstance(d, Sym) else (out * d)
    return out


def symbols(shape: Sequence[Dim]) -> set[str]:
    return {n for d in shape if isinstance(d, Sym) for n in d.names}


def bind(shape: Sequence[Dim], env: Mapping[str, int]) -> tuple[int, ...]:
    """Concrete sizes of ``shape`` under the symbol values in ``env``."""
    return tuple(d.bind(env) if isinstance(d, Sym) else d for d in shape)


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def broadcast_shapes(*shapes: Sequence[Dim]) -> Shape:
    """Numpy-style broadcast of ``shapes``; raises ShapeError naming all of them when they do not fit."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(dims) > 1:
            raise ShapeError("shapes " + " and ".join(shape_str(s) for s in shapes) + " do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def unify(env: dict[str, int], shape: Sequence[Dim], sizes: Sequence[int], what: str) -> None:
    """Bind the symbols of ``shape`` from concrete ``sizes`` into ``env``; raise ShapeError on mismatch.

    A symbol is bound from the first dimension that is exactly that symbol; products are then checked.
    """
    if len(shape) != len(sizes):
        raise ShapeError(f"{what}: expected rank {len(shape)} {shape_str(shape)}, got shape {list(sizes)}")
    for d, n in zip(shape, sizes):
        if isinstance(d, Sym) and len(d.names) == 1 and d.coef == 1:
            if env.setdefault(d.names[0], n) != n:
                raise ShapeError(f"{what}: dimension {d} is {env[d.names[0]]} elsewhere but {n} here")
    for d, n in zip(shape, sizes):
        want = d.bind(env) if isinstance(d, Sym) else d
        if want != n:
            raise ShapeError(
                f"{what}: expected shape {shape_str(shape)} = {list(bind(shape, env))}, got {list(sizes)}"
            )
