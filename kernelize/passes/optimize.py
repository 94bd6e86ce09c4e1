"""The optimizer: a fixed pipeline of pure passes, each switchable in :class:`OptimizerSettings`.

Example:
    >>> g = trace(RMSNorm(64), torch.randn(2, 64))  # doctest: +SKIP
    >>> ir.op_counts(optimize(g))  # doctest: +SKIP
    Counter({'input': 1, 'const': 1, 'rmsnorm': 1})
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields

from kernelize.ir.graph import Graph
from kernelize.ir.verify import verify
from kernelize.passes.affine import affine
from kernelize.passes.clamp import clamp
from kernelize.passes.conv_matmul import conv_matmul
from kernelize.passes.conv_pad import conv_pad
from kernelize.passes.dce import dce
from kernelize.passes.fold import fold
from kernelize.passes.recognize import recognize
from kernelize.passes.router import router
from kernelize.passes.strength import strength

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerSettings:
    """Which passes ``optimize`` runs (all by default).

    Attributes:
        dce: drop nodes no output needs.
        fold: constant folding and layout/cast simplification.
        recognize: layernorm / rmsnorm / softmax / log_softmax / gelu from their templates.
        router: mixture-of-experts routers (score, top-k, renormalisation, cast) into ``route`` nodes.
        strength: division by constants into multiplication, small powers into multiplications.
        clamp: relu / min / max chains into one clamp.
        affine: scale/bias chains (and batch norm) into one scale+bias, and into conv/matmul weights.
        conv_pad: zero padding before a conv into the conv's own padding.
        conv_matmul: 1x1 convs of a 1x1 image (squeeze-and-excite) into matmuls.
        verify: run ``verify`` after every pass (slower; for tests and debugging).
    """

    dce: bool = True
    fold: bool = True
    recognize: bool = True
    router: bool = True
    strength: bool = True
    clamp: bool = True
    affine: bool = True
    conv_pad: bool = True
    conv_matmul: bool = True
    verify: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"OptimizerSettings.{f.name} must be a bool, got {getattr(self, f.name)!r}")


# (setting, pass) in the order they run: recognition sees the templates before strength reduction and affine
# fusion reshape their constants; folding runs again to settle constants the later passes combined
PIPELINE: tuple[tuple[str, Callable[[Graph], Graph]], ...] = (
    ("dce", dce),
    ("fold", fold),
    ("recognize", recognize),
    ("router", router),
    ("strength", strength),
    ("clamp", clamp),
    ("affine", affine),
    ("conv_pad", conv_pad),
    ("conv_matmul", conv_matmul),
    ("fold", fold),
    ("dce", dce),
)


def optimize(graph: Graph, settings: OptimizerSettings | None = None) -> Graph:
    """Run the enabled passes over ``graph``; returns a new graph with the same inputs and outputs.

    Example:
        >>> optimize(g, OptimizerSettings(affine=False))  # doctest: +SKIP
    """
    settings = settings or OptimizerSettings()
    if settings.verify:
        verify(graph)
    for name, run in PIPELINE:
        if not getattr(settings, name):
            continue
        before = len(graph)
        graph = run(graph)
        logger.debug("pass %s: %d -> %d nodes", name, before, len(graph))
        if settings.verify:
            verify(graph)
    return graph


__all__ = ["PIPELINE", "OptimizerSettings", "optimize"]
