"""Optimizer passes: pure ``Graph -> Graph`` functions written as (pattern, fn) rule tables.

Example:
    >>> from kernelize.passes import optimize, OptimizerSettings
    >>> optimize(graph, OptimizerSettings(affine=False))  # doctest: +SKIP
"""

from kernelize.passes.affine import affine
from kernelize.passes.clamp import clamp
from kernelize.passes.dce import dce
from kernelize.passes.fold import fold
from kernelize.passes.optimize import PIPELINE, OptimizerSettings, optimize
from kernelize.passes.recognize import recognize
from kernelize.passes.rewrite import RewriteLoopError, rewrite
from kernelize.passes.strength import strength

__all__ = [
    "PIPELINE",
    "OptimizerSettings",
    "RewriteLoopError",
    "affine",
    "clamp",
    "dce",
    "fold",
    "optimize",
    "recognize",
    "rewrite",
    "strength",
]
