"""10,000 calls on one session from 4 threads: every result
equals the serial result for its problem, and resident memory stays flat
(a leak of one output per call would add ~6 MB here, of one cache copy per
call ~200 MB)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from conftest import make_problem

import turbine_fmha


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.heavy
def test_ten_thousand_calls_flat_memory(explicit_session, rng):
    probs = [
        make_problem(
            rng,
            dtype="f16",
            batch=2,
            seqlen_q=1,
            seqlens_k=[int(rng.integers(1, 64)) for _ in range(2)],
            nhead_q=4,
            nhead_k=2,
            hdim=64,
            page=16,
        )
        for _ in range(4)
    ]
    want = [turbine_fmha.fmha_fwd_paged(*p, session=explicit_session) for p in probs]
    for _ in range(300):  # warm up: loaded modules, thread contexts, allocator pools
        for p in probs:
            turbine_fmha.fmha_fwd_paged(*p, session=explicit_session)
    before = _rss_mb()
    n_threads, per_thread = 4, 2500
    bad = []

    def worker(t):
        for i in range(per_thread):
            j = (t + i) % len(probs)
            out = turbine_fmha.fmha_fwd_paged(*probs[j], session=explicit_session)
            if not np.array_equal(out, want[j]):
                bad.append((t, i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    growth = _rss_mb() - before
    print(f"10000 calls: RSS {before:.1f} MB -> +{growth:.1f} MB")
    assert not bad, bad[:5]
    assert growth < 20, f"resident memory grew {growth:.1f} MB over 10,000 calls"
