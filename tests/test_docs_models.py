"""docs/models.md is generated from benchmarks/results/models.json: the page and the JSON never disagree."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "models.json"


def models_benchmark():
    spec = importlib.util.spec_from_file_location("models_benchmark", ROOT / "benchmarks" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_models_page_is_the_json_rendered() -> None:
    if not RESULTS.exists():
        pytest.skip(
            "benchmarks/results/models.json is absent: run python benchmarks/models.py --sweep --docs"
        )
    bench = models_benchmark()
    page = (ROOT / "docs" / "models.md").read_text()
    assert page == bench.docs_page(json.loads(RESULTS.read_text())), (
        "docs/models.md differs from benchmarks/results/models.json: regenerate it with "
        "python benchmarks/models.py --docs"
    )


def test_the_coverage_list_names_at_least_40_families_and_the_required_ones() -> None:
    bench = models_benchmark()
    required = {"llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "gemma2", "gemma3_text", "phi", "phi3"}
    required |= {"gpt2", "gpt_neox", "falcon", "opt", "bloom", "stablelm", "cohere2", "olmo2", "granite"}
    required |= {"smollm3", "starcoder2", "gpt_oss", "mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "glm4"}
    assert required <= set(bench.TARGET_FAMILIES) and len(set(bench.TARGET_FAMILIES)) >= 40
