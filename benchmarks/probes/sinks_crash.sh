#!/usr/bin/env bash
# The GPU-wait segfault of docs/reliability.md "A segfault in the GPU
# wait": the sinks probe (its prefill runs several calls per run()) run
# again and again with the CUDA driver's JIT cache off, first under
# cuda-gdb (the device machines have no gdb; cuda-gdb debugs host code
# too), which prints every thread's native stack at a fault, then plainly.
# On the GPU machine (device tool, carry [".whl", "build/sinks-cuda"]):
#   bash benchmarks/probes/sinks_crash.sh GDB_RUNS PLAIN_RUNS [PROBE]
# PROBE: h200_run_sinks.py (default) or sinks_crash_noflag.py (the same
# with the HostFlag path off). Each run's log goes to $OUT.
set -uo pipefail
source "$(dirname "$0")/device_steps.sh"
probe=benchmarks/probes/${3:-h200_run_sinks.py}
tag=$(basename "$probe" .py)
args=(--device cuda --dir build/sinks-cuda)
export CUDA_CACHE_DISABLE=1
for i in $(seq 1 "${1:-3}"); do
    SECONDS=0
    timeout 170 cuda-gdb -q -batch -ex "set pagination off" -ex "set print thread-events off" \
        -ex "set cuda break_on_launch none" -ex run -ex "info threads" -ex "thread apply all bt 40" \
        --args python3 -X faulthandler "$probe" "${args[@]}" >"$OUTDIR/${tag}_gdb_$i.log" 2>&1
    echo "$tag under gdb, run $i: exit $? in ${SECONDS}s; $(grep -c '| ok |$' "$OUTDIR/${tag}_gdb_$i.log") lines end ok;" \
        "$(grep -m1 -E 'all ok|FAILED|received signal' "$OUTDIR/${tag}_gdb_$i.log")"
done
for i in $(seq 1 "${2:-4}"); do
    SECONDS=0
    timeout 120 python3 -X faulthandler "$probe" "${args[@]}" >"$OUTDIR/${tag}_$i.log" 2>&1
    echo "$tag, run $i: exit $? in ${SECONDS}s; $(grep -m1 -E 'all ok|FAILED|Segmentation' "$OUTDIR/${tag}_$i.log")"
done
