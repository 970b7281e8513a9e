#!/usr/bin/env python3
"""Per-dispatch device times of planned decode calls on the H200 (issue 14).

torch.profiler's CUDA activity (CUPTI) records IREE's kernels as well as
torch's, so a PagedAttention.run() on torch CUDA tensors shows each
dispatch of the module it runs and what each costs, next to the time of a
whole call back to back.

    PYTHONPATH=<site with iree-base-runtime> python3 scripts/h200_dispatch_profile.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HQ, HK, D, PAGE = 32, 8, 128, 16
SHAPES = ((1, 32768), (4, 32768), (32, 4096), (8, 4096), (64, 4096), (128, 4096))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import turbine_fmha

    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    for batch, keys in SHAPES:
        width = keys // PAGE
        pages = batch * width
        bt = rng.permutation(pages).astype(np.int32).reshape(batch, width)
        sk = np.full(batch, keys, np.int32)
        k = torch.randn(pages, PAGE, HK, D, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(batch, 1, HQ, D, dtype=torch.float16, device="cuda")
        attn = turbine_fmha.PagedAttention(session).plan(
            bt, sk, num_pages=pages, page_block_size=PAGE, nhead_q=HQ, nhead_k=HK, hdim=D, dtype="f16",
            kv_rows_finite=True)
        for _ in range(10):
            attn.run(q, k, v)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            attn.run(q, k, v)
        torch.cuda.synchronize()
        call_ms = (time.perf_counter() - t0) / args.calls * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                attn.run(q, k, v)
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type.name == "CUDA":
                per[e.name] += e.device_time / args.calls
        variant = attn._plan._variant(True)
        kv_gbs = batch * keys * HK * D * 2 * 2 / (call_ms * 1e-3) / 1e9
        print(f"decode b{batch} x {keys}: run() back to back {call_ms:.3f} ms ({kv_gbs:.0f} GB/s of KV), "
              f"splits {attn._plan.splits}, {variant.name}")
        for name, us in sorted(per.items(), key=lambda x: -x[1]):
            print(f"    {us:8.1f} us  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
