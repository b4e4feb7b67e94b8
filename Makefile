# taco_jax — `make train` (main job) and `make test` (test suite) each set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
OUT    ?= runs/compare

.PHONY: install train test test-slow lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## Main job: GPT on Shakespeare, --comm none vs --comm taco on a simulated data=2 × tensor=4 CPU mesh.
train: $(STAMP)
	$(VENV)/bin/taco-jax compare --out $(OUT) $(ARGS)

## Default test suite (simulated 8-device CPU mesh; slow and GPU tests excluded).
test: $(STAMP)
	$(PY) -m pytest -q

## Heavier tests (marked `slow`).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check taco_jax tests experiments

clean:
	rm -rf $(VENV) runs build *.egg-info
