#!/usr/bin/env python3
"""Where an fmha_fwd_paged call spends its host time: cProfile over repeated
decode calls (b32 x 4096 keys, GQA 32/8, hdim 128, page 16, fp16) with the
caches given the way a service would: torch CUDA tensors on a cuda session,
or 64-byte aligned host arrays on the CPU. Prints the median call time and
the functions with the most cumulative time.

    python benchmarks/api_profile.py --device cpu --artifacts artifacts
    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/api_profile.py --device cuda --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha
from turbine_fmha.api.cache import aligned_zeros
from turbine_fmha.core.arrays import is_torch
from turbine_fmha.runtime.executor import Results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlen-k", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--planned",
        action="store_true",
        help="profile PagedAttention.run() on tables planned once (kv_rows_finite=True), and time the "
        "kernel alone (back-to-back calls, one final wait)",
    )
    ap.add_argument(
        "--iree-flags", default="", help="IREE runtime flags to parse first, e.g. --cuda_async_allocations=false"
    )
    args = ap.parse_args()
    if args.iree_flags:
        import iree.runtime as rt

        rt.flags.parse_flags(*args.iree_flags.split())
    session = turbine_fmha.Session(args.device, artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    b, sk, hq, hk, d, page = args.batch, args.seqlen_k, 32, 8, 128, 16
    pages = b * sk // page
    k = aligned_zeros((pages, page, hk, d), np.float16)
    v = aligned_zeros((pages, page, hk, d), np.float16)
    k[...] = rng.standard_normal(k.shape, dtype=np.float32)
    v[...] = rng.standard_normal(v.shape, dtype=np.float32)
    bt = rng.permutation(pages).reshape(b, -1).astype(np.int32)
    sl = np.full(b, sk - 5, np.int32)
    q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
    if args.device == "cuda":
        import torch

        q, k, v = (torch.from_numpy(x).cuda() for x in (q, k, v))

    if args.planned:
        attn = turbine_fmha.PagedAttention(session).plan(
            bt,
            sl,
            num_pages=pages,
            page_block_size=page,
            nhead_q=hq,
            nhead_k=hk,
            hdim=d,
            dtype="f16",
            kv_rows_finite=True,
        )
        print(f"kernel alone: {_kernel_alone_ms(attn, q, k, v, args.calls):.3f} ms per call (device work only)")

    def call():
        if args.planned:
            out = attn.run(q, k, v)
        else:
            out = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sl, session=session, device=args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return out

    call()
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    print(
        f"{args.device}: median {statistics.median(times):.2f} ms per call over {args.calls} calls, "
        f"kernel {session.last_variant.name}, results exported zero-copy: {getattr(session, '_exports', True)}"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


def _kernel_alone_ms(attn, q, k, v, calls: int) -> float:
    """The planned kernel calls back to back on device-resident arguments,
    one wait at the end: the device time run() is compared with."""
    import iree.runtime as rt

    plan, session = attn._plan, attn.session
    variant = plan.variant(0, plan.parts[0].guard_free)
    steps = plan.device_steps(0, variant, Results(session, q if is_torch(q) else None))
    loaded = session._load(variant)

    def fn(*args):
        return loaded.invoke(list(args), 2)

    dev = session.device_of()

    def arg(x):
        return session.import_torch(x) if is_torch(x) else rt.asdevicearray(dev, x)

    kd, vd = arg(k), arg(v)
    qs = [arg(st.q(q)) for st in steps]
    for _ in range(3):
        res = [fn(qq, kd, vd, *st.args) for st, qq in zip(steps, qs)]
    res[-1][1].to_host()
    t0 = time.perf_counter()
    for _ in range(calls):
        res = [fn(qq, kd, vd, *st.args) for st, qq in zip(steps, qs)]
    res[-1][1].to_host()  # waits for the device work
    return (time.perf_counter() - t0) * 1e3 / calls


if __name__ == "__main__":
    sys.exit(main())
