#!/usr/bin/env bash
# Set up, check formatting and lint (ruff, configured in pyproject.toml),
# then run the whole test suite (heavy and compile-only GPU tests included)
# on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/ruff format --check --quiet .
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q "$@"
