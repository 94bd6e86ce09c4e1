# Two entry points from a fresh clone: `make demo` and `make test`. Both build .venv themselves.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_FLAGS ?= -n 2 -q

.PHONY: demo test test-slow lint bench clean gpu-check

$(STAMP): pyproject.toml
	python3 -m venv .venv
	# torch first and pinned: the CPU build lies on local disk; a bare `torch` would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[cuda,test]'
	command -v dot >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq graphviz >/dev/null)
	command -v aarch64-linux-gnu-g++ >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kernelize demo

test: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	$(PY) -m pytest $(PYTEST_FLAGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

bench: $(STAMP)
	$(PY) benchmarks/cpu_layers.py
	$(PY) benchmarks/model.py

# on a GPU machine: the CUDA tests and benchmarks/gpu_check.py with the torch installed there; elsewhere a no-op
gpu-check:
	bash benchmarks/gpu_check.sh $(ARGS)

clean:
	rm -rf .venv build *.egg-info
