#!/usr/bin/env python3
"""Build artifacts: same as `turbine-fmha build` (see --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from turbine_fmha.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
