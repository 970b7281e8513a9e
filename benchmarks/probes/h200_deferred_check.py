#!/usr/bin/env python3
"""On a CUDA machine: run()'s deferred stale-row check on torch CUDA caches
(kv_rows_finite=None, the default), against the float64 reference.

Checks, on the shipped kernels (GQA 32/8, hdim 128, page 16, f16), for a
decode, a causal prefill and a mixed group-mode batch (decodes and a
prefill in one plan): with NaN in a stale V row, the first run() runs
unguarded, finds the rows non-finite after the wait, and runs again guarded
(two kernel runs, exact result, into a poisoned `out` too); the next run()
on that cache checks first and runs once, guarded; once the rows are
finite, the check passes and later runs are one unguarded kernel run.

Then times, back to back (one torch.cuda.synchronize() per round), rounds
interleaved: a plan with kv_rows_finite=True, the default plan on finite
caches (the check deferred behind the kernels), and the default plan on a
cache whose stale rows are NaN (checked before, guarded kernels).

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_deferred_check.py --artifacts artifacts-cuda
    .venv/bin/python benchmarks/probes/h200_deferred_check.py --device cpu --artifacts /tmp/tf-deferred  # dry run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.api import attention
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HQ, HK, D, PAGE = 32, 8, 128, 16
TOL = 5e-3  # f16 output: one rounding of P and of the output (tests/conftest.py)
MASK = dict(mask_type="bottom_right", window_size_right=0)


def _case(rng, seqlens_q, seqlens_k, group: bool):
    width = max(-(-k // PAGE) for k in seqlens_k)
    pages = len(seqlens_k) * width + 3
    bt = rng.permutation(pages)[: len(seqlens_k) * width].reshape(len(seqlens_k), width).astype(np.int32)
    k = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    if group:
        seqstart = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
        q = rng.standard_normal((int(seqstart[-1]), HQ, D)).astype(np.float16)
    else:
        seqstart = None
        q = rng.standard_normal((len(seqlens_k), seqlens_q[0], HQ, D)).astype(np.float16)
    return q, k, v, bt, np.array(seqlens_k, np.int32), seqstart


def _plan(session, bt, sk, k, q, seqstart, kv_rows_finite=None):
    kw = dict(seqstart_q=seqstart) if seqstart is not None else dict(seqlen_q=q.shape[1])
    return turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=k.shape[0],
        page_block_size=PAGE,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype="f16",
        kv_rows_finite=kv_rows_finite,
        **kw,
        **MASK,
    )


def _stale(bt, sk):
    """(page, first stale row) of each sequence whose last page is partial."""
    return [(int(bt[b, (n - 1) // PAGE]), n % PAGE) for b, n in enumerate(sk) if n % PAGE]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run (kernels compiled)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    dev = args.device
    if dev == "cpu":
        session = turbine_fmha.Session(
            "cpu",
            formulation="online",
            compile_missing=True,
            cache_dir=args.artifacts,
            artifact_dir=Path(args.artifacts) / "none",
        )
        # The CPU checks on the host at no wait; give it the GPU's control flow.
        attention._Plan._defers = staticmethod(lambda v_cache: True)
    else:
        session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    calls = []
    run_variants = session.run_variants

    def counted(variant, *a, **k):
        calls.append(variant)
        return run_variants(variant, *a, **k)

    session.run_variants = counted
    rng = np.random.default_rng(27)
    failures = 0

    def report(name, ok, detail):
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    cases = {
        "decode b8": ([1] * 8, [1000, 517, 33, 2048, 700, 45, 1999, 260], False),
        "causal prefill b2 x 300": ([300, 300], [300, 300], False),
        "mixed: 3 decodes + a 200-row prefill": ([1, 200, 1, 1], [900, 200, 77, 1500], True),
    }
    timed = {}
    for name, (sq, skl, group) in cases.items():
        q, k, v, bt, sk, seqstart = _case(rng, sq, skl, group)
        stale = _stale(bt, sk)
        b_nan = stale[0]
        v[b_nan[0], b_nan[1] :] = np.nan
        ref, ref_lse = fmha_fwd_paged_ref(
            q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), bt, sk, seqstart_q=seqstart, **MASK
        )
        qt, kt, vt = (torch.from_numpy(a).to(dev) for a in (q, k, v))
        attention._NONFINITE_SEEN.clear()
        attn = _plan(session, bt, sk, k, q, seqstart)

        def run(expect, label):
            calls.clear()
            out = torch.full(qt.shape[:-1] + (D,), float("nan"), dtype=torch.float16, device=dev)
            got, lse = attn.run(qt, kt, vt, out=out, return_lse=True)
            sync()
            o = got.float().cpu().numpy().astype(np.float64)
            err = float(np.abs(o - ref).max() / np.abs(ref).max())
            guards = [c.v_guard for c in calls]
            ok = got is out and np.isfinite(o).all() and err <= TOL and guards == expect
            report(f"{name}: {label}", ok, f"kernel runs guarded {guards} (expected {expect}), rel err {err:.2e}")

        parts = len(attn._plan.parts)
        if parts == 1:
            run([False, True], "NaN stale row, first run: unguarded, then guarded")
        else:  # the decode part alone runs again (the NaN is in a decode's page)
            run([False, False, True], "NaN stale row, first run: both parts unguarded, the decode part again guarded")
        for i in (2, 3):  # a mixed batch's prefill part has finite rows: unguarded
            run([True] + [False] * (parts - 1), f"NaN stale row, run {i}: checked first, guarded where it must")
        vt[b_nan[0], b_nan[1] :] = 0.25
        v[b_nan[0], b_nan[1] :] = 0.25
        run([False] * parts, "rows made finite: checked first, unguarded")
        run([False] * parts, "rows finite: deferred again, unguarded")
        if name.startswith("decode"):
            v_nan = vt.clone()
            v_nan[b_nan[0], b_nan[1] :] = float("nan")
            timed[name] = (qt, kt, vt, v_nan, bt, sk, k, q, seqstart)

    session.run_variants = run_variants
    for name, (qt, kt, vt, v_nan, bt, sk, k, q, seqstart) in timed.items():
        plans = {
            "run(finite)": (_plan(session, bt, sk, k, q, seqstart, kv_rows_finite=True), vt),
            "run() finite rows": (_plan(session, bt, sk, k, q, seqstart), vt),
            "run() NaN stale row": (_plan(session, bt, sk, k, q, seqstart), v_nan),
        }
        times = {label: [] for label in plans}
        for a, v_ in plans.values():  # warm up (the NaN cache's rerun included)
            for _ in range(3):
                a.run(qt, kt, v_)
        sync()
        for _ in range(args.rounds):
            for label, (a, v_) in plans.items():
                sync()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    a.run(qt, kt, v_)
                sync()
                times[label].append((time.perf_counter() - t0) / args.calls * 1e3)
        cells = ", ".join(f"{label} {statistics.median(t):.4f} ms" for label, t in times.items())
        print(f"{name} x {int(sk.max())} keys max, as called, median of {args.rounds} rounds: {cells}", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
