#!/usr/bin/env bash
# Set up, then run the whole test suite (heavy and compile-only GPU tests
# included) on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
