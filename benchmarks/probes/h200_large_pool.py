#!/usr/bin/env python3
"""On a CUDA machine: a K pool of more than 2^31 f16 elements with the
sequences' pages at its end (tests/test_large.py, on the GPU), checked
against the float64 reference.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_large_pool.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.api.cache import aligned_zeros
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

# The variants it needs (build with turbine-fmha build --targets cuda --variants ...).
VARIANTS = [
    "pagedkv_fwd_f16_d128x8_h8x8_pg16_mbr_lse_online_b1_q128",
    "pagedkv_fwd_f16_d128x8_h8x8_pg16_mbr_lse_online_b1_q128_nvguard",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    args = ap.parse_args()
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    page, hk, d, dv = 16, 8, 128, 8
    num_pages = (1 << 31) // (page * hk * d) + 64
    k = aligned_zeros((num_pages, page, hk, d), np.float16)
    v = aligned_zeros((num_pages, page, hk, dv), np.float16)
    used = np.array([[num_pages - 1, 5], [num_pages - 40, num_pages - 2]], np.int32)
    k[used] = rng.standard_normal(used.shape + (page, hk, d)).astype(np.float16)
    v[used] = rng.standard_normal(used.shape + (page, hk, dv)).astype(np.float16)
    sk = np.array([30, 25], np.int32)
    q = rng.standard_normal((2, 3, hk, d)).astype(np.float16)
    out = turbine_fmha.fmha_fwd_paged(q, k, v, used, sk, mask_type="bottom_right", session=session, device="cuda")
    ref, _ = fmha_fwd_paged_ref(q, k, v, used, sk, mask_type="bottom_right")
    err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
    print(
        f"K pool {k.size} elements (> 2^31: {k.size > 2**31}), variant {session.last_variant.name}: rel err {err:.2e}"
    )
    return 0 if err <= 5e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
