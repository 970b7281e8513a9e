#!/usr/bin/env python3
"""On a CUDA machine: GPU ordinals as a tensor-parallel worker uses them.

Each GPU the process sees: Session("cuda:N") runs a decode on torch
tensors on cuda:N, its results made on cuda:N, checked against the
float64 reference; a tensor on another GPU is refused by name; the first
ordinal past the machine's GPUs is refused at Session(). With two or more
GPUs, two sessions in one process run at once (one thread each). Prints
one line per check and exits 1 if any failed.

    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_devices.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

TOL = 5e-3  # fp16 output: a few ulps of |out| <= max|V| plus f32 accumulation


def _problem(rng, batch=4, hq=32, hk=8, d=128, page=16, pages=64, width=8):
    q = rng.standard_normal((batch, 1, hq, d), dtype=np.float32).astype(np.float16)
    k = rng.standard_normal((pages, page, hk, d), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((pages, page, hk, d), dtype=np.float32).astype(np.float16)
    table = rng.permutation(pages)[: batch * width].reshape(batch, width).astype(np.int32)
    seqlen = rng.integers(1, page * width + 1, batch).astype(np.int32)
    return q, k, v, table, seqlen


def _decode_on(session, rng) -> float:
    q, k, v, table, seqlen = _problem(rng)
    dev = session.torch_device
    out = turbine_fmha.fmha_fwd_paged(
        *(torch.from_numpy(a).to(dev) for a in (q, k, v, table, seqlen)), session=session, kv_rows_finite=True
    )
    assert str(out.device) == dev, f"result on {out.device}, not {dev}"
    ref = fmha_fwd_paged_ref(q, k, v, table, seqlen)[0]
    return float(np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--artifacts", required=True)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    gpus = torch.cuda.device_count()
    failed = 0

    def check(name, ok, detail=""):
        nonlocal failed
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)

    sessions = [turbine_fmha.Session(f"cuda:{i}", artifact_dir=args.artifacts) for i in range(gpus)]
    for s in sessions:
        err = _decode_on(s, rng)
        check(f"{s.device_name} decode on its own tensors", err < TOL, f"err {err:.2e}")
    try:
        turbine_fmha.Session(f"cuda:{gpus}", artifact_dir=args.artifacts)
        check(f"cuda:{gpus} refused", False, "accepted")
    except ValueError as e:
        check(f"cuda:{gpus} refused", f"'cuda:{gpus}'" in str(e), str(e))
    if gpus >= 2:
        q, k, v, table, seqlen = _problem(rng)
        try:
            turbine_fmha.fmha_fwd_paged(
                torch.from_numpy(q).to("cuda:1"), k, v, table, seqlen, session=sessions[0], kv_rows_finite=True
            )
            check("a cuda:1 q refused by the cuda:0 session", False, "accepted")
        except ValueError as e:
            check("a cuda:1 q refused by the cuda:0 session", "q is a torch tensor on cuda:1" in str(e), str(e))
        errs = [None] * gpus
        threads = [
            threading.Thread(target=lambda i=i: errs.__setitem__(i, _decode_on(sessions[i], np.random.default_rng(i))))
            for i in range(gpus)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check("all GPUs at once", all(e is not None and e < TOL for e in errs), f"errs {errs}")
    print(f"{gpus} GPU(s), {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
