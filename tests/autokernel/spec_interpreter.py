"""A tiny pure-torch interpreter of the kernel spec: the oracle that tells planner bugs from codegen bugs.

Each body value is a tensor over the whole kernel domain (per-row values keep size-1 row axes). A load
gathers ``flat[offset + sum(index[d] * strides[d]) + sum(wrap(value) * stride)]`` from the buffer's flat
storage, with masked lanes set to ``other``; a compute runs the reference executor's implementation of the
op (rounded to its dtype, as ``kernelize.ir.evaluate`` rounds every node); a store scatters into the
buffer. Written buffers start as NaN (or a sentinel for integers) and every element must be written.

Use from any test folder::

    sys.path.insert(0, str(Path(__file__).parents[1] / "autokernel"))
    from spec_interpreter import run, run_kernel
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import Compute, Kernel, KernelKind, Load
from kernelize.autokernel.plan import Plan
from kernelize.ir.dtypes import DType, compute_dtype
from kernelize.ir.graph import LAYOUT, Node, Op
from kernelize.ir.reference import EVAL, bind_inputs
from kernelize.ir.shapes import Dim, bind
from kernelize.runtime.library import run_library

SENTINEL = -(2**31) + 7


def _dim(d: Dim, env: Mapping[str, int]) -> int:
    return d if isinstance(d, int) else d.bind(env)


def _grid(sizes: Sequence[int]) -> list[torch.Tensor]:
    """One index tensor per axis, shaped to broadcast over ``sizes``."""
    out = []
    for d, n in enumerate(sizes):
        shape = [1] * len(sizes)
        shape[d] = n
        out.append(torch.arange(n, dtype=torch.int64).reshape(shape))
    return out


def _fake(dtype: DType) -> Node:
    return Node(Op.INPUT, dtype, ())


def _load(
    e: Load, flat: torch.Tensor, grid: list[torch.Tensor], sizes: list[int], vals: list, env
) -> torch.Tensor:
    idx = torch.full(sizes, _dim(e.offset, env), dtype=torch.int64)
    for g, s in zip(grid, e.strides):
        idx = idx + g * _dim(s, env)
    for ind in e.indirect:
        v = vals[ind.value].to(torch.int64)
        size = _dim(ind.size, env)
        v = torch.where(v < 0, v + size, v)
        idx = idx + v * _dim(ind.stride, env)
    valid = torch.ones(sizes, dtype=torch.bool)
    for axis, lo, hi in e.mask:
        valid = valid & (grid[axis] >= _dim(lo, env)) & (grid[axis] < _dim(hi, env))
    if flat.numel() == 0:
        out = torch.zeros(sizes, dtype=flat.dtype)
    else:
        safe = torch.where(valid, idx, torch.zeros_like(idx))
        assert bool(((safe >= 0) & (safe < flat.numel())).all()), f"load out of bounds: {e}"
        out = flat[safe]
    other = torch.tensor(e.other).to(flat.dtype)
    return torch.where(valid, out, other)


def _compute(e: Compute, vals: list, dtypes: list[DType], grid: list[torch.Tensor], env) -> torch.Tensor:
    xs = [vals[s] for s in e.src]
    node = Node(e.op, e.dtype, (), tuple(_fake(dtypes[s]) for s in e.src), e.arg)
    if e.op is Op.CONCAT:
        axis, ends = e.arg.axis, e.arg.ends
        out = xs[-1]
        for x, end in zip(reversed(xs[:-1]), reversed(ends[:-1])):
            out = torch.where(grid[axis] < _dim(end, env), x, out)
        return out
    if e.op is Op.LAYERNORM:
        a = e.arg
        x = xs[0].to(compute_dtype(e.dtype).torch)
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + a.eps)
        if a.has_weight:
            y = y * xs[1].to(y.dtype)
        if a.has_bias:
            y = y + xs[1 + a.has_weight].to(y.dtype)
        return y
    if e.op in (Op.SUM, Op.MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN, Op.PROD, Op.ARGMAX, Op.ARGMIN) and not e.arg:
        return xs[0] if e.op not in (Op.ARGMAX, Op.ARGMIN) else torch.zeros_like(xs[0], dtype=torch.int64)
    return EVAL[e.op](node, xs, dict(env))


def run_kernel(k: Kernel, values: dict[Node, torch.Tensor], env: Mapping[str, int]) -> None:
    """Run one kernel: read buffers from ``values``, add the buffers it writes."""
    if k.kind in (KernelKind.LIBRARY, KernelKind.CONV, KernelKind.CONV_CHAIN):
        values[k.writes[0]] = run_library(k, values, env)
        return
    sizes = [_dim(d, env) for d in k.domain]
    if 0 in sizes[: len(sizes) - k.row_rank]:  # no element (no row): the written buffers are empty
        for s in k.stores:
            values.setdefault(s.buffer, torch.empty(bind(s.buffer.shape, env), dtype=s.buffer.dtype.torch))
        return
    grid = _grid(sizes)
    vals: list = [None] * len(k.body)
    dtypes: list[DType] = [e.dtype for e in k.body]
    order = list(range(len(k.body)))
    if k.kind is KernelKind.MATMUL:
        mm = k.body[0]
        assert isinstance(mm, Compute) and mm.op is Op.MATMUL and mm.src == (1, 2), "matmul kernel layout"
        kk = _dim(mm.arg, env)
        mgrid = _grid([*sizes, kk])
        for i in (1, 2):
            e = k.body[i]
            vals[i] = _load(e, values[e.buffer].reshape(-1), mgrid, [*sizes, kk], vals, env)
        a = vals[1].select(-2, 0) if sizes[-1] else torch.zeros([*sizes[:-1], kk], dtype=vals[1].dtype)
        b = (
            vals[2].select(-3, 0).transpose(-1, -2)
            if sizes[-2]
            else torch.zeros([*sizes[:-2], kk, sizes[-1]], dtype=vals[2].dtype)
        )
        node = Node(Op.MATMUL, mm.dtype, (), (_fake(dtypes[1]), _fake(dtypes[2])))
        vals[0] = EVAL[Op.MATMUL](node, [a, b], dict(env)).to(mm.dtype.torch)
        order = order[3:]
    for i in order:
        e = k.body[i]
        if isinstance(e, Load):
            assert len(e.strides) == len(sizes), f"{k.name}: load strides {e.strides} over {k.domain}"
            vals[i] = _load(e, values[e.buffer].reshape(-1), grid, sizes, vals, env)
        else:
            assert all(s < i for s in e.src), f"{k.name}: v{i} uses a later value"
            vals[i] = _compute(e, vals, dtypes, grid, env).to(e.dtype.torch)
    for s in k.stores:
        buf = s.buffer
        if buf not in values:
            fill = (
                float("nan") if buf.dtype.is_float else (SENTINEL if buf.dtype is not DType.BOOL else False)
            )
            values[buf] = torch.full(bind(buf.shape, env), fill, dtype=buf.dtype.torch)
        flat = values[buf].reshape(-1)
        ssizes = list(sizes)
        rows = range(len(sizes) - k.row_rank, len(sizes))
        if k.row_rank and all(s.strides[a] == 0 for a in rows):  # per-row: once per row, even if it is empty
            for a in rows:
                ssizes[a] = 1
        idx = torch.full(ssizes, _dim(s.offset, env), dtype=torch.int64)
        for g, st in zip(_grid(ssizes), s.strides):
            idx = idx + g * _dim(st, env)
        val = vals[s.value] if vals[s.value].dim() else vals[s.value].reshape([1] * len(sizes))
        if ssizes != sizes:  # the per-row value itself (a loaded one repeats along the row)
            for a in rows:
                val = val.narrow(a, 0, 1) if val.shape[a] > 1 else val
        v = val.expand(ssizes)
        if idx.numel():
            assert bool(((idx >= 0) & (idx < flat.numel())).all()), f"{k.name}: store out of bounds"
            flat[idx.reshape(-1)] = v.reshape(-1).to(flat.dtype)
        written = torch.zeros(flat.numel(), dtype=torch.bool)
        written[idx.reshape(-1)] = True
        values.setdefault(("written", buf), torch.zeros(flat.numel(), dtype=torch.bool))  # type: ignore[arg-type]
        values[("written", buf)] |= written  # type: ignore[index]


def _materialize(node: Node, values: dict, env: Mapping[str, int]) -> torch.Tensor:
    path = []
    v = node
    while v not in values:
        assert v.op in LAYOUT, f"output {node} is neither a buffer nor a view of one"
        path.append(v)
        v = v.src[0]
    for lay in reversed(path):
        values[lay] = EVAL[lay.op](lay, [values[lay.src[0]]], dict(env))
    return values[node]


def run(plan: Plan, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run every kernel of ``plan`` on ``inputs``; returns the graph outputs (like ``ir.evaluate``)."""
    graph = plan.graph
    env = bind_inputs(graph, inputs)
    values: dict = dict(zip(graph.inputs, inputs))
    values.update((n, n.arg.tensor) for n in graph.nodes if n.op is Op.CONST)
    values = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
    for k in plan.kernels:
        for b in k.reads:
            assert b in values, f"{k.name} reads {b} before any kernel writes it"
        run_kernel(k, values, env)
    for key, written in list(values.items()):
        if isinstance(key, tuple) and key[0] == "written":
            assert bool(written.all()), (
                f"buffer {key[1]} has {int((~written).sum())} elements no kernel wrote"
            )
    return [_materialize(o, values, env).contiguous() for o in graph.outputs]
