"""The sinks probe with the HostFlag completion path off (runtime.invoke's
_flag returns None), the control for docs/reliability.md "A segfault in
the GPU wait": it passed where the flag's copy, waiting on several
semaphores, crashed. Same arguments as h200_run_sinks.py."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import turbine_fmha.runtime.invoke as invoke

invoke._flag = lambda device: None
sys.argv = [str(Path(__file__).with_name("h200_run_sinks.py"))] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
