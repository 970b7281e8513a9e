#!/usr/bin/env python3
"""Exported programs' guards and sessions' device checks on a GPU.

Here (needs the build extra):
    .venv/bin/python benchmarks/probes/gpu_contract.py --build build/contract-cuda
builds, for sm_80, the programs tests/test_export_contract.py runs on the
CPU (a causal decode with dynamic batch, pages and width; the online
decode of a static batch; a cache write with a dynamic token count),
with their inputs and the float64 reference's outputs.

On the GPU (device tool; carry [".whl", "artifacts-cuda", "build/contract-cuda"]):
    source benchmarks/probes/device_steps.sh
    python3 benchmarks/probes/gpu_contract.py --dir build/contract-cuda --artifacts artifacts-cuda
checks that the programs give the reference's outputs within the contract,
fail the invocation where sizes disagree, cut a sequence at a bad used
slot, skip slots outside the caches; then that Session("cuda") runs a
decode on torch CUDA tensors against float64, and that Session refuses a
GPU ordinal the machine lacks and a CPU target. Prints one line per check
and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SHAPE = dict(dtype="f16", seqlen_q=1, nhead_q=4, nhead_k=2, hdim=32, page=16)
CAUSAL = dict(mask_type="bottom_right", window_size_right=0)
FLAGS = ["--iree-cuda-target=sm_80"]


def build(out: Path) -> None:
    import iree.compiler as ic
    import iree.turbine.aot as aot
    import torch
    from conftest import make_problem
    from test_export import Attention
    from test_export_contract import Write

    import turbine_fmha
    from turbine_fmha.core.arrays import _numpy_to_torch
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    q, k, v, bt, sk = make_problem(rng, batch=3, seqlens_k=[40, 50, 17], extra_slots=0, **SHAPE)
    example = tuple(_numpy_to_torch(a) for a in (q, k, v, bt, sk))
    b, p, w = torch.export.Dim("batch"), torch.export.Dim("pages"), torch.export.Dim("width")
    dims = [{0: b}, {0: p}, {0: p}, {0: b, 1: w}, {0: b}]
    programs = {"explicit": aot.export(Attention(causal=True), args=example, dynamic_shapes=dims)}
    with turbine_fmha.export_options(formulation="online"):
        programs["online"] = aot.export(Attention(causal=True), args=example)
    k0 = rng.standard_normal((4, 16, 2, 8)).astype(np.float16)
    v0 = rng.standard_normal((4, 16, 2, 8)).astype(np.float16)
    t = torch.export.Dim("tokens")
    rows = tuple(torch.zeros(3, 2, 8, dtype=torch.float16) for _ in range(2))
    programs["write"] = aot.export(
        Write(k0, v0, "NHD"), args=(*rows, torch.arange(3)), dynamic_shapes=[{0: t}, {0: t}, {0: t}]
    )
    for name, program in programs.items():
        (out / f"{name}.vmfb").write_bytes(
            ic.compile_str(str(program.mlir_module), target_backends=["cuda"], extra_args=FLAGS)
        )
    bad = bt.copy()
    bad[1, 1] = -5
    cut = sk.copy()
    cut[1] = SHAPE["page"]
    # Session("cuda")'s decode, of the shape artifacts-cuda holds kernels for.
    shape = dict(dtype="f16", seqlen_q=1, nhead_q=32, nhead_k=8, hdim=128, page=16)
    dec = make_problem(rng, batch=4, seqlens_k=[300, 17, 1000, 64], **shape)
    np.savez(
        out / "inputs.npz",
        **{f"dec_{i}": a for i, a in enumerate(dec)},
        dec_ref=fmha_fwd_paged_ref(*dec, **CAUSAL)[0],
        q=q,
        k=k,
        v=v,
        bt=bt,
        sk=sk,
        bad=bad,
        ref=fmha_fwd_paged_ref(q, k, v, bt, sk, **CAUSAL)[0],
        ref_cut=fmha_fwd_paged_ref(q, k, v, bad, cut, **CAUSAL)[0],
        k0=k0,
        v0=v0,
    )
    print(f"built {', '.join(programs)} into {out}")


def check(d: Path, artifacts: str, diag: bool = False) -> int:
    import iree.runtime as rt

    failed = []

    def report(name, ok, detail=""):
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failed.append(name)

    x = dict(np.load(d / "inputs.npz"))
    err = lambda out, ref: float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())

    def main_of(name):
        config = rt.Config("cuda")
        ctx = rt.SystemContext(config=config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, (d / f"{name}.vmfb").read_bytes()))
        return ctx.modules.module["main"]

    for name in ("explicit", "online"):
        main = main_of(name)
        out = main(x["q"], x["k"], x["v"], x["bt"], x["sk"])[0].to_host()
        report(f"{name}: within the contract", err(out, x["ref"]) <= 5e-3, f"err {err(out, x['ref']):.2e}")
        out = main(x["q"], x["k"], x["v"], x["bad"], x["sk"])[0].to_host()
        e = err(out, x["ref_cut"])
        report(f"{name}: a bad used slot cuts its sequence", e <= 5e-3, f"err {e:.2e}")
        # The online program's sizes are static: IREE's ABI refuses other
        # shapes (ValueError) before the guard would.
        try:
            main(x["q"], x["k"], x["v"][:1], x["bt"], x["sk"])
            report(f"{name}: v_cache of other pages refused", False, "ran")
        except (RuntimeError, ValueError) as e:
            words = "v_cache dim 0 differs" if name == "explicit" else "mismatch"
            report(f"{name}: v_cache of other pages refused", words in str(e), str(e).splitlines()[0])
    main = main_of("explicit")
    try:
        main(np.repeat(x["q"][:1], 1000, 0), x["k"], x["v"], x["bt"][:1], x["sk"][:1])
        report("explicit: a batch past the table refused", False, "ran")
    except RuntimeError as e:
        report(
            "explicit: a batch past the table refused", "block_table dim 0 differs" in str(e), str(e).splitlines()[0]
        )

    write = main_of("write")
    rng = np.random.default_rng(1)
    if diag:
        # Each call on the caches the program holds: all valid first.
        base = x["k0"].copy()
        for sl in ([0, 5, 37], [5, 37, 0], [-1, 5, 0], [-1, -1, -1], [3, -1, 0]):
            sl = np.array(sl, np.int64)
            kn = rng.standard_normal((len(sl), 2, 8)).astype(np.float16)
            got = write(kn, kn.copy(), sl)[0].to_host().reshape(64, -1)
            want = base.reshape(64, -1).copy()
            for i, r in enumerate(sl):
                if 0 <= r < 64:
                    want[r] = kn[i].reshape(-1)
            bad = [r for r in range(64) if not np.array_equal(got[r], want[r])]
            mix = {
                r: [
                    int((got[r] == base.reshape(64, -1)[r]).sum()),
                    [int((got[r] == kn[i].reshape(-1)).sum()) for i in range(len(sl))],
                ]
                for r in bad
            }
            print("diag", sl.tolist(), "rows wrong", bad, "elements equal to old / to each token", mix)
            base = got.reshape(base.shape)
        return 0
    slots = np.array([-1, 5, 64, 37, 10**9, -7, 0], np.int64)
    kn = rng.standard_normal((len(slots), 2, 8)).astype(np.float16)
    vn = rng.standard_normal((len(slots), 2, 8)).astype(np.float16)
    k_out, v_out = write(kn, vn, slots)
    k_ref, v_ref = x["k0"].copy(), x["v0"].copy()
    for i, s in enumerate(slots):
        if 0 <= s < 64:
            k_ref.reshape(-1, 2, 8)[s], v_ref.reshape(-1, 2, 8)[s] = kn[i], vn[i]
    k_got, v_got = k_out.to_host(), v_out.to_host()
    ok = np.array_equal(k_got, k_ref) and np.array_equal(v_got, v_ref)
    detail = ""
    if not ok:
        rows = lambda a: a.reshape(64, -1)
        bad = [r for r in range(64) if not np.array_equal(rows(k_got)[r], rows(k_ref)[r])]
        was = [r for r in bad if np.array_equal(rows(k_got)[r], rows(x["k0"])[r])]
        tok = {r: [i for i in range(len(slots)) if np.array_equal(rows(k_got)[r], kn[i].reshape(-1))] for r in bad}
        detail = f"k rows that differ {bad}; of them unchanged {was}; holding token {tok}"
    report("write: slots outside the caches skipped", ok, detail)

    import torch

    import turbine_fmha

    session = turbine_fmha.Session("cuda", artifact_dir=artifacts)
    dec = [x[f"dec_{i}"] for i in range(5)]
    tq, tk, tv = (torch.from_numpy(a).cuda() for a in dec[:3])
    out = turbine_fmha.fmha_fwd_paged(tq, tk, tv, *dec[3:], causal=True, session=session, device="cuda")
    e = err(out.float().cpu().numpy(), x["dec_ref"])
    report("Session('cuda'): a decode on torch CUDA tensors", e <= 5e-3, f"err {e:.2e}")
    n = torch.cuda.device_count()
    for device, kw, words in ((f"cuda:{n}", {}, "sees"), ("cuda", {"target": "host"}, "cannot run target")):
        try:
            turbine_fmha.Session(device, artifact_dir=artifacts, **kw)
            report(f"Session({device!r}, {kw}) refused", False, "created")
        except ValueError as e:
            report(f"Session({device!r}, {kw}) refused", words in str(e), str(e))
    print(f"{len(failed)} failed")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--artifacts", default="artifacts-cuda")
    ap.add_argument("--diag", action="store_true", help="the cache write's calls, row by row")
    args = ap.parse_args()
    if args.build:
        build(args.build)
        return 0
    return check(args.dir, args.artifacts, args.diag)


if __name__ == "__main__":
    sys.exit(main())
