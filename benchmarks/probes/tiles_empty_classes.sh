#!/usr/bin/env bash
# On a GPU machine, carrying build/gpu-tests: the prefill tiles as called
# with the class filling on (fill) and off (nofill: empty classes),
# alternated twice, in one command (probes/tiles_empty_classes.py).
set -uo pipefail
out=${OUT:-/tmp}
site=/tmp/prefill-tiles-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    build/gpu-tests/wheels/iree_base_runtime-*.whl build/gpu-tests/wheels/ml_dtypes-*.whl
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
shapes=()
for shape in ${SHAPES:-chunked:4x512+8192 chunked:1x512+8192 prefill:1x4096}; do shapes+=(--shape "$shape"); done
for round in $(seq "${ROUNDS:-2}"); do
    for side in fill nofill; do
        echo "== $side, round $round"
        python3 benchmarks/probes/tiles_empty_classes.py $([ $side = nofill ] && echo --no-fill) --device cuda \
            --artifacts build/gpu-tests/artifacts --prefill-tiles on "${shapes[@]}" --rounds 5 \
            --json "$out/empty_${side}_$round.json" 2>&1 | grep -E "^\| (prefill|chunked)|Error|error" | head -20
    done
done
