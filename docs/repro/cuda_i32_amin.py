#!/usr/bin/env python3
"""IREE 3.13 CUDA (sm_80) computes a torch int32 `amin` over a dynamic
dim as -1; the same program is right on llvm-cpu. Five formulations of
"the first valid token" (an exported cache write's skipped-token pick),
each printed beside the right answer. Here:
    .venv/bin/python docs/repro/cuda_i32_amin.py --build build/first-valid
    .venv/bin/python docs/repro/cuda_i32_amin.py --dir build/first-valid --driver local-task
On an NVIDIA GPU (device tool; carry [".whl", "build/first-valid"]):
    python3 docs/repro/cuda_i32_amin.py --dir build/first-valid
"""

import argparse
import sys
from pathlib import Path

import numpy as np

CASES = [[3, -1, 0], [-1, 5, 0], [-1, -1, -1], [0, 5, 37]]


def build(out: Path) -> None:
    import iree.compiler as ic
    import iree.turbine.aot as aot
    import torch

    class Picks(torch.nn.Module):
        def forward(self, slots):
            n = slots.shape[0]
            valid = torch.logical_and(slots >= 0, slots < 64)
            first = torch.where(valid, torch.arange(n, dtype=torch.int32), n)
            a = torch.cat([first, torch.full((1,), n, dtype=torch.int32)]).amin(0, True)
            b = first.amin(0, True)
            c = (torch.cumsum(valid.to(torch.int32), 0) == 0).to(torch.int32).sum(0, True)
            d = first.to(torch.float32).amin(0, True)
            e = torch.sort(first)[0][:1]
            return a, b, c, d, e

    t = torch.export.Dim("t")
    e = aot.export(Picks(), args=(torch.arange(3),), dynamic_shapes=[{0: t}])
    out.mkdir(parents=True, exist_ok=True)
    for name, tb, flags in (("cuda", "cuda", ["--iree-cuda-target=sm_80"]), ("cpu", "llvm-cpu", [])):
        (out / f"{name}.vmfb").write_bytes(ic.compile_str(str(e.mlir_module), target_backends=[tb], extra_args=flags))


def run(d: Path, driver: str) -> None:
    import iree.runtime as rt

    config = rt.Config(driver)
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(
        rt.VmModule.copy_buffer(
            config.vm_instance, (d / f"{'cpu' if driver == 'local-task' else 'cuda'}.vmfb").read_bytes()
        )
    )
    main = ctx.modules.module["main"]
    rng = np.random.default_rng(0)
    big = np.where(rng.random(1000) < 0.99, -1, 7)
    for case in CASES + [big.tolist()]:
        s = np.array(case, np.int64)
        want = next((i for i, x in enumerate(s) if 0 <= x < 64), len(s))
        got = [int(np.asarray(r.to_host()).reshape(-1)[0]) for r in main(s)]
        print(
            driver,
            "n",
            len(s),
            "want",
            want,
            "a (cat, i32 amin)",
            got[0],
            "b (i32 amin)",
            got[1],
            "c (cumsum)",
            got[2],
            "d (f32 amin)",
            got[3],
            "e (i64 amin)",
            got[4],
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--driver", default="cuda")
    a = ap.parse_args()
    build(a.build) if a.build else run(a.dir, a.driver)
    sys.exit(0)
