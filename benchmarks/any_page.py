#!/usr/bin/env python3
"""What a CPU kernel of any page size (Variant.page_block_size 0) costs
against one compiled for the page size, as called: PagedAttention.run() on
numpy arrays, back to back, rounds interleaved, each kind of kernel in a
session that holds only it, every output checked against the float64
reference (cpu_cases.py: the shapes and the harness), at each page size of
--pages.

    python3 benchmarks/any_page.py [--cache DIR] [--rounds 7] [--pages 1,16,32,128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from cpu_cases import CASES, HK, HQ, D, cases, checked_run, interleaved

import turbine_fmha
from turbine_fmha.build import aot
from turbine_fmha.kernels.variants import Variant

# (label, heads (nhead_q, nhead_k; 0, 0: any), page: None the call's, 0 any)
KINDS = (
    ("exact heads, the page", (HQ, HK), None),
    ("any heads, the page", (0, 0), None),
    ("exact heads, any page", (HQ, HK), 0),
    ("any heads, any page", (0, 0), 0),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="build/bench-any-page", help="where the kernels are built")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="calls per round")
    ap.add_argument("--pages", default="16,32")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pages = [int(p) for p in args.pages.split(",")]
    runs = {}
    for page in pages:
        data = cases(rng, page)
        for label, (hq, hk), pg in KINDS:
            variants = [Variant("f16", D, D, hq, hk, page if pg is None else pg, m) for m in ("none", "bottom_right")]
            out_dir = Path(args.cache) / variants[0].name
            aot.build(out_dir, ["host"], variants)
            s = turbine_fmha.Session("cpu", artifact_dir=out_dir)
            for case, (problem, causal) in data.items():
                runs[page, label, case] = checked_run(s, problem, causal, (page, label, case))
                assert s.last_variant in variants, s.last_variant
    ms = interleaved(runs, args.rounds, args.calls)
    print(f"run() ms, median of {args.rounds} rounds x {args.calls} calls (ratio to exact heads at the page)")
    print("| page | kernel | " + " | ".join(CASES) + " |")
    print("|---|---|" + "---|" * len(CASES))
    for page in pages:
        for label, _, _ in KINDS:
            cells = [f"{ms[page, label, c]:.2f} ({ms[page, label, c] / ms[page, KINDS[0][0], c]:.2f}x)" for c in CASES]
            print(f"| {page} | {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
