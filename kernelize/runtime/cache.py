"""In-memory caches: compiled graphs per (graph fingerprint, backend, device), compiled kernels per
(source hash, target).

Triton and NVRTC keep their own disk caches underneath; these maps only save the Python-side work
(planning, rendering, loading) when the same layer signature is compiled again in one process.

Example:
    >>> key = graph_fingerprint(graph)  # doctest: +SKIP
    >>> GRAPHS.get((key, "triton", "cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from kernelize.ir.graph import Constant, Graph

T = TypeVar("T")


def graph_fingerprint(graph: Graph) -> str:
    """A content hash of ``graph``: ops, dtypes, shapes, edges, arguments (constants by digest), I/O."""
    h = hashlib.sha256()
    for i, n in enumerate(graph.nodes):
        arg = n.arg.digest if isinstance(n.arg, Constant) else repr(n.arg)
        src = ",".join(str(graph.index(s)) for s in n.src)
        h.update(f"{i}:{n.op}:{n.dtype}:{n.shape}:{src}:{arg};".encode())
    h.update(("in:" + ",".join(str(graph.index(n)) for n in graph.inputs)).encode())
    h.update(("out:" + ",".join(str(graph.index(n)) for n in graph.outputs)).encode())
    return h.hexdigest()[:24]


class Cache(Generic[T]):
    """A thread-safe memo: ``get_or_build(key, build)`` builds once per key.

    With ``weak=True`` it holds its values weakly: a value nobody else references is freed (and built
    again when asked for), so the memo never pins memory by itself.
    """

    def __init__(self, weak: bool = False) -> None:
        self._items: dict[Hashable, T] | weakref.WeakValueDictionary = (
            weakref.WeakValueDictionary() if weak else {}
        )
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> T | None:
        return self._items.get(key)

    def get_or_build(self, key: Hashable, build: Callable[[], T]) -> T:
        with self._lock:
            value = self._items.get(key)  # one lookup: a weak value may vanish between two
            if value is not None:
                self.hits += 1
                return value
        value = build()  # outside the lock: builds may compile for seconds
        with self._lock:
            self.misses += 1
            return self._items.setdefault(key, value)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)


# (graph fingerprint, backend name, device string) -> CompiledGraph, held weakly: a graph's constants can be
# hundreds of MiB, and callers (hub entries, modules) keep the graphs they use alive themselves
GRAPHS: Cache = Cache(weak=True)
# (source hash, target) -> backend-specific loaded kernel
KERNELS: Cache = Cache()

__all__ = ["GRAPHS", "KERNELS", "Cache", "graph_fingerprint"]
