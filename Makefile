# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) pipelines/arith/demo.py pipelines/arith/config.yaml

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider tests

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

clean:
	rm -rf $(VENV) runs
