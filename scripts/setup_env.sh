#!/usr/bin/env bash
# Creates ./.venv with the pinned build + test environment and installs this
# package into it (editable). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.turbine-fmha-requirements
if ! cmp -s requirements.txt "$stamp" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools
  # torch first and alone, so the exact CPU build is taken before
  # iree-turbine's own torch requirement is resolved.
  .venv/bin/python -m pip install -q --disable-pip-version-check "$(grep '^torch==' requirements.txt)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  cp requirements.txt "$stamp"
fi
