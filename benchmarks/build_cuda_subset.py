#!/usr/bin/env python3
"""The CUDA artifacts as_called.py's default rows and its --hf model need,
out of the default CUDA set: the f16, head dim 128, page 16 variants
without score terms, for 32/8 heads and for run-time head counts (NHD and
HND), row-entry tiles included, their append kernels and the prefill
tile kernels of 32/8 heads. ~180 kernels,
about 2.5 minutes on 2 cores, where the whole set takes an hour.

    .venv/bin/python benchmarks/build_cuda_subset.py [--artifacts artifacts-cuda]
"""

import argparse
import time
from pathlib import Path

from turbine_fmha.build import aot
from turbine_fmha.build.default_sets import default_tiles_kernels, gpu_default_set
from turbine_fmha.kernels.append_kernel import AppendKernel


def subset() -> list:
    out = [
        v
        for v in gpu_default_set()
        if v.dtype == "f16"
        and v.hdim_q == 128
        and v.page_block_size == 16
        and not v.kv_dtype
        and v.bias == "none"
        and not v.softcap
        and not v.sinks
        and v.v_layout == "row"
        and ((v.nhead_q, v.nhead_k) == (32, 8) or v.runtime_heads)
    ]
    tiles = [k for k in default_tiles_kernels(gpu=True) if k.dtype == "f16" and k.page_block_size == 16]
    return out + [AppendKernel("f16", heads, 128, 128, 16) for heads in (8, 4, 1)] + tiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default="artifacts-cuda")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = aot.build(Path(args.artifacts), ["cuda"], subset())
    print(f"{len(results)} kernels ({sum(r.rebuilt for r in results)} compiled) in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
