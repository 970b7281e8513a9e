#!/usr/bin/env python3
"""Can the online decode take its batch at run time (issue 28 item 6: batch
tiles as run-time values)? The default GPU sets build each decode in four
static batch tiles (8, 32, 64, 128) and pad a batch to the tile above it.
This compares those kernels with one module whose batch is dynamic:
the b32 decode (fp16, GQA 32/8, head dim 128, page 16, the group padded
to 16 rows, no stale-row guard) as rendered now, its batch dim made `?`
by dynamic_batch() below. Statically (perf-notes "Building the default
sets faster") the attention dispatch keeps the static kernel's lowering
configuration on sm_80 and gfx942. Here: device time of calls back to back
with one wait, rounds interleaved, each output against the float64
reference, and whether the dynamic module's output equals the static
kernel's bit for bit.

    .venv/bin/python benchmarks/probes/h200_dynamic_batch.py --build DIR --target cuda
    python3 benchmarks/probes/h200_dynamic_batch.py --device cuda --dir DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_merge_any import decode_case

from turbine_fmha.calls.plan import kernel_steps
from turbine_fmha.kernels.variants import Variant

TILES = (8, 32, 64, 128)
BASE = "pagedkv_fwd_f16_d128x128_h32x8_pg16_nmask_lse_online_b{}_q1_nvguard_m16"
CASES = ((5, 4096), (32, 4096), (48, 4096), (100, 4096))  # batch, keys
CPU_CASES = ((5, 256), (32, 256), (48, 256))


def device_ms(loaded, dargs: list, repeat: int) -> float:
    """Device time per call: `repeat` calls queued back to back (each on a
    timeline of its own: a CPU finishes them out of order), one wait."""
    t0 = time.perf_counter()
    calls = [loaded.enqueue(list(dargs), own_timeline=True) for _ in range(repeat)]
    for c in calls:
        c.wait()
    return (time.perf_counter() - t0) * 1e3 / repeat


def static(tile: int) -> Variant:
    return Variant.parse(BASE.format(tile))


def dynamic_batch(mlir: str) -> str:
    """The b32 rendering with its batch dim read from q: every tensor type's
    leading 32, the sizes of tensor.empty, expand_shape and extract_slice
    (the rendering's only other uses of the batch) become %bdyn."""
    t = mlir.replace("tensor<32x", "tensor<?x").replace("tensor<32xi32>", "tensor<?xi32>")
    t = t.replace("output_shape [32, ", "output_shape [%bdyn, ")
    t = re.sub(r"tensor\.empty\((%\w+)\) :", r"tensor.empty(%bdyn, \1) :", t)
    t = t.replace("tensor.empty() :", "tensor.empty(%bdyn) :")
    t = t.replace("] [32, ", "] [%bdyn, ")
    head = "    %c1 = arith.constant 1 : index\n"
    assert head in t, "the rendering changed: redo the edit"
    return t.replace(head, head + "    %bdyn = tensor.dim %arg0, %c0 : tensor<?x1x32x128xf16>\n", 1)


def build(out: Path, target: str) -> None:
    from turbine_fmha.build.compiler import _compile_one
    from turbine_fmha.build.targets import TARGETS
    from turbine_fmha.kernels.custom_ops import render_variant

    out.mkdir(parents=True, exist_ok=True)
    for tile in TILES:
        v = static(tile)
        _, report, _ = _compile_one(render_variant(v), v.name, (out / f"{v.name}.vmfb").resolve(), TARGETS[target])
        print("built", v.name, report, flush=True)
    v = static(32)
    mlir = dynamic_batch(render_variant(v))
    (out / "dyn.mlir").write_text(mlir)
    _, report, _ = _compile_one(mlir, v.name, (out / "dyn.vmfb").resolve(), TARGETS[target])
    print("built dyn", report, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--build", type=Path, help="compile the kernels into this directory and stop")
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
    local = args.device == "local-task"
    modules = {}
    for tile in TILES:
        v = static(tile)
        modules[tile] = (v, rt.VmModule.copy_buffer(config.vm_instance, (args.dir / f"{v.name}.vmfb").read_bytes()))
    dyn_module = rt.VmModule.copy_buffer(config.vm_instance, (args.dir / "dyn.vmfb").read_bytes())
    rng = np.random.default_rng(0)
    for batch, keys in CPU_CASES if local else CASES:
        q, kc, vc, bt, sk, call = decode_case(rng, batch, keys)
        ref, _ = fmha_fwd_paged_ref(q, kc, vc, bt, sk)
        tile = min(t for t in TILES if t >= batch)
        v, vm = modules[tile]
        runs = {}
        # The dynamic module keeps the b32 function's name; its arguments
        # are the batch's own, unpadded (a tile of exactly `batch`).
        for label, variant, laid_out, module in (
            (f"static b{tile}", v, v, vm),
            ("dynamic", static(32), dataclasses.replace(static(32), batch_tile=batch), dyn_module),
        ):
            (step,) = kernel_steps(laid_out, call)
            host = [step.q(q), kc, vc, *step.args]
            dargs = host if local else [rt.asdevicearray(config.device, a) for a in host]
            runs[label] = (_Loaded(variant, module, config, spin=not local), dargs)
        times = {k: [] for k in runs}
        outs = {}
        for _ in range(args.rounds):
            for label, (loaded, dargs) in runs.items():
                # Copied while its DeviceArray lives: a CPU's to_host() maps the
                # buffer, which the timed calls would reuse.
                result = loaded.invoke(list(dargs))[0]
                outs[label] = np.array(result.to_host())[:batch]
                times[label].append(device_ms(loaded, dargs, args.repeat))
        line = [f"b{batch} x {keys}:"]
        for label in runs:
            err = float(np.abs(outs[label].astype(np.float64) - ref).max() / np.abs(ref).max())
            line.append(f"{label} {statistics.median(times[label]):.4f} ms (rel err {err:.1e})")
        (s, d) = runs
        line.append(f"bitwise equal: {np.array_equal(outs[s], outs[d])}")
        line.append(f"dynamic / static {statistics.median(times[d]) / statistics.median(times[s]):.3f}")
        print(", ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
