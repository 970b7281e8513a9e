#!/usr/bin/env bash
# The H200 runs pending since 2026-12-04 (no device machine lent since),
# in the order they matter, each writing its log (and JSON) to $OUT:
#   1. the plans changed since the last H200 run (window cuts, windowed
#      decodes on the decode tiles, sinks as a run() argument), verified
#      and timed as called: as_called.py checks every output against
#      float32 SDPA, the windowed rows beside the plain ones they should
#      cost like (decode b32 x 4096, window 1024 ~ decode b32 x 1024);
#   2. the mixed continuous-batching step against its parts (issue 27
#      target 2: at most 1.2x);
#   3. the run-time batch probe (h200_dynamic_batch.py), when build/dynb
#      holds its kernels.
# Prepare here (no GPU needed; the wheels as the device tool's README says):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl iree-base-runtime==3.13.0 ml_dtypes==0.6.0
#   .venv/bin/python benchmarks/build_cuda_subset.py --artifacts artifacts-cuda
#   .venv/bin/python benchmarks/probes/h200_dynamic_batch.py --build build/dynb --target cuda
# On the H200 (device tool; carry [".whl", "artifacts-cuda", "build/dynb"], 64 MiB in all:
# leave build/dynb for a second call if they do not fit):
#   bash benchmarks/probes/h200_pending.sh
set -uo pipefail
source "$(dirname "$0")/device_steps.sh"
run as_called_window_cuda python3 benchmarks/as_called.py --device cuda --artifacts artifacts-cuda --rounds 5 \
    --shape decode:32x4096:W1024 --shape decode:32x1024 --shape decode:1x32768:W4096 --shape decode:1x4096 \
    --shape prefill:1x4096:W1024 --shape chunked:4x512+8192:W2048 --json "$OUTDIR/as_called_window_cuda.json"
run mixed_step_cuda python3 benchmarks/mixed_step.py --device cuda --artifacts artifacts-cuda \
    --json "$OUTDIR/mixed_step_cuda.json"
if [ -d build/dynb ]; then
    run h200_dynamic_batch python3 benchmarks/probes/h200_dynamic_batch.py --device cuda --dir build/dynb
fi
exit $status
