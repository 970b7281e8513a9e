#!/usr/bin/env python3
"""A call whose dynamic dimension is zero somewhere inside faults IREE's
CUDA device.

The prefill tiles (mlir/prefill_tiles.mlir.jinja) run one attention
dispatch per chunk class, each over the entries its dynamic dimension
counts. A class that no entry fills would be a zero-size argument and a
dispatch over nothing. This module has the same shape of problem, with
no attention: out = concat(a * 2, a[ids] + 1), so the call's inputs and
result are never empty, but with no ids the gather's dispatch covers no
element.

    .venv/bin/python docs/repro/cuda_zero_entries.py --build OUT    # here: sm_80 and llvm-cpu vmfbs
    python3 docs/repro/cuda_zero_entries.py --run OUT [--driver cuda]

runs it with one id, then with none (a zero-size view of a small buffer:
IREE's CUDA allocator refuses a zero-size buffer outright), then uploads
one more array, and prints what each step gave."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SOURCE = """
func.func @f(%a: tensor<?x4xf32>, %ids: tensor<?xi32>) -> tensor<?x4xf32> {
  %c0 = arith.constant 0 : index
  %n = tensor.dim %a, %c0 : tensor<?x4xf32>
  %e = tensor.dim %ids, %c0 : tensor<?xi32>
  %two = arith.constant 2.0 : f32
  %one = arith.constant 1.0 : f32
  %d_e = tensor.empty(%n) : tensor<?x4xf32>
  %d = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]} ins(%a : tensor<?x4xf32>) outs(%d_e : tensor<?x4xf32>) {
  ^bb0(%x: f32, %o: f32):
    %y = arith.mulf %x, %two : f32
    linalg.yield %y : f32
  } -> tensor<?x4xf32>
  %g_e = tensor.empty(%e) : tensor<?x4xf32>
  %g = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i)>, affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]} ins(%ids : tensor<?xi32>) outs(%g_e : tensor<?x4xf32>) {
  ^bb0(%id: i32, %o: f32):
    %j = linalg.index 1 : index
    %r = arith.index_cast %id : i32 to index
    %x = tensor.extract %a[%r, %j] : tensor<?x4xf32>
    %y = arith.addf %x, %one : f32
    linalg.yield %y : f32
  } -> tensor<?x4xf32>
  %total = arith.addi %n, %e : index
  %out_e = tensor.empty(%total) : tensor<?x4xf32>
  %out0 = tensor.insert_slice %d into %out_e[0, 0] [%n, 4] [1, 1] : tensor<?x4xf32> into tensor<?x4xf32>
  %out = tensor.insert_slice %g into %out0[%n, 0] [%e, 4] [1, 1] : tensor<?x4xf32> into tensor<?x4xf32>
  return %out : tensor<?x4xf32>
}
"""

TARGETS = {
    "cuda": ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"],
    "local-task": [
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=generic",
    ],
}


def build(out: Path) -> None:
    import iree.compiler as ic

    out.mkdir(parents=True, exist_ok=True)
    for driver, flags in TARGETS.items():
        (out / f"zero_entries_{driver}.vmfb").write_bytes(ic.compile_str(SOURCE, extra_args=flags))
        print(f"built {out}/zero_entries_{driver}.vmfb", flush=True)


def run(out: Path, driver: str) -> None:
    import iree.runtime as rt
    from iree.runtime import array_interop

    config = rt.Config(driver)
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, (out / f"zero_entries_{driver}.vmfb").read_bytes()))
    f, dev = ctx.modules.module.f, config.device
    a = np.arange(12, dtype=np.float32).reshape(3, 4)

    def step(what, fn):
        try:
            print(f"{what}: {fn()}", flush=True)
        except Exception as e:  # each step's outcome is the output
            print(f"{what}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)

    def empty_ids():
        backing = rt.asdevicearray(dev, np.zeros(64, np.uint8))._buffer_view.get_buffer()
        et = array_interop.map_dtype_to_hal_element_type(np.dtype(np.int32))
        return rt.DeviceArray(dev, rt.HalBufferView(backing, [0], et))

    step("one id", lambda: f(rt.asdevicearray(dev, a), rt.asdevicearray(dev, np.array([1], np.int32))).to_host()[-1])
    step("a zero-size upload", lambda: rt.asdevicearray(dev, np.zeros(0, np.int32)).shape)
    step("no id (a zero-size view)", lambda: f(rt.asdevicearray(dev, a), empty_ids()).to_host().shape)
    step("an upload after it", lambda: rt.asdevicearray(dev, np.ones(1, np.int32)).to_host())
    step(
        "one id again",
        lambda: f(rt.asdevicearray(dev, a), rt.asdevicearray(dev, np.array([1], np.int32))).to_host()[-1],
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--driver", default="cuda", choices=sorted(TARGETS))
    args = ap.parse_args()
    if args.build:
        build(args.build)
    if args.run:
        run(args.run, args.driver)
    return 0


if __name__ == "__main__":
    sys.exit(main())
