"""`make gpu-check` is ready before a GPU is: its script is a clean no-op here, and every section of
benchmarks/gpu_check.py runs on the CPU (the same code the GPU runs, with `--device cpu`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_is_a_clean_no_op_without_a_gpu() -> None:
    if torch.cuda.is_available():
        return  # on a GPU machine `make gpu-check` is the real run, not this test's business
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode == 0 and "nothing to run" in done.stdout, done.stdout + done.stderr


def test_every_section_runs_on_the_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    argv = ["--device", "cpu", "--quick", "--repeat", "1", "--out", str(tmp_path)]
    assert gpu_check.main(argv) == 0
    for name in gpu_check.SECTIONS:
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["ok"] and record["device"] == "cpu", record
    assert json.loads((tmp_path / "llm.json").read_text())["same_tokens"]
