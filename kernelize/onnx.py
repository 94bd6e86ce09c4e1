"""A drop-in for onnxruntime's ``InferenceSession``, running the model as a kernelize compiled graph.

Change ``from onnxruntime import InferenceSession`` to ``from kernelize.onnx import InferenceSession``:
``run(output_names, input_feed)`` takes and returns numpy arrays, ``get_inputs()`` / ``get_outputs()``
describe the graph's inputs and outputs as onnxruntime's ``NodeArg`` does, ``get_modelmeta()`` its metadata.

The session takes the route ``kernelize run`` and ``benchmarks/onnx_models.py`` time: the optimized graph
from the disk cache (:func:`~kernelize.runtime.graph_cache.load_optimized_onnx`, for a model given as a
path) compiled by :func:`~kernelize.runtime.compiled.compile_graph`, whose kernels are cached too.

Symbolic dims (``dim_param``) stay symbolic, so one compiled graph serves every batch size. Some exports
compute a shape from an input (BERT's position ids: ``Shape -> Gather -> Concat -> Reshape``) that the IR
can only fold once the dim has a size; for such a model the session pins every symbolic dim to the sizes of
the inputs of each call (as ``kernelize run`` does with ``--dim``) and keeps the compiled graph of the last
:data:`MAX_SHAPES` input signatures.

Providers: ``CPUExecutionProvider`` (the default) runs the generated C++ kernels on the CPU;
``CUDAExecutionProvider`` runs on the GPU with the backend the hub's device policy picks (Triton, or CUDA C
with ``KERNELIZE_CUDA_BACKEND=cuda``); ``backend=`` names one outright. ``get_providers()`` answers
``["KernelizeCPUExecutionProvider"]`` or ``["KernelizeCUDAExecutionProvider"]``.

Threads: ``sess_options.intra_op_num_threads`` (an ``onnxruntime.SessionOptions`` or any object with that
attribute), when set and not 0, is torch's thread count during each ``run`` (the generated kernels and the
library calls both use torch's pool); the previous count is restored afterwards. Other session and run
options are accepted and ignored.

Example:
    >>> sess = InferenceSession("model.onnx", providers=["CPUExecutionProvider"])  # doctest: +SKIP
    >>> name = sess.get_inputs()[0].name  # doctest: +SKIP
    >>> (y,) = sess.run(None, {name: x})  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SIZE",
    "MAX_SHAPES",
    "PROVIDERS",
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "SymbolicDim",
    "pin_dims",
    "symbolic_dims",
]

# onnxruntime provider name -> torch device type; get_providers() answers "Kernelize" + the name
PROVIDERS: Mapping[str, str] = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}
# the size a symbolic dim is pinned to when nothing gives one (`kernelize run` without --dim or --inputs)
DEFAULT_SIZE = 2
# compiled graphs kept per session for a model whose dims are pinned per input signature
MAX_SHAPES = 8
# what onnxruntime's get_modelmeta().version answers for a model that sets no model_version
UNSET_VERSION = 2**63 - 1
# onnxruntime's other constructor keywords: accepted, as onnxruntime's own defaults would be, and ignored
IGNORED_KEYWORDS = frozenset({"provider_options", "disabled_optimizers", "read_config_from_model"})


@dataclasses.dataclass(frozen=True)
class NodeArg:
    """An input or output of the model, as onnxruntime's ``NodeArg``.

    Attributes:
        name: the graph input or output name.
        shape: one entry per axis: an ``int`` size, a ``str`` symbolic dim (``dim_param``), or ``None``.
        type: the onnxruntime type string, e.g. ``"tensor(float)"`` or ``"tensor(int64)"``.
    """

    name: str
    shape: list[int | str | None]
    type: str


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    """The model's metadata, with the fields of onnxruntime's ``ModelMetadata``."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


@dataclasses.dataclass(frozen=True)
class SymbolicDim:
    """A graph input dim without a static size; ``key`` is its ``dim_param``, else ``"<input>:<axis>"``
    (the keys ``load_onnx(..., dynamic_dims=)`` and ``kernelize run --dim`` take)."""

    input: str
    axis: int
    key: str


def symbolic_dims(model: onnx.ModelProto) -> tuple[SymbolicDim, ...]:
    """Every dim of the model's graph inputs (initializers excluded) that has no ``dim_value``.

    Example:
        >>> symbolic_dims(onnx.load("model.onnx"))  # doctest: +SKIP
        (SymbolicDim(input='x', axis=0, key='batch'),)
    """
    weights = _initializers(model)
    return tuple(
        SymbolicDim(vi.name, axis, d.dim_param or f"{vi.name}:{axis}")
        for vi in model.graph.input
        if vi.name not in weights
        for axis, d in enumerate(vi.type.tensor_type.shape.dim)
        if not d.HasField("dim_value")
    )


def pin_dims(
    dims: Sequence[SymbolicDim], sizes: Mapping[str, Sequence[int]], given: Mapping[str, int] | None = None
) -> dict[str, int]:
    """A size for every symbolic dim in ``dims``: the one in ``given`` (by key or ``input:axis``), else the
    input's size in ``sizes`` (input name -> shape; the first input that has a dim_param sets it), else
    :data:`DEFAULT_SIZE`.

    Example:
        >>> pin_dims([SymbolicDim("x", 0, "batch")], {"x": (8, 3)})
        {'batch': 8}
    """
    pins = dict(given or {})
    for from_sizes in (True, False):
        for d in dims:
            if d.key in pins or f"{d.input}:{d.axis}" in pins:
                continue
            shape = sizes.get(d.input)
            if not from_sizes:
                pins[d.key] = DEFAULT_SIZE
            elif shape is not None and d.axis < len(shape):
                pins[d.key] = int(shape[d.axis])
    return pins


def _type_name(elem_type: int) -> str:
    """onnxruntime's spelling of a tensor element type: ``tensor(float)``, ``tensor(int64)``, ..."""
    return f"tensor({onnx.TensorProto.DataType.Name(elem_type).lower()})"


def _node_args(values: Sequence[onnx.ValueInfoProto]) -> list[NodeArg]:
    args = []
    for vi in values:
        tt = vi.type.tensor_type
        shape: list[int | str | None] = [
            int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        ]
        args.append(NodeArg(vi.name, shape, _type_name(tt.elem_type)))
    return args


def _with_output_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, with its output shapes inferred when an output declares none (onnxruntime reports the
    inferred ones); unchanged when inference fails."""
    if all(o.type.tensor_type.HasField("shape") for o in model.graph.output):
        return model
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model inference cannot follow still runs; its outputs just have no shape
        logger.debug("shape inference failed for %s", model.graph.name, exc_info=True)
        return model


def _choose_device(providers: Sequence[Any] | None) -> tuple[str, torch.device]:
    """(provider name, device) of the first usable entry of ``providers`` (names, or ``(name, options)``
    pairs as onnxruntime takes; ``device_id`` picks the GPU). Unknown or unusable entries are skipped with a
    warning while a later one is usable, as onnxruntime does.

    Raises:
        ValueError: no entry is usable; the message names the supported providers and the remedy.
    """
    entries = [(p, {}) if isinstance(p, str) else (p[0], dict(p[1])) for p in providers or []]
    entries = entries or [("CPUExecutionProvider", {})]
    problems = []
    for name, options in entries:
        kind = PROVIDERS.get(name)
        if kind is None:
            problems.append(f"{name!r} is not a kernelize provider (supported: {', '.join(PROVIDERS)})")
        elif kind == "cuda" and not torch.cuda.is_available():
            problems.append(
                f"{name!r} needs a CUDA GPU, and torch.cuda.is_available() is False (torch "
                f"{torch.__version__}): install a CUDA build of torch on a machine with an NVIDIA GPU, "
                "or pass providers=['CPUExecutionProvider']"
            )
        else:
            if problems:
                logger.warning("InferenceSession: %s; using %s", "; ".join(problems), name)
            index = int(options.get("device_id", 0))
            return name, torch.device(kind, index) if kind == "cuda" else torch.device(kind)
    raise ValueError(f"InferenceSession(providers={[n for n, _ in entries]}): " + "; ".join(problems))


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's thread count is ``n`` inside the block (unchanged when ``n`` is 0 or already the count)."""
    before = torch.get_num_threads()
    if n <= 0 or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _read_model(path_or_bytes: str | os.PathLike | bytes) -> tuple[onnx.ModelProto, Path | None]:
    """The model's protobuf without external data (for its inputs, outputs and metadata) and its path."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        try:
            return onnx.load_from_string(bytes(path_or_bytes)), None
        except Exception as e:  # protobuf raises DecodeError or RuntimeError depending on its backend
            raise ValueError(f"InferenceSession: the bytes are not an ONNX model ({e})") from e
    if not isinstance(path_or_bytes, (str, os.PathLike)):
        raise TypeError(f"InferenceSession takes a path or the model's bytes, got {type(path_or_bytes)}")
    path = Path(path_or_bytes)
    if not path.is_file():
        raise ValueError(f"InferenceSession: ONNX file {str(path)!r} does not exist")
    try:
        return onnx.load(str(path), load_external_data=False), path
    except Exception as e:
        raise ValueError(f"InferenceSession: {str(path)!r} is not an ONNX model ({e})") from e


class InferenceSession:
    """Run an ONNX model with kernelize, with onnxruntime's ``InferenceSession`` interface.

    Args:
        path_or_bytes: the ``.onnx`` file (external data next to it is loaded), or the model's bytes (those
            skip the optimized-graph disk cache; the kernels are cached either way).
        sess_options: ``intra_op_num_threads``, when set and not 0, is torch's thread count during ``run``.
        providers: onnxruntime provider names in order of preference (see the module docstring);
            default ``["CPUExecutionProvider"]``.
        backend: kernelize's code generator (``"cpu"``, ``"triton"``, ``"cuda"``, ``"reference"``) instead of
            the one the device's policy picks.
        **kwargs: onnxruntime's ``provider_options``, ``disabled_optimizers`` and ``read_config_from_model``
            (ignored).

    Raises:
        ValueError: a missing file, bytes that are no model, or no usable provider.
        UnsupportedOpError: an op the IR cannot express (the message names the node).

    Example:
        >>> sess = InferenceSession("model.onnx", providers=["CPUExecutionProvider"])  # doctest: +SKIP
        >>> input_name = sess.get_inputs()[0].name  # doctest: +SKIP
        >>> label_name = sess.get_outputs()[0].name  # doctest: +SKIP
        >>> pred = sess.run([label_name], {input_name: X.astype(np.float32)})[0]  # doctest: +SKIP
    """

    def __init__(
        self,
        path_or_bytes: str | os.PathLike | bytes,
        sess_options: Any = None,
        providers: Sequence[Any] | None = None,
        *,
        backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - IGNORED_KEYWORDS)
        if unknown:
            raise TypeError(f"InferenceSession got unexpected keyword arguments {unknown}")
        from kernelize.hub.policy import backend_for

        model, self._path = _read_model(path_or_bytes)
        self._bytes = None if self._path is not None else bytes(path_or_bytes)
        inputs = [vi for vi in model.graph.input if vi.name not in _initializers(model)]
        self._inputs = _node_args(inputs)
        self._dtypes = [_np_dtype(vi.type.tensor_type.elem_type) for vi in inputs]
        self._outputs = _node_args(_with_output_shapes(model).graph.output)
        self._meta = ModelMetadata(
            model.producer_name,
            model.graph.name,
            model.domain,
            model.doc_string,
            model.graph.doc_string,
            int(model.model_version) if model.HasField("model_version") else UNSET_VERSION,
            {p.key: p.value for p in model.metadata_props},
        )
        self._dims = symbolic_dims(model)
        self._provider, self.device = _choose_device(providers)
        self.backend = backend or backend_for(self.device)
        self._threads = int(getattr(sess_options, "intra_op_num_threads", 0) or 0)
        self._lock = threading.Lock()
        # pins (None: the symbolic graph serves every shape) -> compiled graph, oldest first
        self._compiled: collections.OrderedDict[tuple | None, Any] = collections.OrderedDict()
        self._per_shape = False
        self._prepare()

    def _prepare(self) -> None:
        """Load and compile the symbolic graph; when a symbolic dim must have a size at load time, check that
        the model loads with pinned dims and compile per input signature from then on."""
        from kernelize.ir.errors import UnsupportedOpError

        try:
            graph = self._load(None)
        except UnsupportedOpError as symbolic_error:
            if not self._dims:
                raise
            try:
                self._load(pin_dims(self._dims, {}))
            except Exception as e:
                raise e from symbolic_error
            logger.info("%s: symbolic dims are pinned per input signature (%s)", self, symbolic_error)
            self._per_shape = True
            return
        self._compiled[None] = self._compile(graph)

    def _load(self, pins: Mapping[str, int] | None) -> Any:
        """``optimize(load_onnx(model, dynamic_dims=pins))``, through the optimized-graph cache for a path."""
        from kernelize.ir.onnx_frontend import load_onnx
        from kernelize.passes.optimize import optimize
        from kernelize.runtime.graph_cache import load_optimized_onnx

        if self._path is not None:
            return load_optimized_onnx(self._path, dynamic_dims=pins)
        return optimize(load_onnx(self._bytes, dynamic_dims=pins))

    def _compile(self, graph: Any) -> Any:
        from kernelize.runtime.compiled import compile_graph

        names = [n.arg for n in graph.inputs]
        assert names == [a.name for a in self._inputs], (names, self._inputs)
        return compile_graph(graph, self.backend, self.device)

    def _compiled_for(self, arrays: Sequence[np.ndarray]) -> Any:
        """The compiled graph for inputs ``arrays`` (in input order)."""
        if not self._per_shape:
            return self._compiled[None]
        pins = pin_dims(self._dims, {a.name: x.shape for a, x in zip(self._inputs, arrays)})
        key = tuple(sorted(pins.items()))
        with self._lock:
            cg = self._compiled.get(key)
            if cg is None:
                cg = self._compile(self._load(pins))
                self._compiled[key] = cg
                while len(self._compiled) > MAX_SHAPES:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        return cg

    def get_inputs(self) -> list[NodeArg]:
        """The graph inputs (initializers excluded), in the order the model declares them."""
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        """The graph outputs, in the order ``run(None, ...)`` returns them."""
        return list(self._outputs)

    def get_modelmeta(self) -> ModelMetadata:
        return self._meta

    def get_providers(self) -> list[str]:
        """The provider that runs the model, kernelize's name for it: ``["KernelizeCPUExecutionProvider"]``
        or ``["KernelizeCUDAExecutionProvider"]``."""
        return [f"Kernelize{self._provider}"]

    def run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None
    ) -> list[np.ndarray]:
        """Run the model on ``input_feed`` (input name -> numpy array); returns the outputs named in
        ``output_names``, in that order (``None`` or empty: all of them), as numpy arrays.

        Raises:
            ValueError: an unknown output name, an unknown or missing input, or an input whose dtype, rank
                or static size differs from the model's (the message names the input, expected and got).
        """
        wanted = self._output_indices(output_names)
        arrays = self._feed(input_feed)
        cg = self._compiled_for(arrays)
        tensors = [torch.from_numpy(x) for x in arrays]
        with _torch_threads(self._threads), torch.inference_mode():
            outs = cg(*[t.to(self.device) for t in tensors])
        return _to_numpy([outs[i] for i in wanted], tensors)

    def _output_indices(self, output_names: Sequence[str] | None) -> list[int]:
        names = [o.name for o in self._outputs]
        if not output_names:
            return list(range(len(names)))
        unknown = [n for n in output_names if n not in names]
        if unknown:
            raise ValueError(
                f"run(): output names {unknown} are not outputs of the model; its outputs: {names}"
            )
        return [names.index(n) for n in output_names]

    def _feed(self, input_feed: Mapping[str, Any]) -> list[np.ndarray]:
        """The inputs in the model's order, checked against its inputs and made contiguous and writable."""
        names = [a.name for a in self._inputs]
        missing = [n for n in names if n not in input_feed]
        unknown = [n for n in input_feed if n not in names]
        if missing or unknown:
            what = f"required inputs {missing} are missing" if missing else f"inputs {unknown} are unknown"
            raise ValueError(
                f"run(): {what} in input_feed (names {list(input_feed)}); the model's inputs: {names}"
            )
        return [_checked(a, dt, input_feed[a.name]) for a, dt in zip(self._inputs, self._dtypes)]

    def __repr__(self) -> str:
        where = str(self._path) if self._path is not None else f"<{len(self._bytes or b'')} bytes>"
        return f"InferenceSession({where!r}, backend={self.backend!r}, device={str(self.device)!r})"


def _initializers(model: onnx.ModelProto) -> set[str]:
    return {i.name for i in model.graph.initializer}


def _np_dtype(elem_type: int) -> np.dtype | None:
    """The numpy dtype of an ONNX element type (None for one numpy lacks)."""
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return None


def _checked(arg: NodeArg, want: np.dtype | None, value: Any) -> np.ndarray:
    """``value`` as a contiguous, writable array, after checking its dtype (``want``), rank and static sizes.

    Raises:
        ValueError: naming the input, what the model expects and what ``value`` is.
    """
    x = np.asarray(value)
    if want is not None and x.dtype != want:
        raise ValueError(f"input {arg.name!r}: expected {arg.type} (numpy {want}), got numpy {x.dtype}")
    if x.ndim != len(arg.shape):
        raise ValueError(
            f"input {arg.name!r}: expected rank {len(arg.shape)} (shape {arg.shape}), got rank {x.ndim} "
            f"(shape {list(x.shape)})"
        )
    wrong = [i for i, d in enumerate(arg.shape) if isinstance(d, int) and x.shape[i] != d]
    if wrong:
        raise ValueError(
            f"input {arg.name!r}: expected shape {arg.shape}, got {list(x.shape)} (axes {wrong} differ)"
        )
    # torch.from_numpy shares the memory: a read-only array is copied rather than exposed to writes
    return np.ascontiguousarray(x) if x.flags.writeable else np.array(x, order="C")


def _to_numpy(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The outputs as C-contiguous numpy arrays (as onnxruntime returns), each with memory of its own: one
    that is an input, or an output already returned, is copied."""
    seen = {t.data_ptr() for t in inputs if t.numel()}
    arrays = []
    for t in outs:
        t = t.detach().cpu()
        if t.numel() and t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        arrays.append(t.contiguous().numpy())
    return arrays
