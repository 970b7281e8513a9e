"""Times the CPU prefill's contractions alone (cpu_f16_contractions.mlir),
compiled as the library compiles them and with data tiling and ukernels,
and with the chunk's sizes static (qk_static, pv_static; the rows only:
qk_rows_static, pv_rows_static),
per dispatch through IREE's HAL profiling (iree-run-module
--device_profiling_mode=host-execution, read back by iree-profile), beside
torch.bmm on the same operands. Run from the repo root:

    .venv/bin/python docs/repro/cpu_f16_contractions.py
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).parent
BIN = pathlib.Path(sys.executable).parent
TARGET = [
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
]
FLAGS = {"as built": [], "data tiling + ukernels": ["--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all"]}
# One 64-row chunk of a chunked prefill: 2 sequences, 8 KV heads x 4, 1152 keys.
B, M, HK, G, N, D = 2, 64, 8, 4, 1152, 128


def profile(vmfb, fn, inputs, tmp) -> dict[str, float]:
    out = tmp / "p.ireeprof"
    subprocess.run(
        [str(BIN / "iree-run-module"), f"--module={vmfb}", f"--function={fn}", "--device=local-task"]
        + ["--task_topology_group_count=2", "--device_profiling_mode=host-execution"]
        + [f"--device_profiling_output={out}"]
        + [f"--input=@{i}" for i in inputs],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    text = subprocess.run([str(BIN / "iree-profile"), "dispatch", str(out)], check=True, capture_output=True).stdout
    found = re.findall(r"^  (\S+)\n.*?\n\s+time_ns: min=\d+ avg=([\d.]+)", text.decode(), re.M)
    return {name.split("_dispatch_")[-1].split("_encode_")[-1]: float(ns) / 1e6 for name, ns in found}


def main() -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        arrays = {
            "q": rng.standard_normal((B, M, HK, G, D)).astype(np.float16),
            "k": rng.standard_normal((B, N, HK, D)).astype(np.float16),
            "p": rng.standard_normal((B * HK, G * M, N)).astype(np.float16),
            "v": rng.standard_normal((B * HK, N, D)).astype(np.float16),
            "q3": rng.standard_normal((B * HK, G * M, D)).astype(np.float16),
        }
        for name, a in arrays.items():
            np.save(tmp / f"{name}.npy", a)
        calls = {"qk_generic": "qk", "qk_bmm": "qk", "pv_dyn": "pv", "qk_static": ["q3", "v"], "pv_static": "pv"}
        calls.update(qk_rows_static=["q3", "v"], pv_rows_static="pv")
        gflop = 2 * B * HK * G * M * N * D / 1e9  # each contraction
        for label, flags in FLAGS.items():
            vmfb = tmp / "c.vmfb"
            subprocess.run(
                [str(BIN / "iree-compile"), *TARGET, *flags, str(HERE / "cpu_f16_contractions.mlir"), "-o", str(vmfb)],
                check=True,
            )
            for fn, ops in calls.items():
                inputs = [tmp / f"{o}.npy" for o in ops]
                runs = [profile(vmfb, fn, inputs, tmp) for _ in range(3)]
                best = {k: min(r[k] for r in runs) for k in runs[0]}
                total = sum(best.values())
                parts = ", ".join(f"{k} {v:.1f}" for k, v in best.items())
                print(f"{label:24s} {fn:10s} {total:6.1f} ms ({gflop / total * 1e3:5.1f} GFLOP/s): {parts}")
        import torch

        torch.set_num_threads(2)
        q = torch.from_numpy(arrays["q"]).permute(0, 2, 3, 1, 4).reshape(B * HK, G * M, D).contiguous()
        k = torch.from_numpy(arrays["k"]).permute(0, 2, 1, 3).reshape(B * HK, N, D).contiguous()
        p, v = torch.from_numpy(arrays["p"]), torch.from_numpy(arrays["v"])
        for fn, f in (("qk", lambda: torch.bmm(q, k.transpose(1, 2))), ("pv", lambda: torch.bmm(p, v))):
            f()
            t = time.perf_counter()
            for _ in range(10):
                f()
            ms = (time.perf_counter() - t) / 10 * 1e3
            print(f"{'torch.bmm, f16':24s} {fn:10s} {ms:6.1f} ms ({gflop / ms * 1e3:5.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
