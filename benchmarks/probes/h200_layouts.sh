#!/usr/bin/env bash
# bench.py on a GPU over several artifact directories, each with its cache
# layout, rounds interleaved (device time; torch gather+SDPA in each run):
#   benchmarks/probes/h200_layouts.sh ROUNDS DIR:LAYOUT [DIR:LAYOUT ...] [-- BENCH_ARGS]
# e.g. benchmarks/probes/h200_layouts.sh 2 artifacts-h200-static:NHD artifacts-h200-anyh:HND -- --split-kv
set -euo pipefail
rounds=$1; shift
runs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do runs+=("$1"); shift; done
[ $# -gt 0 ] && shift
for r in $(seq 1 "$rounds"); do
  for run in "${runs[@]}"; do
    echo "=== round $r ${run%%:*} kv_layout=${run##*:}"
    python3 "$(dirname "$0")/../bench.py" --device cuda --artifacts "${run%%:*}" --kv-layout "${run##*:}" "$@"
  done
done
