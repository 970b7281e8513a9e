#!/usr/bin/env python3
"""Attention sinks given to run() (PagedAttention.run(sinks=...)) on a GPU,
against the float64 reference: a plan made with one layer's sinks, then
runs with other sinks as a torch CUDA tensor, as numpy, and none (the
plan's). The cases take each path the sinks go through on the GPU default
set's sink kernels: a decode in one launch, a long single decode split
and merged on the host (combine_splits adds the run's sinks), a causal
prefill in row tiles, a chunked prefill, and a mixed varlen batch
(decodes beside a prefill). Each run's sinks move the output by far more
than the tolerance, which the probe checks too, so a run given the plan's
sinks would fail. fp16, 32/8 heads of 128, page 16; inputs random, spare
pages NaN, unused table slots garbage.

Build the kernels here (the GPU default set's f16 / 128 / 32x8 / page 16
sink variants, no other score terms; a minute on 2 cores):
    .venv/bin/python benchmarks/probes/h200_run_sinks.py --build --dir build/sinks-cuda
Run on the GPU machine (carry .whl and build/sinks-cuda):
    python3 benchmarks/probes/h200_run_sinks.py --device cuda --dir build/sinks-cuda
A dry run on the CPU (explicit kernels, compiled on first use):
    .venv/bin/python benchmarks/probes/h200_run_sinks.py --device cpu --dir build/sinks-cpu --compile-missing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HQ, HK, D, PAGE = 32, 8, 128, 16
OUT_TOL = 5e-3  # tests/conftest.py OUT_TOL["f16"]: two fp16 roundings, f32 accumulation
LSE_TOL = 5e-3  # tests/conftest.py LSE_TOL["f16"]

# name: (query rows per sequence, keys per sequence); a list of rows is a
# varlen batch (seqstart_q).
CASES = {
    "decode b32 x 1024": (1, [1024] * 32),
    "decode b1 x 8192 (split, host merge)": (1, [8192]),
    "prefill 1 x 1024 causal": (1024, [1024]),
    "chunked 4 x 128 over 1024": (128, [1152, 1100, 1152, 1040]),
    "mixed: 6 decodes + a 300-row prefill": ([1, 1, 1, 1, 1, 1, 300], [700, 513, 64, 1000, 33, 257, 300]),
}


def variants():
    from turbine_fmha.build.default_sets import gpu_default_set

    return [
        v
        for v in gpu_default_set()
        if v.sinks
        and v.dtype == "f16"
        and v.hdim_q == D
        and v.page_block_size == PAGE
        and (v.nhead_q, v.nhead_k) == (HQ, HK)
        and v.bias == "none"
        and not v.softcap
        and not v.kv_dtype
        and v.v_layout == "row"
        and v.kv_layout == "NHD"
    ]


def problem(rng, rows, lens_k):
    lens_k = np.array(lens_k, np.int32)
    used = -(-lens_k // PAGE)
    pages = int(used.sum()) + 3
    k = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    perm = rng.permutation(pages)
    bt = rng.choice(np.array([-1, pages, 2**31 - 1]), size=(len(lens_k), int(used.max()) + 2)).astype(np.int32)
    at = 0
    for b, n in enumerate(used):
        bt[b, :n] = perm[at : at + n]
        at += n
    k[perm[at:]] = np.nan
    v[perm[at:]] = np.nan
    kw = dict(mask_type="bottom_right", window_size_right=0)
    if isinstance(rows, list):
        starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        q = rng.standard_normal((int(starts[-1]), HQ, D)).astype(np.float16)
        kw["seqstart_q"] = starts
        plan_rows = max(rows)
    else:
        q = rng.standard_normal((len(lens_k), rows, HQ, D)).astype(np.float16)
        plan_rows = rows
    return q, k, v, bt, lens_k, kw, plan_rows


def rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default="build/sinks-cuda")
    ap.add_argument("--build", action="store_true", help="compile the CUDA kernels into --dir and stop")
    ap.add_argument("--compile-missing", action="store_true", help="compile what --dir lacks (a dry run here)")
    args = ap.parse_args()
    if args.build:
        from turbine_fmha.build import aot

        built = aot.build(Path(args.dir), ["cuda"], variants())
        print(f"{len(built)} kernels in {args.dir}")
        return 0

    import torch

    import turbine_fmha
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    session = turbine_fmha.Session(args.device, artifact_dir=args.dir, compile_missing=args.compile_missing)
    rng = np.random.default_rng(0)
    failed = 0
    print("| case | variant | sinks given | out rel err | lse abs err | moved from the plan's | ok |")
    print("|---|---|---|---|---|---|---|")
    for name, (rows, lens_k) in CASES.items():
        q, k, v, bt, sk, kw, plan_rows = problem(rng, rows, lens_k)
        planned = rng.uniform(-2, 0, HQ).astype(np.float32)
        attn = turbine_fmha.PagedAttention(session).plan(
            bt,
            sk,
            num_pages=k.shape[0],
            page_block_size=PAGE,
            nhead_q=HQ,
            nhead_k=HK,
            hdim=D,
            dtype="f16",
            seqlen_q=plan_rows,
            sinks=planned,
            **kw,
        )
        qt, kt, vt = (torch.from_numpy(x).to(args.device) for x in (q, k, v))
        ref_planned = fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=planned, **kw)[0]
        # Scores are about N(0, 1): a row's sum is about keys x e^0.5, so
        # sinks near log(keys) and above take a share of each row.
        lift = float(np.log(max(lens_k)))
        own = [(lift + rng.uniform(0, 2, HQ)).astype(np.float32) for _ in range(2)]
        for given, sinks in (
            ("torch cuda", torch.from_numpy(own[0]).to(args.device)),
            ("numpy", own[1]),
            ("none", None),
        ):
            out, lse = attn.run(qt, kt, vt, return_lse=True, sinks=sinks)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            want = planned if sinks is None else own[0 if given.startswith("torch") else 1]
            ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=want, **kw)
            err = rel(out.cpu().numpy(), ref)
            lerr = float(np.abs(lse.cpu().numpy().astype(np.float64) - ref_lse).max())
            moved = rel(ref_planned, ref) if sinks is not None else float("nan")
            ok = err <= OUT_TOL and lerr <= LSE_TOL and (sinks is None or moved > 4 * OUT_TOL)
            failed += not ok
            variant = session.last_variant.name if session.last_variant else "?"
            print(f"| {name} | {variant} | {given} | {err:.1e} | {lerr:.1e} | {moved:.2f} | {'ok' if ok else 'FAIL'} |")
    print(f"\n{'all ok' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
