#!/usr/bin/env python3
"""Per-dispatch device times of planned decode calls on the H200.

torch.profiler's CUDA activity (CUPTI) records IREE's kernels as well as
torch's, so a PagedAttention.run() on torch CUDA tensors shows each
dispatch of the module it runs and what each costs, next to the time of a
whole call back to back.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_dispatch_profile.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

HQ, HK, D, PAGE = 32, 8, 128, 16
# (batch, keys, fp8 cache format or None)
SHAPES = (
    (1, 32768, None),
    (4, 32768, None),
    (32, 4096, None),
    (8, 4096, None),
    (64, 4096, None),
    (128, 4096, None),
    (32, 4096, "f8e4m3fn"),
    (1, 32768, "f8e4m3fn"),
)


def _back_to_back(fn, calls: int, warmup: int = 5) -> float:
    """ms per call of `fn`, calls queued back to back with one final wait."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def decode_problem(rng, batch: int, keys: int):
    """A decode of `batch` x `keys` over shuffled pages, on the GPU:
    (pages, block table, seqlen_k, q, k cache, v cache)."""
    import torch

    width = keys // PAGE
    pages = batch * width
    bt = rng.permutation(pages).astype(np.int32).reshape(batch, width)
    k = torch.randn(pages, PAGE, HK, D, dtype=torch.float16, device="cuda")
    q = torch.randn(batch, 1, HQ, D, dtype=torch.float16, device="cuda")
    return pages, bt, np.full(batch, keys, np.int32), q, k, torch.randn_like(k)


def prefill_problem(session, rng, rows: int, page: int):
    """A causal prefill of `rows` rows (f16) over shuffled pages on the GPU,
    planned: (PagedAttention, q, k cache, v cache)."""
    import torch

    import turbine_fmha

    pages = rows // page
    bt = rng.permutation(pages).astype(np.int32)[None]
    k = torch.randn(pages, page, HK, D, dtype=torch.float16, device="cuda")
    q = torch.randn(1, rows, HQ, D, dtype=torch.float16, device="cuda")
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        np.array([rows], np.int32),
        num_pages=pages,
        page_block_size=page,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype="f16",
        seqlen_q=rows,
        kv_rows_finite=True,
        mask_type="bottom_right",
        window_size_right=0,
    )
    return attn, q, k, torch.randn_like(k)


def dispatch_times(fn, calls: int) -> dict:
    """Device microseconds per call of `fn` by kernel name (CUPTI)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name] += e.device_time / calls
    return per


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument(
        "--decodes",
        default=None,
        help="only these fp16 decodes, e.g. 32x4096,1x32768 (batch x keys); no mixed batch or prefill",
    )
    args = ap.parse_args()
    import torch

    import turbine_fmha

    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    shapes = SHAPES if not args.decodes else [(*map(int, d.split("x")), None) for d in args.decodes.split(",")]
    for batch, keys, kv in shapes:
        pages, bt, sk, q, k, v = decode_problem(rng, batch, keys)
        if kv:
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        attn = turbine_fmha.PagedAttention(session).plan(
            bt,
            sk,
            num_pages=pages,
            page_block_size=PAGE,
            nhead_q=HQ,
            nhead_k=HK,
            hdim=D,
            dtype="f16",
            kv_dtype=k.dtype if kv else None,
            kv_rows_finite=True,
        )
        call_ms = _back_to_back(lambda: attn.run(q, k, v), args.calls, warmup=10)
        per = dispatch_times(lambda: attn.run(q, k, v), args.calls)
        variant = attn._plan._variant(attn._plan.guard_free)
        kv_gbs = batch * keys * HK * D * 2 * (1 if kv else 2) / (call_ms * 1e-3) / 1e9
        print(
            f"decode b{batch} x {keys}{' ' + kv if kv else ''}: run() back to back {call_ms:.3f} ms ({kv_gbs:.0f} GB/s of KV), "
            f"splits {attn._plan.parts[0].splits}, {variant.name}"
        )
        for name, us in sorted(per.items(), key=lambda x: -x[1]):
            print(f"    {us:8.1f} us  {name[:110]}")
    if not args.decodes:
        mixed_batch(session, rng, args.calls)
        prefill_pages(session, rng)
    return 0


def prefill_pages(session, rng, calls: int = 10) -> None:
    """The 4096-row causal prefill (f16) over pages of 16 and of 64 rows,
    run() back to back: the page is the online kernels' key step."""
    rows = 4096
    visible = rows * (rows + 1) // 2
    for page in (16, 64):
        attn, q, k, v = prefill_problem(session, rng, rows, page)
        ms = _back_to_back(lambda: attn.run(q, k, v), calls, warmup=3)
        tflops = 4.0 * HQ * D * visible / (ms * 1e-3) / 1e12
        print(
            f"prefill 4096 causal, page {page}: run() back to back {ms:.3f} ms = {tflops:.1f} TFLOP/s "
            f"(visible), {attn._plan.variant(0, True).name}"
        )


def mixed_batch(session, rng, calls: int) -> None:
    """Continuous batching: 2 prefills of 512 rows and 30 decodes over 2048
    keys in one group-mode call, against the prefills alone (group mode)
    plus the decodes alone (batch mode), each planned once and run back to
    back (the target was at most 1.3x the sum)."""
    import torch

    import turbine_fmha

    lens_q = [512, 512] + [1] * 30
    lens_k = [512, 512] + [2048] * 30
    need = [-(-n // PAGE) for n in lens_k]
    pages = sum(need)
    perm = rng.permutation(pages).astype(np.int32)
    bt = np.zeros((len(need), max(need)), np.int32)
    at = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[at : at + n]
        at += n
    sk = np.array(lens_k, np.int32)
    k = torch.randn(pages, PAGE, HK, D, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    starts = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    q = torch.randn(int(starts[-1]), HQ, D, dtype=torch.float16, device="cuda")
    layout = dict(
        num_pages=pages,
        page_block_size=PAGE,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype="f16",
        kv_rows_finite=True,
        mask_type="bottom_right",
        window_size_right=0,
    )

    def timed(attn, qq):
        return _back_to_back(lambda: attn.run(qq, k, v), calls)

    both = timed(turbine_fmha.PagedAttention(session).plan(bt, sk, seqstart_q=starts, **layout), q)
    pre = timed(
        turbine_fmha.PagedAttention(session).plan(bt[:2], sk[:2], seqstart_q=starts[:3], **layout), q[: starts[2]]
    )
    dec = timed(
        turbine_fmha.PagedAttention(session).plan(bt[2:], sk[2:], **layout), q[starts[2] :].reshape(30, 1, HQ, D)
    )
    print(
        f"mixed batch, 2 prefills x 512 + 30 decodes x 2048 keys: one group-mode run() {both:.3f} ms; "
        f"prefills alone {pre:.3f} + decodes alone {dec:.3f} = {pre + dec:.3f} ms; ratio {both / (pre + dec):.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
