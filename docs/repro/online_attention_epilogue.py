#!/usr/bin/env python3
"""IREE fuses one elementwise consumer into an online_attention dispatch,
and only while none of the op's other results leaves it.

A kernel that merges partial attention results needs each partial's
output and its row statistics (max and sum, or an LSE). The normalized
output alone (acc / sum, truncated to f16) is one dispatch; asking for
the statistics as well, whether as the op's own results or through a
second elementwise consumer, splits the normalization into a dispatch
of its own, so the f32 accumulator goes through memory. 16 entries of
128 query rows, GQA 32/8, head dim 128, 256 keys, fp16, dynamic entry
count (the prefill tiles' classes: mlir/prefill_tiles.mlir.jinja).

    .venv/bin/python docs/repro/online_attention_epilogue.py

prints each form's dispatches for sm_80, gfx942 and llvm-cpu (compile
only: `--compile-to=flow`, so no GPU is needed)."""

from __future__ import annotations

import re
import sys

T, HK, G, D, KEYS = 128, 8, 4, 128, 256


def tt(*dims, et="f16") -> str:
    return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"


def module(results: str) -> str:
    """results: "out" (the normalized output), "out_stats" (it, and the
    op's max and sum) or "out_lse" (it, and an LSE from a second
    elementwise consumer of max and sum)."""
    q_t, k_t = tt("?", HK, G, T, D), tt("?", HK, KEYS, D)
    acc_t, r_t, o_t = tt("?", HK, G, T, D, et="f32"), tt("?", HK, G, T, et="f32"), tt("?", HK, G, T, D)
    dims = "(b, h, g, m, e, d, n)"
    maps = ", ".join(
        f"affine_map<{dims} -> ({r})>"
        for r in ("b, h, g, m, d", "b, h, n, d", "b, h, n, e", "", "b, h, g, m, e", "b, h, g, m", "b, h, g, m")
    )
    p4 = "affine_map<(b, h, g, m) -> (b, h, g, m)>"
    ret, types = {
        "out": ("%out", o_t),
        "out_stats": ("%out, %att#1, %att#2", f"{o_t}, {r_t}, {r_t}"),
        "out_lse": ("%out, %lse", f"{o_t}, {r_t}"),
    }[results]
    lse = (
        f"""  %lse = linalg.generic {{indexing_maps = [{p4}, {p4}, {p4}],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%att#1, %att#2 : {r_t}, {r_t}) outs(%r_e : {r_t}) {{
  ^bb0(%mx: f32, %l: f32, %o: f32):
    %ln2 = arith.constant 0.693147182 : f32
    %mn = arith.mulf %mx, %ln2 : f32
    %lg = math.log %l : f32
    %x = arith.addf %mn, %lg : f32
    linalg.yield %x : f32
  }} -> {r_t}
"""
        if results == "out_lse"
        else ""
    )
    return f"""module {{
util.func public @partial(%q: {q_t}, %k: {k_t}, %v: {k_t}) -> ({types}) {{
  %c0 = arith.constant 0 : index
  %n = tensor.dim %q, %c0 : {q_t}
  %zero = arith.constant 0.0 : f32
  %max_start = arith.constant -3.0e+38 : f32
  %scale = arith.constant 0.08838835 : f32
  %acc_e = tensor.empty(%n) : {acc_t}
  %r_e = tensor.empty(%n) : {r_t}
  %acc0 = linalg.fill ins(%zero : f32) outs(%acc_e : {acc_t}) -> {acc_t}
  %max0 = linalg.fill ins(%max_start : f32) outs(%r_e : {r_t}) -> {r_t}
  %sum0 = linalg.fill ins(%zero : f32) outs(%r_e : {r_t}) -> {r_t}
  %att:3 = iree_linalg_ext.online_attention <indexing_maps = [{maps}]>
      ins(%q, %k, %v, %scale : {q_t}, {k_t}, {k_t}, f32) outs(%acc0, %max0, %sum0 : {acc_t}, {r_t}, {r_t}) {{
    ^bb0(%s: f32):
      iree_linalg_ext.yield %s : f32
  }} -> {acc_t}, {r_t}, {r_t}
  %out_e = tensor.empty(%n) : {o_t}
  %out = linalg.generic {{indexing_maps = [affine_map<(b, h, g, m, d) -> (b, h, g, m, d)>,
      affine_map<(b, h, g, m, d) -> (b, h, g, m)>, affine_map<(b, h, g, m, d) -> (b, h, g, m, d)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}}
      ins(%att#0, %att#2 : {acc_t}, {r_t}) outs(%out_e : {o_t}) {{
  ^bb0(%a: f32, %l: f32, %o: f16):
    %x = arith.divf %a, %l : f32
    %t = arith.truncf %x : f32 to f16
    linalg.yield %t : f16
  }} -> {o_t}
{lse}  util.return {ret} : {types}
}}
}}
"""


TARGETS = {
    "sm_80": ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"],
    "gfx942": ["--iree-hal-target-device=hip", "--iree-rocm-target=gfx942"],
    "llvm-cpu": ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu"],
}


def dispatches(source: str, flags: list[str]) -> list[str]:
    import iree.compiler as ic

    flow = ic.compile_str(source, extra_args=[*flags, "--compile-to=flow"], output_format="mlir-text")
    text = flow.decode() if isinstance(flow, bytes) else flow
    return re.findall(r"flow\.executable private @(\w+)", text)


def main() -> int:
    for results in ("out", "out_stats", "out_lse"):
        for target, flags in TARGETS.items():
            names = dispatches(module(results), flags)
            print(f"{results:9s} {target:8s} {len(names)} dispatch(es): {', '.join(names)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
