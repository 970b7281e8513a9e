#!/usr/bin/env bash
# The performance runs behind docs/benchmarks.md's GPU table, in two parts
# that each fit one device command (10 minutes):
#   rows: as_called.py's default rows and the windowed rows, each timed as
#         called beside torch gather+SDPA (every output also checked
#         against float32 SDPA); then the mixed continuous-batching step;
#   hf:   as_called.py --hf-only: the Hugging Face model's decode steps and
#         prompt forwards against HF sdpa, generate beside HF's dynamic
#         cache (tokens compared), the static cache not compiled.
# The GPU's correctness tests are tests/gpu (tests/gpu/README.md).
# Prepare here (no GPU needed): the cp312 runtime wheels in .whl/, as the
# device tool's README says (echo /.whl/ >> .git/info/exclude first):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl iree-base-runtime==3.13.0 ml_dtypes==0.6.0
#   .venv/bin/python benchmarks/build_cuda_subset.py --artifacts artifacts-cuda
# On the GPU (device tool, carry [".whl", "artifacts-cuda"]):
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
    ;;
*)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
exit $status
