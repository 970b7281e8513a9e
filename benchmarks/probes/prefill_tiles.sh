#!/usr/bin/env bash
# On a GPU machine (torch, no IREE), from the repository root, carrying
# build/gpu-tests/wheels, build/roof and artifacts-cuda (built here by
# benchmarks/roof.py --build build/roof and benchmarks/build_cuda_subset.py;
# ARTIFACTS names another folder, e.g. build/gpu-tests/artifacts),
# and optionally a benchmarks/prefill_tiles.py --build folder (TILES, with
# ONLY its modules to run): the library's prefill through contiguous
# tiles (Session prefill_tiles on) beside the paged prefill (off) as a
# user calls them, and IREE's roof before and after, in one command on
# one GPU. NCU="SHAPE ..." then lists each dispatch of one tiles call per
# shape with its time (probes/tiles_ncu.py). Extra arguments go to
# as_called.py.
set -euo pipefail
site=/tmp/prefill-tiles-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 benchmarks/roof.py --run build/roof
if [ -n "${TILES:-}" ]; then
    python3 benchmarks/prefill_tiles.py --run "$TILES" --only "${ONLY:-}"
fi
shapes=(--shape prefill:1x4096 --shape prefill:4x1024 --shape chunked:4x512+8192
    --shape prefill:1x1024 --shape prefill:1x512 --shape prefill:8x256 --shape prefill:1x128)
for tiles in off on; do
    python3 benchmarks/as_called.py --device cuda --artifacts "${ARTIFACTS:-artifacts-cuda}" --prefill-tiles "$tiles" \
        "${shapes[@]}" --rounds 5 ${OUT:+--json "$OUT/as_called_tiles_$tiles.json"} "$@"
done
python3 benchmarks/roof.py --run build/roof
for shape in ${NCU:-}; do
    log=${OUT:-/tmp}/tiles_ncu_${shape//[^a-z0-9]/_}.log
    /usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        python3 benchmarks/probes/tiles_ncu.py "${ARTIFACTS:-artifacts-cuda}" "$shape" >"$log" 2>&1 || true
    grep -E "_dispatch_|gpu__time_duration|^(prefill|chunked|decode)" "$log" | sed -E 's/ +\(.*//; s/ +/ /g' || true
done
