#!/usr/bin/env python3
"""On a CUDA machine: KV writes into torch CUDA caches (issue 15 item 3),
checked on the host afterwards.

- reshape_and_cache, NHD and HND caches, f16 and bf16, shuffled slots with
  -1 (skipped) tokens: the written rows equal k/v bit for bit and every
  other row is unchanged;
- the same with rotary embedding of K (half-rotated and interleaved) at
  positions seqlen_k + i, against a float64 rotation, and of q;
- PagedKVCache.append from torch CUDA tensors into a device pool without a
  host mirror (NHD and HND pages), then attention on it against the float64
  reference.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_kv_write.py --artifacts artifacts-cuda
    python benchmarks/probes/h200_kv_write.py --device cpu --cache build/test-cache   # dry run here (compiles)

--list-kernels prints the append kernels it needs (to build for cuda).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

PAGES, PAGE, HK, D, TOKENS = 64, 16, 8, 128, 40
# f32 rotation then one rounding to the cache dtype (tests/test_kv_write.py).
ROPE_TOL = {torch.float16: 2.0**-11 + 2.0**-21, torch.bfloat16: 2.0**-8 + 2.0**-21}


def _rope(x, pos, cos, sin, interleaved):
    x = x.astype(np.float64)
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    rh = cos.shape[1]
    first, second = (slice(0, 2 * rh, 2), slice(1, 2 * rh, 2)) if interleaved else (slice(0, rh), slice(rh, 2 * rh))
    a, b = x[..., first], x[..., second]
    out = x.copy()
    out[..., first], out[..., second] = a * c - b * s, b * c + a * s
    return out


def _rows(cache, layout, slots):
    """[tokens, heads, dim] rows of a cache at the slots."""
    p, r = slots // PAGE, slots % PAGE
    return cache[p, r] if layout == "NHD" else cache[p, :, r]


def case_write(session, dev, dtype, layout, rotary):
    g = torch.Generator().manual_seed(1)
    shape = (PAGES, PAGE, HK, D) if layout == "NHD" else (PAGES, HK, PAGE, D)
    kc, vc = (torch.randn(shape, generator=g).to(dtype).to(dev) for _ in range(2))
    before = kc.cpu(), vc.cpu()
    k, v = (torch.randn((TOKENS, HK, D), generator=g).to(dtype).to(dev) for _ in range(2))
    slots = torch.randperm(PAGES * PAGE, generator=g)[:TOKENS]
    slots[::7] = -1
    kw = {}
    seqlen_k = np.array([5], np.int32)
    if rotary:
        ang = np.arange(256)[:, None] * (1e-2 * np.arange(1, D // 2 + 1))[None, :]
        kw = dict(
            rotary_cos=np.cos(ang).astype(np.float32),
            rotary_sin=np.sin(ang).astype(np.float32),
            rotary_interleaved=rotary == "interleaved",
            seqlen_k=seqlen_k,
            seqstart=np.array([0, TOKENS], np.int32),
        )  # flat rows: one sequence
    turbine_fmha.reshape_and_cache(k, v, kc, vc, slots.to(dev), kv_layout=layout, session=session, **kw)
    torch.cuda.synchronize() if dev != "cpu" else None
    keep = slots >= 0
    s = slots[keep].numpy()
    got_k, got_v = _rows(kc.cpu(), layout, s), _rows(vc.cpu(), layout, s)
    ok = torch.equal(got_v, v.cpu()[keep])
    if rotary:
        pos = (seqlen_k[0] + np.arange(TOKENS))[keep.numpy()]
        want = _rope(k.cpu()[keep].float().numpy(), pos, kw["rotary_cos"], kw["rotary_sin"], rotary == "interleaved")
        err = np.abs(got_k.double().numpy() - want).max() / np.abs(want).max()
        ok &= err <= 2 * ROPE_TOL[dtype]
    else:
        ok &= torch.equal(got_k, k.cpu()[keep])
    untouched = np.ones(PAGES * PAGE, bool)
    untouched[s] = False
    u = np.nonzero(untouched)[0]
    ok &= torch.equal(_rows(kc.cpu(), layout, u), _rows(before[0], layout, u))
    ok &= torch.equal(_rows(vc.cpu(), layout, u), _rows(before[1], layout, u))
    return ok, f"{int(keep.sum())} rows written, {u.size} untouched"


def case_rotary_q(session, dev):
    """q rotated in the call that writes its keys (positions seqlen_k, as
    without has_mask); then q alone, which a GPU session refuses by name,
    after which the device still serves a write."""
    g = torch.Generator().manual_seed(3)
    kc, vc = (torch.zeros((PAGES, PAGE, HK, D), dtype=torch.float16, device=dev) for _ in range(2))
    k, v = (torch.randn((1, 4, HK, D), generator=g).half().to(dev) for _ in range(2))
    q = torch.randn((1, 4, 32, D), generator=g).half().to(dev)
    ang = np.arange(64)[:, None] * (1e-2 * np.arange(1, D // 2 + 1))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    rot = dict(rotary_cos=cos, rotary_sin=sin, seqlen_k=np.array([7], np.int32), session=session)
    q_out = turbine_fmha.reshape_and_cache(k, v, kc, vc, torch.arange(4, device=dev)[None], q=q, **rot)
    want = _rope(q.cpu()[0].float().numpy(), np.full(4, 7), cos, sin, False)
    err = np.abs(q_out.cpu()[0].double().numpy() - want).max() / np.abs(want).max()
    ok = err <= 2 * ROPE_TOL[torch.float16]
    refused = "not refused"
    if dev != "cpu":
        try:
            turbine_fmha.reshape_and_cache(
                k[:, :0], v[:, :0], kc, vc, torch.zeros((1, 0), dtype=torch.int64, device=dev), q=q, **rot
            )
        except NotImplementedError as e:
            refused = f"refused ({str(e)[:50]}...)"
        ok &= refused.startswith("refused")
    ok &= case_write(session, dev, torch.float16, "NHD", None)[0]  # the device still works
    return ok, f"q rel err {err:.2e}; q alone: {refused}"


def case_cache_append(session, dev, kv_layout="NHD"):
    g = torch.Generator().manual_seed(2)
    cache = turbine_fmha.PagedKVCache(
        PAGES, PAGE, HK, D, "f16", session=session, host_mirror=False, kv_layout=kv_layout
    )
    seqs, ks, vs = [cache.allocate(), cache.allocate()], [], []
    for n, seq in zip((37, 70), seqs):
        k, v = (torch.randn((n, HK, D), generator=g).half() for _ in range(2))
        cache.append(seq, k.to(dev), v.to(dev))
        ks.append(k.numpy())
        vs.append(v.numpy())
    q = torch.randn((2, 1, 32, D), generator=g).half()
    out = cache.attend(q.to(dev) if dev != "cpu" else q.numpy(), seqs)
    out = out.cpu().numpy() if isinstance(out, torch.Tensor) else out
    err = 0.0
    for i in range(2):
        n = ks[i].shape[0]
        pages = -(-n // PAGE)
        kp = np.zeros((pages * PAGE, HK, D), np.float16)
        vp = np.zeros_like(kp)
        kp[:n], vp[:n] = ks[i], vs[i]
        ref, _ = fmha_fwd_paged_ref(
            q.numpy()[i : i + 1],
            kp.reshape(pages, PAGE, HK, D),
            vp.reshape(pages, PAGE, HK, D),
            np.arange(pages, dtype=np.int32)[None],
            np.array([n], np.int32),
        )
        err = max(err, float(np.abs(out[i : i + 1].astype(np.float64) - ref).max() / np.abs(ref).max()))
    return err <= 5e-3, f"rel err {err:.2e}"  # conftest.OUT_TOL f16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cache", default=None, help="cpu dry run: compile what is missing into this directory")
    ap.add_argument("--list-kernels", action="store_true")
    args = ap.parse_args()
    kw = dict(compile_missing=True, cache_dir=args.cache) if args.cache else {}
    session = turbine_fmha.Session(args.device, artifact_dir=args.artifacts, **kw)
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    cases = [
        (
            f"reshape_and_cache {layout} {str(dt)[6:]}{' rotary ' + r if r else ''}",
            lambda layout=layout, dt=dt, r=r: case_write(session, dev, dt, layout, r),
        )
        for dt in (torch.float16, torch.bfloat16)
        for layout in ("NHD", "HND")
        for r in (None, "half", "interleaved")
    ]
    cases.append(("rotary of q with its keys; q alone", lambda: case_rotary_q(session, dev)))
    cases += [
        (
            f"PagedKVCache.append from torch, no host mirror, {layout} pages, then attend",
            lambda layout=layout: case_cache_append(session, dev, layout),
        )
        for layout in ("NHD", "HND")
    ]
    failed = 0
    for label, run in cases:
        try:
            ok, detail = run()
        except Exception as e:  # report and go on: one line per case
            ok, detail = False, f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {label}: {detail}", flush=True)
    if args.list_kernels:
        print(",".join(sorted(name for name in session._loaded if name.startswith("pagedkv_append"))))
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
