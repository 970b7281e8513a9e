#!/usr/bin/env python3
"""Host time of each piece of the deferred stale-row check on a torch CUDA
cache (decode b32 x 4096 shape: 672 stale rows of [8, 128] f16), each
piece queued N times back to back, then one sync: what run()'s default
path adds to the host's side of a call. "old" is the check of cf1d16a
(isfinite, then all), "now" plan.rows_sum behind a reused pinned float
and event (runtime.executor.LaterBool).

    python3 benchmarks/probes/h200_check_pieces.py
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from turbine_fmha.calls.plan import rows_sum, stale_rows
from turbine_fmha.runtime.executor import LaterBool

PAGE, HK, D, N = 16, 8, 128, 2000


def timed(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        out.append(host / N * 1e6)
    return statistics.median(out)


def main() -> int:
    rng = np.random.default_rng(0)
    batch, keys = 32, 4096
    sk = np.full(batch, keys - 5, np.int32)
    width = -(-keys // PAGE)
    pages = batch * width
    bt = rng.permutation(pages).reshape(batch, width).astype(np.int32)
    v = torch.randn(pages, PAGE, HK, D, dtype=torch.float16, device="cuda")
    p, r = stale_rows(bt, sk, np.zeros(batch, np.int32), PAGE)
    pi, ri = torch.from_numpy(p).cuda(), torch.from_numpy(r).cuda()
    flat = torch.from_numpy(p * PAGE + r).cuda()
    view = v.view(-1, HK * D)
    rows = v[pi, ri]
    flag = rows.isfinite().all()
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    ev = torch.cuda.Event()
    pieces = {
        "v[pages, rows] (advanced index)": lambda: v[pi, ri],
        "index_select(view, 0, flat)": lambda: torch.index_select(view, 0, flat),
        "rows.float()": lambda: rows.float(),
        "isfinite(rows)": lambda: torch.isfinite(rows),
        "isfinite(rows).all()": lambda: rows.isfinite().all(),
        "pinned empty": lambda: torch.empty((), dtype=torch.bool, pin_memory=True),
        "copy_ to pinned, non_blocking": lambda: host.copy_(flag, non_blocking=True),
        "Event() + record": lambda: torch.cuda.Event().record(),
        "reused event record": lambda: ev.record(),
        "event.synchronize + bool(host)": lambda: (ev.synchronize(), bool(host)),
        "flag.item()": lambda: flag.item(),
        "old check: v[p, r].float().isfinite().all() + pinned + copy + event": lambda: _old(v, pi, ri),
        "new: index_select + isfinite().all() + copy to reused pinned + reused event": lambda: _new(
            view, flat, host, ev
        ),
        "rows.sum(dtype=float32)": lambda: rows.sum(dtype=torch.float32),
        "now: rows_sum + LaterBool start (queued, not read)": lambda: _now_start(v, [pi, ri]),
        "now: rows_sum + LaterBool start + value (with its wait)": lambda: _now(v, [pi, ri]),
    }
    for name, fn in pieces.items():
        print(f"{name}: {timed(fn):.1f} us host per call", flush=True)
    return 0


def _old(v, pi, ri):
    f = v[pi, ri].float().isfinite().all()
    h = torch.empty((), dtype=torch.bool, pin_memory=True)
    h.copy_(f, non_blocking=True)
    torch.cuda.Event().record()


def _now_start(v, index):
    b = LaterBool(lambda: rows_sum(v, index), math.isfinite)
    b.start()
    return b


def _now(v, index):
    b = LaterBool(lambda: rows_sum(v, index), math.isfinite)
    b.start()
    assert b.value()


def _new(view, flat, host, ev):
    host.copy_(torch.index_select(view, 0, flat).isfinite().all(), non_blocking=True)
    ev.record()


if __name__ == "__main__":
    sys.exit(main())
