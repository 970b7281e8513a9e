#!/usr/bin/env python3
"""The host side of one PagedAttention.run() on a GPU, piece by piece.

Decode b32 x 4096 keys (GQA 32/8, hdim 128, page 16, fp16) on torch CUDA
tensors, tables planned once. Prints medians over many calls of: run();
the kernel alone (its invoke on device-resident arguments, back to back);
run()'s steps timed in place; and a one-shot fmha_fwd_paged. GPU clocks
drift during a run, so run() and the kernel are timed twice, interleaved:
compare neighbours. docs/devlog/perf-notes.md has the story.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/run_overhead.py --artifacts artifacts-cuda
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
from turbine_fmha.runtime.executor import Results as _Results


def timed(fn, calls: int, sync=None) -> float:
    for _ in range(5):
        fn()
    if sync:
        sync()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=2, help="run() / kernel-alone pairs, interleaved")
    ap.add_argument("--profile", action="store_true", help="cProfile of plan() + run(), by own time")
    args = ap.parse_args()
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    b, sk, hq, hk, d, page = 32, 4096, 32, 8, 128, 16
    pages = b * sk // page
    bt = rng.permutation(pages).reshape(b, -1).astype(np.int32)
    sl = np.full(b, sk - 5, np.int32)
    k = torch.randn((pages, page, hk, d), dtype=torch.float16, device="cuda")
    v = torch.randn((pages, page, hk, d), dtype=torch.float16, device="cuda")
    q = torch.randn((b, 1, hq, d), dtype=torch.float16, device="cuda")
    attn = turbine_fmha.PagedAttention(session).plan(
        bt, sl, num_pages=pages, page_block_size=page, nhead_q=hq, nhead_k=hk, hdim=d, dtype="f16", kv_rows_finite=True
    )
    plan = attn._plan
    variant = plan.variant(0, True)
    steps = plan.device_steps(0, variant, _Results(session, q))
    assert len(steps) == 1
    loaded = session._load(variant)
    # The kernel alone on the plan's split rows (split-KV merged on the host
    # repeats q's rows, and run() also merges the splits, which this leaves
    # out; a variant that merges them itself takes q as it is).
    host_merge = plan.splits > 1 and not variant.merge_splits
    qs = q.repeat_interleave(plan.splits, dim=0) if host_merge else q
    print(f"variant {variant.name}, {plan.splits} split(s)")
    fargs = [session.import_torch(x) for x in (qs, k, v)] + steps[0].args
    sync = torch.cuda.synchronize
    r = {}
    for rep in range(1, args.pairs + 1):
        r[f"run() #{rep}"] = timed(lambda: attn.run(q, k, v), args.calls, sync)
        r[f"kernel alone #{rep}"] = timed(lambda: loaded.invoke(fargs, 2), args.calls)
    if host_merge:
        from turbine_fmha.calls.plan import combine_splits

        n = b * plan.splits
        parts = [torch.randn((n, 1, hq, d), device="cuda").half()] + [
            torch.rand((n, hq, 1), device="cuda") for _ in range(3)
        ]
        r["split-KV merge alone (torch)"] = timed(lambda: combine_splits(*parts, plan.splits, None), args.calls, sync)
    r.update(_staged_run(attn, q, k, v, args.calls))
    planner = turbine_fmha.PagedAttention(session)
    kw = dict(num_pages=pages, page_block_size=page, nhead_q=hq, nhead_k=hk, hdim=d, dtype="f16", kv_rows_finite=True)
    r.update(_staged_run(planner, q, k, v, args.calls, replan=lambda: planner.plan(bt, sl, **kw)))
    r["one-shot fmha_fwd_paged, kv_rows_finite=True"] = timed(
        lambda: turbine_fmha.fmha_fwd_paged(q, k, v, bt, sl, session=session, device="cuda", kv_rows_finite=True),
        args.calls,
        sync,
    )
    r["one-shot fmha_fwd_paged (stale-row check)"] = timed(
        lambda: turbine_fmha.fmha_fwd_paged(q, k, v, bt, sl, session=session, device="cuda"), args.calls, sync
    )
    r["plan() alone (host)"] = timed(lambda: planner.plan(bt, sl, **kw), args.calls)
    r["plan() + first run() (tables uploaded)"] = timed(
        lambda: planner.plan(bt, sl, **kw).run(q, k, v), args.calls, sync
    )
    bt_t, sl_t = torch.from_numpy(bt).cuda(), torch.from_numpy(sl).cuda()
    r["one-shot, tables as CUDA tensors, kv_rows_finite=True"] = timed(
        lambda: turbine_fmha.fmha_fwd_paged(q, k, v, bt_t, sl_t, session=session, device="cuda", kv_rows_finite=True),
        args.calls,
        sync,
    )
    tabs = [a._torch_keepalive for a in steps[0].args]
    host = [t.cpu().numpy() for t in tabs]
    res_ = _Results(session, q)
    r["kernel, tables re-imported from the same memory"] = timed(
        lambda: loaded.invoke(fargs[:3] + [session.import_torch(t) for t in tabs], 2), args.calls
    )
    r["kernel, tables uploaded anew (one packed copy)"] = timed(
        lambda: loaded.invoke(fargs[:3] + res_.upload(host), 2), args.calls
    )
    r["upload alone"] = timed(lambda: res_.upload(host), args.calls)
    r["kernel alone #3"] = timed(lambda: loaded.invoke(fargs, 2), args.calls)
    w = max(len(x) for x in r)
    for name, ms in r.items():
        print(f"{name:<{w}}  {ms:7.3f} ms")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            planner.plan(bt, sl, **kw).run(q, k, v)
            sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


def _staged_run(attn, q, k, v, calls, replan=None):
    """run()'s steps for the single-call decode, each timed in place; with
    `replan`, after a new plan each time (a one-shot call)."""
    import torch

    session = attn.session
    stages = {}

    def lap(name, t0):
        t = time.perf_counter()
        stages.setdefault(name, []).append(t - t0)
        return t

    for _ in range(calls + 5):
        t = t0 = time.perf_counter()
        if replan:
            replan()
            t = lap("plan()", t)
        plan = attn._plan
        like, kc, vc, _ = plan._arrays(q, k, v, None)
        t = lap("checks + cache binds", t)
        results = _Results(session, like)
        variant = plan.variant(0, plan._rows_finite(0, vc))
        t = lap("variant", t)
        st = plan.device_steps(0, variant, results)[0]
        t = lap("steps (tables uploaded)", t)
        args = [
            st.q(plan._batch_q(like.detach(), results)),
            *(session.kernel_cache(c, False) for c in (kc, vc)),
            *st.args,
        ]
        args = [a if not hasattr(a, "data_ptr") else session.import_torch(a) for a in args]
        t = lap("import q", t)
        torch.cuda.synchronize()
        t = lap("torch sync", t)
        res = session._load(variant).invoke(args, 2)
        t = lap("invoke (with its wait)", t)
        out = session.to_torch(*res)
        t = lap("export", t)
        del out, res
        lap("free", t)
        lap("total", t0)
    tag = "plan() + run() staged" if replan else "run() staged"
    return {f"{tag}: {k}": statistics.median(v[5:]) * 1e3 for k, v in stages.items()}


if __name__ == "__main__":
    sys.exit(main())
