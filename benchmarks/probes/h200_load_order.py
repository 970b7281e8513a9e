#!/usr/bin/env python3
"""On the H200: does loading other modules slow a kernel that is already
loaded, or one loaded after them?

as_called.py's default rows ran the causal prefill 4096 (4 launches of
`..._b1_q1024_nvguard`) at 4.1-4.4 ms of device time when its module was
loaded after the three decode rows' modules, and at 2.63-2.68 ms when it
was loaded first, even with the decode rows run in between
(benchmarks/results/2026-12-02-8bb8ffd/load_order/). This probe times the
prefill's device loop (as_called.DeviceLoop: the kernels alone, queued
back to back, one wait) in these steps, one process:

  A. prefill module loaded first, timed;
  B. the decode modules loaded (not run), prefill timed again;
  C. the decode kernels run once each, prefill timed again;
and, in a second process (--late), the decode modules loaded first, then
the prefill's, then timed. Prints one line per step.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_load_order.py --artifacts artifacts-cuda [--late]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import as_called

import turbine_fmha

DECODES = ["decode:32x4096", "decode:4x32768", "decode:1x32768"]
PREFILL = "prefill:1x4096"


def _planned(session, spec: str, seed: int):
    case = as_called.make_case(as_called.parse_shape(spec), "torch", "f16", "cuda", seed)
    attn = turbine_fmha.PagedAttention(session).plan(
        case.block_table,
        case.seqlen_k,
        kv_rows_finite=True,
        **as_called.plan_kwargs(case),
    )
    return case, attn


def _device_ms(loop, rounds: int = 7, calls: int = 20) -> float:
    loop()
    loop.wait()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            loop()
        loop.wait()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--late", action="store_true", help="load the decode modules before the prefill's")
    args = ap.parse_args()
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    decodes = [_planned(session, s, i + 1) for i, s in enumerate(DECODES)]
    if args.late:
        for _, a in decodes:
            session._load(a._plan._variant(a._plan.guard_free))
        print("decode modules loaded first", flush=True)
    case, attn = _planned(session, PREFILL, 0)
    loop = as_called.DeviceLoop(session, attn, case)
    print(f"{loop.variant.name}: {len(loop.steps)} launches", flush=True)
    print(f"A. prefill device {_device_ms(loop):.3f} ms", flush=True)
    if not args.late:
        for _, a in decodes:
            session._load(a._plan._variant(a._plan.guard_free))
        print(f"B. after loading the decode modules: prefill device {_device_ms(loop):.3f} ms", flush=True)
    for c, a in decodes:
        a.run(c.q, c.k, c.v)
    print(f"C. after running each decode once: prefill device {_device_ms(loop):.3f} ms", flush=True)
    case2, attn2 = _planned(session, PREFILL, 5)
    fresh = as_called.DeviceLoop(session, attn2, case2)
    print(f"D. a new prefill case, same module: prefill device {_device_ms(fresh):.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
