#!/usr/bin/env python3
"""What the stale-row check (plan.rows_finite over plan.stale_rows) costs on
torch CUDA caches: the rows it reads now (every row of each table row's
first page, and the tail of its last page) against the tail rows alone (the
check before bd31521), for the as_called decode shapes; each check timed
back to back with its sync, rounds interleaved.

    python3 benchmarks/probes/h200_stale_check.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from turbine_fmha.calls.plan import rows_finite, stale_rows

PAGE, HK, D = 16, 8, 128


def tail_only(bt, sk, page):
    rows = np.arange(page)[None, :]
    last = (sk.astype(np.int64) - 1) // page
    tail = rows >= (sk - last * page)[:, None]
    pages = np.broadcast_to(bt[np.arange(len(sk)), last][:, None], tail.shape)[tail]
    return pages.astype(np.int64), np.broadcast_to(rows, tail.shape)[tail].astype(np.int64)


def main() -> int:
    rng = np.random.default_rng(0)
    for batch, keys in ((32, 4096), (4, 32768), (1, 32768)):
        sk = np.full(batch, keys - 5, np.int32)  # a partial last page
        width = -(-keys // PAGE)
        pages = batch * width
        bt = rng.permutation(pages)[: batch * width].reshape(batch, width).astype(np.int32)
        v = torch.randn(pages, PAGE, HK, D, dtype=torch.float16, device="cuda")
        kinds = {
            "now": [torch.from_numpy(i).cuda() for i in stale_rows(bt, sk, np.zeros(batch, np.int32), PAGE)],
            "tail only": [torch.from_numpy(i).cuda() for i in tail_only(bt, sk, PAGE)],
        }
        times = {k: [] for k in kinds}
        for _ in range(7):
            for k, index in kinds.items():
                assert rows_finite(v, index)
                t0 = time.perf_counter()
                for _ in range(200):
                    rows_finite(v, index)
                times[k].append((time.perf_counter() - t0) / 200 * 1e3)
        cells = ", ".join(f"{k} {statistics.median(t):.4f} ms ({len(kinds[k][0])} rows)" for k, t in times.items())
        print(f"decode b{batch} x {keys}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
