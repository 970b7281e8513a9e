#!/usr/bin/env bash
# On a GPU machine, carrying build/gpu-tests: for each SHAPES entry, a
# CUPTI timeline of queued tile calls (probes/tiles_timeline.py) and each
# dispatch's time from ncu (probes/tiles_ncu.py), in one command.
set -uo pipefail
out=${OUT:-/tmp}
site=/tmp/prefill-tiles-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
for shape in ${SHAPES:-prefill:4x1024}; do
    name=${shape//[^a-z0-9]/_}
    python3 benchmarks/probes/tiles_timeline.py build/gpu-tests/artifacts "$shape" --calls 7 >"$out/timeline7_$name.log" 2>&1
    grep -E "^kernels" "$out/timeline7_$name.log"
    /usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        python3 benchmarks/probes/tiles_ncu.py build/gpu-tests/artifacts "$shape" >"$out/tiles_ncu_$name.log" 2>&1
    grep -E "_dispatch_|gpu__time_duration" "$out/tiles_ncu_$name.log" | sed -E 's/ +\(.*//; s/ +/ /g' | paste - - | head -40
done
