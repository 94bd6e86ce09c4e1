"""The aten op table the torch front end reads: ``ATEN[op](tracer, *args, **kwargs) -> value``.

The handlers live in :mod:`kernelize.ir.torch_ops` (elementwise, casts, indexing) and
:mod:`kernelize.ir.torch_ops_layers` (layout, reductions, norms, matmul, conv, pool); both register here
with :func:`handles`, so neither imports the other's internals.

Example:
    >>> @handles(torch.ops.aten.relu.default)  # doctest: +SKIP
    ... def _relu(t, x): return t.g.relu(x)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Handler = Callable[..., Any]
ATEN: dict[Any, Handler] = {}


class Lazy:
    """A secondary result of a multi-output op (e.g. layer norm's mean), built only if something reads it."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build = build

    def __call__(self) -> Any:
        return self.build()


def handles(*ops: Any) -> Callable[[Handler], Handler]:
    """Decorator: register the handler for each of ``ops``."""

    def register(fn: Handler) -> Handler:
        for op in ops:
            ATEN[op] = fn
        return fn

    return register


__all__ = ["ATEN", "Handler", "Lazy", "handles"]
