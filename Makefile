# Two entry points from a fresh clone: `make demo` and `make test`. Both build .venv themselves.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_FLAGS ?= -n 2 -q

.PHONY: demo test test-compat test-slow lint bench docs clean gpu-check

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

# The suite against the newest torch and transformers the package index serves, in a venv of its own (a CUDA
# torch wheel, several GB). The first install lifts any site-wide pip constraint so that nothing caps the
# newest; the pins it writes are the constraint after it, so nothing downgrades them. kernelize's own
# requirements (runtime, cuda and test extras) go in without its torch and transformers bounds: those state
# the range this target and `make test` prove, and must not hold back the versions being tried.
COMPAT  := .venv-compat
COMPAT_REQS := import importlib.metadata as m, re; print(*( \
	r.split(";")[0] if "extra ==" in r else r for r in m.requires("kernelize") \
	if re.match(r"[\w.-]+", r)[0] not in ("torch", "transformers") \
	and ("extra ==" not in r or r.endswith(("\"cuda\"", "\"test\"")))), sep="\n")

test-compat:
	python3 -m venv $(COMPAT)
	PIP_CONSTRAINT=/dev/null $(COMPAT)/bin/pip install -q -U torch transformers
	$(COMPAT)/bin/pip freeze | grep -E '^(torch|transformers)==' > $(COMPAT)/pins.txt
	PIP_CONSTRAINT=$(COMPAT)/pins.txt $(COMPAT)/bin/pip install -q --no-deps -e .
	$(COMPAT)/bin/python -c '$(COMPAT_REQS)' > $(COMPAT)/requirements.txt
	PIP_CONSTRAINT=$(COMPAT)/pins.txt $(COMPAT)/bin/pip install -q -r $(COMPAT)/requirements.txt
	$(COMPAT)/bin/python -c 'import sys, torch, transformers; print("python", sys.version.split()[0], \
		"torch", torch.__version__, "transformers", transformers.__version__)'
	$(COMPAT)/bin/python -m pytest $(PYTEST_FLAGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

bench: $(STAMP)
	$(PY) benchmarks/cpu_layers.py
	$(PY) benchmarks/model.py --out benchmarks/results
	$(PY) benchmarks/report.py

# the performance tables of README.md and docs/, rendered from benchmarks/results/*.json
docs: $(STAMP)
	$(PY) benchmarks/report.py

# on a GPU machine: the CUDA tests and benchmarks/gpu_check.py with the torch installed there; elsewhere a no-op
gpu-check:
	bash benchmarks/gpu_check.sh $(ARGS)

clean:
	rm -rf .venv build *.egg-info
