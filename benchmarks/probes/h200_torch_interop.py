#!/usr/bin/env python3
"""On a CUDA machine: fmha_fwd_paged with torch CUDA tensors, checked
against the float64 reference, with timings.

Cases: host numpy caches; torch CUDA caches imported zero-copy (DLPack) with
q on the GPU, so the results are made on the GPU (arrays._Results), with the
stale rows checked on the GPU (unguarded kernels) and with NaN put there
(guarded kernels, also with NaN in q and a visible K); fp8 torch caches;
a non-paged cache with cache_batch_idx into a preallocated torch out; batch-1 long-context decode (split-KV merged by torch on
the GPU); a varlen (group mode) prefill+decode batch; and a CUDA tensor
handed to a "cpu" session, which must be refused.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_torch_interop.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

TOL = 5e-3  # fp16 output: a few ulps of |out| <= max|V| plus f32 accumulation


def _pool(rng, pages, page, hk, d):
    k = rng.standard_normal((pages, page, hk, d), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((pages, page, hk, d), dtype=np.float32).astype(np.float16)
    return k, v


def _timed(fn, reps=10):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = fn()
        if isinstance(r, torch.Tensor):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _err(out, ref):
    o = out.double().cpu().numpy() if isinstance(out, torch.Tensor) else out.astype(np.float64)
    return float(np.abs(o - ref).max() / np.abs(ref).max())


def _plan_run_layers(session, rng, qt, kt, vt, bt, sl, sample) -> bool:
    """Planned once, run over three "layers" (caches of their own) twice, so
    the second pass reuses the caches each plan bound; then a cache of
    another shape and one resized in place must be refused by name."""
    pages, page, hk, d = kt.shape
    attn = turbine_fmha.PagedAttention(session).plan(
        bt, sl, num_pages=pages, page_block_size=page, nhead_q=qt.shape[2], nhead_k=hk, hdim=d, dtype="f16"
    )
    layers = [(kt, vt)] + [tuple(torch.from_numpy(x).cuda() for x in _pool(rng, pages, page, hk, d)) for _ in (1, 2)]
    err = 0.0
    for _ in range(2):
        for kk, vv in layers:
            ref, _ = fmha_fwd_paged_ref(
                qt[sample].cpu().numpy(), kk.cpu().numpy(), vv.cpu().numpy(), bt[sample], sl[sample]
            )
            err = max(err, _err(attn.run(qt, kk, vv)[sample], ref))
    refused = []
    short = layers[1][0][:-1]
    resized = layers[2][1]
    resized.resize_(pages - 1, page, hk, d)  # same tensor, bound before: checked again
    for label, kk, vv in (
        ("a shorter k_cache", short, layers[1][1]),
        ("a v_cache resized in place", layers[2][0], resized),
    ):
        try:
            attn.run(qt, kk, vv)
            refused.append(f"{label}: NOT refused")
        except ValueError as e:
            refused.append(f"{label}: refused ({str(e)[:60]}...)")
    good = err <= TOL and all("NOT" not in r for r in refused)
    print(f"plan once, run 3 layers x 2 (bound caches reused): rel err {err:.2e}; " + "; ".join(refused), flush=True)
    return good


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    args = ap.parse_args()
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    rng = np.random.default_rng(0)
    ok = True

    def report(label, ms, err, out, extra=""):
        nonlocal ok
        dev = out.device if isinstance(out, torch.Tensor) else "numpy (host)"
        print(
            f"{label}: median {ms:.2f} ms per API call, rel err {err:.2e}, output on {dev}, "
            f"kernel {session.last_variant.name}{extra}",
            flush=True,
        )
        ok &= err <= TOL

    # Decode, batch 32 x 4096 keys.
    b, sk, hq, hk, d, page = 32, 4096, 32, 8, 128, 16
    pages = b * sk // page
    k, v = _pool(rng, pages + 1, page, hk, d)
    bt = rng.permutation(pages + 1)[:pages].reshape(b, -1).astype(np.int32)
    sl = np.full(b, sk - 5, np.int32)  # a tail of 5 stale rows per sequence
    q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
    kt, vt, qt = (torch.from_numpy(x).cuda() for x in (k, v, q))
    sample = [0, b - 1]
    ref, _ = fmha_fwd_paged_ref(q[sample], k, v, bt[sample], sl[sample])
    for label, (qq, kk, vv) in (
        ("decode b32, host numpy caches", (q, k, v)),
        ("decode b32, torch CUDA q and caches", (qt, kt, vt)),
    ):
        call = lambda: turbine_fmha.fmha_fwd_paged(qq, kk, vv, bt, sl, session=session, device="cuda")
        ms = _timed(call)
        out = call()
        report(label, ms, _err(out[sample], ref), out)
        if isinstance(out, torch.Tensor):
            ok &= out.is_cuda
    ok &= _plan_run_layers(session, rng, qt, kt, vt, bt, sl, sample)
    # NaN in the stale rows, found on the GPU: in K only it is harmless (the
    # score sentinel and the mask remove it) and the unguarded kernel runs;
    # in V as well the guarded one must.
    kt_nan, vt_nan = kt.clone(), vt.clone()
    kt_nan[int(bt[3, -1]), page - 2 :] = float("nan")
    vt_nan[int(bt[3, -1]), page - 2 :] = float("nan")
    for label, vv, guarded in (("K", vt, False), ("K and V", vt_nan, True)):
        call = lambda: turbine_fmha.fmha_fwd_paged(qt, kt_nan, vv, bt, sl, session=session, device="cuda")
        ms = _timed(call)
        out = call()
        report(f"decode b32, torch CUDA caches with NaN stale {label} rows", ms, _err(out[sample], ref), out)
        ok &= session.last_variant.v_guard == guarded and not torch.isnan(out).any().item()
    # The guarded kernel with NaN where the reference propagates it too: in
    # one q row and in one visible key's K; the NaN rows must match exactly.
    qn, kn, vn = q.copy(), k.copy(), v.copy()
    kn[int(bt[3, -1]), page - 2 :] = np.nan  # stale, as above
    vn[int(bt[3, -1]), page - 2 :] = np.nan
    qn[5, 0, 7, 0] = np.nan
    kn[int(bt[9, 2]), 3, 1, 0] = np.nan  # key 35 of sequence 9, KV head 1 (query heads 4-7)
    out = turbine_fmha.fmha_fwd_paged(
        torch.from_numpy(qn).cuda(),
        torch.from_numpy(kn).cuda(),
        torch.from_numpy(vn).cuda(),
        bt,
        sl,
        session=session,
        device="cuda",
    )
    rows = [3, 5, 9]
    refn, _ = fmha_fwd_paged_ref(qn[rows], kn, vn, bt[rows], sl[rows])
    got = torch.isnan(out).cpu().numpy()
    same = np.array_equal(got[rows], np.isnan(refn)) and not got[[i for i in range(b) if i not in rows]].any()
    print(
        f"guarded kernel, NaN in q and in a visible K: NaN rows as the reference: {same} "
        f"({int(np.isnan(refn).any(-1).sum())} NaN head rows), kernel {session.last_variant.name}",
        flush=True,
    )
    ok &= same and session.last_variant.v_guard

    # fp8 (e4m3fn) torch CUDA caches, imported as their bytes, f16 q.
    k8t, v8t = kt.to(torch.float8_e4m3fn), vt.to(torch.float8_e4m3fn)
    import ml_dtypes

    k8, v8 = (t.cpu().view(torch.int8).numpy().view(ml_dtypes.float8_e4m3fn) for t in (k8t, v8t))
    ref8, _ = fmha_fwd_paged_ref(q[sample], k8, v8, bt[sample], sl[sample], k_scale=0.5, v_scale=2.0)
    call = lambda: turbine_fmha.fmha_fwd_paged(
        qt, k8t, v8t, bt, sl, k_scale=0.5, v_scale=2.0, session=session, device="cuda"
    )
    ms = _timed(call)
    out = call()
    report("decode b32, fp8 e4m3fn torch CUDA caches (zero-copy bytes)", ms, _err(out[sample], ref8), out)

    # Batch-1 decode over 32k keys: split-KV, merged by torch on the GPU.
    sk1 = 32768
    k1, v1 = _pool(rng, sk1 // page, page, hk, d)
    bt1 = rng.permutation(sk1 // page)[None].astype(np.int32)
    sl1 = np.array([sk1], np.int32)
    q1 = rng.standard_normal((1, 1, hq, d), dtype=np.float32).astype(np.float16)
    k1t, v1t, q1t = (torch.from_numpy(x).cuda() for x in (k1, v1, q1))
    ref1, ref1_lse = fmha_fwd_paged_ref(q1, k1, v1, bt1, sl1)
    for splits in (1, None):
        call = lambda: turbine_fmha.fmha_fwd_paged(
            q1t, k1t, v1t, bt1, sl1, num_splits=splits, return_lse=True, session=session, device="cuda"
        )
        ms = _timed(call)
        out, lse = call()
        lse_err = float(np.abs(lse.cpu().numpy() - ref1_lse).max())
        report(
            f"decode b1 x 32k keys, torch CUDA, num_splits={splits}",
            ms,
            _err(out, ref1),
            out,
            f", LSE abs err {lse_err:.1e}",
        )
        ok &= lse_err <= 1e-3

    # Varlen: two prefills and two decodes in one group-mode call.
    lens_q, lens_k = [300, 1, 77, 1], [300, 2000, 500, 17]
    need = [-(-n // page) for n in lens_k]
    kg, vg = _pool(rng, sum(need), page, hk, d)
    perm = rng.permutation(sum(need)).astype(np.int32)
    btg = np.zeros((4, max(need)), np.int32) - 1
    at = 0
    for i, n in enumerate(need):
        btg[i, :n] = perm[at : at + n]
        at += n
    slg = np.array(lens_k, np.int32)
    qg = rng.standard_normal((sum(lens_q), hq, d), dtype=np.float32).astype(np.float16)
    seqstart = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    kw = dict(seqstart_q=seqstart, mask_type="bottom_right", window_size_right=0)
    refg, _ = fmha_fwd_paged_ref(qg, kg, vg, btg, slg, **kw)
    qgt, kgt, vgt = (torch.from_numpy(x).cuda() for x in (qg, kg, vg))
    call = lambda: turbine_fmha.fmha_fwd_paged(qgt, kgt, vgt, btg, slg, session=session, device="cuda", **kw)
    ms = _timed(call)
    out = call()
    report("group mode 2 prefills + 2 decodes, torch CUDA", ms, _err(out, refg), out)

    # Non-paged KV cache (cache_batch_idx), torch CUDA caches viewed as pages
    # on the GPU, into a preallocated torch out.
    kc = torch.from_numpy(k[: 8 * 256].reshape(8, 4096, hk, d)).cuda()
    vc = torch.from_numpy(v[: 8 * 256].reshape(8, 4096, hk, d)).cuda()
    idx = np.array([5, 0, 7, 2], np.int32)
    slc = np.array([4096, 100, 2049, 1], np.int32)
    qc = q[:4].copy()
    outc = torch.empty((4, 1, hq, d), dtype=torch.float16, device="cuda")
    call = lambda: turbine_fmha.fmha_fwd_kvcache(
        torch.from_numpy(qc).cuda(), kc, vc, slc, cache_batch_idx=idx, out=outc, session=session, device="cuda"
    )
    ms = _timed(call)
    got = call()
    ok &= got is outc
    k4, v4 = kc.cpu().numpy(), vc.cpu().numpy()
    btc = (idx[:, None] * 32 + np.arange(32)[None, :]).astype(np.int32)  # pages of 128 rows
    refc, _ = fmha_fwd_paged_ref(qc, k4.reshape(-1, 128, hk, d), v4.reshape(-1, 128, hk, d), btc, slc)
    report("non-paged KV cache (cache_batch_idx), torch CUDA, into a torch out", ms, _err(outc, refc), outc)

    # A CUDA tensor for a "cpu" session: refused by name, nothing copied.
    try:
        turbine_fmha.fmha_fwd_paged(qt, k, v, bt, sl, session=turbine_fmha.Session("cpu", artifact_dir="/nonexistent"))
        print("cuda q on a cpu session: NOT refused")
        ok = False
    except ValueError as e:
        print(f"cuda q on a cpu session: refused: {e}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
