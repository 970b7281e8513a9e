#!/usr/bin/env bash
# The prefill tiles on a GPU machine (torch, no IREE), from the repository
# root, carrying build/gpu-tests (scripts/build_gpu_tests.py: its wheels
# and artifacts) and, for `compare`, build/roof (benchmarks/roof.py
# --build build/roof). Runs the named steps in order, in one command;
# logs go to $OUT (or /tmp):
#   tests        tests/gpu -k tiles
#   compare      probes/prefill_tiles.sh on the GPU-test build: the roof,
#                tiles off and on as called, the roof again (EXTRA: more
#                as_called.py arguments, e.g. --shape prefill:1x16384)
#   timelines    a CUPTI timeline (probes/tiles_timeline.py) of CALLS (3)
#                queued calls per TIMELINE shape: timeline_<shape>.log
#   ab           as_called.py from artifact folders $A and $B, A B A B:
#                ab_<A|B>_<round>.json
#   timeline-ab  7 queued causal 4096-row calls from $A and from $B:
#                timeline7_<folder>.log
#   depth        the device column at 2, 8 and 32 calls asked in flight, and
#                32 with a caching pool of 1 GiB allocations and 4 GiB:
#                depth_*.json (as_called.py queues at most what the pool
#                holds, so the tile rows stop at its capacity)
#   ncu          per SHAPES entry, a 7-call timeline and each dispatch's
#                time (or the comma-separated METRICS) from ncu:
#                timeline7_<shape>.log, tiles_ncu_<shape>.log
#   fill         the class filling planned for the GPU's wave and for one
#                entry a wave (probes/tiles_empty_classes.py --wave 1),
#                ROUNDS rounds: fill_<wave|one>_<round>.json, then a
#                7-call timeline of each: timeline7_fill_<wave|one>.log
# e.g. TIMELINE="prefill:1x4096" bash benchmarks/probes/tiles_steps.sh tests compare timelines
set -uo pipefail
out=${OUT:-/tmp}
build=build/gpu-tests
art=$build/artifacts
site=/tmp/tiles-steps-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$build"/wheels/iree_base_runtime-*.whl "$build"/wheels/ml_dtypes-*.whl 2>/dev/null
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
name() { echo "${1//[^a-z0-9]/_}"; }
as_called() {  # artifacts, json, as_called.py arguments...
    local a=$1 json=$2
    shift 2
    python3 benchmarks/as_called.py --device cuda --artifacts "$a" --prefill-tiles on --rounds 7 \
        --json "$out/$json" "$@" 2>&1 | grep -E "^\| (prefill|chunked)|FAILED"
}
shapes() { for s in "$@"; do printf -- '--shape\n%s\n' "$s"; done; }
three=(prefill:1x4096 prefill:4x1024 chunked:4x512+8192)
status=0
for step in "$@"; do
    echo "== $step"
    case $step in
    tests) bash tests/gpu/run.sh "$build" -k tiles 2>&1 | tail -3 || status=1 ;;
    compare)
        ARTIFACTS=$art bash benchmarks/probes/prefill_tiles.sh ${EXTRA:-} 2>&1 | tee "$out/prefill_tiles.log" |
            grep -E "^roof|^\| (prefill|chunked)|^- commit" ;;
    timelines)
        for s in ${TIMELINE:-prefill:1x4096 chunked:4x512+8192}; do
            python3 benchmarks/probes/tiles_timeline.py "$art" "$s" --calls "${CALLS:-3}" >"$out/timeline_$(name "$s").log" 2>&1
            grep -E "^kernels:" "$out/timeline_$(name "$s").log"
        done ;;
    ab)
        mapfile -t sh < <(shapes ${SHAPES:-${three[*]}})
        for round in 1 2; do
            for side in A B; do
                echo "-- $side (${!side}), round $round"
                as_called "${!side}" "ab_${side}_$round.json" "${sh[@]}"
            done
        done ;;
    timeline-ab)
        for side in A B; do
            log=$out/timeline7_$(basename "$(dirname "${!side}")").log
            python3 benchmarks/probes/tiles_timeline.py "${!side}" prefill:1x4096 --calls 7 >"$log" 2>&1
            grep -E "^kernels" "$log"
        done ;;
    depth)
        mapfile -t sh < <(shapes "${three[@]}")
        for calls in 2 8 32; do
            echo "-- $calls in flight"
            as_called "$art" "depth_$calls.json" "${sh[@]}" --calls "$calls"
        done
        echo "-- 32 in flight, a pool of 1 GiB allocations"
        TURBINE_FMHA_CUDA_ALLOCATORS="caching:device_local=1gib;4gib;256" \
            as_called "$art" depth_32_pool1g.json "${sh[@]}" --calls 32 ;;
    ncu)
        metrics=${METRICS:-gpu__time_duration.sum}
        for s in ${SHAPES:-prefill:4x1024}; do
            python3 benchmarks/probes/tiles_timeline.py "$art" "$s" --calls 7 >"$out/timeline7_$(name "$s").log" 2>&1
            grep -E "^kernels" "$out/timeline7_$(name "$s").log"
            /usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics "$metrics" \
                python3 benchmarks/probes/tiles_ncu.py "$art" "$s" >"$out/tiles_ncu_$(name "$s").log" 2>&1
            grep -E "_dispatch_|${metrics//,/|}" "$out/tiles_ncu_$(name "$s").log" | sed -E 's/ +\(.*//; s/ +/ /g' |
                paste $(printf -- '- %.0s' $(seq $(($(tr -cd , <<<"$metrics" | wc -c) + 2))))
        done ;;
    fill)
        mapfile -t sh < <(shapes ${SHAPES:-chunked:4x512+8192 chunked:1x512+8192})
        for round in $(seq "${ROUNDS:-2}"); do
            for side in wave one; do
                echo "-- $side, round $round"
                python3 benchmarks/probes/tiles_empty_classes.py $([ $side = one ] && echo --wave 1) --device cuda \
                    --artifacts "$art" --prefill-tiles on "${sh[@]}" --rounds 5 --json "$out/fill_${side}_$round.json" 2>&1 |
                    grep -E "^\| (prefill|chunked)|FAILED" | head -20
            done
        done
        for side in wave one; do
            log=$out/timeline7_fill_$side.log
            python3 benchmarks/probes/tiles_timeline.py "$art" chunked:4x512+8192 --calls 7 \
                $([ $side = one ] && echo --wave 1) >"$log" 2>&1
            grep -E "^kernels" "$log"
        done ;;
    *) echo "unknown step $step" >&2 && exit 2 ;;
    esac
done
exit $status
