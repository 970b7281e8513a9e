#!/usr/bin/env bash
# On a GPU machine (torch, no IREE), from the repository root, carrying
# build/gpu-tests (scripts/build_gpu_tests.py, plus the c8 tile kernel of
# 32/8 heads for 32k rows) and build/roof (benchmarks/roof.py --build):
# the tile kernels' GPU tests, a CUPTI timeline of one-call shapes
# (TIMELINE), and long causal prefills through row groups beside the
# paged kernels (ROWS), with IREE's roof before and after, in one command.
set -uo pipefail
build=build/gpu-tests
out=${OUT:-/tmp}
bash tests/gpu/run.sh "$build" -k tiles 2>&1 | tail -4
export PYTHONPATH=/tmp/gpu-tests-site:$PWD PYTHONUNBUFFERED=1
python3 benchmarks/roof.py --run build/roof
for shape in ${TIMELINE:-prefill:1x4096 chunked:4x512+8192}; do
    log=$out/timeline_${shape//[^a-z0-9]/_}.log
    python3 benchmarks/probes/tiles_timeline.py "$build/artifacts" "$shape" --calls 3 >"$log" 2>&1
    sed -n '/^kernels:/,$p' "$log" | head -8
done
shapes=()
for shape in ${ROWS:-prefill:1x4096 prefill:1x16384 prefill:1x32768}; do shapes+=(--shape "$shape"); done
for tiles in off on; do
    python3 benchmarks/as_called.py --device cuda --artifacts "$build/artifacts" --prefill-tiles "$tiles" \
        "${shapes[@]}" --rounds 3 --json "$out/as_called_rows_$tiles.json"
done
python3 benchmarks/roof.py --run build/roof
