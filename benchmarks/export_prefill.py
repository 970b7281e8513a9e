"""An exported causal prefill on the host CPU: wall time of the compiled
program's call, back to back, against torch's SDPA on the same K/V
gathered (the caller's alternative), in one process.

    .venv/bin/python benchmarks/export_prefill.py [--rows 1024] [--runs 5]

Run it at two commits (a git worktree of the older one on PYTHONPATH) to
compare what the program's plan changed; record `lscpu`'s model name
with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import iree.compiler as ic
import iree.runtime as rt
import numpy as np
import torch
from iree.turbine import aot

import turbine_fmha


class _Prefill(torch.nn.Module):
    def forward(self, q, k_cache, v_cache, block_table, seqlen_k):
        return turbine_fmha.fmha_fwd_paged(q, k_cache, v_cache, block_table, seqlen_k, causal=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--heads", type=int, nargs=2, default=(8, 2))
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    hq, hk = a.heads
    rng = np.random.default_rng(0)
    pages = -(-a.rows // a.page)
    q = torch.from_numpy(rng.standard_normal((1, a.rows, hq, a.hdim)).astype(np.float16))
    k = torch.from_numpy(rng.standard_normal((pages, a.page, hk, a.hdim)).astype(np.float16))
    v = torch.from_numpy(rng.standard_normal((pages, a.page, hk, a.hdim)).astype(np.float16))
    bt = torch.from_numpy(rng.permutation(pages).astype(np.int32)[None])
    sk = torch.tensor([a.rows], dtype=torch.int32)
    exported = aot.export(_Prefill(), args=(q, k, v, bt, sk))
    flags = ["--iree-llvmcpu-target-cpu=host", "--iree-llvmcpu-fail-on-large-vector=false"]
    vmfb = ic.compile_str(str(exported.mlir_module), target_backends=["llvm-cpu"], extra_args=flags)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    fn = ctx.modules.module["main"]
    args = [x.numpy() for x in (q, k, v, bt, sk)]

    def program():
        fn(*args).to_host()

    def sdpa():
        kk = k[bt[0]].reshape(1, -1, hk, a.hdim)[:, : a.rows].transpose(1, 2).float()
        vv = v[bt[0]].reshape(1, -1, hk, a.hdim)[:, : a.rows].transpose(1, 2).float()
        qq = q.transpose(1, 2).float()
        torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)

    for name, f in (("exported program", program), ("torch gather+SDPA (f32)", sdpa)):
        f()
        times = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        print(f"{name}: median {statistics.median(times) * 1e3:.1f} ms over {a.runs} calls")


if __name__ == "__main__":
    main()
