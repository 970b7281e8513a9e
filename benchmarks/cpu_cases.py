"""The harness of the CPU benchmarks that compare kernels as called
(cpu_targets.py, any_page.py): the shapes (fp16, GQA 32/8, head dim 128; a
decode b8 x 2048 keys and a causal prefill of 512 rows over 512 keys),
PagedAttention.run() planned once on numpy arrays (caches 64-byte aligned,
read in place) and checked against the float64 reference, and rounds of
calls interleaved across everything compared, so that the machine's drift
falls on every kind alike."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha
from turbine_fmha.core.arrays import aligned_empty
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HQ, HK, D = 32, 8, 128
TOL = 5e-3  # f16 output (tests/conftest.py OUT_TOL)
CASES = ("decode b8 x 2048", "prefill 512 causal")


def cases(rng, page: int) -> dict:
    """CASES -> ((q, k, v, block_table, seqlen_k), causal), caches of
    `page`-row pages."""
    return {CASES[0]: (_case(rng, page, 8, 1, 2048), False), CASES[1]: (_case(rng, page, 1, 512, 512), True)}


def _case(rng, page, batch, seqlen_q, keys):
    used = batch * -(-keys // page)
    pages = used + 4
    bt = rng.permutation(pages)[:used].reshape(batch, -1).astype(np.int32)
    sl = np.full(batch, keys, np.int32)
    k, v = aligned_empty((pages, page, HK, D), np.float16), aligned_empty((pages, page, HK, D), np.float16)
    k[...] = rng.standard_normal(k.shape)
    v[...] = rng.standard_normal(v.shape)
    q = rng.standard_normal((batch, seqlen_q, HQ, D)).astype(np.float16)
    return q, k, v, bt, sl


def checked_run(session, problem, causal: bool, what):
    """run() of `problem` planned once on `session`, its output checked
    against the float64 reference (`what` names it in a failure): a
    function of no arguments that calls it again."""
    q, k, v, bt, sl = problem
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        sl,
        num_pages=k.shape[0],
        page_block_size=k.shape[1],
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype=np.float16,
        seqlen_q=q.shape[1],
        causal=causal,
        kv_rows_finite=True,
    )
    out = attn.run(q, k, v)
    mask = dict(mask_type="bottom_right", window_size_right=0) if causal else {}
    ref = fmha_fwd_paged_ref(q, k, v, bt, sl, **mask)[0]
    err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
    assert err < TOL, (what, err)
    return lambda: attn.run(q, k, v)


def interleaved(runs: dict, rounds: int, calls: int) -> dict:
    """Key -> median ms per call of runs[key](), over `rounds` rounds of
    `calls` calls, every key once per round."""
    times = {key: [] for key in runs}
    for _ in range(rounds):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[key].append((time.perf_counter() - t0) / calls * 1e3)
    return {key: statistics.median(t) for key, t in times.items()}
