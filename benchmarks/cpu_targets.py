#!/usr/bin/env python3
"""What a portable CPU artifact costs: the same calls through
PagedAttention.run() on numpy arrays, back to back, with the kernels of
each CPU target this machine can run (host, x86-64-v4, x86-64-v3),
rounds interleaved so that the machine's drift falls on every target
alike. Each target's output is checked against the float64 reference.
Shapes and harness: cpu_cases.py, at page 16.

    python3 benchmarks/cpu_targets.py [--cache DIR] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from cpu_cases import CASES, cases, checked_run, interleaved

import turbine_fmha
from turbine_fmha.build.targets import CPU_TARGET_PREFERENCE, TARGETS
from turbine_fmha.core.cpu import this_cpu

PAGE = 16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="build/bench-cpu-targets", help="where the kernels are compiled")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="calls per round")
    args = ap.parse_args()
    cpu = this_cpu()
    names = [n for n in CPU_TARGET_PREFERENCE if not cpu.lacks(TARGETS[n].cpu_arch, TARGETS[n].cpu_requires)]
    data = cases(np.random.default_rng(0), PAGE)
    runs = {}
    for name in names:
        s = turbine_fmha.Session(
            "cpu", target=name, artifact_dir=args.cache, cache_dir=args.cache, compile_missing=True
        )
        for case, (problem, causal) in data.items():
            runs[name, case] = checked_run(s, problem, causal, (name, case))
    ms = interleaved(runs, args.rounds, args.calls)
    print(
        f"CPU {cpu.arch}, {len(cpu.features)} ISA features; run() ms, median of {args.rounds} rounds x {args.calls} calls"
    )
    print("| target | " + " | ".join(CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    for name in names:
        cells = [f"{ms[name, c]:.2f} ({ms[name, c] / ms[names[0], c]:.2f}x)" for c in CASES]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
