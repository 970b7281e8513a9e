#!/usr/bin/env bash
# On a GPU machine, carrying build/gpu-tests: the prefill tiles as called,
# with the device column's calls in flight at 2, 8 and 32 (as_called.py
# --calls), then 32 again with IREE's CUDA caching pool taking single
# allocations up to 1 GiB (TURBINE_FMHA_CUDA_ALLOCATORS), in one command.
set -uo pipefail
out=${OUT:-/tmp}
site=/tmp/prefill-tiles-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
shapes=(--shape prefill:1x4096 --shape prefill:4x1024 --shape chunked:4x512+8192)
run() {  # name, extra as_called arguments...
    local name=$1
    shift
    echo "== $name"
    python3 benchmarks/as_called.py --device cuda --artifacts build/gpu-tests/artifacts --prefill-tiles on \
        "${shapes[@]}" --rounds 7 --json "$out/depth_$name.json" "$@" 2>&1 | grep -E "^\| (prefill|chunked)"
}
run 2 --calls 2
run 8 --calls 8
run 32 --calls 32
TURBINE_FMHA_CUDA_ALLOCATORS="caching:device_local=1gib;4gib;256" run 32_pool1g --calls 32
