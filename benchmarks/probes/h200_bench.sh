#!/usr/bin/env bash
# Runs on the lent H200 (device tool): no IREE there, so the cp312
# iree-base-runtime and ml_dtypes wheels travel in .whl/ and the CUDA
# artifacts (built here: turbine-fmha build --targets cuda --out artifacts-cuda)
# in artifacts-cuda/ (add the --features variants with
#   turbine-fmha build --targets cuda --out artifacts-cuda --variants "$(python benchmarks/bench.py --device cuda --list-feature-variants)").
# Verifies on the GPU, then benchmarks against torch; BENCH_ARGS=--features
# also times each score-side feature.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch; print('torch', torch.__version__)"
OUTDIR=${OUT:-/tmp}
python3 benchmarks/bench.py --device cuda --artifacts artifacts-cuda --verify --dtypes "${DTYPES:-f16,bf16}" ${BENCH_ARGS:-} --json "$OUTDIR/bench_cuda.json" 2>&1 | tee "$OUTDIR/bench_cuda.log"
