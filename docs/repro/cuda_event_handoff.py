"""IREE 3.13's CUDA driver, no compiled module: can a semaphore's timepoint
cross to another CUDA stream (torch's) without the host waiting?

The as-called target 1 wanted a GPU run() that returns once its work is queued,
torch's later work on the results ordered after it on the device. That
takes a timepoint IREE can export as a CUDA event (torch's stream waits on
it) or import from one (IREE waits on torch's work). Each step prints its
outcome; the script always exits 0, as a record (docs/repro/README.md "No
stream-ordered handoff to torch").

    python3 docs/repro/cuda_event_handoff.py [--device cuda]

1. export a timepoint as a CUDA event;
2. export it as an ASYNC_PRIMITIVE (a host-side wait handle: the control);
3. import a CUDA event torch recorded on its current stream (needs torch
   with CUDA; skipped without it).
"""

import argparse
from importlib.metadata import version

import iree.runtime as rt

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
args = ap.parse_args()

device = rt.get_device(args.device)
print(f"iree-base-runtime {version('iree-base-runtime')}, device {args.device}")


def step(name, fn):
    try:
        print(f"{name}: ok ({fn()})")
    except Exception as e:  # the outcome is the record
        print(f"{name}: {type(e).__name__}: {e}")


def export(kind):
    sem = device.create_semaphore(0)
    tp = rt.HalExternalTimepoint()
    sem.export_timepoint(1, kind, int(rt.ExternalTimepointFlags.NONE), tp)
    return f"type {tp.type}"


step("1. export CUDA_EVENT", lambda: export(rt.ExternalTimepointType.CUDA_EVENT))
step("2. export ASYNC_PRIMITIVE", lambda: export(rt.ExternalTimepointType.ASYNC_PRIMITIVE))

try:
    import torch

    have_cuda = torch.cuda.is_available()
except ImportError:
    have_cuda = False
if have_cuda:

    def import_torch_event():
        event = torch.cuda.Event()
        event.record()
        tp = rt.HalExternalTimepoint()
        tp.type = rt.ExternalTimepointType.CUDA_EVENT
        tp.cuda_event = event.cuda_event
        device.create_semaphore(0).import_timepoint(1, tp)
        return "imported"

    step("3. import a torch CUDA event", import_torch_event)
else:
    print("3. import a torch CUDA event: skipped (no torch with CUDA)")
