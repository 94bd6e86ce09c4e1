"""Shared test setup: a bounded hypothesis profile and a deterministic torch seed for every test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

# bounded so the whole suite stays fast on 2 cores; tests may lower max_examples further
settings.register_profile("ci", max_examples=25, deadline=None)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same torch RNG state, so random inputs are reproducible."""
    torch.manual_seed(0)
    yield
