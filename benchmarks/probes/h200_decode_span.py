#!/usr/bin/env python3
"""Where a short decode call's time goes on the H200: the host's enqueue,
the kernels, or the gaps between them (b1 x 32k).

For each decode shape (GQA 32/8, hdim 128, page 16, f16, tables planned
once, all arguments already on the device) this times N calls queued back
to back with one wait (as bench.py's device column does) and, separately,
the loop of enqueues alone: when the enqueues take as long as the whole
run, the host is the limit, not the GPU. torch.profiler (CUPTI) then gives
the kernels' own time per call and the idle time between them. torch
gather+SDPA is timed the same way. `--flag` passes IREE runtime flags
(process-wide, parsed before the device exists).

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_decode_span.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

HQ, HK, D, PAGE = 32, 8, 128, 16


def queued(enqueue, wait, calls: int) -> tuple[float, float]:
    """(ms per call with one final wait, ms per call of the enqueues alone)."""
    for _ in range(10):
        enqueue()
    wait()
    t0 = time.perf_counter()
    for _ in range(calls):
        enqueue()
    t1 = time.perf_counter()
    wait()
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3 / calls, (t1 - t0) * 1e3 / calls


def kernel_timeline(enqueue, wait, calls: int) -> tuple[float, float, int]:
    """(kernel us per call, idle us per call between the first kernel's
    start and the last one's end, kernels per call) from CUPTI."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            enqueue()
        wait()
    ev = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    if not ev:
        return float("nan"), float("nan"), 0
    busy = sum(e - s for s, e in ev)
    span = ev[-1][1] - ev[0][0]
    return busy / calls, (span - busy) / calls, len(ev) // calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument(
        "--flag", action="append", default=[], help="an IREE runtime flag, e.g. --flag=--cuda_use_streams=false"
    )
    ap.add_argument("--shapes", default="1x32768,32x4096")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--hold-mib",
        type=int,
        default=0,
        help="keep this much IREE-allocated device memory alive (in 128 MiB arrays), as a "
        "PagedKVCache device pool does",
    )
    ap.add_argument(
        "--hold-via",
        choices=["asdevicearray", "device_array"],
        default="device_array",
        help="how the held arrays are made: iree.runtime.asdevicearray (counted by the per-call "
        "buffer pool) or Session.device_array (allocated past it)",
    )
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    import iree.runtime as rt
    import torch
    import torch.nn.functional as F
    from h200_dispatch_profile import decode_problem

    import turbine_fmha
    from turbine_fmha.runtime.executor import Results as _Results

    for f in args.flag:
        rt.flags.parse_flags(f)
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    make = (
        session.device_array
        if args.hold_via == "device_array"
        else (lambda a: rt.asdevicearray(session.device_of(), a))
    )
    held = [make(np.zeros(128 << 20, np.uint8)) for _ in range(args.hold_mib // 128)]
    if held:
        print(f"holding {len(held) * 128} MiB of IREE device arrays made by {args.hold_via}")
    rng = np.random.default_rng(0)
    print(f"flags: {' '.join(args.flag) or '(defaults)'}")
    for shape in args.shapes.split(","):
        batch, keys = (int(x) for x in shape.split("x"))
        pages, bt, sk, q, k, v = decode_problem(rng, batch, keys)
        attn = turbine_fmha.PagedAttention(session).plan(
            bt,
            sk,
            num_pages=pages,
            page_block_size=PAGE,
            nhead_q=HQ,
            nhead_k=HK,
            hdim=D,
            dtype="f16",
            kv_rows_finite=True,
        )
        plan = attn._plan
        if plan.parts[0].host_split:
            print(f"decode b{batch} x {keys}: split-KV merged on the host, skipped")
            continue
        variant = plan.variant(0, True)
        results = _Results(session, q)
        st = plan.device_steps(0, variant, results)[0]
        loaded = session._load(variant)
        qb = st.q(plan._batch_q(0, q, results))  # q as the tile takes it (padded rows)
        fargs = [session.import_torch(x.contiguous()) for x in (qb, k, v)] + st.args
        last = []

        def enqueue():
            last[:] = [loaded.enqueue(list(fargs), after=last[0] if last else None)]

        def enqueue_free():  # waits for nothing: the allocations need not wait for the previous call
            last[:] = [loaded.enqueue(list(fargs))]

        flat = torch.from_numpy(bt).long().cuda().reshape(-1)
        qh = q.transpose(1, 2)

        def gather_sdpa():
            kk = k.index_select(0, flat).reshape(batch, -1, HK, D).transpose(1, 2)
            vv = v.index_select(0, flat).reshape(batch, -1, HK, D).transpose(1, 2)
            return F.scaled_dot_product_attention(qh, kk, vv, enable_gqa=True)

        rounds = {"chained": [], "unchained": [], "torch": []}
        hosts = {"chained": [], "unchained": [], "torch": []}
        with torch.no_grad():
            for _ in range(args.rounds):  # interleaved: the H200's clocks drift within a command
                for name, fn, wait in (
                    ("chained", enqueue, lambda: last[0].wait()),
                    ("unchained", enqueue_free, lambda: last[0].wait()),
                    ("torch", gather_sdpa, torch.cuda.synchronize),
                ):
                    ms, host = queued(fn, wait, args.calls)
                    rounds[name].append(ms)
                    hosts[name].append(host)
            busy, idle, n = kernel_timeline(enqueue, lambda: last[0].wait(), 50)
            f_busy, f_idle, _ = kernel_timeline(enqueue_free, lambda: last[0].wait(), 50)
            t_busy, t_idle, t_n = kernel_timeline(gather_sdpa, torch.cuda.synchronize, 50)
        run_ms = statistics.median(_timed_runs(attn, q, k, v, 100))
        print(
            f"decode b{batch} x {keys} ({plan.parts[0].splits} splits, {variant.name}), {args.rounds} interleaved rounds "
            f"of {args.calls} calls, ms per call (median [min-max]); enqueue loop alone:"
        )
        for name in rounds:
            r, h = rounds[name], hosts[name]
            print(
                f"  {name:9s} {statistics.median(r):.3f} [{min(r):.3f}-{max(r):.3f}]; enqueues alone "
                f"{statistics.median(h):.3f}"
            )
        print(
            f"  CUPTI, per call: chained kernels {busy:.1f} us + idle {idle:.1f} us in {n} launches; unchained "
            f"{f_busy:.1f} + {f_idle:.1f}; torch {t_busy:.1f} + {t_idle:.1f} in {t_n}"
        )
        print(f"  run() one at a time: {run_ms:.3f} ms")
    if not args.no_prefill:
        _prefill(session, rng, args.rounds)
    return 0


def _prefill(session, rng, rounds: int, calls: int = 10) -> None:
    """The 4096-row causal prefill (f16, page 16), as planned (row chunks),
    its kernel calls queued chained (each waiting for the one before) and
    unchained, back to back."""
    from h200_dispatch_profile import prefill_problem

    from turbine_fmha.runtime.executor import Results as _Results

    rows = 4096
    attn, q, k, v = prefill_problem(session, rng, rows, PAGE)
    plan = attn._plan
    variant = plan.variant(0, True)
    results = _Results(session, q)
    steps = plan.device_steps(0, variant, results)
    loaded = session._load(variant)
    qb = plan._batch_q(0, q.detach(), results)
    kv = [session.import_torch(x) for x in (k, v)]
    arg_lists = [[session.import_torch(st.q(qb).contiguous()), *kv, *st.args] for st in steps]
    last = []

    def chained():
        prev = last[-1] if last else None
        last.clear()
        for a in arg_lists:
            prev = loaded.enqueue(list(a), after=prev)
            last.append(prev)

    def unchained():
        last.clear()
        last.extend(loaded.enqueue(list(a), own_timeline=True) for a in arg_lists)

    def wait():
        for c in last:
            c.wait()

    visible = rows * (rows + 1) // 2
    times = {"chained": [], "unchained": []}
    for _ in range(rounds):
        for name, fn in (("chained", chained), ("unchained", unchained)):
            times[name].append(queued(fn, wait, calls)[0])
    for name, r in times.items():
        ms = statistics.median(r)
        print(
            f"prefill 4096 causal, {len(steps)} calls of {variant.name}, {name}: {ms:.3f} ms "
            f"[{min(r):.3f}-{max(r):.3f}] = {4.0 * HQ * D * visible / (ms * 1e-3) / 1e12:.1f} TFLOP/s visible"
        )
    ms = statistics.median(_timed_runs(attn, q, k, v, calls))
    print(f"prefill 4096 causal, run() one at a time: {ms:.3f} ms")


def _timed_runs(attn, q, k, v, calls):
    import torch

    out = []
    for _ in range(calls + 5):
        t0 = time.perf_counter()
        attn.run(q, k, v)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out[5:]


if __name__ == "__main__":
    sys.exit(main())
