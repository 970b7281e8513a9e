#!/usr/bin/env python3
"""Host time of one PagedKVCache.append_batch of a decode step (one f16
row of 8 heads x 128 per sequence, a host pool, pages of 16) at several
batch sizes: the best of 5 rounds of 100 back-to-back calls. Pass a
repository root to time another tree (a worktree of an older commit).

    .venv/bin/python benchmarks/probes/append_batch_cost.py [ROOT]
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[2]))
from turbine_fmha.api.cache import PagedKVCache

for batch in (1, 8, 16, 32, 128, 256):
    pool = PagedKVCache(batch * 40, 16, 8, 128, "f16")
    seqs = [pool.allocate() for _ in range(batch)]
    rows = np.random.default_rng(0).standard_normal((batch, 1, 8, 128)).astype(np.float16)
    for _ in range(20):
        pool.append_batch(seqs, rows, rows)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(100):
            pool.append_batch(seqs, rows, rows)
        best = min(best, (time.perf_counter() - t0) / 100 * 1e6)
    print(f"batch {batch:4d}: {best:6.0f} us per append_batch", flush=True)
