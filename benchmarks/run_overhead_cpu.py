#!/usr/bin/env python3
"""The host time PagedAttention.run() adds to its kernel on a CPU session.

The kernels run on the same cores as the caller, so the kernel cannot be
timed apart and subtracted across separate runs (a 2-core VM's kernel times
swing by more than the whole overhead). Instead each run() is timed with
its own kernel call inside it: the span from the first enqueue to the end
of the wait is the kernel's, the rest of run() is host work. Decode shapes
(GQA 32/8, hdim 128, page 16, f16), caches 64-byte aligned as a service
keeps them (read in place), tables planned once:

- a tiny decode (b1 x 64 keys), back to back: the host work with warm caches;
- the same with a 128 MiB copy before each call: the same host work after
  something evicted the caches, as a large kernel does;
- decode b8 x 2048 keys, back to back (its kernel reads 67 MB of K/V).

    python3 benchmarks/run_overhead_cpu.py [--artifacts DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha
from turbine_fmha.core.arrays import aligned_empty
from turbine_fmha.runtime import invoke

_marks: list[float] = []


def _instrument() -> None:
    """Marks the first enqueue of a run() and the end of its wait."""
    enqueue, wait = invoke.Loaded.enqueue, invoke._Call.wait

    def timed_enqueue(self, args, after=None, own_timeline=False):
        if not own_timeline:  # a run()'s first call (Session.run_variants)
            _marks.append(time.perf_counter())
        return enqueue(self, args, after, own_timeline)

    def timed_wait(self):
        wait(self)
        _marks.append(time.perf_counter())

    invoke.Loaded.enqueue, invoke._Call.wait = timed_enqueue, timed_wait


def measure(session, rng, batch, keys, calls, evict=None) -> dict:
    hq, hk, d, page, dtype = 32, 8, 128, 16, np.float16
    pages = batch * keys // page + 4
    bt = rng.permutation(pages)[: batch * keys // page].reshape(batch, -1).astype(np.int32)
    sl = np.full(batch, keys - 3, np.int32)
    k, v = aligned_empty((pages, page, hk, d), dtype), aligned_empty((pages, page, hk, d), dtype)
    k[...] = rng.standard_normal(k.shape)
    v[...] = rng.standard_normal(v.shape)
    q = rng.standard_normal((batch, 1, hq, d)).astype(dtype)
    attn = turbine_fmha.PagedAttention(session).plan(
        bt, sl, num_pages=pages, page_block_size=page, nhead_q=hq, nhead_k=hk, hdim=d, dtype=dtype, kv_rows_finite=True
    )
    total, kernel = [], []
    for i in range(calls + 5):
        if evict is not None:
            evict[1][...] = evict[0]
        _marks.clear()
        t0 = time.perf_counter()
        attn.run(q, k, v)
        t1 = time.perf_counter()
        if i >= 5:
            total.append(t1 - t0)
            kernel.append(_marks[-1] - _marks[0])
    host = [a - b for a, b in zip(total, kernel)]
    ms = lambda xs, p=50: float(np.percentile(xs, p)) * 1e3
    return dict(run=ms(total), kernel=ms(kernel), host=ms(host), host_p10=ms(host, 10), host_p90=ms(host, 90))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=None, help="artifact directory (default: the user cache)")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    _instrument()
    session = turbine_fmha.Session("cpu", artifact_dir=args.artifacts, compile_missing=True)
    rng = np.random.default_rng(0)
    big = np.ones(1 << 27, np.uint8)
    cases = [
        ("decode b1 x 64, back to back", 1, 64, args.calls, None),
        ("decode b1 x 64, 128 MiB copied before each call", 1, 64, args.calls // 3, (big, np.zeros_like(big))),
        ("decode b8 x 2048, back to back", 8, 2048, 30, None),
    ]
    print("| case | run() ms | kernel (enqueue to wait) ms | host work ms, median (p10-p90) |")
    print("|---|---|---|---|")
    for name, b, keys, calls, evict in cases:
        r = measure(session, rng, b, keys, calls, evict)
        print(
            f"| {name} | {r['run']:.3f} | {r['kernel']:.3f} | {r['host']:.3f} ({r['host_p10']:.3f}-{r['host_p90']:.3f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
