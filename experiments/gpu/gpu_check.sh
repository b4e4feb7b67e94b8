#!/usr/bin/env bash
# GPU check of taco_jax for a lent H200 (sm_90), <= 6 minutes: builds the CUDA FFI library, then
# experiments/gpu/gpu_check.py writes ONE JSON report, $OUT/gpu_check.json: each GPU backend's
# conformance to `reference`, codec throughput vs a device memcpy of the same bytes (1-256 MB),
# compressed vs exact collectives on the visible GPUs, and a short compressed training run.
# Also: $OUT/gpu_check.log (everything printed), $OUT/build.log, $OUT/nvidia_smi.txt,
# $OUT/gpu_speeds.json (the measured speed table of `auto`; UPDATE_SPEEDS=1 writes it into perf/hardware.toml),
# $OUT/triton_aot.json with AOT=1 (resources and SASS counts of the Triton kernels, compiled for sm_90).
#
# Target machine: Python 3.12, jax 0.11.2 (CUDA 13), triton 3.6, nvcc 13, no network, no
# jax-triton: to check the triton backend too, carry its wheel in .whl/ (in the repo root here:
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: -d .whl jax-triton==0.3.1
# and name `.whl` in the device tool's `carry`). Without it the triton backend is not listed.
#
# Usage:  bash experiments/gpu/gpu_check.sh             # on the GPU (device tool; OUT=$OUT there)
#         bash experiments/gpu/gpu_check.sh --dry-run   # on CPU: tiny sizes, validates the report format
#   env: OUT (results folder, default runs/gpu_check), PYTHON (default python3, or .venv's),
#        CUDA_ARCH (default sm_90), LIMIT_S (default 240: the report step's time limit),
#        PYTEST_GPU (1: run `pytest -m gpu` first, into $OUT/pytest_gpu.log), AOT (1: triton_aot.py; off by default: the same on CPU),
#        SECTIONS, SIZES (MB), TRAIN_STEPS: passed to gpu_check.py.
# Exit status: that of gpu_check.py (0: no section failed and every backend conforms).

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
case $PYTHON in /*) ;; */*) PYTHON="$PWD/$PYTHON" ;; esac  # make -C changes directory
CUDA_ARCH=${CUDA_ARCH:-sm_90}
LIMIT_S=${LIMIT_S:-240}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

date
$PYTHON --version
if [ "$DRY" = 1 ]; then
  echo "gpu_check: dry run on $(uname -m) CPU"
  exec timeout 900 $PYTHON -m experiments.gpu.gpu_check --out "$OUT" --dry-run
fi

export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
nvcc --version | tail -1
$PYTHON -c "import jax; print('jax', jax.__version__, jax.devices())"

# 1. optional carried wheels (jax-triton), into a private site dir
if ls .whl/*.whl > /dev/null 2>&1; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/taco_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/taco_site"
fi

# 2. CPU and CUDA FFI libraries against this machine's jaxlib headers (~1 min)
make -C custom_calls clean > /dev/null
make -C custom_calls cpu cuda PYTHON="$PYTHON" CUDA_ARCH="$CUDA_ARCH" > "$OUT/build.log" 2>&1 \
  || { echo "gpu_check: FFI build failed (see build.log); the ffi backend will be missing"; tail -5 "$OUT/build.log"; }

# 3. the GPU tests (pytest -m gpu: every GPU backend against `reference`); PYTEST_GPU=0 skips
if [ "${PYTEST_GPU:-1}" = 1 ]; then
  JAX_PLATFORMS=cuda timeout 90 $PYTHON -m pytest -q -m gpu tests/test_kernels.py -p no:cacheprovider \
    > "$OUT/pytest_gpu.log" 2>&1; echo "gpu_check: pytest -m gpu rc=$? ($(tail -1 "$OUT/pytest_gpu.log"))"
fi

# 4. Triton kernels compiled ahead of time for this GPU: registers, spills, SASS counts (~2 min); AOT=1 runs it
if [ "${AOT:-0}" = 1 ]; then
  timeout 120 $PYTHON -m experiments.gpu.triton_aot --out "$OUT/triton_aot.json" --arch "${CUDA_ARCH#sm_}" \
    || echo "gpu_check: triton_aot failed"
fi

# 5. the report (SECTIONS: a comma-separated subset; SIZES: throughput sizes in MB; TRAIN_STEPS)
timeout "$LIMIT_S" $PYTHON -m experiments.gpu.gpu_check --out "$OUT" \
  --sections "${SECTIONS:-conformance,throughput,collectives,training}" --sizes "${SIZES:-4,16,64,256}" \
  --train-steps "${TRAIN_STEPS:-30}" ${UPDATE_SPEEDS:+--update-speeds}
rc=$?
date
exit $rc
