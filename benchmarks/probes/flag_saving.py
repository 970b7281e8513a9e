#!/usr/bin/env python3
"""What the GPU wait's HostFlag saves a run() (perf-notes item 28).

Since 313e3b4 only runs whose calls share one timeline (every single-call
run) wait through the HostFlag; runs of several calls (HND decodes of two
calls, fresh causal prefills in q1024 chunks) wait on their fences, which
item 28 predicted to cost ~0.03 ms a run, unmeasured. This probe times the
same plans with the flag as the library uses it ("flag") and with it off
("fences", `invoke._flag_for` answering None), interleaved in the same
rounds as benchmarks/as_called.py times its columns, torch gather+SDPA
beside them; every output is checked against float32 SDPA first. The
flag-off column of a single-call row is what a multi-call run now pays
instead of the flag.

  PYTHONPATH=/tmp/site python3 benchmarks/probes/flag_saving.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import as_called  # noqa: E402

import turbine_fmha  # noqa: E402
import turbine_fmha.runtime.invoke as invoke  # noqa: E402

SHAPES = ["decode:32x4096", "decode:1x32768", "decode:32x4096:28/4:HND", "prefill:4x1024"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--compile-missing", action="store_true", help="a CPU dry run: compile what --artifacts lacks")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    session = turbine_fmha.Session(
        args.device, artifact_dir=args.artifacts, compile_missing=args.compile_missing, cache_dir=args.artifacts
    )
    rule = invoke._flag_for
    use_flag, last = [True], [(0, 0)]

    def flag_for(fenced):
        last[0] = (len(fenced), len({id(c.timeline) for c in fenced}))
        return rule(fenced) if use_flag[0] else None

    invoke._flag_for = flag_for
    print(f"# flag_saving: commit {as_called.git_commit()}, {as_called.device_name(args.device)}")
    rows = []
    for spec in args.shape or SHAPES:
        sh = as_called.parse_shape(spec)
        case = as_called.make_case(sh, "torch", "f16", args.device, seed=0)
        side = as_called.TorchSide(case, "enable")
        attn = turbine_fmha.PagedAttention(session).plan(
            case.block_table,
            case.seqlen_k,
            kv_rows_finite=True,
            **as_called.plan_kwargs(case),
        )
        q, k, v = case.q, case.k, case.v

        def with_flag(on):
            def call():
                use_flag[0] = on
                try:
                    return attn.run(q, k, v)
                finally:
                    use_flag[0] = True

            return call

        fns = {"flag": with_flag(True), "fences": with_flag(False), "torch": lambda: side.call(q, k, v)}
        ref = side.reference()
        errs = {}
        for name, fn in fns.items():
            out = fn()
            side.sync()
            errs[name] = side.rel_err(out, ref)
        del ref
        syncs = dict.fromkeys(fns, side.sync)
        calls = as_called.calls_per_round(fns, syncs, 0.2, 10, 200)
        res = as_called.timed_rounds(fns, syncs, dict.fromkeys(fns, calls), args.rounds, 0.5)
        ms = {n: round(m, 4) for n, (m, _) in res.items()}
        ok = max(errs.values()) <= as_called.BOUND["f16"]
        row = dict(
            name=sh.label,
            kernel_calls=last[0][0],
            timelines=last[0][1],
            calls_per_round=calls,
            ms=ms,
            rounds_ms={n: [round(t, 4) for t in ts] for n, (_, ts) in res.items()},
            saving_ms=round(ms["fences"] - ms["flag"], 4),
            rel_err={n: float(f"{e:.3g}") for n, e in errs.items()},
            ok=ok,
        )
        rows.append(row)
        print(json.dumps(row))
    print("\n| row | calls / timelines | flag ms | fences ms | fences - flag ms | torch ms | ok |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["ms"]
        print(
            f"| {r['name']} | {r['kernel_calls']} / {r['timelines']} | {m['flag']:.3f} | {m['fences']:.3f} | {r['saving_ms']:+.3f} | {m['torch']:.3f} | {'ok' if r['ok'] else 'FAIL'} |"
        )
    out = args.json or (os.path.join(os.environ["OUT"], "flag_saving.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
