"""Load an ONNX model into a :class:`~kernelize.ir.graph.Graph`.

The model is parsed and checked with the ``onnx`` package; each node goes through a converter from the
:data:`OPS` table that maps it onto the IR's builder ops (decomposing where the IR has no direct op).
Values known at load time (initializers, ``Constant``, ``Shape`` of static dims and everything computed from
those only) are evaluated eagerly by running the same converter on a scratch graph with the reference
executor, so shape subgraphs (``Shape -> Gather -> Concat -> Reshape``) fold into a plain view. Symbolic
input dims (``dim_param`` such as ``"batch"``) become :class:`~kernelize.ir.shapes.Sym` dims and flow
through shape subgraphs as :class:`~kernelize.ir.onnx_context.SymInts`.

The converters live in ``onnx_ops`` (elementwise, casts, reductions, symbolic shape arithmetic),
``onnx_layout`` (shapes, slicing, gathers, padding, constants), ``onnx_nn`` (matmul/Gemm/Einsum, conv,
pooling, normalizations, softmax, Resize) and ``onnx_attention`` (Attention, RotaryEmbedding, losses); each
module exports one ``{op_type: converter}`` table and :data:`OPS` is their union.

Example:
    >>> g = load_onnx("tests/ir/data/tiny_cnn.onnx")  # doctest: +SKIP
    >>> out, = evaluate(g, [torch.randn(2, 3, 16, 16)])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from kernelize.ir.errors import FoldLimitError, UnsupportedOpError
from kernelize.ir.graph import DTypeError, Graph, Node, Op
from kernelize.ir.onnx_attention import ATTENTION_OPS
from kernelize.ir.onnx_context import (
    Converter,
    NodeContext,
    SymInts,
    Value,
    fold_limit,
    materialize,
    nbytes,
    onnx_type_name,
    tensor_from_proto,
    to_dtype,
)
from kernelize.ir.onnx_layout import LAYOUT_OPS
from kernelize.ir.onnx_nn import NN_OPS
from kernelize.ir.onnx_ops import MATH_OPS, SYM_OPS
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import Dim, ShapeError, Sym

logger = logging.getLogger(__name__)

# op type -> converter, for the default ONNX domain
OPS: dict[str, Converter] = {**MATH_OPS, **LAYOUT_OPS, **NN_OPS, **ATTENTION_OPS}
# converters used instead when an input is a symbolic shape (SymInts)
SYMBOLIC_OPS: dict[str, Converter] = dict(SYM_OPS)


def load_onnx(
    path_or_model: str | os.PathLike | bytes | onnx.ModelProto,
    *,
    dynamic_dims: Mapping[str, int | str] | None = None,
    fold_limit: int | None = None,
) -> Graph:
    """Convert an ONNX model into a graph.

    Args:
        path_or_model: a path to a ``.onnx`` file (external data next to it is loaded), the serialized
            bytes, or a ``ModelProto``.
        dynamic_dims: renames or pins input dims. Keys are a ``dim_param`` name (``"batch"``) or
            ``"<input>:<axis>"`` (``"x:0"``, also for static dims); a value ``str`` makes that dim a symbolic
            dim of that name, an ``int`` makes it static.
        fold_limit: the cap, in bytes, on each value folded at load time (default ``$KERNELIZE_FOLD_LIMIT``
            or 64 MiB). A node whose folded result (or an intermediate of it) would be larger stays a
            run-time computation; when the IR cannot express it at run time (``Range``, ``EyeLike``),
            :class:`~kernelize.ir.errors.FoldLimitError` names the node.

    Returns:
        The graph, with one input per ONNX graph input (same names, initializers excluded) and one output
        per ONNX graph output.

    Raises:
        UnsupportedOpError: an op, attribute value or element type kernelize cannot express; the message
            names the op type, the node name and the opset.
        ValueError: a malformed model (unparsable bytes, a checker failure, an undefined value, operands whose
            shapes do not fit); the message names the model and the node.

    Example:
        >>> g = load_onnx("model.onnx", dynamic_dims={"x:0": "batch"})  # doctest: +SKIP
    """
    limit = _fold_limit(fold_limit)
    model, where = _read(path_or_model)
    return _Loader(model, where, dict(dynamic_dims or {}), limit).run()


def _read(src: str | os.PathLike | bytes | onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    if isinstance(src, onnx.ModelProto):
        model, where = src, f"model {src.graph.name or '<unnamed>'!r}"
    elif isinstance(src, (bytes, bytearray)):
        where = f"model bytes ({len(src)} bytes)"
        try:
            model = onnx.load_from_string(bytes(src))
        except Exception as e:  # protobuf raises DecodeError or RuntimeError depending on the backend
            raise ValueError(f"{where}: not a valid ONNX protobuf: {e}") from e
    elif isinstance(src, (str, os.PathLike)):
        path = Path(src)
        where = f"ONNX file {str(path)!r}"
        if not path.is_file():
            raise ValueError(f"{where} does not exist")
        try:
            model = onnx.load(str(path))
        except Exception as e:
            raise ValueError(f"{where}: not a valid ONNX protobuf ({type(e).__name__}: {e})") from e
    else:
        raise TypeError(f"load_onnx takes a path, bytes or onnx.ModelProto, got {type(src).__name__}")
    if not model.HasField("graph") or not model.graph.output:
        raise ValueError(f"{where}: not an ONNX model (it has no graph outputs)")
    try:
        checked = _weightless(model)
        if checked.ByteSize() < 2**31 - 1:  # the checker cannot take protos over 2 GB in memory
            onnx.checker.check_model(checked)
    except onnx.checker.ValidationError as e:
        raise ValueError(f"{where} fails the ONNX checker: {str(e).strip()}") from e
    return model, where


WEIGHTLESS_ELEMENTS = 1024  # initializers with more elements are checked by size, not by the checker


def _weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for the checker, its large raw initializers replaced by graph inputs of their type and
    shape (IR 4 and later allow initializers that are not inputs, and inputs that nothing initializes).

    The checker parses and walks whatever proto it is given: for a transformer's 330-440 MB of weights
    that took 1-2 s of each cold load, for checks of the graph that do not need the bytes. The bytes are
    checked here against the shape instead (the one thing about them the converters rely on).

    Raises:
        onnx.checker.ValidationError: an initializer whose byte count does not fit its shape and type.
    """
    graph = model.graph
    # sized by their dims: reading raw_data copies the bytes out, ByteSize walks the message
    big = [t for t in graph.initializer if math.prod(t.dims) > WEIGHTLESS_ELEMENTS and t.HasField("raw_data")]
    if not big:
        return model
    for t in big:
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        except (KeyError, ValueError, TypeError):  # no such element type: the checker says so
            return model
        size = len(t.raw_data)
        if size != itemsize * int(np.prod(t.dims, dtype=np.int64)):
            raise onnx.checker.ValidationError(
                f"initializer {t.name!r}: {size} bytes of raw data for shape {list(t.dims)} of "
                f"{onnx_type_name(t.data_type)}"
            )
    names = {t.name for t in big}
    out = onnx.ModelProto()
    _copy_fields(out, model, skip="graph")
    _copy_fields(out.graph, graph, skip="initializer")
    out.graph.initializer.extend(t for t in graph.initializer if t.name not in names)
    declared = {i.name for i in graph.input}
    out.graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in big
        if t.name not in declared
    )
    return out


def _copy_fields(dst: Any, src: Any, skip: str) -> None:
    """Copy every set field of the proto message ``src`` but ``skip`` into ``dst``."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field (the descriptor API to ask differs across protobufs)
            getattr(dst, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _sym_name(name: str) -> str:
    name = re.sub(r"\W", "_", name)
    return name if name.isidentifier() else f"d_{name}"


class _Loader:
    def __init__(
        self, model: onnx.ModelProto, where: str, dynamic_dims: dict[str, int | str], limit: int
    ) -> None:
        self.model, self.where, self.dynamic, self.limit = model, where, dynamic_dims, limit
        # a model of other domains only has no default opset; its nodes are then unsupported anyway
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        self.g = Graph()
        self.values: dict[str, Value] = {}

    def run(self) -> Graph:
        graph = self.model.graph
        unknown = sorted(set(self.dynamic) - self._dim_keys())
        if unknown:
            raise ValueError(
                f"dynamic_dims keys {unknown} match no input dim of {self.where} (keys are "
                "dim_param names or '<input>:<axis>')"
            )
        for key, value in self.dynamic.items():
            # bool is an int, 2.5 is not a size, -3 passes every check until a kernel runs
            if (
                isinstance(value, bool)
                or not isinstance(value, int | str)
                or (isinstance(value, int) and value < 0)
            ):
                raise ValueError(
                    f"dynamic_dims[{key!r}] = {value!r} for {self.where}: a value is a dim name "
                    "(str) or a static size (int >= 0)"
                )
        for init in graph.initializer:
            self.values[init.name] = tensor_from_proto(init, f"initializer {init.name!r} of {self.where}")
        if graph.sparse_initializer:
            raise UnsupportedOpError(f"{self.where} has sparse initializers; kernelize does not support them")
        for vi in graph.input:
            if vi.name in self.values:
                logger.debug("input %r has an initializer; treating it as a constant", vi.name)
                continue
            self.values[vi.name] = self._input(vi)
        for index, node in enumerate(graph.node):
            self._node(index, node)
        outputs = []
        for vo in graph.output:
            if vo.name not in self.values:
                raise ValueError(f"{self.where}: graph output {vo.name!r} is computed by no node")
            v = self.values[vo.name]
            if isinstance(v, SymInts):
                sizes = [str(d) for d in v.dims]
                raise UnsupportedOpError(
                    f"graph output {vo.name!r} of {self.where} is a shape with symbolic "
                    f"sizes {sizes}; kernelize has no run-time shape op"
                )
            outputs.append(v if isinstance(v, Node) else materialize(self.g, v))
        self.g.output(*outputs)
        logger.debug(
            "loaded %s: %d ONNX nodes (opset %d) -> %d IR nodes",
            self.where,
            len(graph.node),
            self.opset,
            len(self.g),
        )
        return self.g

    # -- inputs -------------------------------------------------------------------------------------------
    def _input(self, vi: onnx.ValueInfoProto) -> Node:
        kind = vi.type.WhichOneof("value")
        if kind != "tensor_type":
            raise UnsupportedOpError(
                f"graph input {vi.name!r} of {self.where} is a {kind}; kernelize supports tensor inputs only"
            )
        tt = vi.type.tensor_type
        dtype = to_dtype(tt.elem_type, f"graph input {vi.name!r} of {self.where}")
        if not tt.HasField("shape"):
            raise UnsupportedOpError(f"graph input {vi.name!r} of {self.where} has no shape (unknown rank)")
        dims: list[Dim] = []
        for axis, d in enumerate(tt.shape.dim):
            pinned = self.dynamic.get(f"{vi.name}:{axis}", self.dynamic.get(d.dim_param or None))
            if pinned is not None:
                dims.append(Sym.of(_sym_name(pinned)) if isinstance(pinned, str) else int(pinned))
            elif d.HasField("dim_value"):
                if d.dim_value < 0:
                    raise ValueError(
                        f"graph input {vi.name!r} of {self.where}: dim {axis} has dim_value "
                        f"{d.dim_value}; sizes must be >= 0 (pin it with dynamic_dims="
                        f"{{'{vi.name}:{axis}': size}})"
                    )
                dims.append(int(d.dim_value))
            else:
                dims.append(Sym.of(_sym_name(d.dim_param or f"{vi.name}_{axis}")))
        return self.g.input(vi.name, dims, dtype)

    def _dim_keys(self) -> set[str]:
        """Every key ``dynamic_dims`` may use: the dim_params and ``input:axis`` of the graph inputs."""
        keys = set()
        for vi in self.model.graph.input:
            for axis, d in enumerate(vi.type.tensor_type.shape.dim):
                keys |= {f"{vi.name}:{axis}", d.dim_param} - {""}
        return keys

    # -- nodes --------------------------------------------------------------------------------------------
    def _node(self, index: int, node: onnx.NodeProto) -> None:
        values = []
        for name in node.input:
            if not name:
                values.append(None)
            elif name in self.values:
                values.append(self.values[name])
            else:
                raise ValueError(
                    f"{self.where}: node {node.name or index!r} ({node.op_type}) reads "
                    f"{name!r}, which no earlier node, input or initializer defines"
                )
        ctx = NodeContext(self.g, node, self.opset, values, self.where, self.limit)
        if node.domain not in ("", "ai.onnx"):
            raise ctx.unsupported(f"domain {node.domain!r} is not supported (only the default ONNX domain)")
        symbolic = any(isinstance(v, SymInts) for v in values)
        fn = SYMBOLIC_OPS.get(node.op_type) if symbolic else None
        fn = fn or OPS.get(node.op_type)
        if fn is None:
            raise ctx.unsupported(
                f"this op type is not supported (the {len(OPS)} supported ones are listed "
                "in kernelize.ir.onnx_frontend.OPS)"
            )
        # every supported op is pure, so a node of constants is folded (random ops are unsupported)
        fold = not symbolic and all(v is None or isinstance(v, torch.Tensor) for v in values)
        if fold:
            ctx.g = Graph()
        try:
            outs = _outputs(fn(ctx))
            if fold and _oversized(ctx.g, self.limit):  # keep it a run-time computation instead
                ctx.g = self.g
                outs = _outputs(fn(ctx))
            elif fold:
                outs = _fold(ctx.g, outs)
        except (UnsupportedOpError, FoldLimitError):
            raise
        except MemoryError as e:
            raise MemoryError(
                f"{ctx.describe()}: out of memory while converting it (folding cap {self.limit} bytes)"
            ) from e
        except (
            ShapeError,
            DTypeError,
            ValueError,
            TypeError,
            IndexError,
            KeyError,
            ZeroDivisionError,
            RuntimeError,
        ) as e:  # operands that do not fit the op: a malformed model
            kind = ShapeError if isinstance(e, ShapeError) else ValueError
            raise kind(f"{ctx.describe()}: {e}") from e
        for i, name in enumerate(node.output):
            if not name:
                continue
            if i >= len(outs) or outs[i] is None:
                raise ctx.unsupported(f"output {i} ({name!r}) is not supported")
            self.values[name] = outs[i]


def _fold_limit(value: int | None) -> int:
    try:
        return fold_limit(value)
    except ValueError as e:
        raise ValueError(f"load_onnx: {e}") from None


def _outputs(out: Any) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _oversized(scratch: Graph, limit: int) -> bool:
    """Whether folding would allocate a value over ``limit`` bytes: some computed node of the scratch graph
    (its constants exist already; converters that return tensors check the cap themselves)."""
    return any(nbytes(n.shape, n.dtype) > limit for n in scratch.nodes if n.op is not Op.CONST)


def _fold(scratch: Graph, outs: list) -> list:
    """Evaluate the nodes a converter built on a scratch graph of constants; tensors and None pass through."""
    nodes = [o for o in outs if isinstance(o, Node)]
    if not nodes:
        return outs
    scratch.output(*nodes)
    vals = iter(evaluate(scratch, []))
    return [next(vals) if isinstance(o, Node) else o for o in outs]


__all__ = ["OPS", "SYMBOLIC_OPS", "FoldLimitError", "UnsupportedOpError", "load_onnx", "onnx_type_name"]
