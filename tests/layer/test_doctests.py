"""The `Example:` sections of kernelize.layer run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "decorators",
    "device",
    "hub",
    "importer",
    "kernelize",
    "lockfile",
    "mapping",
    "mode",
    "record",
    "repos",
    "validate",
    "variants",
]


@pytest.mark.parametrize("name", MODULES)
def test_examples(name: str) -> None:
    module = importlib.import_module(f"kernelize.layer.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0, f"kernelize.layer.{name} has no examples"
