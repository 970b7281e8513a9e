#!/usr/bin/env python3
"""benchmarks/as_called.py with prefills run as they were before row
entries (each sequence's 128-row chunks a launch of their own, or the
1024/4096-row tiles): the comparison beside the default run. Arguments as
as_called.py's."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from turbine_fmha.api import attention

attention._Plan._choose_entries = lambda self: None
sys.argv[0] = str(Path(__file__).resolve().parents[1] / "as_called.py")
runpy.run_path(sys.argv[0], run_name="__main__")
