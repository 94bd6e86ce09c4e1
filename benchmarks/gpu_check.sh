#!/usr/bin/env bash
# `make gpu-check`: on a machine with an NVIDIA GPU, every @pytest.mark.cuda test, then benchmarks/gpu_check.py
# (hub layers through Triton and NVRTC vs eager, attention vs SDPA, a ~1 B Llama's prefill and decode, a
# training step; JSON in benchmarks/results/gpu/). It uses the torch already installed there (the GPU
# machine has no network) with this checkout's code. Without a usable GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
has_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && has_gpu .venv/bin/python; then PY=.venv/bin/python; fi
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! has_gpu "$PY"; then
  echo "gpu-check: no NVIDIA GPU usable by $PY's torch here: nothing to run"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# compiled Triton: the test conftests default to the interpreter (for the CPU-tensor tests) unless it is set
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
rc=0
# only the files that hold cuda tests: collecting the whole suite costs time and imports what the GPU
# machine may lack (the test extras)
mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests)
timeout 240 "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs "${files[@]}" || rc=1
timeout 300 "$PY" benchmarks/gpu_check.py "$@" || rc=1
exit $rc
