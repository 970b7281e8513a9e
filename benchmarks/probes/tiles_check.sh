#!/usr/bin/env bash
# On a GPU machine, carrying build/gpu-tests and build/roof: the tile
# kernels' GPU tests, then benchmarks/probes/prefill_tiles.sh on the
# GPU-test build (roof, tiles off and on, roof; EXTRA shapes appended),
# then CUPTI timelines (TIMELINE shapes), in one command.
set -uo pipefail
out=${OUT:-/tmp}
bash tests/gpu/run.sh build/gpu-tests -k tiles 2>&1 | tail -3
ARTIFACTS=build/gpu-tests/artifacts bash benchmarks/probes/prefill_tiles.sh ${EXTRA:-} 2>&1 | tee "$out/prefill_tiles.log" |
    grep -E "^roof|^\| (prefill|chunked)|^- date|^- commit"
export PYTHONPATH=/tmp/gpu-tests-site:$PWD PYTHONUNBUFFERED=1
for shape in ${TIMELINE:-}; do
    log=$out/timeline_${shape//[^a-z0-9]/_}.log
    python3 benchmarks/probes/tiles_timeline.py build/gpu-tests/artifacts "$shape" --calls 3 >"$log" 2>&1
    grep -E "^kernels:" "$log"
done
