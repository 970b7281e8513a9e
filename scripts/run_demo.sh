#!/usr/bin/env bash
# Main job on the CPU: set up, build the default host artifacts (unchanged
# ones are skipped), then serve and verify a small paged-attention workload.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/turbine-fmha build --targets host --artifacts artifacts
.venv/bin/python examples/demo.py --artifacts artifacts "$@"
