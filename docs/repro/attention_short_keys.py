#!/usr/bin/env python3
"""IREE's online_attention runs short reductions far below its rate on
long ones: 16 entries of 128 query rows, GQA 32/8, head dim 128, fp16,
static and unpaged (no gather, no mask), over 128 ... 4096 keys each.

    .venv/bin/python docs/repro/attention_short_keys.py --build OUT   # here: sm_80 vmfbs
    python3 docs/repro/attention_short_keys.py --run OUT              # on a CUDA GPU

prints device ms and TFLOP/s per key count (calls back to back). The
prefill tiles' classes are these shapes (kernels/tiles_kernel.py): a
causal prefill's short classes hold as many entries as its long ones,
so their rate bounds the whole call's."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

E, T, HK, G, D = 16, 128, 8, 4, 128
KEYS = (128, 256, 512, 1024, 2048, 4096)


def mlir(keys: int) -> str:
    def tt(*dims, et="f16"):
        return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"

    q_t, k_t = tt(E, HK, G, T, D), tt(E, HK, keys, D)
    acc_t, r_t = tt(E, HK, G, T, D, et="f32"), tt(E, HK, G, T, et="f32")
    dims = "(b, h, g, m, e, d, n)"
    maps = ", ".join(
        f"affine_map<{dims} -> ({r})>"
        for r in ("b, h, g, m, d", "b, h, n, d", "b, h, n, e", "", "b, h, g, m, e", "b, h, g, m", "b, h, g, m")
    )
    return f"""module {{
util.func public @attention(%q: {q_t}, %k: {k_t}, %v: {k_t}) -> {acc_t} {{
  %zero = arith.constant 0.0 : f32
  %max_start = arith.constant -3.0e+38 : f32
  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32
  %acc_e = tensor.empty() : {acc_t}
  %r_e = tensor.empty() : {r_t}
  %acc0 = linalg.fill ins(%zero : f32) outs(%acc_e : {acc_t}) -> {acc_t}
  %max0 = linalg.fill ins(%max_start : f32) outs(%r_e : {r_t}) -> {r_t}
  %sum0 = linalg.fill ins(%zero : f32) outs(%r_e : {r_t}) -> {r_t}
  %att:3 = iree_linalg_ext.online_attention <indexing_maps = [{maps}]>
      ins(%q, %k, %v, %scale : {q_t}, {k_t}, {k_t}, f32) outs(%acc0, %max0, %sum0 : {acc_t}, {r_t}, {r_t}) {{
    ^bb0(%s: f32):
      iree_linalg_ext.yield %s : f32
  }} -> {acc_t}, {r_t}, {r_t}
  util.return %att#0 : {acc_t}
}}
}}
"""


def build(out: Path) -> None:
    import iree.compiler as ic

    out.mkdir(parents=True, exist_ok=True)
    for keys in KEYS:
        vmfb = ic.compile_str(
            mlir(keys), target_backends=["cuda"], extra_args=["--iree-cuda-target=sm_80", "--iree-opt-level=O3"]
        )
        (out / f"keys{keys}.vmfb").write_bytes(vmfb)
        print(f"keys{keys}.vmfb", len(vmfb), flush=True)


def run(out: Path, calls: int = 50) -> None:
    import iree.runtime as rt

    config = rt.Config("cuda")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((E, HK, G, T, D), dtype=np.float32).astype(np.float16)
    for keys in KEYS:
        module = rt.VmModule.copy_buffer(config.vm_instance, (out / f"keys{keys}.vmfb").read_bytes())
        ctx = rt.SystemContext(vm_modules=[module], config=config)
        f = ctx.modules.module.attention
        k = rng.standard_normal((E, HK, keys, D), dtype=np.float32).astype(np.float16)
        args = [rt.asdevicearray(config.device, a) for a in (q, k, k)]
        f(*args).to_host()
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f(*args)
        r.to_host()
        ms = (time.perf_counter() - t0) / calls * 1e3
        flops = 4.0 * E * HK * G * T * keys * D
        print(f"keys {keys:5d}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    args = ap.parse_args()
    if args.build:
        build(args.build)
    if args.run:
        run(args.run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
