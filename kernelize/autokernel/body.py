"""Lower one fusion group to a :class:`~kernelize.autokernel.kernels.Kernel` body.

Starting from the values the group stores, each value is expanded at an index map (an
:class:`~kernelize.autokernel.indexing.Affine` over the domain): layout ops compose into the map,
materialized values become :class:`Load` s, everything else a :class:`Compute`. Concat evaluates each
branch with a shifted map and masked loads, pad is a masked load with ``other``, gather an indirect load
whose index is a body value. Entries are hash-consed, so a value used twice is computed once. The walk
uses an explicit stack: a chain of thousands of ops does not recurse.

When a map cannot pass a layout op (a view splitting a varying index, an offset that is no single
symbolic size), or a load cannot read an NHWC buffer, :meth:`BodyBuilder.kernel` returns a
:class:`~kernelize.autokernel.reasons.Rejection` instead of a kernel: the value to write to memory, or the
buffer to keep dense. The planner then plans again with that change. Every step that can fail returns its
rejection, and the callers hand it up unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kernelize.autokernel.indexing import Affine, NotAffine
from kernelize.autokernel.kernels import Compute, Indirect, Kernel, KernelKind, Load, Store, loop_kernel
from kernelize.autokernel.layout import nhwc_strides
from kernelize.autokernel.partition import POINTWISE_OPS, Group, column_member, is_axis, operand_sel
from kernelize.autokernel.reasons import Rejection
from kernelize.ir.graph import ELEMENTWISE, LAYOUT, REDUCE, ROW, SOURCE, Node, Op
from kernelize.ir.ops import ConcatArgs
from kernelize.ir.shapes import shape_str

Masks = tuple[tuple[int, int, int], ...]
Key = tuple[Node, Affine, Masks]


def _and_masks(masks: Masks, extra: Sequence[tuple[int, int, int]]) -> Masks:
    bounds: dict[int, tuple[int, int]] = {a: (lo, hi) for a, lo, hi in masks}
    for a, lo, hi in extra:
        if a in bounds:
            lo, hi = max(lo, bounds[a][0]), min(hi, bounds[a][1])
        bounds[a] = (lo, hi)
    return tuple((a, lo, hi) for a, (lo, hi) in sorted(bounds.items()))


def _unit(m: Affine, k: int, ndom: int, node: Node) -> tuple[int, int, int] | Rejection:
    """``coord[k] = sign * index[d] + off`` for one domain axis ``d``, ``sign`` = +-1 and a static offset:
    ``(d, sign, off)``. Anything else cannot be masked by index ranges: materialize ``node``."""
    row = m.rows[k]
    nz = [c for c, r in enumerate(row) if r != 0]
    if (
        not m.plain(k)
        or len(nz) != 1
        or nz[0] >= ndom
        or row[nz[0]] not in (1, -1)
        or not isinstance(m.off[k], int)
    ):
        return Rejection.materialize(node, f"axis {k} is not a plain domain axis here")
    return nz[0], row[nz[0]], m.off[k]


def _range(sign: int, off: int, lo: int, hi: int) -> tuple[int, int]:
    """The domain indices ``i`` with ``lo <= sign * i + off < hi``."""
    return (lo - off, hi - off) if sign == 1 else (off - hi + 1, off - lo + 1)


class BodyBuilder:
    """Builds the body and stores of one group; see the module docstring."""

    def __init__(
        self,
        group: Group,
        buffers: set[Node],
        stop: set[Node],
        order: Mapping[Node, int],
        nhwc: frozenset[Node] = frozenset(),
    ):
        self.g = group
        self.nhwc = nhwc  # buffers laid out NHWC (kernelize.autokernel.layout)
        self.order = order
        self.ndom = len(group.domain)
        self.buffers = buffers
        self.stop = stop
        self.body: list[Load | Compute] = []
        self.memo: dict[Key, int] = {}
        self.entries: dict[Load | Compute, int] = {}
        self.computed: list[Node] = []
        self.maps = {
            m: Affine.select([e if is_axis(e) else None for e in s], self.ndom).norm(m.shape)
            for m, s in group.sel.items()
        }

    # -- driver -----------------------------------------------------------------------------------------
    def value(self, v: Node, m: Affine, masks: Masks = ()) -> int | Rejection:
        """The body position of ``v`` read at map ``m`` under ``masks`` (emitting what it needs), or why it
        cannot be read so."""
        stack: list[Key] = [(v, m, masks)]
        while stack:
            key = stack[-1]
            if key in self.memo:
                stack.pop()
                continue
            need = self._step(key)
            if isinstance(need, Rejection):
                return need
            if isinstance(need, int):
                self.memo[key] = need
                stack.pop()
            else:
                stack.extend(reversed([k for k in need if k not in self.memo]))
        return self.memo[(v, m, masks)]

    def _have(self, keys: Sequence[Key]) -> list[int] | list[Key]:
        missing = [k for k in keys if k not in self.memo]
        return missing if missing else [self.memo[k] for k in keys]

    def _emit(self, e: Load | Compute) -> int:
        if e not in self.entries:
            self.entries[e] = len(self.body)
            self.body.append(e)
        return self.entries[e]

    def _materialize(self, e: NotAffine) -> Rejection:
        """What to write to memory so the map that failed at ``e.node`` is not needed: its operand, or the
        layout value itself (a copy kernel) when the operand is in memory already."""
        src = e.node.src[0]
        return Rejection.materialize(e.node if self._is_buffer(src) else src, str(e))

    def _is_buffer(self, v: Node) -> bool:
        return v.op in SOURCE or v in self.buffers or v in self.stop

    # -- one step ---------------------------------------------------------------------------------------
    def _step(self, key: Key) -> int | list[Key] | Rejection:
        v, m, masks = key
        member = v in self.maps and self.maps[v] == m and not masks
        if v.op in LAYOUT and (v not in self.stop or (member and v in self.g.sel)):
            if v.op is Op.VIEW and self._is_buffer(v.src[0]) and v.src[0] not in self.maps:
                return self._load(v.src[0], m, masks, flat_shape=v.shape)
            try:
                return self._alias((v.src[0], m.through(v), masks))
            except NotAffine as e:
                return self._materialize(e)
        if self._is_buffer(v) and v not in self.maps:
            return self._load(v, m, masks)
        if not member and v.op not in POINTWISE_OPS:
            raise AssertionError(
                f"{v} is needed at another map than its group's in {shape_str(self.g.domain)}"
            )
        if member and v not in self.computed:
            self.computed.append(v)
        return self._compute(v, m, masks)

    def _flat(
        self, m: Affine, buf: Node, flat_shape: Sequence | None = None
    ) -> tuple[tuple, object] | Rejection:
        """``m.flat`` into ``buf`` as laid out in memory (row-major, or NHWC)."""
        if buf not in self.nhwc:
            return m.flat(buf.shape if flat_shape is None else flat_shape, buf)
        if flat_shape is not None and tuple(flat_shape) != tuple(buf.shape):
            return Rejection.dense(buf, f"read as {shape_str(flat_shape)} through a reshape")
        return m.flat(buf.shape, buf, nhwc_strides(buf.shape))

    def _alias(self, child: Key) -> int | list[Key]:
        got = self._have([child])
        return got[0] if isinstance(got[0], int) else got

    def _load(
        self,
        buf: Node,
        m: Affine,
        masks: Masks,
        other: float | None = None,
        flat_shape: Sequence | None = None,
    ) -> int | Rejection:
        if buf.op is Op.CONST and other is None and Load(buf, (0,) * self.ndom).constant is not None:
            return self._emit(Load(buf, (0,) * self.ndom))
        if other is None:
            # masked lanes of a concat branch are never used; 1 keeps an integer division there from trapping
            other = 1.0 if masks and buf.dtype.is_int else 0.0
        try:
            flat = self._flat(m, buf, flat_shape)
        except NotAffine as e:
            if buf in self.nhwc:
                return Rejection.dense(buf, str(e))
            if e.node.op in LAYOUT and e.node is not buf:
                return self._materialize(e)
            raise NotImplementedError(f"cannot index {buf} with a strided load: {e}") from None
        if isinstance(flat, Rejection):
            return flat
        strides, offset = flat
        dom = list(strides[: self.ndom])
        indirect = []
        for j, (val, size) in enumerate(m.virt):
            s = strides[self.ndom + j]
            if val is None:
                dom.append(s)
            elif s != 0:
                indirect.append(Indirect(val, s, size))
        return self._emit(Load(buf, tuple(dom), offset, masks, float(other), tuple(indirect)))

    def _resolve(self, v: Node, m: Affine) -> tuple[Node, Affine, Sequence | None] | Rejection:
        """Walk layout ops down to a materialized value: (buffer, map, shape to flatten by)."""
        while v.op in LAYOUT and v not in self.stop:
            if v.op is Op.VIEW and self._is_buffer(v.src[0]) and v.src[0] not in self.maps:
                return v.src[0], m, v.shape
            try:
                m = m.through(v)
            except NotAffine as e:
                return self._materialize(e)
            v = v.src[0]
        if not self._is_buffer(v):
            return Rejection.materialize(v, "read through a masked or matmul load")
        return v, m, None

    # -- computes ---------------------------------------------------------------------------------------
    def _compute(self, v: Node, m: Affine, masks: Masks) -> int | list[Key] | Rejection:
        op = v.op
        if op in ELEMENTWISE:
            got = self._have([(s, m, masks) for s in v.src])
            if not isinstance(got[0], int):
                return got
            return self._emit(Compute(op, v.dtype, tuple(got), v.arg))
        if op in REDUCE or op in ROW:
            return self._row_op(v, m, masks)
        if op is Op.CONCAT:
            return self._concat(v, m, masks)
        if op is Op.PAD:
            return self._pad(v, m, masks)
        if op is Op.GATHER:
            return self._gather(v, m, masks)
        raise AssertionError(f"{op} inside a {self.g.kind} kernel")

    def _row_op(self, v: Node, m: Affine, masks: Masks) -> int | list[Key]:
        sel = self.g.sel[v]
        keys = []
        for i, s in enumerate(v.src):
            osel = operand_sel(v, i, sel)
            assert osel is not None
            keys.append(
                (s, Affine.select([e if is_axis(e) else None for e in osel], self.ndom).norm(s.shape), ())
            )
        got = self._have(keys)
        if not isinstance(got[0], int):
            return got
        if v.op in REDUCE and column_member(self.g, v, sel):
            arg = tuple(a for a in range(self.ndom) if a not in self.g.row_axes)
        elif v.op in REDUCE:
            arg = self.g.row_axes
        elif v.op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
            arg = self.ndom - 1
        else:
            arg = v.arg
        return self._emit(Compute(v.op, v.dtype, tuple(got), arg))

    def _concat(self, v: Node, m: Affine, masks: Masks) -> int | list[Key] | Rejection:
        axis = v.arg
        unit = _unit(m, axis, self.ndom, v)
        if isinstance(unit, Rejection):
            return unit
        d, sign, off = unit
        keys, ends, start = [], [], 0
        for s in v.src:
            size = s.shape[axis]
            lo, hi = _range(sign, off, start, start + size)
            mi = m.replace(axis, m.rows[axis], off - start)
            keys.append((s, mi.norm(s.shape), _and_masks(masks, [(d, lo, hi)])))
            ends.append(hi)
            start += size
        got = self._have(keys)
        if not isinstance(got[0], int):
            return got
        if sign == -1:  # a flipped concat meets its branches in reverse order along the domain axis
            got, ends = got[::-1], ends[::-1]
        return self._emit(Compute(Op.CONCAT, v.dtype, tuple(got), ConcatArgs(d, ends)))

    def _pad(self, v: Node, m: Affine, masks: Masks) -> int | Rejection:
        src = v.src[0]
        extra = []
        for k, (lo, hi) in enumerate(v.arg.pads):
            if lo or hi:
                unit = _unit(m, k, self.ndom, v)
                if isinstance(unit, Rejection):
                    return unit
                d, sign, off = unit
                extra.append((d, *_range(sign, off, lo, lo + src.shape[k])))
                m = m.replace(k, m.rows[k], off - lo)
        got = self._resolve(src, m.norm(src.shape))
        if isinstance(got, Rejection):
            return got
        buf, bm, shape = got
        return self._load(buf, bm, _and_masks(masks, extra), other=v.arg.value, flat_shape=shape)

    def _gather(self, v: Node, m: Affine, masks: Masks) -> int | list[Key]:
        x, index = v.src
        a, r = v.arg, index.rank
        ikey = (index, m.sub(range(a, a + r)).norm(index.shape), masks)
        if ikey not in self.memo:
            return [ikey]
        zero = (0,) * m.ncols
        base = m._new(
            (*m.rows[:a], zero, *m.rows[a + r :]),
            (*m.off[:a], 0, *m.off[a + r :]),
            (*m.parts[:a], None, *m.parts[a + r :]),
        )
        xm, col = base.with_virtual(self.memo[ikey], x.shape[a])
        xm = xm.replace(a, tuple(int(c == col) for c in range(xm.ncols)), 0)
        return self._alias((x, xm, masks))

    # -- kernels ----------------------------------------------------------------------------------------
    def matmul_prefix(self, mm: Node) -> Rejection | None:
        """body[0] = matmul(body[1], body[2]) with both loads over (*batch, M, N, K)."""
        left = self._matmul_operand(mm.src[0], True)
        if isinstance(left, Rejection):
            return left
        right = self._matmul_operand(mm.src[1], False)
        if isinstance(right, Rejection):
            return right
        self.body += [Compute(Op.MATMUL, mm.dtype, (1, 2), mm.src[0].shape[-1]), left, right]
        self.memo[(mm, self.maps[mm], ())] = 0
        self.computed.append(mm)
        return None

    def matmul_more(self, mm: Node) -> Rejection | None:
        """Another matmul of the group (same left operand ``body[1]``): its right operand, then itself."""
        right = self._matmul_operand(mm.src[1], False)
        if isinstance(right, Rejection):
            return right
        self.body.append(right)
        self.body.append(Compute(Op.MATMUL, mm.dtype, (1, len(self.body) - 1), mm.src[0].shape[-1]))
        self.memo[(mm, self.maps[mm], ())] = len(self.body) - 1
        self.computed.append(mm)
        return None

    def _matmul_operand(self, x: Node, left: bool) -> Load | Rejection:
        n = self.ndom
        kdim = x.shape[-1] if left else x.shape[-2]
        row_of_m, row_of_k = (n - 2, n) if left else (n, n - 1)
        rows = [tuple(int(c == k) for c in range(n + 1)) for k in range(n - 2)]
        rows += [
            tuple(int(c == row_of_m) for c in range(n + 1)),
            tuple(int(c == row_of_k) for c in range(n + 1)),
        ]
        xm = Affine(tuple(rows), (0,) * n, n + 1, ((None, kdim),)).norm(x.shape)
        got = self._resolve(x, xm)
        if isinstance(got, Rejection):
            return got
        buf, bm, shape = got
        if buf in self.nhwc:  # channels_last_buffers keeps a matmul operand dense up front; in case not
            return Rejection.dense(buf, "a matmul operand")
        try:
            strides, offset = bm.flat(buf.shape if shape is None else shape, buf)
        except NotAffine as e:
            return self._materialize(e) if e.node.op in LAYOUT else Rejection.materialize(x, str(e))
        return Load(buf, tuple(strides), offset)

    def kernel(self, stores: Sequence[Node], slices: Mapping[Node, Node] | None = None) -> Kernel | Rejection:
        """The kernel storing `stores`, or why it cannot be built as planned (the first obstacle met); a
        value in `slices` (a piece of a concat) is stored into its slice of the concat's buffer instead of a
        buffer of its own."""
        g = self.g
        if g.kind is KernelKind.MATMUL:
            mms = [m for m in g.sel if m.op is Op.MATMUL]
            steps = (self.matmul_more(mm) if i else self.matmul_prefix(mm) for i, mm in enumerate(mms))
            why = next((w for w in steps if w is not None), None)  # lazily: stop at the first
            if why is not None:
                return why
        out = []
        for s in stores:
            m = self.maps[s]
            idx = self.value(s, m)
            if isinstance(idx, Rejection):
                return idx
            buf = s if slices is None or s not in slices else slices[s]
            if buf is not s:  # the slice of the concat: shift the concat axis by the pieces before `s`
                start = sum(p.shape[buf.arg] for p in buf.src[: buf.src.index(s)])
                m = m.replace(buf.arg, m.rows[buf.arg], m.off[buf.arg] + start).norm(buf.shape)
            flat = self._flat(m, buf)
            assert not isinstance(flat, Rejection), "a store is flattened by its buffer's own shape"
            strides, offset = flat
            out.append(Store(idx, buf, tuple(strides[: self.ndom]), offset))
        computes = tuple(sorted(self.computed, key=lambda n: self.order[n]))
        return loop_kernel(g.kind, "", g.domain, tuple(self.body), tuple(out), g.row_rank, computes)
