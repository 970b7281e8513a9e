"""The sinks probe with the GPU wait as it was before 313e3b4: the HostFlag
copy queued to wait on every call of a run, several semaphores at once.
On IREE 3.13's CUDA driver that crashed the process (docs/reliability.md
"A segfault in the GPU wait"); this keeps the crash reproducible at the
current code. Same arguments as h200_run_sinks.py; run it through
sinks_crash.sh (PROBE sinks_crash_multiwait.py) for the native stacks."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import turbine_fmha.runtime.invoke as invoke

# The rule before 313e3b4: the flag for any GPU calls, on however many
# semaphores.
invoke._flag_for = lambda fenced: (
    invoke._flag(fenced[0].loaded.config.device) if fenced and fenced[0].loaded.spin else None
)
sys.argv = [str(Path(__file__).with_name("h200_run_sinks.py"))] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
