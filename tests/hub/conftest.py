"""Shared fixtures for the bundled hub tests: the hub packages, loaded the way users load them."""

from __future__ import annotations

import types

import pytest

from kernelize import get_kernel

REPOS = ("activation", "layer_norm", "rotary", "softmax", "linear", "attention")


@pytest.fixture(scope="session")
def hub_pkg() -> dict[str, types.ModuleType]:
    """`{repo: layers module}` of every bundled repository, loaded with `get_kernel("kernelize/<repo>")`."""
    return {name: get_kernel(f"kernelize/{name}", version=1).layers for name in REPOS}
