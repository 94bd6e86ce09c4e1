"""A disk cache of optimized ONNX graphs, so a warm start skips ``load_onnx`` and ``optimize``.

Loading and optimizing a transformer's ONNX file is most of a warm start once the kernels are cached:
parsing and checking the protobuf, copying 86-110M parameters into tensors, hashing every constant and
folding the weights (measured on BERT-base: 5.5 s load + 4.9 s optimize, against 0.4 s to plan and 0.2 s
to load the cached kernels). :func:`load_optimized_onnx` keys the optimized graph on the sha256 of the
model file, the load and optimizer settings, the versions of torch and onnx and the source of the loader
and passes, and keeps it in the checked kernel cache folder (``runtime.diskcache``) as one
``torch.save`` file: a JSON description of the nodes and the constant tensors with their digests, read back
with ``torch.load(weights_only=True)`` (no pickled objects). A graph whose node arguments have a type the
description does not know is simply not cached.

Example:
    >>> g = load_optimized_onnx("model.onnx", dynamic_dims={"batch": "batch"})  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import mmap
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from kernelize.ir import ops
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Constant, Graph, Node, Op
from kernelize.ir.shapes import Sym
from kernelize.runtime.cache import graph_fingerprint
from kernelize.runtime.diskcache import cached, file_identity, get_or_build, racy, remembered_sha256

logger = logging.getLogger(__name__)

FORMAT = "kernelize-optimized-graph 1"  # bump when the description below changes
# the only classes a description may name: anything else makes a graph uncacheable
ENUMS: dict[str, type[Enum]] = {"Op": Op, "DType": DType}
DATACLASSES: dict[str, type] = {c.__name__: c for c in (Sym, *ops.TYPED_ARGS)}
# the modules whose source decides what an optimized graph looks like
SOURCE_FOLDERS = ("ir", "passes")


class UncacheableGraph(ValueError):
    """A node argument the graph description cannot hold (the graph is then loaded without the cache)."""


def encode(x: Any, consts: list[Constant]) -> Any:
    """``x`` (a node argument or dim) as JSON data; constants are appended to ``consts`` and referenced by
    position. Floats are kept as ``repr`` strings so inf, nan and every bit of the value survive."""
    t = type(x)
    if x is None or t in (bool, int, str):
        return x
    if t is float:
        return {"f": repr(x)}
    if t is Constant:
        consts.append(x)
        return {"c": len(consts) - 1}
    if t in (tuple, list):
        return {"t" if t is tuple else "l": [encode(v, consts) for v in x]}
    if isinstance(x, Enum) and ENUMS.get(t.__name__) is t:
        return {"e": [t.__name__, x.value]}
    if dataclasses.is_dataclass(x) and DATACLASSES.get(t.__name__) is t:
        fields = {f.name: encode(getattr(x, f.name), consts) for f in dataclasses.fields(x)}
        return {"d": [t.__name__, fields]}
    raise UncacheableGraph(f"a node argument of type {t.__qualname__} has no graph description")


def decode(x: Any, consts: list[Constant]) -> Any:
    """The inverse of :func:`encode`."""
    if not isinstance(x, dict):
        return x
    ((kind, v),) = x.items()
    if kind == "f":
        return float(v)
    if kind == "c":
        return consts[v]
    if kind in ("t", "l"):
        items = [decode(i, consts) for i in v]
        return tuple(items) if kind == "t" else items
    if kind == "e":
        return ENUMS[v[0]](v[1])
    if kind == "d":
        return DATACLASSES[v[0]](**{k: decode(f, consts) for k, f in v[1].items()})
    raise ValueError(f"graph description: unknown entry {kind!r}")


def graph_state(graph: Graph) -> dict[str, Any]:
    """``graph`` as ``{"format", "graph" (JSON text), "digests", "tensors"}`` for ``torch.save``.

    Raises:
        UncacheableGraph: a node argument of a type the description does not know.
    """
    consts: list[Constant] = []
    nodes = [
        [
            n.op.value,
            n.dtype.value,
            [encode(d, consts) for d in n.shape],
            [graph.index(s) for s in n.src],
            encode(n.arg, consts),
        ]
        for n in graph.nodes
    ]
    io = {
        "inputs": [graph.index(n) for n in graph.inputs],
        "outputs": [graph.index(n) for n in graph.outputs],
    }
    return {
        "format": FORMAT,
        "graph": json.dumps({"nodes": nodes, **io}),
        "digests": [c.digest for c in consts],
        "tensors": [_alone(c.tensor) for c in consts],
    }


def _alone(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it views part of a larger buffer (``torch.save`` would write the whole buffer)."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def graph_from_state(state: Mapping[str, Any]) -> Graph:
    """The graph :func:`graph_state` described; constants keep their recorded digests (not rehashed)."""
    if state.get("format") != FORMAT:
        raise ValueError(f"graph description format {state.get('format')!r}, expected {FORMAT!r}")
    desc = json.loads(state["graph"])
    consts = [Constant.known(t, d) for t, d in zip(state["tensors"], state["digests"], strict=True)]
    g = Graph()
    nodes: list[Node] = []
    for op, dtype, shape, src, arg in desc["nodes"]:
        dims = tuple(decode(d, consts) for d in shape)
        nodes.append(g.push(Op(op), DType(dtype), dims, [nodes[i] for i in src], decode(arg, consts)))
    g.inputs.extend(nodes[i] for i in desc["inputs"])
    g.output(*(nodes[i] for i in desc["outputs"]))
    return g


def _may_use_external_data(path: Path) -> bool:
    """Whether the protobuf may reference external data: the key ``location`` of an external-data entry
    appears in its bytes (weight bytes that happen to spell it only cost the caching)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(b"location") >= 0


def _key(digest: str, dynamic_dims: Mapping[str, int | str] | None, limit: int, settings: Any) -> tuple:
    import onnx

    dims = json.dumps(sorted((str(k), v) for k, v in (dynamic_dims or {}).items()))
    return (
        FORMAT,
        digest,
        dims,
        str(limit),
        repr(settings),
        _source_digest(),
        torch.__version__,
        onnx.__version__,
    )


@functools.cache
def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def load_optimized_onnx(
    path: str | os.PathLike,
    *,
    dynamic_dims: Mapping[str, int | str] | None = None,
    fold_limit: int | None = None,
    settings: Any = None,
    loaded: Graph | None = None,
) -> Graph:
    """``optimize(load_onnx(path, ...), settings)``, read from the disk cache when this exact model file
    was loaded with the same arguments before (by this version of kernelize, torch and onnx).

    A model whose bytes may name external data files is not cached (their content is not part of the key).
    The cached tensors are memory-mapped from the entry (copy-on-write), so a warm start reads each weight
    page once, when it is first used. The model file's sha256 is remembered per file identity
    (``diskcache.remembered_sha256``): an unchanged file is not hashed again, and a file not seen before is
    hashed beside the front end (hashlib lets go of the GIL) while the CPU runtime's fixed libraries build
    (:func:`_warm_cpu_libraries`). On a miss the graph is returned at once and the entry written by a
    background thread (saving and hashing a transformer's 330-440 MB of weights took ~1 s of a cold start);
    the process waits for it at exit, and :func:`wait_for_cache_writes` waits for it sooner.

    ``loaded``: the graph ``load_onnx(path, dynamic_dims=..., fold_limit=...)`` returned, when the caller
    has it already (``kernelize run`` loads it for the reference executor): a miss optimizes it instead of
    loading the model again.

    Example:
        >>> g = load_optimized_onnx("model.onnx", dynamic_dims={"batch": 8})  # doctest: +SKIP
    """
    from kernelize.ir.onnx_context import fold_limit as fold_limit_bytes
    from kernelize.ir.onnx_frontend import load_onnx
    from kernelize.passes.optimize import optimize

    def fresh() -> Graph:
        raw = loaded or load_onnx(path, dynamic_dims=dynamic_dims, fold_limit=fold_limit)
        return optimize(raw, settings)

    try:
        ident, digest = _identify(Path(path))
        limit = fold_limit_bytes(fold_limit)
    except (OSError, ValueError):
        return fresh()  # load_onnx names the problem
    if digest is None:  # a file not loaded before (a first start)
        hashing = _HASHING.submit(remembered_sha256, Path(path))
        _warm_cpu_libraries()
        graph = fresh()
        try:
            key = _key(hashing.result(), dynamic_dims, limit, settings)
        except OSError:
            return graph
        if cached(key, SUFFIX) is not None:  # the same bytes under another name: this entry is there
            return graph
    else:
        key = _key(digest, dynamic_dims, limit, settings)
        _wait_for(key)  # a write of this entry still under way in this process
        entry = cached(key, SUFFIX)
        if entry is not None:
            return graph_from_state(torch.load(entry, weights_only=True, mmap=True))
        _warm_cpu_libraries()
        graph = fresh()
    _start_write(key, graph, Path(path), ident)
    return graph


def _identify(path: Path) -> tuple[tuple, str | None]:
    """The file's identity and its remembered sha256 (None: not loaded before). A file just written is never
    remembered (``diskcache.RACY_SECONDS``): it is hashed now, as any repeat load of it will be."""
    ident = file_identity(path)
    return ident, remembered_sha256(path, compute=racy(ident))


def _start_write(key: tuple, graph: Graph, path: Path, ident: tuple) -> None:
    """Write ``graph``'s entry from a background thread (:func:`_write`), which :func:`_wait_for` finds."""
    writer = threading.Thread(target=_write, args=(key, graph, path, ident), name="kernelize-graph-cache")
    with _WRITES_LOCK:
        _WRITES[key] = writer
    writer.start()


SUFFIX = ".graph.pt"
_HASHING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kernelize-model-hash")


def _warm_cpu_libraries() -> None:
    """Start building the CPU runtime's fixed libraries (:func:`cpu_backend.warm_libraries`) unless there is
    no C++ compiler (the backend says so when it is used)."""
    from kernelize.codegen import cpu_build
    from kernelize.codegen.cpu_backend import warm_libraries

    try:
        cpu_build.compiler()
    except cpu_build.CompilerNotFoundError:
        return
    warm_libraries()


_WRITES: dict[tuple, threading.Thread] = {}  # entries being written by this process
_WRITES_LOCK = threading.Lock()


def _write(key: tuple, graph: Graph, path: Path, ident: tuple) -> None:
    """Write ``graph``'s cache entry (in the background: nothing waits for it but the next load of it),
    unless the model file is no longer the one (``ident``) whose digest is in ``key``."""

    def build(tmp: Path) -> None:
        if file_identity(path) != ident:
            raise UncacheableGraph("the file changed while it was loaded")
        if _may_use_external_data(path):
            raise UncacheableGraph("it may read external data files, whose content is not in the key")
        state = graph_state(graph)  # raises UncacheableGraph: nothing is written
        if graph_fingerprint(graph_from_state(state)) != graph_fingerprint(graph):
            raise UncacheableGraph("the graph description does not round-trip")
        torch.save(state, tmp)

    try:
        get_or_build(key, build, SUFFIX)
    except UncacheableGraph as e:
        logger.info("optimized graph of %s not cached: %s", path, e)
    except Exception:  # a failed write only costs the next start the load: never the caller's problem
        logger.warning("optimized graph of %s not cached", path, exc_info=True)
    finally:
        with _WRITES_LOCK:
            if _WRITES.get(key) is threading.current_thread():
                del _WRITES[key]


def _wait_for(key: tuple) -> None:
    with _WRITES_LOCK:
        writer = _WRITES.get(key)
    if writer is not None:
        writer.join()


def wait_for_cache_writes() -> None:
    """Wait until the cache entries :func:`load_optimized_onnx` is writing in the background are written.

    Example:
        >>> g = load_optimized_onnx("model.onnx")  # doctest: +SKIP
        >>> wait_for_cache_writes()  # the entry is on disk now  # doctest: +SKIP
    """
    with _WRITES_LOCK:
        writers = list(_WRITES.values())
    for writer in writers:
        writer.join()


__all__ = [
    "FORMAT",
    "UncacheableGraph",
    "decode",
    "encode",
    "graph_from_state",
    "graph_state",
    "load_optimized_onnx",
    "wait_for_cache_writes",
]
