# Sourced by benchmarks/probes/h200_verify.sh on the device machine:
# installs the carried IREE runtime wheels, then defines run(), which logs
# one step to $OUTDIR/<name>.log; a failed step does not stop the others,
# it sets status=1 for the script's exit.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
status=0
run() {  # name, command...
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUTDIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
