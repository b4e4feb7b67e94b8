#!/usr/bin/env bash
# GPU check of the TACO codec kernels, for a lent H200 (sm_90): builds the CUDA FFI library,
# runs the GPU tests (pallas / triton / CUDA FFI against the reference) and the codec benchmark,
# and leaves everything under $OUT (default runs/gpu_check).
#
# Target machine: Python 3.12, jax 0.11.2 (CUDA 13), triton 3.6, nvcc 13.0, no network, no
# jax-triton: to test the triton backend, carry its wheel in .whl/ (here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: -d .whl jax-triton==0.3.1
# and name `.whl` in the device tool's `carry`). Without it the triton tests skip.
#
# Usage (device tool):  bash experiments/gpu_check.sh          # about 3-6 minutes
#   env: OUT (results folder), PYTHON (default python3), CUDA_ARCH (default sm_90),
#        BENCH_SIZES (MB list, default 1,16,256), EXTRA_SIZE (MB for the other G/format runs, 256).
# Every step runs even if an earlier one failed; the exit status is that of the GPU tests.

set -x
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

PYTHON=${PYTHON:-python3}
case $PYTHON in /*) ;; */*) PYTHON="$PWD/$PYTHON" ;; esac  # make -C changes directory
CUDA_ARCH=${CUDA_ARCH:-sm_90}
BENCH_SIZES=${BENCH_SIZES:-1,16,256}
EXTRA_SIZE=${EXTRA_SIZE:-256}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}  # tests/conftest.py defaults it to cpu

date
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
nvcc --version
$PYTHON --version
$PYTHON -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
$PYTHON -c "import triton; print('triton', triton.__version__)"

# 1. optional carried wheels (jax-triton), into a private site dir
if ls .whl/*.whl > /dev/null 2>&1; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/taco_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/taco_site"
fi
$PYTHON -c "import jax_triton; print('jax_triton', jax_triton.__version__)" || echo "jax-triton missing: triton tests will skip"

# 2. build: CPU and CUDA FFI libraries against this machine's jaxlib headers
make -C custom_calls clean
make -C custom_calls cpu cuda PYTHON="$PYTHON" CUDA_ARCH="$CUDA_ARCH" 2>&1 | tee "$OUT/build.log"
ls -la taco_jax/kernels/_lib/
$PYTHON -c "from taco_jax import kernels; print('available:', kernels.available_backends(), 'auto ->', kernels.resolve('auto'))"

# 3. GPU tests (marked gpu), then the CPU-side FP8 / selection tests on this machine's jax
timeout 900 $PYTHON -m pytest -v -p no:cacheprovider -o addopts="" -m gpu tests/test_kernels.py \
  --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log"
gpu_rc=${PIPESTATUS[0]}

# 4. benchmark: every available backend beside device copies (HBM peak 4.8 TB/s in the JSON)
timeout 900 $PYTHON experiments/bench_codec.py --out "$OUT" --sizes "$BENCH_SIZES" --rounds 10 \
  2>&1 | tee "$OUT/bench.log"
for fmt_g in "e5m2 128" "e4m3 512" "e4m3 32"; do
  set -- $fmt_g
  timeout 600 $PYTHON experiments/bench_codec.py --out "$OUT/bench_${1}_g$2" --sizes "$EXTRA_SIZE" --fmt "$1" --group-size "$2" \
    --backends reference,ffi --rounds 10 2>&1 | tee -a "$OUT/bench.log"
done

# 5. summary
$PYTHON - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for p in sorted(out.rglob("bench_codec.json")):
    r = json.loads(p.read_text())
    peak = r["environment"].get("hbm_peak_gbps")
    g = r["config"]["group_size"]
    for s in r["sizes"]:
        for row in s["rows"]:
            if row["regime"] == "steady" and row["kind"] != "memcpy":
                # DRAM traffic per f32 byte of message: 4 B f32 + 1 B code + 8/G B scales, over 4 B
                traffic = row["gbps"] * (5 + 8 / g) / 4
                extra = f"  traffic {traffic:8.1f} GB/s = {traffic / peak:5.1%} of HBM peak" if peak else ""
                print(f"{p.parent.name:>18} {s['size_mb']:6.0f} MB {row['case']:<20} {row['gbps']:9.1f} GB/s "
                      f"{row['ratio_vs_memcpy']:5.2f}x copy{extra}")
EOF
date
exit "$gpu_rc"
