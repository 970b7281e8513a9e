#!/usr/bin/env python3
"""Where a prefill call through contiguous tiles spends the time its
kernels do not: the CUDA driver calls and kernels of a few calls, queued
back to back as as_called.py's device loop queues them, from torch's
profiler (CUPTI sees IREE's work in the same process).

    python3 benchmarks/probes/tiles_timeline.py ARTIFACTS SHAPE [--calls 3] [--trace OUT.json] [--wave N]

prints, per call, each kernel and driver call with its start (us from
the first event) and duration, and sums them by kind. SHAPE is
as_called.py's (prefill:1x4096, chunked:4x512+8192, ...)."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("kernel", "cuda_driver", "cuda_runtime", "gpu_memcpy", "gpu_memset")


def main() -> int:
    import torch
    from as_called import DeviceLoop, make_case, parse_shape, plan_kwargs
    from torch.profiler import ProfilerActivity, profile

    import turbine_fmha

    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts")
    ap.add_argument("shape")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--flags", default="", help="IREE runtime flags, e.g. --cuda_use_streams=true")
    ap.add_argument("--wave", type=int, default=None, help="plan the class filling for this wave, not the GPU's")
    args = ap.parse_args()
    if args.wave is not None:
        from turbine_fmha.calls import tiles

        tiles.wave_entries = lambda nhead_q: args.wave
    if args.flags:
        import iree.runtime as rt

        rt.flags.parse_flags(*args.flags.split())

    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts, prefill_tiles=True)
    case = make_case(parse_shape(args.shape), "torch", "f16", "cuda", 0)
    attn = turbine_fmha.PagedAttention(session).plan(case.block_table, case.seqlen_k, **plan_kwargs(case))
    loop = DeviceLoop(session, attn, case)
    for _ in range(5):
        loop()
    loop.wait()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            loop()
        loop.wait()
        torch.cuda.synchronize()
    trace = Path(args.trace or tempfile.mktemp(suffix=".json"))
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") in KINDS and "dur" in e]
    events.sort(key=lambda e: e["ts"])
    t0 = events[0]["ts"] if events else 0.0
    print(args.shape, loop.variant.name, f"{args.calls} calls", flush=True)
    totals = collections.defaultdict(float)
    last_kernel_end = None
    for e in events:
        gap = ""
        if e["cat"] == "kernel":
            if last_kernel_end is not None:
                gap = f" gap {e['ts'] - last_kernel_end:8.1f}"
            last_kernel_end = e["ts"] + e["dur"]
        totals[(e["cat"], e["name"].split("_dispatch_")[-1][:48])] += e["dur"]
        print(f"{e['ts'] - t0:10.1f} {e['dur']:9.1f} {e['cat']:12s} {e['name'][-60:]}{gap}")
    kernels = [e for e in events if e["cat"] == "kernel"]
    if kernels:
        span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
        busy = sum(e["dur"] for e in kernels)
        print(
            f"kernels: {len(kernels)}, span {span / args.calls:.1f} us a call, busy {busy / args.calls:.1f} us a call"
        )
    print("totals over the calls (us):")
    for (cat, name), us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {us:10.1f} {cat:12s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
