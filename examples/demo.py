#!/usr/bin/env python3
"""The main job on the CPU: load the built host artifacts through a Session,
serve a few decode and prefill requests over one shared page pool, verify
each against the float64 reference, print a table.

Run after `turbine-fmha build --targets host --artifacts artifacts` (scripts/run_demo.sh
does both).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

# Relative max error bound vs the float64 reference (see tests/test_numerics.py
# for why): fp16/bf16 inputs round P and the output to 11/8 mantissa bits.
TOL = {"f16": 1e-2, "bf16": 2e-2, "f32": 1e-5}
NP_DTYPE = {"f16": np.float16, "f32": np.float32}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=str(Path(__file__).resolve().parent.parent / "artifacts"))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--compile-missing",
        action="store_true",
        help="compile the variants it needs into the cache instead of requiring built artifacts",
    )
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    session = turbine_fmha.Session("cpu", artifact_dir=args.artifacts, compile_missing=args.compile_missing)

    nhead_q, nhead_k, hdim, page = 32, 8, 128, 16
    num_pages = 512
    dtype = "f16"
    k_cache = rng.standard_normal((num_pages, page, nhead_k, hdim)).astype(NP_DTYPE[dtype])
    v_cache = rng.standard_normal((num_pages, page, nhead_k, hdim)).astype(NP_DTYPE[dtype])
    free_pages = list(rng.permutation(num_pages))

    def alloc(seqlen_k: int, width: int) -> np.ndarray:
        n = -(-seqlen_k // page)
        row = np.full(width, -1, np.int32)  # unused slots hold garbage
        row[:n] = [free_pages.pop() for _ in range(n)]
        return row

    # (name, batch, seqlen_q, seqlen_k per sequence, mask, extra features)
    requests = [
        ("decode", 4, 1, [517, 1024, 33, 260], "none", {}),
        ("decode", 8, 1, [100, 200, 300, 400, 500, 600, 700, 800], "none", {}),
        ("prefill", 1, 200, [200], "bottom_right", {}),
        ("prefill+cache", 2, 64, [300, 130], "bottom_right", {}),
        ("chunk", 1, 48, [96], "top_left", {}),
        ("streaming", 2, 16, [400, 90], "bottom_right", dict(window_size_left=64, sink_size=4)),
        ("alibi", 2, 32, [150, 40], "bottom_right", dict(alibi_slopes=2.0 ** (-8.0 * np.arange(1, 33) / 32))),
        ("attn sinks", 3, 1, [300, 7, 64], "bottom_right", dict(sinks=rng.uniform(-1, 1, 32).astype(np.float32))),
    ]
    print(
        f"{'request':<14} {'batch':>5} {'sq':>4} {'max sk':>6} {'mask':<13} {'variant':<62} {'ms':>8} {'rel err':>9}  ok"
    )
    failures = 0
    for name, b, sq, sks, mask, extra in requests:
        width = max(-(-s // page) for s in sks) + 2
        bt = np.stack([alloc(s, width) for s in sks])
        sk = np.array(sks, np.int32)
        q = rng.standard_normal((b, sq, nhead_q, hdim)).astype(NP_DTYPE[dtype])
        # Masked requests are causal: window (-1, 0), unless the request says.
        kw = dict(mask_type=mask, window_size_right=0 if mask != "none" else -1, **extra)
        turbine_fmha.fmha_fwd_paged(q, k_cache, v_cache, bt, sk, session=session, **kw)  # load/warm
        t0 = time.perf_counter()
        out, lse = turbine_fmha.fmha_fwd_paged(q, k_cache, v_cache, bt, sk, return_lse=True, session=session, **kw)
        ms = (time.perf_counter() - t0) * 1e3
        variant = session.last_variant
        ref, ref_lse = fmha_fwd_paged_ref(q, k_cache, v_cache, bt, sk, **kw)
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        lse_ok = np.allclose(lse, ref_lse, atol=1e-2, rtol=0)
        ok = err <= TOL[dtype] and lse_ok
        failures += not ok
        print(
            f"{name:<14} {b:>5} {sq:>4} {max(sks):>6} {mask:<13} {variant.name:<62} {ms:>8.1f} {err:>9.2e}  {'yes' if ok else 'NO'}"
        )
        for row in bt:  # return the pages to the pool
            free_pages.extend(int(p) for p in row if p >= 0)
    print("all requests verified against the float64 reference" if not failures else f"{failures} request(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
