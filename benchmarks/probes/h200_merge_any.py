#!/usr/bin/env python3
"""Does a run-time split count (Variant.merge_any, `_xn`) keep the speed
of the merged decodes of one count each (`_x<n>`)? For long decodes of
tile 128 (b16 x 4096 in 8 splits, b4 x 32k in 32, b1 x 32k in 128), with
and without the stale-row guard: device time of calls back to back with
one wait, rounds interleaved, and each output against the float64
reference (the kernels' own entries: kernel_steps lays out the `_xn`
variant's split-major).

DIR holds `<variant>.vmfb` for every variant the cases name, compiled for
the device here (no compiler there):

    .venv/bin/python benchmarks/probes/h200_merge_any.py --build DIR --target cuda
    python3 benchmarks/probes/h200_merge_any.py --device cuda --dir DIR
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from turbine_fmha.calls.mask import MaskSpec
from turbine_fmha.calls.plan import KernelCall, kernel_steps, split_kv
from turbine_fmha.kernels.variants import Variant, online_variant

HQ, HK, D, PAGE, TILE = 32, 8, 128, 16, 128
CASES = ((16, 4096, 8), (4, 32768, 32), (1, 32768, 128))  # batch, keys, splits
CPU_CASES = ((16, 256, 8), (4, 2048, 32), (1, 4096, 128))  # the same entries, fewer keys
PROBLEM = Variant("f16", D, D, HQ, HK, PAGE, "none").problem


def variants(n: int) -> dict:
    return {
        f"{kind} {'guard' if guard else 'no guard'}": online_variant(PROBLEM, TILE, 1, v_guard=guard, **fields)
        for guard in (True, False)
        for kind, fields in (("_x<n>", dict(merge_splits=n)), ("_xn", dict(merge_any=True)))
    }


def decode_case(rng, batch: int, keys: int):
    """Random f16 paged decode inputs (pages shuffled, every sequence `keys`
    long) and the mask-free KernelCall over them: (q, k_cache, v_cache,
    block_table, seqlen_k, call)."""
    pages = keys // PAGE
    num_pages = batch * pages + 1
    kc = rng.standard_normal((num_pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((num_pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    bt = rng.permutation(num_pages)[: batch * pages].reshape(batch, pages).astype(np.int32)
    sk = np.full(batch, keys, np.int32)
    q = rng.standard_normal((batch, 1, HQ, D), dtype=np.float32).astype(np.float16)
    call = KernelCall(
        rows=1,
        q_itemsize=2,
        nhead_q=HQ,
        block_table=bt,
        page=PAGE,
        seqlen_q=np.ones(batch, np.int32),
        seqlen_k=sk,
        kv_shift=np.zeros(batch, np.int32),
        scale=1 / math.sqrt(D),
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=MaskSpec(),
        alibi_slopes=None,
        bias=None,
        sinks=None,
    )
    return q, kc, vc, bt, sk, call


def device_ms(loaded, dargs: list, repeat: int) -> float:
    """Device time per call: `repeat` calls queued back to back, one wait."""
    t0 = time.perf_counter()
    calls = [loaded.enqueue(list(dargs)) for _ in range(repeat)]
    calls[-1].wait()
    return (time.perf_counter() - t0) * 1e3 / repeat


def build(out: Path, target: str) -> None:
    from turbine_fmha.build.compiler import _compile_one
    from turbine_fmha.build.targets import TARGETS
    from turbine_fmha.kernels.custom_ops import render_variant

    out.mkdir(parents=True, exist_ok=True)
    seen = set()
    for _, _, n in CASES:
        for v in variants(n).values():
            if v.name not in seen:
                seen.add(v.name)
                _compile_one(render_variant(v), v.name, (out / f"{v.name}.vmfb").resolve(), TARGETS[target])
                print("built", v.name, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--build", type=Path, help="compile the cases' variants into this directory and stop")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.build:
        build(args.build, args.target)
        return 0
    import iree.runtime as rt

    from turbine_fmha.runtime.invoke import _Loaded
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    config = rt.Config(args.device)
    dev = config.device
    local = args.device == "local-task"
    rng = np.random.default_rng(0)
    for batch, keys, n in CASES if not local else CPU_CASES:
        q, kc, vc, bt, sk, call = decode_case(rng, batch, keys)
        split = split_kv(call, n, merged=True)
        ref, _ = fmha_fwd_paged_ref(q, kc, vc, bt, sk)
        mods = {}
        for label, v in variants(n).items():
            (step,) = kernel_steps(v, split)
            vm = rt.VmModule.copy_buffer(config.vm_instance, (args.dir / f"{v.name}.vmfb").read_bytes())
            host = [step.q(q), kc, vc, *step.args]
            # The CPU dry run passes the host arrays as they are (the call
            # imports them); a GPU gets them uploaded once.
            dargs = host if local else [rt.asdevicearray(dev, a) for a in host]
            mods[label] = (_Loaded(v, vm, config, spin=not local), dargs, host)
        times = {k: [] for k in mods}
        outs = {}
        for _ in range(args.rounds):
            for label, (loaded, dargs, _) in mods.items():
                # Copied at once: to_host's array may be the result buffer's own memory.
                outs[label] = np.array(loaded.invoke(list(dargs))[0].to_host()[:batch], copy=True)
                if local:  # a dry run: the CPU checks the outputs, its times mean nothing
                    continue
                times[label].append(device_ms(loaded, dargs, args.repeat))
        line = [f"b{batch} x {keys}, {n} splits (device ms, median of {args.rounds} rounds; rel err):"]
        for label in mods:
            err = float(np.abs(outs[label].astype(np.float64) - ref).max() / np.abs(ref).max())
            ms = statistics.median(times[label]) if times[label] else math.nan
            line.append(f"  {label}: {ms:.4f} ({err:.1e})")
        print("\n".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
