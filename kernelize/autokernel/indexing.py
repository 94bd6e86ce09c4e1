"""Affine index maps: how layout ops (view, broadcast, permute, slice, flip) become strides and offsets.

A kernel iterates over a ``domain``; every value it touches is read at coordinates that are an affine
function of the domain index: ``coord[k] = sum(rows[k][c] * index[c]) + off[k]``. Walking *down* a chain of
layout ops (from the value a consumer wants to the buffer that holds the data) transforms the map
(:meth:`Affine.through`); at a buffer, :meth:`Affine.flat` gives the load's strides and offset. Extra
columns after the domain axes are *virtual* axes: the contracted ``K`` of a matmul, or the gathered index
of an indirect load.

Example:
    >>> g = Graph(); x = g.input("x", (4, 6), "f32"); y = g.permute(g.slice(x, 1, 2), (1, 0))
    >>> Affine.identity(y.shape).through(y).through(y.src[0]).flat(x.shape)
    ((1, 6), 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kernelize.ir.graph import Node, Op
from kernelize.ir.shapes import Dim, Sym, numel, shape_str


class NotAffine(Exception):
    """The map cannot be carried through ``node``: materialize ``node``'s operand (or ``node`` itself when
    that operand is already in memory) instead."""

    def __init__(self, node: Node, why: str):
        super().__init__(f"{node.op} {shape_str(node.shape)}: {why}")
        self.node = node


def dmul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, Sym):
        return a * b
    if isinstance(b, Sym):
        return b * a
    return a * b


def dadd(a: Dim, b: Dim) -> Dim | None:
    """``a + b`` when it is a single size (int or monomial), else None."""
    if a == 0:
        return b
    if b == 0:
        return a
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if isinstance(a, Sym) and isinstance(b, Sym) and a.names == b.names:
        coef = a.coef + b.coef
        return Sym(a.names, coef) if coef else 0
    return None


def dneg(a: Dim) -> Dim:
    return Sym(a.names, -a.coef) if isinstance(a, Sym) else -a


def dsum(terms: Sequence[Dim], node: Node, what: str) -> Dim:
    out: Dim = 0
    for t in terms:
        s = dadd(out, t)
        if s is None:
            raise NotAffine(node, f"{what} {out} + {t} is not a single symbolic size")
        out = s
    return out


def contiguous_strides(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    out: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        out.append(acc)
        acc = dmul(acc, d)
    return tuple(reversed(out))


def divides(a: Dim, b: Dim) -> bool:
    """Whether ``a`` divides ``b`` as sizes (for every value of the symbols)."""
    if isinstance(a, int) and isinstance(b, int):
        return a != 0 and b % a == 0
    if isinstance(a, Sym) and isinstance(b, int):
        return False
    try:
        b // a
    except (ValueError, ZeroDivisionError):
        return False
    return True


def _pair_dims(y: Sequence[Dim], x: Sequence[Dim], node: Node) -> list[tuple[list[int], list[int]]]:
    """Blocks of dims of ``y`` and ``x`` with equal products (size-1 dims alone), in order."""
    i = j = 0
    blocks: list[tuple[list[int], list[int]]] = []
    while i < len(y) or j < len(x):
        if i < len(y) and y[i] == 1:
            blocks.append(([i], []))
            i += 1
            continue
        if j < len(x) and x[j] == 1:
            blocks.append(([], [j]))
            j += 1
            continue
        if i >= len(y) or j >= len(x):
            raise NotAffine(node, "view dims do not pair up")
        ys, xs, py, px = [i], [j], y[i], x[j]
        i, j = i + 1, j + 1
        while py != px:
            smaller_y = py < px if isinstance(py, int) and isinstance(px, int) else divides(py, px)
            if smaller_y and i < len(y):
                ys.append(i)
                py, i = dmul(py, y[i]), i + 1
            elif (not smaller_y or divides(px, py)) and j < len(x):
                xs.append(j)
                px, j = dmul(px, x[j]), j + 1
            else:
                raise NotAffine(node, f"cannot pair view dims {shape_str(y)} and {shape_str(x)}")
        blocks.append((ys, xs))
    return blocks


@dataclass(frozen=True)
class Affine:
    """``coord[k] = sum_c rows[k][c] * index[c] + off[k]``; ``virt`` describes the columns past the domain.

    ``virt[j] = (value, size)``: the column ``ndom + j`` is the gathered index held in body entry ``value``
    (an indirect load), or the matmul's contracted axis when ``value`` is None.

    A view that splits a varying index ``Y`` into dims ``(a, b)`` makes coordinates ``Y // b`` and
    ``Y % b``, which are not affine; they are kept as *parts* of split ``splits[i] = (row, off, view)``:
    ``parts[k] = (i, c, size)`` means ``coord[k] = (Y // c) % size``. They must reach a buffer together with
    strides proportional to ``c`` (as torch's ``view`` of a strided tensor requires), and then read as
    ``stride * Y``: the merged batch dims of a transposed operand stay strides.
    """

    rows: tuple[tuple[Dim, ...], ...]
    off: tuple[Dim, ...]
    ncols: int
    virt: tuple[tuple[int | None, Dim], ...] = ()
    parts: tuple[tuple[int, Dim, Dim] | None, ...] = ()
    splits: tuple[tuple[tuple[Dim, ...], Dim, Node, Dim], ...] = ()

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.rows):
            object.__setattr__(self, "parts", (None,) * len(self.rows))

    def _new(self, rows, off, parts=None, **kw) -> Affine:
        return Affine(
            tuple(rows),
            tuple(off),
            kw.get("ncols", self.ncols),
            kw.get("virt", self.virt),
            tuple(parts) if parts is not None else (None,) * len(rows),
            kw.get("splits", self.splits),
        )

    @staticmethod
    def identity(shape: Sequence[Dim]) -> Affine:
        n = len(shape)
        return Affine(tuple(tuple(int(c == k) for c in range(n)) for k in range(n)), (0,) * n, n).norm(shape)

    @staticmethod
    def select(sel: Sequence[int | None], ncols: int) -> Affine:
        """Each coordinate is one domain axis (an int) or the constant 0 (None)."""
        rows = tuple(tuple(int(c == a) for c in range(ncols)) if a is not None else (0,) * ncols for a in sel)
        return Affine(rows, (0,) * len(sel), ncols)

    def norm(self, shape: Sequence[Dim]) -> Affine:
        """Coordinates of size-1 dims are always 0: drop their rows so equal maps compare equal."""
        if all(d != 1 for d in shape):
            return self
        zero = (0,) * self.ncols
        rows = tuple(zero if d == 1 else r for r, d in zip(self.rows, shape))
        off = tuple(0 if d == 1 else o for o, d in zip(self.off, shape))
        parts = tuple(None if d == 1 else p for p, d in zip(self.parts, shape))
        return self._new(rows, off, parts)

    def with_virtual(self, value: int | None, size: Dim) -> tuple[Affine, int]:
        """This map with one more (zero) column; returns it and the new column's index."""
        rows = tuple((*r, 0) for r in self.rows)
        splits = tuple(((*r, 0), o, v, n) for r, o, v, n in self.splits)
        virt = (*self.virt, (value, size))
        return self._new(
            rows, self.off, self.parts, ncols=self.ncols + 1, virt=virt, splits=splits
        ), self.ncols

    def replace(self, k: int, row: tuple[Dim, ...], off: Dim) -> Affine:
        rows, offs, parts = list(self.rows), list(self.off), list(self.parts)
        rows[k], offs[k], parts[k] = row, off, None
        return self._new(rows, offs, parts)

    def sub(self, coords: Sequence[int]) -> Affine:
        return self._new(
            [self.rows[k] for k in coords], [self.off[k] for k in coords], [self.parts[k] for k in coords]
        )

    def plain(self, k: int) -> bool:
        """Whether coordinate ``k`` is affine (not part of a split)."""
        return self.parts[k] is None

    def through(self, node: Node) -> Affine:
        """The map of ``node.src[0]`` when ``node`` (a layout op) is read at this map."""
        src = node.src[0]
        rows, off, parts = list(self.rows), list(self.off), list(self.parts)
        zero = (0,) * self.ncols
        if node.op is Op.PERMUTE:
            nr: list = [None] * len(rows)
            no: list = [None] * len(rows)
            npart: list = [None] * len(rows)
            for j, p in enumerate(node.arg):
                nr[p], no[p], npart[p] = rows[j], off[j], parts[j]
            rows, off, parts = nr, no, npart
        elif node.op is Op.BROADCAST:
            for k, s in enumerate(src.shape):
                if s == 1:
                    rows[k], off[k], parts[k] = zero, 0, None
        elif node.op is Op.SLICE:
            for k, (start, _, step) in enumerate(node.arg):
                if (start, step) == (0, 1) and node.shape[k] == src.shape[k]:
                    continue
                if parts[k] is not None:
                    raise NotAffine(self.splits[parts[k][0]][2], "a split index is sliced further down")
                rows[k] = tuple(dmul(r, step) for r in rows[k])
                off[k] = dsum([dmul(off[k], step), start], node, "slice offset")
        elif node.op is Op.FLIP:
            for k in node.arg:
                size = node.shape[k]
                if not isinstance(size, int):
                    raise NotImplementedError(f"flip of symbolic dimension {size} of {shape_str(node.shape)}")
                if parts[k] is not None:
                    raise NotAffine(self.splits[parts[k][0]][2], "a split index is flipped further down")
                rows[k] = tuple(dneg(r) for r in rows[k])
                off[k] = dsum([size - 1, dneg(off[k])], node, "flip offset")
        elif node.op is Op.VIEW:
            return self._view(node)
        else:
            raise AssertionError(f"{node.op} is not a layout op")
        return self._new(rows, off, parts).norm(src.shape)

    def _view(self, node: Node) -> Affine:
        y, x = node.shape, node.src[0].shape
        zero = (0,) * self.ncols
        rows: list = [zero] * len(x)
        off: list = [0] * len(x)
        parts: list = [None] * len(x)
        splits = list(self.splits)
        for ys, xs in _pair_dims(y, x, node):
            if not xs or not ys:
                continue
            if len(ys) == 1 and len(xs) == 1:
                rows[xs[0]], off[xs[0]], parts[xs[0]] = self.rows[ys[0]], self.off[ys[0]], self.parts[ys[0]]
                continue
            split = next((self.parts[i] for i in ys if self.parts[i] is not None), None)
            if split is not None:
                raise NotAffine(self.splits[split[0]][2], "a split index is merged again further down")
            cs = contiguous_strides([y[i] for i in ys])
            row = tuple(
                dsum([dmul(c, self.rows[i][col]) for c, i in zip(cs, ys)], node, "merged stride")
                for col in range(self.ncols)
            )
            o = dsum([dmul(c, self.off[i]) for c, i in zip(cs, ys)], node, "merged offset")
            if len(xs) == 1:
                rows[xs[0]], off[xs[0]] = row, o
                continue
            xcs = contiguous_strides([x[j] for j in xs])
            if all(r == 0 for r in row) and isinstance(o, int) and all(isinstance(s, int) for s in xcs):
                for s, j in zip(xcs, xs):
                    off[j], o = o // s, o % s
                continue
            sid = len(splits)
            splits.append((row, o, node, numel([x[j] for j in xs])))
            for s, j in zip(xcs, xs):
                parts[j] = (sid, s, x[j])
        return self._new(rows, off, parts, splits=tuple(splits)).norm(x)

    def flat(
        self, shape: Sequence[Dim], node: Node | None = None, memory: Sequence[Dim] | None = None
    ) -> tuple[tuple[Dim, ...], Dim]:
        """Strides (one per column) and offset into a buffer of ``shape``: contiguous, or with the element
        strides ``memory`` (an NHWC buffer).

        Raises:
            NotAffine: naming the view whose split index the buffer's strides cannot follow.
        """
        cs = contiguous_strides(shape) if memory is None else tuple(memory)
        who = node if node is not None else Node(Op.INPUT, "f32", tuple(shape))  # for the error message
        terms: list[list[Dim]] = [
            [dmul(c, r[col]) for c, r in zip(cs, self.rows)] for col in range(self.ncols)
        ]
        offs = [dmul(c, o) for c, o in zip(cs, self.off)]
        for sid, (row, o, view, size) in enumerate(self.splits):
            mine = [(cs[k], p) for k, p in enumerate(self.parts) if p is not None and p[0] == sid]
            if not mine:
                continue
            inner = [c for c, p in mine if p[1] == 1]
            scale = inner[0] if inner else None
            total = 1
            for _, p in mine:
                total = dmul(total, p[2])
            if scale is None or any(c != dmul(scale, p[1]) for c, p in mine) or total != size:
                raise NotAffine(view, "a split index reaches memory with strides that do not merge")
            for col in range(self.ncols):
                terms[col].append(dmul(scale, row[col]))
            offs.append(dmul(scale, o))
        strides = tuple(dsum(t, who, "stride") for t in terms)
        return strides, dsum(offs, who, "offset")
