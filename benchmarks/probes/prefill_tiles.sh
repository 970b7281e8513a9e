#!/usr/bin/env bash
# On a GPU machine (torch, no IREE), from the repository root, carrying
# build/gpu-tests/wheels, build/roof, build/prefill-tiles and artifacts-cuda
# (built here by benchmarks/roof.py --build build/roof,
# benchmarks/prefill_tiles.py --build build/prefill-tiles and
# benchmarks/build_cuda_subset.py): the prefill through contiguous tiles
# beside IREE's roof and today's paged prefill, in one command on one GPU.
# TILES names another --build folder (a subset, to stay within the carry).
set -euo pipefail
site=/tmp/prefill-tiles-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 benchmarks/roof.py --run build/roof
python3 benchmarks/prefill_tiles.py --run "${TILES:-build/prefill-tiles}" --only "${ONLY:-}"
python3 benchmarks/roof.py --run build/roof
python3 benchmarks/as_called.py --device cuda --artifacts artifacts-cuda --shape prefill:1x4096 --shape prefill:4x1024 --shape chunked:4x512+8192 --rounds 5 "$@"
