#!/usr/bin/env python3
"""Where a GPU run()'s time goes beyond its kernels: run(kv_rows_finite=True)
on torch CUDA tensors (benchmarks/as_called.py's cases), timed as called
(back to back, one sync at the end) beside the device column (the same
kernels on device-resident arguments, queued back to back), then the host
time of each phase of a call, from timers wrapped around the runtime's
functions (each phase's mean per run(), nested phases indented), then
cProfile of the calls. Beside run(), the same calls with each kernel
call's results placed into allocated outputs, as before
attention._Plan._join_axis, interleaved in the same rounds.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_call_phases.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import as_called as ac  # noqa: E402

import turbine_fmha  # noqa: E402
from turbine_fmha.api import attention  # noqa: E402
from turbine_fmha.core import arrays  # noqa: E402
from turbine_fmha.runtime import interop, invoke, session  # noqa: E402

SHAPES = [
    "decode:32x4096",
    "decode:1x32768",
    "prefill:1x4096",
    "prefill:4x1024",
    "chunked:4x512+8192",
    "prefill:1x2048:28/4:HND",
]

# (label, owner, attribute, depth): the phases timed, in call order.
PHASES = [
    ("run()", attention._Plan, "run", 0),
    ("_arrays (checks, cache binds)", attention._Plan, "_arrays", 1),
    ("_device_steps", attention._Plan, "_device_steps", 1),
    ("_allocate (out, lse)", attention._Plan, "_allocate", 1),
    ("_batch_q (q as entries)", attention._Plan, "_batch_q", 1),
    ("_Results.run", arrays._Results, "run", 1),
    ("torch_writes_done (stream sync)", arrays, "torch_writes_done", 2),
    ("import_torch", interop.DeviceInterop, "import_torch", 2),
    ("run_variants", session.Session, "run_variants", 2),
    ("enqueue", invoke._Loaded, "enqueue", 3),
    ("wait_all", session, "wait_all", 3),
    ("results", invoke._Call, "results", 3),
    ("to_torch (DLPack exports)", interop.DeviceInterop, "to_torch", 2),
    ("Step.place (torch copies)", None, "place", 1),  # each planned step's own
]


class Timers:
    def __init__(self):
        self.total = dict.fromkeys(range(len(PHASES)), 0.0)
        self.count = dict.fromkeys(range(len(PHASES)), 0)
        self.on = False

    @contextlib.contextmanager
    def installed(self, planned):
        saved = []
        for i, (_, owner, name, _) in enumerate(PHASES):
            if owner is None:  # the plan's steps (made on its first run)
                owners = [st for pt in planned.parts for steps in pt._steps.values() for st in steps]
            else:
                owners = [owner]
            for o in owners:
                fn = o.__dict__[name] if isinstance(o, type) else getattr(o, name)
                saved.append((o, name, fn))
                setattr(o, name, self._wrap(i, fn))
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)

    def _wrap(self, i, fn):
        timers = self

        def timed(*a, **k):
            if not timers.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers.total[i] += time.perf_counter() - t0
                timers.count[i] += 1

        return timed

    def report(self, calls: int) -> str:
        lines = []
        for i, (label, _, _, depth) in enumerate(PHASES):
            us = self.total[i] / calls * 1e6
            n = self.count[i] / calls
            lines.append(f"  {'  ' * depth}{label:<{40 - 2 * depth}} {us:8.1f} us  ({n:g} per run)")
        return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--shape", action="append", help=f"as_called.py's shape specs (default: {SHAPES})")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="run() calls timed by phase and profiled")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run (kernels compiled)")
    args = ap.parse_args()
    import torch

    if args.device == "cpu":
        sess = turbine_fmha.Session("cpu", artifact_dir=args.artifacts, compile_missing=True, cache_dir=args.artifacts)
    else:
        sess = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    reports = []
    for spec in args.shape or SHAPES:
        shape = ac.parse_shape(spec)
        case = ac.make_case(shape, "torch", "f16", args.device, seed=0)
        side = ac.TorchSide(case, "enable")
        attn = turbine_fmha.PagedAttention(sess).plan(
            case.block_table,
            case.seqlen_k,
            kv_rows_finite=True,
            **ac.plan_kwargs(case),
        )
        q, k, v = case.q, case.k, case.v
        sess.trim()
        ref = side.reference()
        run = lambda: attn.run(q, k, v)
        err = side.rel_err(run(), ref)
        loop = ac.DeviceLoop(sess, attn, case)
        loop()
        err_d = side.rel_err(loop.output(), ref)
        del ref

        def run_placed():
            # As before the join (attention._Plan._join_axis): each call's
            # results placed into allocated outputs.
            saved = attention._Plan._join_axis
            attention._Plan._join_axis = lambda self, steps: None
            try:
                return run()
            finally:
                attention._Plan._join_axis = saved

        fns = {"run": run, "placed": run_placed, "run_again": run, "device": loop, "torch": lambda: side.call(q, k, v)}
        syncs = {"run": side.sync, "placed": side.sync, "run_again": side.sync, "device": loop.wait, "torch": side.sync}
        calls = ac.calls_per_round(fns, syncs, 0.25, 10, 200)
        per = dict.fromkeys(fns, calls)
        per["device"] = max(1, min(calls, 32 // len(loop.steps)))
        res = ac.timed_rounds(fns, syncs, per, args.rounds, 0.3)
        ms = {n: m for n, (m, _) in res.items()}
        steps = len(loop.steps)
        head = (
            f"== {shape.label}: run(finite) {ms['run']:.3f} ms (placed per call: {ms['placed']:.3f}; run() again, the noise: {ms['run_again']:.3f}), "
            f"device {ms['device']:.3f}, torch {ms['torch']:.3f}; "
            f"{steps} kernel call(s) of {loop.variant.name}, entries {attn._plan.entries}; "
            f"err {err:.1e} / {err_d:.1e}{'' if max(err, err_d) <= ac.BOUND['f16'] else '  FAIL'}"
        )
        timers = Timers()
        run()
        with timers.installed(attn._plan):
            run()
            side.sync()
            timers.on = True
            t0 = time.perf_counter()
            for _ in range(args.calls):
                run()
            side.sync()
            wall = (time.perf_counter() - t0) / args.calls * 1e3
            timers.on = False
        phases = f"{head}\n  instrumented: {wall:.3f} ms per run()\n{timers.report(args.calls)}"
        print(phases)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            run()
        side.sync()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        reports.append(f"{head}\n{buf.getvalue()}")
        sess.trim()
    for text in reports:
        print(f"\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
