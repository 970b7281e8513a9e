#!/usr/bin/env python3
"""Long decodes at several merged split counts on the H200.

For each shape and split count (num_splits; merged in the module where
the artifacts hold that count, guarded and not), the call is verified against the float64 reference, and run() is timed back to back
with its per-dispatch device times (torch.profiler), next to torch
gather+SDPA in the same process.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_split_count.py --artifacts artifacts-h200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from h200_dispatch_profile import _back_to_back, decode_problem, dispatch_times

HQ, HK, D, PAGE = 32, 8, 128, 16


def _torch_ms(q, k, v, bt, keys, calls):
    import torch
    import torch.nn.functional as F

    btt = torch.as_tensor(bt, device="cuda").long()

    def gather_sdpa():
        kk = k[btt].flatten(1, 2)[:, :keys].transpose(1, 2)
        vv = v[btt].flatten(1, 2)[:, :keys].transpose(1, 2)
        return F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True)

    return _back_to_back(gather_sdpa, calls)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()

    import turbine_fmha
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    for batch, keys in ((1, 32768), (4, 32768)):
        pages, bt, sk, q, k, v = decode_problem(rng, batch, keys)
        ref, _ = fmha_fwd_paged_ref(*(t.cpu().numpy() for t in (q, k, v)), bt, sk)
        print(f"decode b{batch} x {keys}: torch gather+SDPA {_torch_ms(q, k, v, bt, keys, args.calls):.3f} ms")
        for n in (16, 32, 64, 128):
            try:
                attn = turbine_fmha.PagedAttention(session).plan(
                    bt,
                    sk,
                    num_pages=pages,
                    page_block_size=PAGE,
                    nhead_q=HQ,
                    nhead_k=HK,
                    hdim=D,
                    dtype="f16",
                    kv_rows_finite=True,
                    num_splits=n,
                )
                out = attn.run(q, k, v)
            except Exception as e:
                print(f"  splits {n}: {type(e).__name__}: {str(e)[:120]}")
                continue
            part = attn._plan.parts[0]
            err = float(np.abs(out.float().cpu().numpy() - ref).max() / np.abs(ref).max())
            ms = _back_to_back(lambda: attn.run(q, k, v), args.calls, warmup=10)
            per = dispatch_times(lambda: attn.run(q, k, v), args.calls)
            name = attn._plan.variant(0, True).name
            print(
                f"  splits {part.splits} (merged {part.merge}): run() back to back {ms:.3f} ms, rel err {err:.1e} ({'ok' if err < 5e-3 else 'FAILED'}), "
                f"{name}; dispatches {len(per)}, device sum {sum(per.values()):.1f} us"
            )
            for dname, us in sorted(per.items(), key=lambda x: -x[1])[:4]:
                print(f"      {us:7.1f} us  {dname[-60:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
