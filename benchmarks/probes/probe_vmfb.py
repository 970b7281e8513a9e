#!/usr/bin/env python3
"""Times and checks hand-configured builds of one variant (lowering-config
experiments, docs/devlog/perf-notes.md): each vmfb is a compile of `--variant` with
a substituted executable configuration (iree-compile
--iree-hal-substitute-executable-configuration). Runs the benchmark's decode
or prefill shape on the device, checks the output against the float64
reference on a sample of sequences, and prints the median time."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench
import bench
import iree.runtime as rt
from bench import HQ, PAGE, SHAPES, make_inputs, median_ms

from turbine_fmha.calls.mask import MaskSpec
from turbine_fmha.calls.plan import KernelCall, kernel_steps
from turbine_fmha.kernels.variants import Variant
from turbine_fmha.runtime.invoke import _Loaded
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--page", type=int, default=PAGE, help="page size of the inputs (must match the variant)")
    ap.add_argument("vmfbs", nargs="+")
    args = ap.parse_args()
    v = Variant.parse(args.variant)
    shape = next(s for s in SHAPES["cuda"] if s["name"] == args.shape)
    rng = np.random.default_rng(0)
    bench.PAGE = args.page  # make_inputs pages by the module's PAGE
    q, kc, vc, bt, sk = make_inputs(rng, shape, v.dtype)
    b, sq = shape["batch"], shape["seqlen_q"]
    call = KernelCall(
        rows=sq,
        q_itemsize=q.itemsize,
        nhead_q=HQ,
        block_table=bt,
        page=args.page,
        seqlen_q=np.full(b, sq, np.int32),
        seqlen_k=sk,
        kv_shift=np.zeros(b, np.int32),
        scale=1 / math.sqrt(v.hdim_q),
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=MaskSpec(v.mask, -1, 0 if v.mask != "none" else -1),
        alibi_slopes=None,
        bias=None,
        sinks=None,
    )
    config = rt.Config(args.device)
    dev = config.device
    kc_d, vc_d = rt.asdevicearray(dev, kc), rt.asdevicearray(dev, vc)
    sample = [0, b - 1]
    kw = dict(mask_type=v.mask, window_size_right=0 if v.mask != "none" else -1)
    ref, _ = fmha_fwd_paged_ref(q[sample], kc, vc, bt[sample], sk[sample], **kw)
    for path in args.vmfbs:
        vm = rt.VmModule.copy_buffer(config.vm_instance, Path(path).read_bytes())
        loaded = _Loaded(v, vm, config, spin=args.device != "local-task")  # fenced or synchronous builds alike

        def fn(*c):
            return loaded.invoke(list(c))

        calls, places = [], []
        for st in kernel_steps(v, call):
            a, place = [st.q(q), *st.args], st.place
            d = [rt.asdevicearray(dev, x) for x in a]
            calls.append([d[0], kc_d, vc_d, *d[1:]])
            places.append(place)
        last = []

        def run():
            last.clear()
            for c in calls:
                last.append(fn(*c))

        def sync():
            for r in last:
                r[0].to_host()

        ms = median_ms(run, args.repeat, sync=sync)
        out = np.empty((b, sq, HQ, v.hdim_v), q.dtype)
        lse = np.empty((b, HQ, sq), np.float32)
        run()
        for r, place in zip(last, places):
            place((out, lse), [r[0].to_host(), r[1].to_host()])
        err = float(np.abs(out[sample].astype(np.float64) - ref).max() / np.abs(ref).max())
        print(f"{Path(path).name}: {ms:.3f} ms, rel err {err:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
