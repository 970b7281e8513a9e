#!/usr/bin/env bash
# Runs the GPU tests on a machine with a CUDA GPU, python3 with torch (and
# transformers for test_gpu_hf.py), and no IREE: from the repository root,
#   bash tests/gpu/run.sh [BUILD] [pytest arguments...]
# BUILD is scripts/build_gpu_tests.py's output (default build/gpu-tests),
# carried with the repository. Its wheels/ go into /tmp/gpu-tests-site on
# PYTHONPATH: the IREE runtime and ml_dtypes always (this repository's
# IREE release), pytest and its dependencies only where python3 has no
# pytest. Then pytest runs tests/gpu alone (--confcutdir: tests/conftest.py,
# which compiles host kernels, is not loaded). Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=build/gpu-tests
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    build=$1
    shift
fi
site=/tmp/gpu-tests-site
wheels=("$build"/wheels/iree_base_runtime-*.whl "$build"/wheels/ml_dtypes-*.whl)
if ! python3 -c "import pytest" 2>/dev/null; then
    for name in pytest pluggy iniconfig pygments packaging; do
        wheels+=("$build"/wheels/"$name"-*.whl)
    done
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
exec python3 -m pytest tests/gpu --confcutdir=tests/gpu -p no:cacheprovider -m gpu -rs \
    --gpu-artifacts "$build" "$@"
