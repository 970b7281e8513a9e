#!/usr/bin/env python3
"""The prototype behind Variant.merge_any (perf-notes "A run-time split
count"): the shipped `_x8`, `_x32`, `_x128` merged decodes of tile 128
(as rendered at 1dafdf1) against two hand-edited modules whose count is
read from q's batch, edited from the `_x8` rendering:
docs/repro/merge_dynamic_inner.mlir (entries b * n + j: the merge reduces
a dynamic inner dim) and docs/repro/merge_dynamic_outer.mlir (entries
j * BO + b, split-major: it reduces the outer dim). Device time of calls
back to back with one wait, each output against the float64 reference.

DIR holds `<variant>.vmfb` for the static variants (turbine_fmha's
compile, build.compiler._compile_one, for the device), `dyn.vmfb` and
`dyn_sm.vmfb` (the two edited modules through the same compile):

    python3 benchmarks/probes/h200_merge_proto.py --dir DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import iree.runtime as rt
from h200_merge_any import CASES, PROBLEM, decode_case, device_ms

from turbine_fmha.calls.plan import kernel_steps, split_kv
from turbine_fmha.kernels.variants import online_variant
from turbine_fmha.runtime.invoke import _Loaded
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    d = Path(args.dir)
    config = rt.Config("cuda")  # its to_host copies; a CPU run would need the copies h200_merge_any makes
    dev = config.device
    rng = np.random.default_rng(0)
    for batch, keys, n in CASES:
        q, kc, vc, bt, sk, call = decode_case(rng, batch, keys)
        static = online_variant(PROBLEM, 128, 1, merge_splits=n)
        (step,) = kernel_steps(static, split_kv(call, n, merged=True))
        host = [step.q(q), kc, vc, *step.args]
        dargs = [rt.asdevicearray(dev, x) for x in host]
        sample = [0, batch - 1]
        ref, _ = fmha_fwd_paged_ref(q[sample], kc, vc, bt[sample], sk[sample])
        mods = {}
        # The dynamic module keeps the name of the variant it was edited from.
        x8 = online_variant(PROBLEM, 128, 1, merge_splits=8)
        # dyn_sm.vmfb takes its entries split-major (entry j * sequences + b).
        order = np.arange(128).reshape(128 // n, n).T.reshape(-1)
        split_major = [dargs[0], dargs[1], dargs[2], *(rt.asdevicearray(dev, a[order]) for a in host[3:7]), *dargs[7:]]
        runs = (
            ("static", d / f"{static.name}.vmfb", static, dargs),
            ("dynamic", d / "dyn.vmfb", x8, dargs),
            ("dynamic split-major", d / "dyn_sm.vmfb", x8, split_major),
        )
        for label, path, v, a in runs:
            vm = rt.VmModule.copy_buffer(config.vm_instance, path.read_bytes())
            mods[label] = (_Loaded(v, vm, config, spin=True), a)
        times = {k: [] for k in mods}
        outs = {}
        for _ in range(args.rounds):
            for label, (loaded, dargs) in mods.items():
                outs[label] = loaded.invoke(list(dargs))[0].to_host()
                times[label].append(device_ms(loaded, dargs, args.repeat))
        line = [f"b{batch} x {keys}, {n} splits:"]
        for label in mods:
            o = outs[label][:batch]
            err = float(np.abs(o[sample].astype(np.float64) - ref).max() / np.abs(ref).max())
            line.append(f"{label} {sorted(times[label])[len(times[label]) // 2]:.4f} ms (rel err {err:.1e})")
        for label in list(mods)[1:]:
            line.append(
                f"{label} bitwise equal to static: {np.array_equal(outs['static'][:batch], outs[label][:batch])}"
            )
        print(", ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
