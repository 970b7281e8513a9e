#!/usr/bin/env python3
"""What a CPU kernel of any page size (Variant.page_block_size 0) costs
against one compiled for the page size, as called: PagedAttention.run() on
numpy arrays (caches 64-byte aligned), back to back, rounds interleaved,
each kind of kernel in a session that holds only it. Every output is
checked against the float64 reference. fp16, GQA 32/8, head dim 128; a
decode b8 x 2048 keys and a causal prefill of 512 rows, at pages 16 and 32.

    python3 benchmarks/any_page.py [--cache DIR] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha
from turbine_fmha.build import aot
from turbine_fmha.core.arrays import aligned_empty
from turbine_fmha.kernels.variants import Variant
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HQ, HK, D = 32, 8, 128
TOL = 5e-3  # f16 output (tests/conftest.py OUT_TOL)
# (label, heads (nhead_q, nhead_k; 0, 0: any), page: None the call's, 0 any)
KINDS = (
    ("exact heads, the page", (HQ, HK), None),
    ("any heads, the page", (0, 0), None),
    ("exact heads, any page", (HQ, HK), 0),
    ("any heads, any page", (0, 0), 0),
)


def _case(rng, page, batch, seqlen_q, keys):
    used = batch * keys // page
    pages = used + 4
    bt = rng.permutation(pages)[:used].reshape(batch, -1).astype(np.int32)
    sl = np.full(batch, keys, np.int32)
    k, v = aligned_empty((pages, page, HK, D), np.float16), aligned_empty((pages, page, HK, D), np.float16)
    k[...] = rng.standard_normal(k.shape)
    v[...] = rng.standard_normal(v.shape)
    q = rng.standard_normal((batch, seqlen_q, HQ, D)).astype(np.float16)
    return q, k, v, bt, sl


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="build/bench-any-page", help="where the kernels are built")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="calls per round")
    ap.add_argument("--pages", default="16,32")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    runs = {}
    cases = ("decode b8 x 2048", "prefill 512 causal")
    pages = [int(p) for p in args.pages.split(",")]
    for page in pages:
        data = {cases[0]: (_case(rng, page, 8, 1, 2048), False), cases[1]: (_case(rng, page, 1, 512, 512), True)}
        for label, (hq, hk), pg in KINDS:
            variants = [Variant("f16", D, D, hq, hk, page if pg is None else pg, m) for m in ("none", "bottom_right")]
            out_dir = Path(args.cache) / variants[0].name
            aot.build(out_dir, ["host"], variants)
            s = turbine_fmha.Session("cpu", artifact_dir=out_dir)
            for case, ((q, k, v, bt, sl), causal) in data.items():
                attn = turbine_fmha.PagedAttention(s).plan(
                    bt,
                    sl,
                    num_pages=k.shape[0],
                    page_block_size=page,
                    nhead_q=HQ,
                    nhead_k=HK,
                    hdim=D,
                    dtype=np.float16,
                    seqlen_q=q.shape[1],
                    causal=causal,
                    kv_rows_finite=True,
                )
                out = attn.run(q, k, v)
                assert s.last_variant in variants, s.last_variant
                ref = fmha_fwd_paged_ref(
                    q,
                    k,
                    v,
                    bt,
                    sl,
                    mask_type="bottom_right" if causal else "none",
                    window_size_right=0 if causal else -1,
                )[0]
                err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
                assert err < TOL, (label, case, err)
                runs[page, label, case] = (lambda a=attn, q=q, k=k, v=v: a.run(q, k, v), [])
    for _ in range(args.rounds):
        for fn, times in runs.values():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times.append((time.perf_counter() - t0) / args.calls * 1e3)
    print(f"run() ms, median of {args.rounds} rounds x {args.calls} calls (ratio to exact heads at the page)")
    print("| page | kernel | " + " | ".join(cases) + " |")
    print("|---|---|" + "---|" * len(cases))
    for page in pages:
        for label, _, _ in KINDS:
            cells = []
            for case in cases:
                ms = statistics.median(runs[page, label, case][1])
                base = statistics.median(runs[page, KINDS[0][0], case][1])
                cells.append(f"{ms:.2f} ({ms / base:.2f}x)")
            print(f"| {page} | {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
