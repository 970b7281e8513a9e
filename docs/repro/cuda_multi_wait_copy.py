"""IREE 3.13's CUDA driver, with no compiled module: queue copies that each
signal a semaphore of their own, then one 4-byte copy that waits on all of
them, waited for on the host, again and again. turbine-fmha's GPU wait
queued such a copy after a multi-call run (runtime/invoke.py's HostFlag)
and the process crashed in IREE's queue worker thread, inside
cuStreamWaitEvent (docs/reliability.md "A segfault in the GPU wait").
Prints "no crash" after the rounds, or dies with SIGSEGV.

    python3 docs/repro/cuda_multi_wait_copy.py [--rounds N] [--waits W] [--gate]
"""

import argparse

import iree.runtime as rt
import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=2000)
ap.add_argument("--waits", type=int, default=8)
ap.add_argument("--bytes", type=int, default=1 << 22)
ap.add_argument("--device", default="cuda")
ap.add_argument(
    "--gate",
    action="store_true",
    help="the copies wait on a semaphore the host signals after the flag copy is queued, so that "
    "the flag copy is queued before the work that signals its waits is issued",
)
args = ap.parse_args()

device = rt.get_device(args.device)
src = rt.asdevicearray(device, np.ones(args.bytes // 4, np.float32))._buffer_view.get_buffer()
dst = [
    rt.asdevicearray(device, np.zeros(args.bytes // 4, np.float32))._buffer_view.get_buffer() for _ in range(args.waits)
]
one = rt.asdevicearray(device, np.ones(1, np.int32))._buffer_view.get_buffer()
flag = rt.asdevicearray(device, np.zeros(1, np.int32))._buffer_view.get_buffer()
done, count = device.create_semaphore(0), 0
for _ in range(args.rounds):
    sems = [device.create_semaphore(0) for _i in range(args.waits)]
    gate = device.create_semaphore(0)
    for s, d in zip(sems, dst):
        device.queue_copy(src, d, [(gate, 1)] if args.gate else [], [(s, 1)])
    count += 1
    device.queue_copy(one, flag, [(s, 1) for s in sems], [(done, count)])
    gate.signal(1)
    rt.HalFence.create_at(done, count).wait()
print(f"no crash: {args.rounds} rounds of {args.waits} waits{', gated' if args.gate else ''}")
