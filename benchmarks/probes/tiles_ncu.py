#!/usr/bin/env python3
"""One prefill call through contiguous tiles (Session prefill_tiles on) on
a CUDA GPU, for a profiler: warm-up calls, then one call between
cudaProfilerStart and Stop, so that

    ncu --profile-from-start off --clock-control none \
        --metrics gpu__time_duration.sum python3 benchmarks/probes/tiles_ncu.py ARTIFACTS SHAPE

lists each dispatch of that call with its time. SHAPE is as_called.py's
(prefill:1x4096, chunked:4x512+8192, ...)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    from as_called import make_case, parse_shape, plan_kwargs

    import turbine_fmha

    artifacts, spec = sys.argv[1], sys.argv[2]
    session = turbine_fmha.Session("cuda", artifact_dir=artifacts, prefill_tiles=True)
    case = make_case(parse_shape(spec), "torch", "f16", "cuda", 0)
    attn = turbine_fmha.PagedAttention(session).plan(case.block_table, case.seqlen_k, **plan_kwargs(case))
    for _ in range(3):
        attn.run(case.q, case.k, case.v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    attn.run(case.q, case.k, case.v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(spec, session.last_variant.name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
