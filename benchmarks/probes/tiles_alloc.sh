#!/usr/bin/env bash
# On a GPU machine, from the repository root, carrying build/gpu-tests
# (scripts/build_gpu_tests.py): the prefill tiles' calls with IREE's
# CUDA allocations synchronous (the library's default, so that DLPack can
# export results) and stream-ordered (TURBINE_FMHA_CUDA_ASYNC_ALLOCATIONS=1):
# each call's kernel and driver timeline (probes/tiles_timeline.py), then
# as_called.py's rows for both, in one command on one GPU.
set -euo pipefail
site=/tmp/tiles-alloc-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
art=${ARTIFACTS:-build/gpu-tests/artifacts}
out=${OUT:-/tmp}
for shape in prefill:1x4096 chunked:4x512+8192; do
    for a in 0 1; do
        log=$out/timeline_${shape//[^a-z0-9]/_}_async$a.log
        TURBINE_FMHA_CUDA_ASYNC_ALLOCATIONS=$a python3 benchmarks/probes/tiles_timeline.py "$art" "$shape" --calls 3 >"$log" 2>&1 || true
        echo "== $shape async=$a"
        sed -n '/^kernels:/,$p' "$log" | head -14
    done
done
for a in 0 1; do
    echo "== as_called, async allocations $a"
    TURBINE_FMHA_CUDA_ASYNC_ALLOCATIONS=$a python3 benchmarks/as_called.py --device cuda --artifacts "$art" \
        --prefill-tiles on --shape prefill:1x4096 --shape prefill:4x1024 --shape chunked:4x512+8192 \
        --rounds 3 --json "$out/as_called_async$a.json" | grep -E "^\| (prefill|chunked)"
done
