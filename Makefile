# taco_jax — `make train` (main job) and `make test` (test suite) each set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SIM    := $(VENV)/.gpu-sim
OUT    ?= runs/compare

.PHONY: ffi cuda gpu-sim gpu-compile install train test test-fast test-gpu-sim bench bench-e2e bench-e2e-link fidelity fidelity-long lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## The C++ XLA FFI codec library (no-op when up to date).
ffi: $(STAMP)
	$(MAKE) --no-print-directory -C custom_calls PYTHON=$(abspath $(PY))

install: ffi

## The CUDA FFI library, whenever nvcc is present (here a compile check: it runs only on a GPU).
cuda: $(STAMP)
	@if command -v nvcc > /dev/null; then \
	  $(MAKE) --no-print-directory -C custom_calls cuda PYTHON=$(abspath $(PY)); \
	else echo "nvcc not found: CUDA FFI library not built"; fi

## CPU torch + triton for the Triton interpreter test (the `gpu-sim` extra; ~30 s from the local wheel),
## and transformers for the Hugging Face cross-check (the `hf` extra: transformers loads our export).
## Where no CPU torch wheel exists for this Python, those tests skip (named reason) instead of failing.
gpu-sim: $(SIM)
$(SIM): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,gpu-sim,hf]' \
	  || echo "gpu-sim/hf extras not installed (no torch 2.13.0+cpu wheel for this Python): their tests skip"
	touch $(SIM)

## XLA's CUDA plugin and ptxas for `plan --compiler gpu` (the `gpu-compile` extra, at jaxlib's version), beside the
## venv rather than in it: the suite's jax stays the CPU-only install, and only the tests of the deviceless compile
## (tests/test_deviceless.py) put it on their child processes' path. Users: pip install -e '.[gpu-compile]'.
GPUC := $(VENV)/gpu-compile
gpu-compile: $(GPUC)/.installed $(GPUC)/.jax-triton
$(GPUC)/.installed: $(STAMP)
	v=$$($(PY) -c "import jaxlib; print(jaxlib.__version__)"); \
	$(PY) -m pip install --quiet --target $(GPUC) --no-deps "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" \
	  nvidia-cuda-nvcc-cu12 || echo "the CUDA plugin $$v was not installed: tests/test_deviceless.py's compile skips"
	touch $@
## jax-triton for the Triton codec in the CUDA train step (tests/test_gpu_step.py): pure Python, --no-deps (its
## triton is the gpu-sim extra's, whose wheel ships the ptxas it compiles the kernels with); a stamp of its own so
## that a gpu-compile folder made before it gets it too. Pinned: triton_codec wraps its CUDA lowering.
$(GPUC)/.jax-triton: $(GPUC)/.installed
	$(PY) -m pip install --quiet --target $(GPUC) --no-deps "jax-triton==0.3.1" \
	  || echo "jax-triton was not installed: tests/test_gpu_step.py's Triton backend skips"
	touch $@

## Main job: GPT on Shakespeare, --comm none vs --comm taco on a simulated data=2 × tensor=4 CPU mesh.
## A second `make train` replaces the previous one's outputs in $(OUT) (none/, taco/, summary.json,
## loss.png; other files stay); OUT=DIR writes elsewhere. `taco-jax compare` itself never overwrites.
COMPARE_OUTPUTS := none taco summary.json loss.png
train: install
	@if [ -n "$(strip $(foreach f,$(COMPARE_OUTPUTS),$(wildcard $(OUT)/$(f))))" ]; then \
	  echo "make train: replacing the previous run in $(OUT) (give OUT=DIR to keep it)"; \
	  rm -rf $(foreach f,$(COMPARE_OUTPUTS),"$(OUT)/$(f)"); fi
	$(VENV)/bin/taco-jax compare --out $(OUT) $(ARGS)

## The whole test suite: everything that runs here (simulated 8-device CPU mesh; real processes, network
## namespaces and notebooks included; `gpu` tests excluded), the GPU path checked on CPU (Triton interpreter,
## CUDA export, CUDA FFI build, gpu_check.sh --dry-run). 2 workers, one line per file, the time at the end.
## Which command when: docs/development.md.
TEST_ARGS ?=
PYTEST    := $(PY) -m pytest -q --per-file -n 2 --dist loadfile --no-loadscope-reorder
test: install gpu-sim cuda gpu-compile
	$(PYTEST) --durations=15 $(TEST_ARGS)

## The inner loop: in-process tests only (marker `fast`: no child processes, namespaces, notebooks or `slow`).
test-fast: install gpu-sim
	$(PYTEST) -m fast $(TEST_ARGS)

## Only the CPU checks of the GPU path (docs/results.md "GPU path").
test-gpu-sim: install gpu-sim cuda
	$(PY) -m pytest -q tests/test_triton_interpret.py tests/test_gpu_export.py tests/test_gpu_check.py

## The collective benchmark as docs/results.md "Every compressed collective, measured" runs it (2 processes over
## gloo, taco vs exact, 64 KB to 64 MB per rank, 9 interleaved rounds): JSON, PNG and
## Markdown in $(BENCH_OUT). Other options: BENCH_ARGS (python -m experiments.collectives.bench_collectives --help).
BENCH_OUT  ?= runs/bench_collectives
BENCH_ARGS ?= --transports gloo --ranks 2 --codecs none,taco --backends ffi --dtypes float32 \
              --sizes 64K,1M,4M,16M,64M --runs 9 --variants 'two_shot,one_shot,hd:algorithm=two_shot:reduce_domain=hadamard'
bench: install
	$(PY) -m experiments.collectives.bench_collectives --out $(BENCH_OUT) $(BENCH_ARGS)

## The fidelity study as docs/fidelity.md "Convergence" runs it (paired seeds, none vs taco vs int8 on gpt2-tiny and
## qwen3-tiny, 60 steps, 8 seeds): summary JSON, Markdown and plot in $(FIDELITY_OUT).
## Other options: FIDELITY_ARGS (python -m experiments.fidelity.fidelity_runs --help).
FIDELITY_OUT  ?= runs/fidelity_runs_lr1e-3
FIDELITY_ARGS ?= --models gpt2-tiny qwen3-tiny --variants none taco int8 --seeds 8 --eval-batches 64 \
                 --mesh data=1,tensor=2 --steps 60 --lr 1e-3 --batch-size 8 --seq-len 128 --backend ffi
fidelity: install
	$(PY) -m experiments.fidelity.fidelity_runs --out $(FIDELITY_OUT) $(FIDELITY_ARGS)

## The long paired study (docs/fidelity.md "Fidelity at length"): gpt2 and qwen3, 4 seeds × {exact, taco} × 2,000
## steps on the CPython-stdlib corpus (prepared first when missing), TP=2 with sequence parallelism, bf16. Resumable:
## run it again after a stop and it continues; with every run finished it only rebuilds the tables and plots.
## Tables from the saved runs alone: FIDELITY_LONG_ARGS=--analyze. Other options: python -m experiments.fidelity.fidelity_long --help.
CORPUS            ?= runs/corpus/cpython-stdlib
FIDELITY_LONG_OUT ?= runs/fidelity_long
FIDELITY_LONG_ARGS ?=
$(CORPUS)/corpus.json: | $(STAMP)
	$(PY) -m experiments.fidelity.prepare_corpus --out $(CORPUS)
fidelity-long: install $(CORPUS)/corpus.json
	$(PY) -m experiments.fidelity.fidelity_long --corpus $(CORPUS) --out $(FIDELITY_LONG_OUT) $(FIDELITY_LONG_ARGS)

## Where compression pays: exact vs TACO end to end on emulated links (network namespaces: root), the
## link sweep, TP 2/4, SP on/off, bf16/f32, chunks, the collective matmul, two tiers, and the cost model
## against it (docs/emulated.md; ~90 min on 2 cores). One configuration: E2E_ARGS="--only gpt2_tp2_sp_bf16".
E2E_OUT  ?= runs/e2e_study
E2E_ARGS ?=
bench-e2e: install
	$(PY) -m experiments.e2e.e2e_study --out $(E2E_OUT) $(E2E_ARGS)

## One link, exact vs TACO (gpt2-narrow, TP=2 + SP, 2 processes, 2 rounds; ~3 min at 250 Mbit/s; root for a shaped
## link): `make bench-e2e-link LINK=150mbit` (LINK: a rate, none = loopback, or intra=RATE,inter=RATE with
## LINK_ARGS='--launch-args "--nodes 2"'). Table and JSON in runs/bench_e2e/<link> (LINK_OUT=DIR elsewhere); other options:
## LINK_ARGS (python -m experiments.e2e.bench_e2e --help). Both bench-e2e targets refuse a busy machine (docs/emulated.md);
## on a shared host, E2E_ARGS / LINK_ARGS="--wait-quiet 900" waits it out and reruns a round it was busy during.
comma    := ,
LINK     ?= 250mbit
LINK_OUT ?= runs/bench_e2e/$(subst =,-,$(subst $(comma),_,$(LINK)))
LINK_ARGS ?=
bench-e2e-link: install
	$(PY) -m experiments.e2e.bench_e2e --links '$(LINK)' --sequence-parallel --out $(LINK_OUT) $(LINK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check taco_jax tests experiments

clean:
	rm -rf $(VENV) runs build *.egg-info
