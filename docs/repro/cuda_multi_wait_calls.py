"""IREE 3.13's CUDA driver and a queue copy that waits on several semaphores,
each signaled by a call of a compiled function (async-external model: the
call takes a wait and a signal fence, and allocates its result on the
queue). This is the pattern that crashed turbine-fmha's GPU wait before
313e3b4 (docs/reliability.md "A segfault in the GPU wait"): IREE's queue
worker thread faulted inside cuStreamWaitEvent. A copies-only form
(cuda_multi_wait_copy.py) never crashed. Prints "no crash" after the
rounds, or dies with SIGSEGV.

Compile here (iree-base-compiler), run where the GPU is (iree-base-runtime):
    python3 docs/repro/cuda_multi_wait_calls.py --build [--target cuda|host]
    python3 docs/repro/cuda_multi_wait_calls.py [--device cuda] [--rounds N] [--waits W]
"""

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[2] / "build" / "repro-multiwait"
SOURCE = """
func.func @f(%a: tensor<?xf32>) -> tensor<?xf32> {
  %c0 = arith.constant 0 : index
  %n = tensor.dim %a, %c0 : tensor<?xf32>
  %e = tensor.empty(%n) : tensor<?xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i) -> (i)>, affine_map<(i) -> (i)>],
                       iterator_types = ["parallel"]} ins(%a : tensor<?xf32>) outs(%e : tensor<?xf32>) {
  ^bb0(%x: f32, %o: f32):
    %y = math.exp %x : f32
    linalg.yield %y : f32
  } -> tensor<?xf32>
  return %r : tensor<?xf32>
}
"""
FLAGS = {
    "cuda": ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"],
    "host": [
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=generic",
    ],
}

ap = argparse.ArgumentParser()
ap.add_argument("--build", action="store_true")
ap.add_argument("--target", default="cuda", choices=sorted(FLAGS))
ap.add_argument("--device", default="cuda")
ap.add_argument("--rounds", type=int, default=2000)
ap.add_argument("--waits", type=int, default=8)
ap.add_argument("--elements", type=int, default=1 << 20)
args = ap.parse_args()

if args.build:
    import iree.compiler as ic

    HERE.mkdir(parents=True, exist_ok=True)
    flags = FLAGS[args.target] + ["--iree-execution-model=async-external"]
    (HERE / f"f_{args.target}.vmfb").write_bytes(ic.compile_str(SOURCE, extra_args=flags))
    raise SystemExit(f"built {HERE / f'f_{args.target}.vmfb'}")

import iree.runtime as rt  # noqa: E402

target = "cuda" if args.device.startswith("cuda") else "host"
config = rt.Config(args.device)
ctx = rt.SystemContext(config=config)
ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, (HERE / f"f_{target}.vmfb").read_bytes()))
fn = ctx.modules.module["f"]
device = config.device
x = rt.asdevicearray(device, np.zeros(args.elements, np.float32))
one = rt.asdevicearray(device, np.ones(1, np.int32))._buffer_view.get_buffer()
flag = rt.asdevicearray(device, np.zeros(1, np.int32))._buffer_view.get_buffer()
done, count = device.create_semaphore(0), 0
for _ in range(args.rounds):
    sems, results = [], []
    for _i in range(args.waits):
        sem = device.create_semaphore(0)
        argv = rt.VmVariantList(3)
        argv.push_ref(x._buffer_view.ref)
        argv.push_ref(rt.HalFence(1).ref)
        argv.push_ref(rt.HalFence.create_at(sem, 1).ref)
        ret = rt.VmVariantList(1)
        fn._vm_context.invoke(fn.vm_function, argv, ret)
        sems.append(sem)
        results.append(ret)
    count += 1
    device.queue_copy(one, flag, [(s, 1) for s in sems], [(done, count)])
    rt.HalFence.create_at(done, count).wait()
print(f"no crash: {args.rounds} rounds of {args.waits} calls and a copy waiting on all")
