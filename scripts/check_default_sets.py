#!/usr/bin/env python3
"""Release check: build every kernel of the default sets for the given
targets (compile only on a machine without GPUs) and check each GPU
kernel's ISA the way the suite checks the sets' distinct kernels
(turbine_fmha.build.isa.isa_problems). Prints the kernel count and the
build time per target; exits 1 on any compile failure or ISA problem.

    .venv/bin/python scripts/check_default_sets.py --targets gfx942,gfx90a,gfx950,cuda,host [--artifacts DIR] [--jobs N]

On 2 cores each GPU target takes minutes (the kernel counts and build times:
docs/benchmarks.md, "Default sets: kernel counts and build times"): this is
what the suite's test_gpu_default_set_compiles samples."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from turbine_fmha.build import aot
from turbine_fmha.build.default_sets import default_append_kernels, gpu_default_set, host_default_set
from turbine_fmha.build.isa import isa_problems
from turbine_fmha.build.targets import TARGETS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="gfx942,gfx90a,gfx950,cuda", help=f"comma list of: {', '.join(TARGETS)}")
    p.add_argument(
        "--artifacts", default="build/default-sets", help="where to build (kept: unchanged kernels are not rebuilt)"
    )
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args()
    out, failed = Path(args.artifacts), 0
    for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
        gpu = TARGETS[target].formulation == "online"
        variants = gpu_default_set() if gpu else host_default_set()
        t0 = time.perf_counter()
        results = aot.build(out, [target], variants + default_append_kernels(gpu), jobs=args.jobs)
        seconds = time.perf_counter() - t0
        entries = {
            a["variant"]: a
            for a in json.loads((out / "manifest.json").read_text())["artifacts"]
            if a["target"] == target
        }
        bad = {v.name: isa_problems(v, entries[v.name]["isa"], target) for v in variants} if gpu else {}
        bad = {n: ps for n, ps in bad.items() if ps}
        compiled = sum(r.rebuilt for r in results)
        print(
            f"{target}: {len(results)} kernels ({compiled} compiled) in {seconds:.0f} s; {len(bad)} with ISA problems"
        )
        for name, ps in sorted(bad.items()):
            print(f"  {name}: {'; '.join(ps)}")
        failed += len(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
