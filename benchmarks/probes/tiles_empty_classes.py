#!/usr/bin/env python3
"""benchmarks/as_called.py with the prefill tiles' class filling planned
for a GPU wave of `--wave N` entries instead of the planner's
wave_entries (`--wave 1`: the filling before it knew waves, one chunk
split per run of empty classes). Every other argument goes to
as_called.py, which checks each output against its reference. (Leaving
a class empty is no option: the kernel refuses it, since a dispatch over
no entry faults IREE 3.13's CUDA device, docs/repro/cuda_zero_entries.py.)

    python3 benchmarks/probes/tiles_empty_classes.py [--wave N] AS_CALLED_ARGS..."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


if __name__ == "__main__":
    import as_called

    from turbine_fmha.calls import tiles

    if "--wave" in sys.argv:
        i = sys.argv.index("--wave")
        wave = int(sys.argv[i + 1])
        del sys.argv[i : i + 2]
        tiles.wave_entries = lambda nhead_q: wave
    sys.exit(as_called.main())
