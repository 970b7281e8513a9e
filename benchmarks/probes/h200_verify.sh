#!/usr/bin/env bash
# The H200 verification of the code as it stands (issue 27 target 6), in
# two parts that each fit one device command (10 minutes):
#   rows: as_called.py's default rows and the windowed rows, every output
#         checked against float32 SDPA, each timed as called beside torch
#         gather+SDPA; then the mixed continuous-batching step;
#   hf:   as_called.py --hf-only: the Hugging Face model's decode steps and
#         prompt forwards against HF sdpa, generate beside HF's dynamic
#         cache (tokens compared), the static cache not compiled; then
#         sinks given to run() against the float64 reference
#         (h200_run_sinks.py, its kernels built into build/sinks-cuda).
# Prepare here as benchmarks/probes/h200_pending.sh's header says (.whl,
# artifacts-cuda; `h200_run_sinks.py --build` for build/sinks-cuda); on the
# H200 (device tool, carry [".whl", "artifacts-cuda", "build/sinks-cuda"]):
#   bash benchmarks/probes/h200_verify.sh rows|hf
set -uo pipefail
part=${1:?usage: h200_verify.sh rows|hf}
source "$(dirname "$0")/device_steps.sh"
case $part in
rows)
    run as_called_cuda python3 benchmarks/as_called.py --device cuda --artifacts artifacts-cuda --rounds 5 \
        --json "$OUTDIR/as_called_cuda.json"
    run as_called_window_cuda python3 benchmarks/as_called.py --device cuda --artifacts artifacts-cuda --rounds 5 \
        --shape prefill:1x4096:W1024 --shape chunked:4x512+8192:W2048 --shape decode:32x4096:W1024 \
        --json "$OUTDIR/as_called_window_cuda.json"
    run mixed_step_cuda python3 benchmarks/mixed_step.py --device cuda --artifacts artifacts-cuda \
        --json "$OUTDIR/mixed_step_cuda.json"
    ;;
hf)
    run as_called_hf_cuda python3 benchmarks/as_called.py --device cuda --artifacts artifacts-cuda --rounds 5 \
        --hf-only --hf-static-no-compile --json "$OUTDIR/as_called_hf_cuda.json"
    run h200_run_sinks python3 benchmarks/probes/h200_run_sinks.py --device cuda --dir build/sinks-cuda
    ;;
*)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
exit $status
