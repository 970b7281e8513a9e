#!/usr/bin/env python3
"""On a CUDA machine: fmha_fwd_paged with torch CUDA caches (imported
zero-copy through DLPack) against the same call with host caches, checked
against the float64 reference, with timings of both.

    PYTHONPATH=<site with iree-base-runtime> python3 scripts/h200_torch_interop.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha  # noqa: E402
from turbine_fmha.reference import fmha_fwd_paged_ref  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    args = ap.parse_args()
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    b, sk, hq, hk, d, page = 32, 4096, 32, 8, 128, 16
    pages = b * sk // page
    k = rng.standard_normal((pages + 1, page, hk, d), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((pages + 1, page, hk, d), dtype=np.float32).astype(np.float16)
    bt = rng.permutation(pages + 1)[:pages].reshape(b, -1).astype(np.int32)
    sl = np.full(b, sk, np.int32)
    q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
    kt, vt, qt = (torch.from_numpy(x).cuda() for x in (k, v, q))
    ok = True
    for label, (qq, kk, vv) in (("host numpy caches", (q, k, v)), ("torch CUDA caches (DLPack)", (qt, kt, vt))):
        out = turbine_fmha.fmha_fwd_paged(qq, kk, vv, bt, sl, session=session, device="cuda")
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            turbine_fmha.fmha_fwd_paged(qq, kk, vv, bt, sl, session=session, device="cuda")
            times.append((time.perf_counter() - t0) * 1e3)
        o = out.cpu().numpy() if isinstance(out, torch.Tensor) else out
        sample = [0, b - 1]
        ref, _ = fmha_fwd_paged_ref(q[sample], k, v, bt[sample], sl[sample])
        err = float(np.abs(o[sample].astype(np.float64) - ref).max() / np.abs(ref).max())
        dev = out.device if isinstance(out, torch.Tensor) else "numpy"
        print(f"{label}: median {statistics.median(times):.2f} ms per API call, rel err {err:.2e}, output on {dev}")
        ok &= err <= 5e-3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
