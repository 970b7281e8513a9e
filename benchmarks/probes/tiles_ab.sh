#!/usr/bin/env bash
# On a GPU machine, carrying build/gpu-tests (its wheels), build/roof and
# two artifact folders A and B (e.g. tile kernels of two commits): the
# prefill tiles as called from each, alternated twice (A B A B), with
# IREE's roof before and after, in one command. SHAPES overrides the rows.
set -uo pipefail
out=${OUT:-/tmp}
site=/tmp/prefill-tiles-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
shapes=()
for shape in ${SHAPES:-prefill:1x4096 prefill:4x1024 chunked:4x512+8192}; do shapes+=(--shape "$shape"); done
python3 benchmarks/roof.py --run build/roof
for round in 1 2; do
    for side in A B; do
        echo "== $side (${!side}), round $round"
        python3 benchmarks/as_called.py --device cuda --artifacts "${!side}" --prefill-tiles on "${shapes[@]}" \
            --rounds 7 --json "$out/ab_${side}_$round.json" 2>&1 | grep -E "^\| (prefill|chunked)"
    done
done
python3 benchmarks/roof.py --run build/roof
