#!/usr/bin/env python3
"""On a CUDA machine: the reliability fixes of issue 12 on the shipped GPU
kernels (default CUDA set, GQA 32/8, hdim 128, page 16), against the
float64 reference.

- Scores of ~1e6 and ~1e8 (three identical hot keys in three pages), with
  and without split-KV: the output is the mean of their V rows.
- A bias of -1e30 on every key, with and without split-KV.
- A NaN key under that bias: exactly the reference's NaN rows.
- A device-resident PagedKVCache: one request stores +Inf (a float32 7e4
  in an f16 pool) and is freed; the next one reuses the page and must stay
  finite and exact.
- A torch CUDA out that overlaps the K cache is refused by name.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_reliability.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HQ, HK, D, PAGE = 32, 8, 128, 16
TOL = 5e-3  # f16 output: one rounding of P and of the output (tests/conftest.py)


def _problem(rng, batch=2, keys=(40, 35), pages=12):
    k = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    q = rng.standard_normal((batch, 1, HQ, D)).astype(np.float16)
    bt = rng.permutation(pages)[: batch * 3].reshape(batch, 3).astype(np.int32)
    return q, k, v, bt, np.array(keys, np.int32)


def _err(out, ref):
    out = np.asarray(out, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: a dry run of this script on the CPU (online kernels compiled on demand)",
    )
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
    else:
        session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(12)
    failures = 0

    def report(name, ok, detail):
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    for c in (1000.0, 9984.0):  # scores c^2: ~1e6, ~1e8
        q, k, v, bt, sk = _problem(rng)
        q[...] = 0
        q[..., 0] = c
        for b in range(2):
            for t in (3, 20, 33):
                k[bt[b, t // PAGE], t % PAGE] = 0
                k[bt[b, t // PAGE], t % PAGE, :, 0] = c
        ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, scale=1.0)
        for splits in (1, 3):
            out = turbine_fmha.fmha_fwd_paged(
                q, k, v, bt, sk, scale=1.0, num_splits=splits, session=session, device=dev
            )
            e = _err(out, ref)
            report(f"scores {c * c:.0e}, splits {splits}", e <= TOL, f"rel err {e:.2e} ({session.last_variant.name})")

    q, k, v, bt, sk = _problem(rng)
    bias = np.full((1, 1, 1, 48), -1e30, np.float32)
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, bias=bias)
    for splits in (1, 2):
        out = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, bias=bias, num_splits=splits, session=session, device=dev)
        e = _err(out, ref)
        report(f"bias -1e30 on every key, splits {splits}", e <= TOL, f"rel err {e:.2e} ({session.last_variant.name})")

    k[bt[0, 1], 3, 0, 5] = np.nan
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, bias=bias)
    out = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, bias=bias, session=session, device=dev)
    same = bool(np.array_equal(np.isnan(out), np.isnan(ref))) and np.isnan(ref).any()
    report(
        "NaN key under a -1e30 bias",
        same,
        f"{int(np.isnan(out).sum())} NaN outputs, reference {int(np.isnan(ref).sum())}",
    )

    cache = turbine_fmha.PagedKVCache(4, PAGE, HK, D, "f16", session=session)
    a = cache.allocate()
    v_a = rng.standard_normal((6, HK, D)).astype(np.float16)
    v_a[4] = np.inf  # appends take the pool's dtype: the +Inf is stored as given
    cache.append(a, rng.standard_normal((6, HK, D)).astype(np.float16), v_a)
    cache.free(a)
    b = cache.allocate()
    cache.append(
        b, rng.standard_normal((3, HK, D)).astype(np.float16), rng.standard_normal((3, HK, D)).astype(np.float16)
    )
    q = rng.standard_normal((1, 1, HQ, D)).astype(np.float16)
    out = cache.attend(q, [b])
    kb, vb = cache.gather(b)
    ref, _ = fmha_fwd_paged_ref(q, kb[None], vb[None], np.zeros((1, 1), np.int32), np.array([3], np.int32))
    e = _err(out, ref) if np.isfinite(out).all() else float("inf")
    report(
        "freed request's +Inf cannot poison the next (device pool)",
        e <= TOL,
        f"rel err {e:.2e}, values_finite={cache.values_finite} ({session.last_variant.name})",
    )

    import torch

    tdev = session.torch_device
    q, k, v, bt, sk = _problem(rng)
    kt = torch.from_numpy(k).to(tdev)
    out = kt.reshape(-1)[: q.size].reshape(q.shape)
    try:
        turbine_fmha.fmha_fwd_paged(
            torch.from_numpy(q).to(tdev), kt, torch.from_numpy(v).to(tdev), bt, sk, out=out, session=session, device=dev
        )
        report(f"torch {tdev} out overlapping k_cache", False, "accepted")
    except ValueError as e:
        report(f"torch {tdev} out overlapping k_cache", "out overlaps k_cache" in str(e), str(e))
    print(f"{failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
