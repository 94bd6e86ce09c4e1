"""`kernelize demo --quick`: the table of substitutions, the diff against eager, timings and the SVG."""

from __future__ import annotations

import json

from kernelize.cli import main
from kernelize.models.llama_demo import MARKED_LAYERS


def test_demo_quick(tmp_path, capsys) -> None:
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for column in ("module", "layer", "repo", "backend", "kernels"):
        assert column in printed
    for layer in MARKED_LAYERS.values():
        assert layer in printed
    assert "kernelize/layer_norm" in printed and "kernelize/attention" in printed
    assert "max |kernelized - eager|" in printed and "speedup" in printed

    result = json.loads((tmp_path / "demo.json").read_text())
    rows = result["substitutions"]
    assert rows and all(r["backend"] == "cpu" and r["kernels"] not in ("-", "") for r in rows), rows
    assert result["max_abs_diff"] < 1e-3 * max(1.0, result["max_abs_logit"])
    assert set(result["timings_ms"]) == {"eager", "kernelized", "torch.compile"}
    assert all(v > 0 for v in result["timings_ms"].values())
    svg = (tmp_path / result["svg"].rsplit("/", 1)[-1]).read_text()
    assert svg.lstrip().startswith(("<?xml", "<svg")) and "</svg>" in svg
