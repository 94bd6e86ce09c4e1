"""The torch front end: plain PyTorch code (a module's ``forward`` or a function) -> :class:`Graph`.

``trace`` runs the code once under ``make_fx`` (pre-dispatch, symbolic shapes, a selected set of torch's own
decompositions) and maps every aten op of the resulting fx graph onto builder calls through the table
``ATEN``. Module parameters and buffers become constants (``params="const"``) or graph inputs named by their
qualified names (``params="input"``), so one compiled kernel can serve any weight values. Sizes named in
``dynamic_dims`` stay symbolic: torch's ``SymInt`` expressions such as ``s0*s1`` become :class:`Sym`
products of the names.

Example:
    >>> class RMSNorm(torch.nn.Module):
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.ones(d))
    ...     def forward(self, x):
    ...         return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
    >>> g = trace(RMSNorm(64), torch.randn(2, 8, 64), dynamic_dims={0: "batch", 1: "seq"})
    >>> g.inputs[0].shape
    (Sym(names=('batch',), coef=1), Sym(names=('seq',), coef=1), 64)
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from kernelize.ir.dtypes import DType
from kernelize.ir.errors import UnsupportedOpError
from kernelize.ir.graph import DTypeError, Graph, Node
from kernelize.ir.shapes import Dim, ShapeError, Sym, shape_str
from kernelize.ir.torch_ops import ATEN, IGNORED, Lazy

logger = logging.getLogger(__name__)

DynamicDims = Mapping[int, str] | Sequence[Mapping[int, str] | None] | None

# core ATen decompositions we do NOT take: variance ops (their decomposition goes through prims), and
# rms_norm and softplus (the IR has nodes for them, so the traced graph stays small)
_KEEP = frozenset({"rms_norm", "var", "var_mean", "std", "std_mean", "softplus"})


def _decomposition_table(extra: Iterable[Any]) -> dict:
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = {
        op: fn
        for op, fn in core_aten_decompositions().items()
        if op.name().split("::")[-1].split(".")[0] not in _KEEP
    }
    table.update(get_decompositions(list(extra)))
    return table


def trace(
    fn_or_module: Callable[..., Any],
    *example_inputs: torch.Tensor,
    dynamic_dims: DynamicDims = None,
    params: str = "const",
    decompositions: Iterable[Any] = (),
) -> Graph:
    """Trace ``fn_or_module`` on ``example_inputs`` into a graph.

    Args:
        fn_or_module: an ``nn.Module`` (its ``forward`` is traced) or a function of tensors.
        *example_inputs: one tensor per positional argument; their dtypes become the graph's input dtypes.
        dynamic_dims: sizes that stay symbolic. A dict ``{axis: name}`` applies to every input (axes
            beyond an input's rank are skipped); a list gives one dict (or None) per input. Example sizes
            of dynamic axes must be >= 2 (torch specialises sizes 0 and 1).
        params: ``"const"`` (parameters and buffers become constants) or ``"input"`` (they become graph
            inputs after the example inputs, named by qualified name such as ``"0.weight"``).
        decompositions: extra aten ops to decompose with torch's own decompositions (for example
            ``torch.ops.aten._softmax.default`` to see the template the optimizer recognises).

    Returns:
        The graph: example inputs first (named after the ``forward`` / function parameters), then
        parameters when ``params="input"``; one output per tensor returned (tuples flatten).

    Raises:
        UnsupportedOpError: an aten op the table cannot express, naming the op and the source line.
        ValueError: bad ``dynamic_dims`` / ``params``, or a dynamic size the code specialised.

    Example:
        >>> g = trace(lambda x: torch.softmax(x @ x.T, -1), torch.randn(4, 8))
        >>> sorted(ir.op_counts(g))  # doctest: +SKIP
        ['input', 'matmul', 'permute', 'softmax']
    """
    if params not in ("const", "input"):
        raise ValueError(f"trace: params must be 'const' or 'input', got {params!r}")
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"trace: example input {i} must be a torch.Tensor, got {type(t).__name__} "
                "(bind non-tensor arguments with functools.partial or a lambda)"
            )
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else None
    names = _input_names(module.forward if module is not None else fn_or_module, len(example_inputs))
    specs = _dynamic_specs(dynamic_dims, example_inputs, names)
    state = dict(module.named_parameters()) | dict(module.named_buffers()) if module is not None else {}
    gm = _make_fx(fn_or_module, module, example_inputs, specs, state, decompositions)
    return _Builder(gm, names, example_inputs, specs, state, params).run()


def _input_names(fn: Callable, n: int) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [f"x{i}" for i in range(n)]
    names: list[str] = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            names += [f"{p.name}{i}" for i in range(n - len(names))]
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    names = names[:n] + [f"x{i}" for i in range(len(names), n)]
    return [nm if names.count(nm) == 1 else f"{nm}{i}" for i, nm in enumerate(names)]


def _dynamic_specs(
    dynamic_dims: DynamicDims, inputs: Sequence[torch.Tensor], names: list[str]
) -> list[dict[int, str]]:
    if dynamic_dims is None:
        return [{} for _ in inputs]
    if isinstance(dynamic_dims, Mapping):
        per = [{a % t.dim(): nm for a, nm in dynamic_dims.items() if -t.dim() <= a < t.dim()} for t in inputs]
    else:
        if len(dynamic_dims) != len(inputs):
            raise ValueError(f"trace: dynamic_dims has {len(dynamic_dims)} entries for {len(inputs)} inputs")
        per = []
        for t, spec, nm in zip(inputs, dynamic_dims, names):
            spec = dict(spec or {})
            bad = [a for a in spec if not -t.dim() <= a < t.dim()]
            if bad:
                raise ValueError(
                    f"trace: dynamic axes {bad} are out of range for input {nm!r} of rank {t.dim()}"
                )
            per.append({a % t.dim(): s for a, s in spec.items()})
    for t, spec, nm in zip(inputs, per, names):
        for a, s in spec.items():
            if not isinstance(s, str) or not s.isidentifier():
                raise ValueError(
                    f"trace: dynamic dim name {s!r} (input {nm!r}, axis {a}) must be an identifier"
                )
            if t.shape[a] < 2:
                raise ValueError(
                    f"trace: dynamic dim {s!r} of input {nm!r} (axis {a}) has example size "
                    f"{t.shape[a]}; give an example size >= 2 (torch specialises 0 and 1)"
                )
    return per


def _make_fx(
    fn: Callable,
    module: torch.nn.Module | None,
    inputs: Sequence[torch.Tensor],
    specs: list[dict[int, str]],
    state: dict[str, torch.Tensor],
    decompositions: Iterable[Any],
) -> fx.GraphModule:
    """``make_fx`` over fake inputs whose dynamic axes (only those) are symbolic.

    Pre-dispatch tracing: after autograd, torch's C++ composite of ``F.linear`` reads concrete sizes and
    would specialise a symbolic batch; before it, the (symbolic) python decomposition runs instead.
    Duck sizing is off so two axes that happen to share an example size stay distinct symbols.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)

    def fake(t: torch.Tensor, spec: Mapping[int, str]) -> torch.Tensor:
        dims = [DimDynamic.DYNAMIC if i in spec else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t.detach(), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    fakes = [fake(t, s) for t, s in zip(inputs, specs)] + [fake(t, {}) for t in state.values()]
    n = len(inputs)
    if module is not None:
        keys = list(state)

        def run(*args):
            return torch.func.functional_call(module, dict(zip(keys, args[n:])), tuple(args[:n]))
    else:

        def run(*args):
            return fn(*args)

    _anchor_stack_traces(fn if module is None else None)
    with torch.no_grad():
        gm = make_fx(
            run,
            decomposition_table=_decomposition_table(decompositions),
            tracing_mode="symbolic",
            pre_dispatch=True,
            record_stack_traces=True,
        )(*fakes)
    gm.graph.eliminate_dead_code()
    return gm


def _anchor_stack_traces(fn: Callable | None) -> None:
    """Let fx record source lines inside a plain function too (it keeps only ``forward`` frames otherwise)."""
    while fn is not None and hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    register = getattr(fx.proxy, "_register_stack_trace_anchor", None)
    if fn is not None and register is not None:
        register(fn)


def where(node: fx.Node) -> str:
    """``file:line in func: source`` of the user code that produced ``node`` (from its stack trace)."""
    st = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            try:
                file_part, line_part, func_part = lines[i].split(", ", 2)
                file = file_part[len('File "') : -1]
                code = lines[i + 1] if i + 1 < len(lines) else ""
                return f"{file}:{line_part.split()[-1]} in {func_part.split()[-1]}: {code}"
            except ValueError:
                break
    return "unknown source line"


class _Builder:
    """Walks the fx graph once, in order, keeping an fx node -> IR value map."""

    def __init__(
        self,
        gm: fx.GraphModule,
        names: list[str],
        inputs: Sequence[torch.Tensor],
        specs: list[dict[int, str]],
        state: dict[str, torch.Tensor],
        params: str,
    ) -> None:
        self.gm, self.names, self.inputs, self.specs, self.state, self.params = (
            gm,
            names,
            inputs,
            specs,
            state,
            params,
        )
        self.g = Graph()
        self.env: dict[fx.Node, Any] = {}
        self.shape_env = getattr(gm, "shape_env", None)
        self.symbols: dict[Any, str] = {}
        self.node: fx.Node | None = None
        self.viewed: set[fx.Node] = set()  # fx values that are views or have views (in-place ops refuse them)

    # -- the walk ------------------------------------------------------------------------------------------
    def run(self) -> Graph:
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        n_in = len(self.inputs)
        self._name_symbols(phs[:n_in])
        for ph, name, t in zip(phs[:n_in], self.names, self.inputs):
            self.env[ph] = self.g.input(name, self.shape_of(ph), DType.from_torch(t.dtype))
        for ph, (qual, t) in zip(phs[n_in:], self.state.items()):
            self.env[ph] = (
                self.g.input(qual, tuple(t.shape), DType.from_torch(t.dtype))
                if self.params == "input"
                else self.g.const(t.detach())
            )
        for node in self.gm.graph.nodes:
            self.node = node
            if node.op == "get_attr":
                self.env[node] = self.g.const(_attr(self.gm, node.target).detach())
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                outs = torch.utils._pytree.tree_leaves(node.args[0])
                for o in outs:
                    val = self.env.get(o) if isinstance(o, fx.Node) else o
                    val = val() if isinstance(val, Lazy) else val
                    if not isinstance(val, Node):
                        raise UnsupportedOpError(
                            f"trace: the traced code returns {type(val).__name__} "
                            f"{val!r}; only tensors (or tuples of tensors) can be outputs"
                        )
                    self.g.output(val)
        logger.debug("traced %d fx nodes into %d graph nodes", len(self.gm.graph.nodes), len(self.g))
        return self.g

    def call(self, node: fx.Node) -> Any:
        target = node.target
        val = node.meta.get("val")
        if (
            isinstance(val, (torch.SymInt, int))
            and not isinstance(val, bool)
            and target is not operator.getitem
        ):
            return self.dim(val)
        if isinstance(val, (list, tuple)) and val and all(isinstance(v, (torch.SymInt, int)) for v in val):
            return tuple(self.dim(v) for v in val)  # aten.size and friends
        if target in IGNORED:
            return None
        args = torch.utils._pytree.tree_map(self.value, node.args)
        kwargs = torch.utils._pytree.tree_map(self.value, dict(node.kwargs))
        if target is operator.getitem:
            out = args[0][args[1]]
            return out() if isinstance(out, Lazy) else out
        functional, inplace = _functional(target)
        handler = ATEN.get(functional)
        if handler is None:
            return self.unsupported(target)
        if inplace:
            self.check_inplace(node)
        try:
            out = handler(self, *args, **kwargs)
        except (ShapeError, DTypeError) as e:
            raise type(e)(f"{e} (tracing {target} from {where(node)})") from e
        out = self.conform(out, val, target)
        if inplace:  # later reads of the mutated value see the result
            self.env[node.args[0]] = out
        if functional in _VIEWS:
            self.viewed.update(a for a in node.args[:1] if isinstance(a, fx.Node))
            self.viewed.add(node)
        return out

    def unsupported(self, target: Any) -> Any:
        names = sorted({str(op).split(".")[1] if str(op).startswith("aten.") else str(op) for op in ATEN})
        raise UnsupportedOpError(
            f"{target} (from {where(self.node)}) is not supported by kernelize.ir.trace; "
            f"supported: {', '.join(names)}"
        )

    def check_inplace(self, node: fx.Node) -> None:
        dst = node.args[0]
        if isinstance(dst, fx.Node) and (dst.op == "placeholder" or dst in self.viewed):
            what = (
                "an input or parameter" if dst.op == "placeholder" else "a view (or a tensor that has views)"
            )
            raise UnsupportedOpError(
                f"{node.target} (from {where(node)}) mutates {what}; kernelize.ir.trace "
                "supports in-place ops only on fresh intermediates: use the out-of-place "
                "form (x = x + y instead of x += y)"
            )

    def conform(self, out: Any, val: Any, target: Any) -> Any:
        """Check the IR's shape against torch's and cast to torch's dtype (type promotion)."""
        if isinstance(out, Node) and isinstance(val, torch.Tensor):
            want = self.shape(val.shape)
            if out.shape != want:
                raise AssertionError(
                    f"kernelize bug: {target} (from {where(self.node)}) built "
                    f"{shape_str(out.shape)} but torch says {shape_str(want)}"
                )
            return self.g.cast(out, DType.from_torch(val.dtype))
        if isinstance(out, (tuple, list)) and isinstance(val, (tuple, list)):
            return tuple(
                self.conform(o, v, target) if not isinstance(o, Lazy) else o for o, v in zip(out, val)
            )
        return out

    def value(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            return self.env[a]
        if isinstance(a, torch.SymInt):
            return self.dim(a)
        return a

    # -- helpers for handlers ------------------------------------------------------------------------------
    def out_dtype(self, i: int | None = None) -> DType:
        val = self.node.meta["val"]
        return DType.from_torch((val[i] if i is not None else val).dtype)

    def cast(self, x: Any, dtype: DType) -> Any:
        return self.g.cast(x, dtype) if isinstance(x, Node) else x

    def fail(self, why: str) -> UnsupportedOpError:
        return UnsupportedOpError(f"{self.node.target} (from {where(self.node)}): {why}")

    # -- symbolic sizes ------------------------------------------------------------------------------------
    def _name_symbols(self, phs: list[fx.Node]) -> None:
        for ph, spec, nm in zip(phs, self.specs, self.names):
            for axis, sym in spec.items():
                d = ph.meta["val"].shape[axis]
                expr = self._expr(d)
                if expr.is_Integer:
                    raise ValueError(
                        f"trace: dynamic dim {sym!r} (input {nm!r}, axis {axis}) was specialised to "
                        f"{int(expr)} by the traced code (a size-dependent branch or a fixed-size "
                        "view); drop it from dynamic_dims or make the code size-agnostic"
                    )
                if expr.is_Symbol:
                    self.symbols.setdefault(expr, sym)
        for ph, spec, nm in zip(phs, self.specs, self.names):
            for axis, sym in spec.items():
                got = self.dim(ph.meta["val"].shape[axis])
                if got != Sym.of(sym):
                    logger.warning(
                        "trace: dynamic dim %r of input %r must equal %s in the traced code; graph uses %s",
                        sym,
                        nm,
                        got,
                        got,
                    )

    def _expr(self, d: Any):
        import sympy

        if isinstance(d, int):
            return sympy.Integer(d)
        expr = d.node.expr
        return self.shape_env.replace(expr) if self.shape_env is not None else expr

    def dim(self, d: Any) -> Dim:
        """A torch size (int or SymInt) as an IR dim."""
        expr = self._expr(d)
        if expr.is_Integer:
            return int(expr)
        out: Dim = 1
        factors = expr.args if expr.is_Mul else (expr,)
        for f in factors:
            if f.is_Integer:
                out = out * int(f)
            elif f.is_Symbol and f in self.symbols:
                out = Sym.of(self.symbols[f]) * out
            elif f.is_Pow and f.base in self.symbols and f.exp.is_Integer and f.exp > 0:
                for _ in range(int(f.exp)):
                    out = Sym.of(self.symbols[f.base]) * out
            else:
                raise self.fail(
                    f"size {expr} is not a product of named dynamic dims "
                    f"{sorted(self.symbols.values())} (kernelize sizes are products like batch*seq)"
                )
        return out

    def shape(self, sizes: Sequence[Any]) -> tuple[Dim, ...]:
        return tuple(self.dim(s) for s in sizes)

    def shape_of(self, node: fx.Node) -> tuple[Dim, ...]:
        return self.shape(node.meta["val"].shape)


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _functional(target: Any) -> tuple[Any, bool]:
    """``aten.add_.Tensor`` -> (``aten.add.Tensor``, True); other targets -> (target, False)."""
    if isinstance(target, torch._ops.OpOverload) and target not in ATEN:
        name = target._schema.name.split("::")[-1]
        if name.endswith("_") and not name.startswith("_"):
            packet = getattr(torch.ops.aten, name[:-1], None)
            overload = getattr(packet, target._overloadname, None) if packet is not None else None
            if overload is not None:
                return overload, True
    return target, False


aten = torch.ops.aten
# ops whose result aliases their first operand
_VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.expand.default,
        aten.permute.default,
        aten.t.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.narrow.default,
        aten.split.Tensor,
        aten.chunk.default,
        aten.unbind.int,
        aten.flatten.using_ints,
        aten.unflatten.int,
        aten.alias.default,
        aten.split_with_sizes.default,
        aten.movedim.int,
        aten.detach.default,
        aten.mT.default,
        aten.tensor_split.sections,
        aten.tensor_split.indices,
    }
)

__all__ = ["ATEN", "UnsupportedOpError", "trace", "where"]
