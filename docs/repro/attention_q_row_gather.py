#!/usr/bin/env python3
"""A gather of query rows fused into online_attention fails to compile for
sm_80 when the gathered dimension is the attention's row dimension.

The prefill tiles (mlir/prefill_tiles.mlir.jinja) need each entry's query
tile: 128 rows of one sequence, at any row offset in the ragged q. Two
forms of the same attention (16 entries of 128 query rows, GQA 32/8, head
dim 128, 256 keys, fp16, dynamic entry count), each with its Q from an
`iree_linalg_ext.gather` that IREE fuses into the attention dispatch:

- heads: Q gathered from a head-major copy [tiles * HK, G, T, D] by one
  index per (entry, KV head): what the library ships, after a pass that
  writes that copy;
- rows: Q gathered straight from q [N, HK, G, D] by one index per
  (entry, row), the attention reading it as (b, m, h, g, d): no copy.

    .venv/bin/python docs/repro/attention_q_row_gather.py

compiles both for sm_80, gfx942 and llvm-cpu with IREE's default
configuration (no GPU needed) and prints which compile."""

from __future__ import annotations

import sys

T, HK, G, D, KEYS = 128, 8, 4, 128, 256


def tt(*dims, et="f16") -> str:
    return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"


def module(form: str) -> str:
    dims = "(b, h, g, m, e, d, n)"
    q_map = {"rows": "b, m, h, g, d", "heads": "b, h, g, m, d"}[form]
    maps = ", ".join(
        f"affine_map<{dims} -> ({r})>"
        for r in (q_map, "b, h, n, d", "b, h, n, e", "", "b, h, g, m, e", "b, h, g, m", "b, h, g, m")
    )
    if form == "rows":
        src_t, qt_t, idx_t = tt("?", HK, G, D), tt("?", T, HK, G, D), "tensor<?xi32>"
        gather = f"""  %et = arith.muli %e, %c{T} : index
  %qf_e = tensor.empty(%et) : {src_t}
  %qf = iree_linalg_ext.gather dimension_map = [0] ins(%src, %idx : {src_t}, {idx_t}) outs(%qf_e : {src_t}) -> {src_t}
  %qt = tensor.expand_shape %qf [[0, 1], [2], [3], [4]] output_shape [%e, {T}, {HK}, {G}, {D}] : {src_t} into {qt_t}"""
    else:
        src_t, qt_t, idx_t = tt("?", G, T, D), tt("?", HK, G, T, D), f"tensor<?x{HK}xi32>"
        gather = f"""  %qt_e = tensor.empty(%e) : {qt_t}
  %qt = iree_linalg_ext.gather dimension_map = [0] ins(%src, %idx : {src_t}, {idx_t}) outs(%qt_e : {qt_t}) -> {qt_t}"""
    k_t, acc_t, r_t = tt("?", HK, KEYS, D), tt("?", HK, G, T, D, et="f32"), tt("?", HK, G, T, et="f32")
    return f"""func.func @partial(%src: {src_t}, %idx: {idx_t}, %k: {k_t}, %v: {k_t}) -> {acc_t} {{
  %c0 = arith.constant 0 : index
  %c{T} = arith.constant {T} : index
  %scale = arith.constant 0.08838835 : f32
  %zero = arith.constant 0.0 : f32
  %max_start = arith.constant -3.0e+38 : f32
  %e = tensor.dim %k, %c0 : {k_t}
{gather}
  %acc_e = tensor.empty(%e) : {acc_t}
  %r_e = tensor.empty(%e) : {r_t}
  %acc0 = linalg.fill ins(%zero : f32) outs(%acc_e : {acc_t}) -> {acc_t}
  %max0 = linalg.fill ins(%max_start : f32) outs(%r_e : {r_t}) -> {r_t}
  %sum0 = linalg.fill ins(%zero : f32) outs(%r_e : {r_t}) -> {r_t}
  %att:3 = iree_linalg_ext.online_attention <indexing_maps = [{maps}]>
      ins(%qt, %k, %v, %scale : {qt_t}, {k_t}, {k_t}, f32) outs(%acc0, %max0, %sum0 : {acc_t}, {r_t}, {r_t}) {{
  ^bb0(%s: f32):
    iree_linalg_ext.yield %s : f32
  }} -> {acc_t}, {r_t}, {r_t}
  return %att#0 : {acc_t}
}}
"""


TARGETS = {
    "sm_80": ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"],
    "gfx942": ["--iree-hal-target-device=hip", "--iree-rocm-target=gfx942"],
    "llvm-cpu": [
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=generic",
    ],
}


def main() -> int:
    import iree.compiler as ic

    for form in ("heads", "rows"):
        for target, flags in TARGETS.items():
            try:
                ic.compile_str(module(form), extra_args=flags)
                result = "compiles"
            except ic.CompilerToolError as e:
                first = next((ln for ln in str(e).splitlines() if "error:" in ln), str(e).splitlines()[0])
                result = "FAILS: " + first.split("error:", 1)[-1].strip()[:120]
            print(f"{form:6s} {target:8s} {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
