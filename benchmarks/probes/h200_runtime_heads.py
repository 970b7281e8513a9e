#!/usr/bin/env python3
"""Run-time head counts on a device: verify and time.

Verifies, against the float64 reference, calls whose head counts no variant
was built for: each artifact directory given is loaded on its own, so that
what serves a call is what that directory holds (--static: exact head
counts; --group: run-time heads for a GQA group; --any-online: run-time
heads for any group, padded; --hnd: the same over head-major (HND) caches;
--any: the explicit variants for any head counts, which a GPU session falls
back to; --any-hnd: those over HND caches), at the page sizes of --pages
(kernels of any page size, _pg0, serve the odd ones). --stale-nan puts NaN in the
value rows past each sequence's keys, so that the variants with the
stale-row guard run. Then
times PagedAttention.run() of the GQA 32/8 shapes with each directory,
rounds interleaved, and torch gather+SDPA in the same run.

  python3 benchmarks/probes/h200_runtime_heads.py --device cuda --static artifacts-h200s \
      --group artifacts-h200rt --any-online artifacts-h200anyon --hnd artifacts-h200hnd \
      --any artifacts-h200any
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.core.arrays import np_dtype
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

# Output and LSE error bounds (tests/conftest.py says why).
OUT_TOL = {"f16": 5e-3, "bf16": 2e-2}
LSE_TOL = {"f16": 5e-3, "bf16": 3e-2}


def make_problem(rng, dtype, batch, seqlen_q, seqlens_k, nhead_q, nhead_k, hdim, page):
    """Pages shuffled across sequences, garbage in unused table slots, NaN in
    spare pages; NHD caches."""
    dt = np_dtype(dtype)
    used = [-(-s // page) for s in seqlens_k]
    num_pages = sum(used) + 2
    kc = rng.standard_normal((num_pages, page, nhead_k, hdim)).astype(dt)
    vc = rng.standard_normal((num_pages, page, nhead_k, hdim)).astype(dt)
    perm = rng.permutation(num_pages)
    bt = rng.choice(np.array([-1, num_pages + 5], np.int32), size=(batch, max(used) + 1)).astype(np.int32)
    i = 0
    for b, n in enumerate(used):
        bt[b, :n] = perm[i : i + n]
        i += n
    kc[perm[i:]] = np.nan
    vc[perm[i:]] = np.nan
    q = rng.standard_normal((batch, seqlen_q, nhead_q, hdim)).astype(dt)
    return q, kc, vc, bt, np.array(seqlens_k, np.int32)


def hnd(cache):
    """An NHD cache's pages head-major: [pages, nhead_k, page, dim]."""
    return np.ascontiguousarray(cache.transpose(0, 2, 1, 3))


# The sessions' cache layouts (--hnd and --any-hnd run over HND caches).
LAYOUT = {"hnd": "HND", "any_hnd": "HND"}


def poison_stale_rows(vc, bt, seqlen_k, page):
    """NaN in the value rows of each sequence's last page past its keys."""
    for b, n in enumerate(seqlen_k):
        if n % page:
            vc[bt[b, (n - 1) // page], n % page :] = np.nan


def verify(session, rng, label, heads, hdims, dtype="f16", page=16, stale_nan=False) -> bool:
    ok = True
    for (hq, hk), d in ((h, d) for h in heads for d in hdims):
        for sq, mask in ((1, None), (150, "bottom_right")):
            sk = [5, 300, 77] if sq == 1 else [150, 170, 400]
            q, kc, vc, bt, seqlen_k = make_problem(rng, dtype, 3, sq, sk, hq, hk, d, page)
            if stale_nan:
                poison_stale_rows(vc, bt, seqlen_k, page)
            kw = {"mask_type": mask} if mask else {}
            layout = LAYOUT.get(label, "NHD")
            kc_l, vc_l = (hnd(kc), hnd(vc)) if layout == "HND" else (kc, vc)
            out, lse = turbine_fmha.fmha_fwd_paged(
                q,
                kc_l,
                vc_l,
                bt,
                seqlen_k,
                return_lse=True,
                session=session,
                device=session.device,
                kv_layout=layout,
                **kw,
            )
            ref, ref_lse = fmha_fwd_paged_ref(q, kc, vc, bt, seqlen_k, **kw)
            err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
            lerr = np.abs(lse - ref_lse).max()
            good = bool(np.isfinite(out).all() and err <= OUT_TOL[dtype] and lerr <= LSE_TOL[dtype])
            ok &= good
            variants = sorted(set(session.picked))
            session.picked.clear()
            print(
                f"verify {label} pg{page} h{hq}x{hk} d{d} sq={sq}: rel err {err:.2e}, lse err {lerr:.2e} -> "
                f"{'OK' if good else 'FAIL'} {variants}"
            )
    return ok


def recording(session):
    """`session`, whose select() now appends each variant it picks to
    session.picked."""
    pick = session.select
    session.picked = []

    def select(*args, **kwargs):
        v = pick(*args, **kwargs)
        session.picked.append(v.name)
        return v

    session.select = select
    return session


def time_run(session, shape, dtype, repeat, sync, kv_layout="NHD"):
    """Median ms of PagedAttention.run() on device-resident inputs, `repeat`
    calls back to back and one wait, over 5 samples."""
    import torch

    rng = np.random.default_rng(0)
    q, kc, vc, bt, sk = make_problem(
        rng, dtype, shape["batch"], shape["seqlen_q"], [shape["seqlen_k"]] * shape["batch"], 32, 8, 128, 16
    )
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    if kv_layout == "HND":
        kc, vc = hnd(kc), hnd(vc)
    dev = (lambda a: torch.from_numpy(a).to("cuda:0")) if session.device == "cuda" else (lambda a: a)
    q, kc, vc = dev(q), dev(kc), dev(vc)
    kw = {"mask_type": "bottom_right"} if shape["seqlen_q"] > 1 else {}
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=kc.shape[0],
        page_block_size=16,
        nhead_q=32,
        nhead_k=8,
        hdim=128,
        dtype=dtype,
        seqlen_q=shape["seqlen_q"],
        kv_rows_finite=True,
        kv_layout=kv_layout,
        **kw,
    )
    session.picked.clear()
    for _ in range(3):
        attn.run(q, kc, vc)
    sync()
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeat):
            attn.run(q, kc, vc)
        sync()
        samples.append((time.perf_counter() - t) / repeat * 1e3)
    return statistics.median(samples), sorted(set(session.picked))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--static", help="exact head counts (GQA 32/8)")
    ap.add_argument("--group", help="online, run-time heads for GQA group 4")
    ap.add_argument("--any-online", help="online, run-time heads for any group (padded)")
    ap.add_argument("--hnd", help="online, run-time heads for any group (padded), HND caches")
    ap.add_argument("--any", help="explicit, any head counts")
    ap.add_argument("--any-hnd", help="explicit, any head counts, HND caches")
    ap.add_argument("--stale-nan", action="store_true", help="NaN in the value rows past the keys (guarded variants)")
    ap.add_argument("--dtype", default="f16", choices=sorted(OUT_TOL), help="of the verified calls")
    ap.add_argument("--pages", default="16", help="comma list: the verified calls' page sizes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-time", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng()
    dirs = {k: getattr(args, k) for k in ("static", "group", "any_online", "hnd", "any", "any_hnd") if getattr(args, k)}
    sessions = {k: recording(turbine_fmha.Session(args.device, artifact_dir=d)) for k, d in dirs.items()}
    checks = {
        "group": (((32, 8), (16, 4), (4, 1), (40, 10)), (128,)),
        "any_online": (((32, 8), (28, 4), (12, 2), (16, 16), (8, 1), (64, 4), (24, 8)), (128,)),
        "hnd": (((32, 8), (28, 4), (12, 2), (16, 16), (8, 1), (24, 8)), (128,)),
        "any": (((32, 8), (28, 4), (12, 2), (16, 16), (8, 1)), (64, 128, 256)),
    }
    checks["any_hnd"] = checks["any"]
    ok = True
    for page in (int(p) for p in args.pages.split(",")):
        for k, (heads, hdims) in checks.items():
            if k in sessions:
                ok &= verify(sessions[k], rng, k, heads, hdims, args.dtype, page, args.stale_nan)
    print("verify", "PASS" if ok else "FAIL")
    if args.no_time:
        return 0 if ok else 1
    import torch

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    shapes = [
        dict(name="decode", batch=32, seqlen_q=1, seqlen_k=4096),
        dict(name="decode", batch=1, seqlen_q=1, seqlen_k=32768),
        dict(name="prefill", batch=1, seqlen_q=4096, seqlen_k=4096),
    ]
    for r in range(args.rounds):
        for shape in shapes:
            for k, s in sessions.items():
                ms, used = time_run(s, shape, "f16", 20, sync, LAYOUT.get(k, "NHD"))
                print(
                    f"round {r} {shape['name']} b{shape['batch']} sq{shape['seqlen_q']} sk{shape['seqlen_k']} "
                    f"{k}: {ms:.3f} ms {used}"
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
