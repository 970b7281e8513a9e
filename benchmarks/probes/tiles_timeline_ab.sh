#!/usr/bin/env bash
# On a GPU machine, carrying build/gpu-tests and build/tiles-old (tile
# kernels of another commit): a CUPTI timeline (probes/tiles_timeline.py)
# of CALLS queued causal 4096-row tile calls from each build, in one
# command; each log lists every kernel with the gap before it.
set -uo pipefail
site=/tmp/prefill-tiles-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
for side in tiles-old/artifacts gpu-tests/artifacts; do
    log=${OUT:-/tmp}/timeline7_${side%%/*}.log
    python3 benchmarks/probes/tiles_timeline.py "build/$side" "${SHAPE:-prefill:1x4096}" --calls "${CALLS:-7}" >"$log" 2>&1
    grep -E "^kernels" "$log"
done
