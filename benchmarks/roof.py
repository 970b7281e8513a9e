#!/usr/bin/env python3
"""The "IREE roof" for prefill: IREE's own attention on plain,
static, unpaged tensors of the benchmark's prefill shape, built by the same
compiler, timed on the device like bench.py.

    python benchmarks/roof.py --build artifacts-cuda/roof        # here: compile
    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/roof.py --run artifacts-cuda/roof   # on the GPU

Shape: 32 heads (the GQA 32/8 K/V repeated to 32 heads: the roof reads
each head's K/V once), 4096 x 4096, head dim 128, f16, NO mask. Causal
prefill computes about half the score elements; bench.py reports it as
TFLOP/s over the visible elements, so the roof is compared as TFLOP/s over
all of its elements (4 FLOPs per element and head-dim lane).

Three roofs: "iree", IREE's attention op with its own configuration; and
"online_full" / "online_causal", the online_attention form this project's
kernels use (the same tuning edit applies), without and with a causal i1
mask like ours: the causal one is the roof for our causal prefill, minus
the paging (a mask still computes every block, as ours does on GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

H, S, D = 32, 4096, 128
NAME = "roof_attention_f16"


def mlir() -> str:
    t = f"tensor<{H}x{S}x{D}xf16>"
    # (d0, d1, d2, d3, d4) = (head, query, head dim, key, value dim)
    dims = "affine_map<(d0, d1, d2, d3, d4) -> "
    maps = [dims + r + ">" for r in ("(d0, d1, d2)", "(d0, d3, d2)", "(d0, d3, d4)", "()", "(d0, d1, d4)")]
    return f"""func.func @{NAME}(%q: {t}, %k: {t}, %v: {t}) -> {t} {{
  %scale = arith.constant {1 / np.sqrt(D):.8f} : f16
  %empty = tensor.empty() : {t}
  %out = iree_linalg_ext.attention <{{indexing_maps = [{", ".join(maps)}]}}>
      ins(%q, %k, %v, %scale : {t}, {t}, {t}, f16) outs(%empty : {t}) {{
    ^bb0(%s: f32):
      iree_linalg_ext.yield %s : f32
  }} -> {t}
  return %out : {t}
}}
"""


def online_mlir(causal: bool) -> str:
    """The roof as this project's kernels state it: online_attention (which
    turbine_fmha.tuning configures, as for ours), scale f32, an i1 mask
    [query, key] broadcast over heads (ours is computed into such a tensor
    by the module), then the normalization. With causal=False the mask is
    all true."""
    t, ta = f"tensor<{H}x{S}x{D}xf16>", f"tensor<{H}x{S}x{D}xf32>"
    tr, tm = f"tensor<{H}x{S}xf32>", f"tensor<{S}x{S}xi1>"
    dims = "affine_map<(d0, d1, d2, d3, d4) -> "
    maps = [
        dims + r + ">"
        for r in (
            "(d0, d1, d2)",
            "(d0, d3, d2)",
            "(d0, d3, d4)",
            "()",
            "(d1, d3)",
            "(d0, d1, d4)",
            "(d0, d1)",
            "(d0, d1)",
        )
    ]
    keep = "%ok = arith.cmpi sle, %j, %i : index" if causal else "%ok = arith.constant true"
    return f"""func.func @{NAME}(%q: {t}, %k: {t}, %v: {t}) -> {t} {{
  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32
  %zero = arith.constant 0.0 : f32
  %lo = arith.constant -3.0e+38 : f32
  %mask_e = tensor.empty() : {tm}
  %mask = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>], iterator_types = ["parallel", "parallel"]}}
      outs(%mask_e : {tm}) {{
  ^bb0(%o: i1):
    %i = linalg.index 0 : index
    %j = linalg.index 1 : index
    {keep}
    linalg.yield %ok : i1
  }} -> {tm}
  %acc_e = tensor.empty() : {ta}
  %r_e = tensor.empty() : {tr}
  %acc0 = linalg.fill ins(%zero : f32) outs(%acc_e : {ta}) -> {ta}
  %max0 = linalg.fill ins(%lo : f32) outs(%r_e : {tr}) -> {tr}
  %sum0 = linalg.fill ins(%zero : f32) outs(%r_e : {tr}) -> {tr}
  %att:3 = iree_linalg_ext.online_attention <indexing_maps = [{", ".join(maps)}]>
      ins(%q, %k, %v, %scale, %mask : {t}, {t}, {t}, f32, {tm}) outs(%acc0, %max0, %sum0 : {ta}, {tr}, {tr}) {{
    ^bb0(%s: f32):
      iree_linalg_ext.yield %s : f32
  }} -> {ta}, {tr}, {tr}
  %out_e = tensor.empty() : {t}
  %out = linalg.generic {{indexing_maps = [affine_map<(h, m, e) -> (h, m, e)>, affine_map<(h, m, e) -> (h, m)>,
                                          affine_map<(h, m, e) -> (h, m, e)>],
                         iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%att#0, %att#2 : {ta}, {tr}) outs(%out_e : {t}) {{
  ^bb0(%a: f32, %l: f32, %o: f16):
    %n = arith.divf %a, %l : f32
    %h = arith.truncf %n : f32 to f16
    linalg.yield %h : f16
  }} -> {t}
  return %out : {t}
}}
"""


ROOFS = {"iree": mlir, "online_full": lambda: online_mlir(False), "online_causal": lambda: online_mlir(True)}


def build(out: Path) -> None:
    """IREE's own configuration (turbine_fmha.tuning edits online_attention
    only; measured here, it left this module unchanged)."""
    from turbine_fmha.build import compiler, targets

    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for tag, source in ROOFS.items():
        seconds, report, _ = compiler.compile_one(
            source(), NAME, (out / f"{tag}.vmfb").resolve(), targets.TARGETS["cuda"]
        )
        reports[tag] = dict(report, seconds=round(seconds, 2))
        print(tag, reports[tag])
    (out / "roof.json").write_text(json.dumps(reports, indent=1))


def run(out: Path, repeat: int) -> None:
    import iree.runtime as rt

    import turbine_fmha
    from turbine_fmha.runtime.invoke import Loaded

    session = turbine_fmha.Session("cuda", artifact_dir="/nonexistent-roof")
    cfg, dev = session._iree_config(), session.device_of()
    rng = np.random.default_rng(0)
    q, k, v = (
        rt.asdevicearray(dev, rng.standard_normal((H, S, D), dtype=np.float32).astype(np.float16)) for _ in range(3)
    )
    flops = 4.0 * H * S * S * D
    visible = 4.0 * H * S * (S + 1) / 2 * D
    for tag in ROOFS:
        path = out / f"{tag}.vmfb"
        if not path.exists():
            continue
        loaded = Loaded(
            type("V", (), {"name": NAME})(), rt.VmModule.copy_buffer(cfg.vm_instance, path.read_bytes()), cfg, spin=True
        )
        last = [None]

        def call():
            # Waiting for nothing: see bench.py's run().
            last[0] = loaded.enqueue([q, k, v])

        for _ in range(3):
            call()
        last[0].wait()
        t0 = time.perf_counter()
        for _ in range(repeat):
            call()
        last[0].wait()
        ms = (time.perf_counter() - t0) * 1e3 / repeat
        out_h = last[0].results(1)[0].to_host().astype(np.float32)
        causal = tag.endswith("causal")
        print(
            f"roof ({tag}): {ms:.3f} ms, {flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s over all {H}x{S}x{S} "
            f"elements"
            + (f", {visible / (ms * 1e-3) / 1e12:.1f} over the visible (causal) ones" if causal else "")
            + f"; output finite: {bool(np.isfinite(out_h).all())}",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    if args.build:
        build(args.build)
    if args.run:
        run(args.run, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
