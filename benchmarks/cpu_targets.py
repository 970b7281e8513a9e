#!/usr/bin/env python3
"""What a portable CPU artifact costs: the same calls through
PagedAttention.run() on numpy arrays, back to back, with the kernels of
each CPU target this machine can run (host, x86-64-v4, x86-64-v3),
rounds interleaved so that the machine's drift falls on every target
alike. Each target's output is checked against the float64 reference.
Shapes: GQA 32/8, head dim 128, page 16, f16; a decode b8 x 2048 keys and
a causal prefill of 512 rows over 512 keys.

    python3 benchmarks/cpu_targets.py [--cache DIR] [--rounds 5]
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
from turbine_fmha.build.targets import CPU_TARGET_PREFERENCE, TARGETS
from turbine_fmha.core.arrays import aligned_empty
from turbine_fmha.core.cpu import this_cpu
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HQ, HK, D, PAGE = 32, 8, 128, 16
TOL = 5e-3  # f16 output (tests/conftest.py OUT_TOL)


def _case(rng, batch, seqlen_q, keys):
    pages = batch * keys // PAGE + 4
    bt = rng.permutation(pages)[: batch * keys // PAGE].reshape(batch, -1).astype(np.int32)
    sl = np.full(batch, keys, np.int32)
    k, v = aligned_empty((pages, PAGE, HK, D), np.float16), aligned_empty((pages, PAGE, HK, D), np.float16)
    k[...] = rng.standard_normal(k.shape)
    v[...] = rng.standard_normal(v.shape)
    q = rng.standard_normal((batch, seqlen_q, HQ, D)).astype(np.float16)
    return q, k, v, bt, sl


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="build/bench-cpu-targets", help="where the kernels are compiled")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="calls per round")
    args = ap.parse_args()
    cpu = this_cpu()
    names = [n for n in CPU_TARGET_PREFERENCE if not cpu.lacks(TARGETS[n].cpu_arch, TARGETS[n].cpu_requires)]
    rng = np.random.default_rng(0)
    cases = {"decode b8 x 2048": (_case(rng, 8, 1, 2048), False), "prefill 512 causal": (_case(rng, 1, 512, 512), True)}
    runs = {}
    for name in names:
        s = turbine_fmha.Session(
            "cpu", target=name, artifact_dir=args.cache, cache_dir=args.cache, compile_missing=True
        )
        for case, ((q, k, v, bt, sl), causal) in cases.items():
            attn = turbine_fmha.PagedAttention(s).plan(
                bt,
                sl,
                num_pages=k.shape[0],
                page_block_size=PAGE,
                nhead_q=HQ,
                nhead_k=HK,
                hdim=D,
                dtype=np.float16,
                seqlen_q=q.shape[1],
                causal=causal,
                kv_rows_finite=True,
            )
            out = attn.run(q, k, v)
            ref = fmha_fwd_paged_ref(
                q, k, v, bt, sl, mask_type="bottom_right" if causal else "none", window_size_right=0 if causal else -1
            )[0]
            err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
            assert err < TOL, (name, case, err)
            runs[name, case] = (lambda a=attn, q=q, k=k, v=v: a.run(q, k, v), [])
    for _ in range(args.rounds):
        for fn, times in runs.values():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times.append((time.perf_counter() - t0) / args.calls * 1e3)
    print(
        f"CPU {cpu.arch}, {len(cpu.features)} ISA features; run() ms, median of {args.rounds} rounds x {args.calls} calls"
    )
    print("| target | " + " | ".join(cases) + " |")
    print("|---|" + "---|" * len(cases))
    for name in names:
        cells = []
        for case in cases:
            ms = statistics.median(runs[name, case][1])
            base = statistics.median(runs[names[0], case][1])
            cells.append(f"{ms:.2f} ({ms / base:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
