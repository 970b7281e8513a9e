#!/usr/bin/env python3
"""benchmarks/as_called.py with the prefill tiles' class filling off
(--no-fill): a class no chunk fills stays empty (zero entries: a
zero-size argument and an attention dispatch over no entry) instead of
taking pieces split off a longer chunk or a dummy entry. Every other
argument goes to as_called.py, which checks each output against its
reference. On IREE 3.13's CUDA driver the dispatch over no entry faults
the device (docs/repro/cuda_zero_entries.py).

    python3 benchmarks/probes/tiles_empty_classes.py [--no-fill] AS_CALLED_ARGS..."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


if __name__ == "__main__":
    import as_called

    from turbine_fmha.calls import tiles

    if "--no-fill" in sys.argv:
        sys.argv.remove("--no-fill")
        tiles._fill_classes = lambda entries, classes, tile: []
    sys.exit(as_called.main())
