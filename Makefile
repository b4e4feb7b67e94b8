# taco_jax — `make train` (main job) and `make test` (test suite) each set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
OUT    ?= runs/compare

.PHONY: ffi install train test test-slow lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## The C++ XLA FFI codec library (no-op when up to date).
ffi: $(STAMP)
	$(MAKE) --no-print-directory -C custom_calls PYTHON=$(abspath $(PY))

install: ffi

## Main job: GPT on Shakespeare, --comm none vs --comm taco on a simulated data=2 × tensor=4 CPU mesh.
train: install
	$(VENV)/bin/taco-jax compare --out $(OUT) $(ARGS)

## Default test suite (simulated 8-device CPU mesh; slow and GPU tests excluded).
test: install
	$(PY) -m pytest -q

## Heavier tests (marked `slow`).
test-slow: install
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check taco_jax tests experiments

clean:
	rm -rf $(VENV) runs build *.egg-info
