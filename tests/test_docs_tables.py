"""The performance tables of README.md and docs/ are their JSON rendered (`benchmarks/report.py`).

The tampering tests work on a copy of the pages and results in a temporary folder, never on the real files.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def report_module():
    spec = importlib.util.spec_from_file_location("docs_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = report_module()


def checkout_copy(tmp_path: Path) -> Path:
    """README.md, docs/ and benchmarks/results/ copied under `tmp_path` (all that report.py reads)."""
    shutil.copy2(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    return tmp_path


def tamper(path: Path, marker: str) -> None:
    """Change the header row of the first table after `marker`."""
    text = path.read_text()
    row = text.index("\n| ", text.index(marker)) + 1
    path.write_text(text[:row] + "| tampered " + text[row + 1 :])


def test_every_table_equals_its_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--check"]) == 0, capsys.readouterr().out


def test_every_marked_table_has_a_renderer_and_every_page_is_seen() -> None:
    pages = report.pages(ROOT)
    assert ROOT / "README.md" in pages and ROOT / "docs" / "performance.md" in pages
    names = {m.group(2) for page in pages for m in report.MARKED.finditer(page.read_text())}
    assert "headline" in names and names - {"headline"} <= set(report.TABLES), names


def test_a_tampered_table_is_found_and_rewritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = checkout_copy(tmp_path)
    tamper(root / "docs" / "performance.md", "<!-- table: models.json:speed -->")
    tamper(root / "README.md", "<!-- table: headline -->")
    assert report.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "docs/performance.md: models.json:speed" in out and "README.md: headline" in out
    assert report.main(["--root", str(root)]) == 0  # rewrites them
    assert report.main(["--check", "--root", str(root)]) == 0
    for name in ("README.md", "docs/performance.md"):
        assert (root / name).read_text() == (ROOT / name).read_text()


def test_a_changed_json_is_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = checkout_copy(tmp_path)
    path = root / "benchmarks" / "results" / "models.json"
    result = json.loads(path.read_text())
    result["speed"][0]["decode_vs_eager"] += 1.0
    path.write_text(json.dumps(result))
    assert report.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "models.json:speed" in out and "README.md: headline" in out and "docs/models.md" in out


def test_a_table_without_its_json_keeps_its_text_and_names_the_command(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    old = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    page = f"x\n<!-- table: attention.json:kernel -->\n{old}<!-- end table -->\ny\n"
    new, changed = report.rewrite(page, results)
    note = f"{report.ABSENT} `python benchmarks/attention.py` writes benchmarks/results/attention.json.\n"
    assert changed == ["attention.json:kernel"] and new == page.replace(old, old + "\n" + note)
    assert report.rewrite(new, results) == (new, [])  # the note is not added twice


# records shaped as each benchmark script writes them (see its main), one row each
RECORDS = {
    "demo.json": {
        "config": {"hidden": 256, "layers": 4, "batch": 4, "seq": 256},
        "timings_ms": {"eager": 90.0, "kernelized": 45.0, "torch.compile": 60.0},
        "max_abs_diff": 1e-6,
    },
    "attention.json": {
        "dtype": "f32",
        "rows": [{"case": "c", "sdpa": 2e-3, "kernelize": 1e-3, "ratio": 2.0, "max_abs_err": 1e-7}],
    },
    "decode.json": {
        "gemv": [
            {"dtype": "f32", "weight_mb": 32, "rows": 1, "kernel_vs_sum": 1.3, "kernel_vs_linear": 2.5}
            | {f"{k}_{u}": 1.0 for k in ("kernel", "F.linear", "sum") for u in ("ms", "gbs")}
        ],
        "model": [
            {"family": "llama", "hidden": 512, "dtype": "float32", "batch": 1, "eager_tok_s": 50.0}
            | {"kernelized_tok_s": 100.0, "eager_vs_eager": 1.0, "kernelized_vs_eager": 2.0}
            | {"same_tokens_as_eager": {"eager": True, "kernelized": True}}
        ],
    },
    "onnx_models.json": {
        "rows": [
            {"model": "resnet50", "batch": 1, "kernelize_ms": 40.0, "onnxruntime_ms": 50.0, "eager_ms": 60.0}
            | {
                "ratio_vs_ort": 0.8,
                "ratio_vs_eager": 0.67,
                "rel_diff_vs_ort": 1e-6,
                "cold_s": 3.0,
                "warm_s": 0.3,
            }
        ],
        "summary": {"batch1": {"models": 1, "geomean_vs_ort": 0.8, "worst_vs_ort": 0.8}},
    },
}
SHOWN = {
    "demo.json:forward": "| LlamaDemo h256, 4 layers, batch 4 x seq 256 | 90.0 | 45.0 | 60.0 | 2.00x |",
    "attention.json:kernel": "| c | 2.000 | 1.000 | 2.00x | 1.0e-07 |",
    "decode.json:gemv": "| f32 | 32 | 1 | 1.00 | 1.0 | 1.00 | 1.0 | 1.00 | 1.0 | 1.30 | 2.50x |",
    "decode.json:model": "| llama h512 float32 | 1 | 50.0 | 100.0 | 2.00x | kernelized: yes |",
    "onnx_models.json:models": "| resnet50 | 1 | 40.0 | 50.0 | **0.80** | 0.67 | 1.0e-06 | 3.0 / 0.30 |",
}
HEADLINE = {
    "Demo decoder, forward (`make demo`)": "2.00x eager, 1.33x `torch.compile`",
    "Attention kernel": "2.00x SDPA (f32)",
    "Decode matmuls": "few-row matmul 2.50x `F.linear`",
    "Decode, transformers models": "2.00x eager tokens/s",
    "ONNX models": "kernelize / onnxruntime time, geomean: batch 1 (1 model): 0.80 (worst 0.80)",
    "Training": "not in benchmarks/results yet",
}


def test_renderers_read_what_the_benchmarks_write(tmp_path: Path) -> None:
    for name, record in RECORDS.items():
        (tmp_path / name).write_text(json.dumps(record))
    page = "".join(f"<!-- table: {name} -->\n<!-- end table -->\n" for name in [*SHOWN, "headline"])
    new, _ = report.rewrite(page, tmp_path)
    for name, row in SHOWN.items():
        assert row in new, (name, new)
    for label, figure in HEADLINE.items():
        assert f"| {label} | {figure} |" in new, (label, new)


def test_a_json_without_the_part_a_table_needs_counts_as_absent(tmp_path: Path) -> None:
    (tmp_path / "decode.json").write_text(json.dumps({"gemv": RECORDS["decode.json"]["gemv"]}))
    new, _ = report.rewrite("<!-- table: decode.json:model -->\n<!-- end table -->\n", tmp_path)
    assert "`python benchmarks/decode.py` writes benchmarks/results/decode.json (its `model` part)" in new
