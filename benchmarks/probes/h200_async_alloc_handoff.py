#!/usr/bin/env python3
"""Does IREE 3.13's stream-ordered allocator remove the deadlock of the
device-side handoff to torch (issue 27 target 1)?

h200_async_handoff.py's row C (a 4-byte queue_copy of the call's number
into torch memory after each call, cuStreamWaitValue32 on torch's stream
for it) hung at 200 calls back to back: with plain allocations
(`--cuda_async_allocations=false`, the library's default, so that DLPack
can export results) IREE frees buffers beyond its pool with cuMemFree,
which synchronizes the device and so waits for torch's stream, which
waits for a flag IREE has not written yet (docs/repro, "No stream-ordered
handoff to torch"). With stream-ordered allocations (cuMemAllocAsync /
cuMemFreeAsync on IREE's stream) no free synchronizes the device; results
then cannot be exported, so each call's output is queue-copied into a
torch tensor made once, before the flag. On the b32 x 4096 decode of
docs/benchmarks.md (fp16, GQA 32/8, head dim 128, page 16), planned once:

  A  run() back to back as the library calls it, in this process
     (stream-ordered allocations: results copied to torch, host wait);
  B  the kernel enqueued back to back, one wait at the end (device floor);
  G  IREE -> torch on the device: per call the kernel, a queue_copy of its
     output into a torch tensor, the flag copy, cuStreamWaitValue32 on
     torch's stream, and a torch reduction of the output; no host wait;
  H  G with q made by torch before each call and torch's stream
     synchronized on the host before IREE reads it (the torch -> IREE
     order a model's layer needs without a bridge);
  T  torch gather+SDPA, timed the same way.

Each row runs under a watchdog: a hang prints the stacks and exits
(faulthandler), so the command's other rows still report.

    TURBINE_FMHA_CUDA_ASYNC_ALLOCATIONS=1 python3 benchmarks/probes/h200_async_alloc_handoff.py --artifacts artifacts-cuda
    python3 benchmarks/probes/h200_async_alloc_handoff.py --artifacts artifacts-cuda  # the control: plain allocations
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import iree.runtime as rt
import torch
from h200_async_handoff import _median_ms, _wait_value_fn, planned_decode, torch_gather_sdpa

import turbine_fmha

WATCHDOG_S = 90


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--ring", type=int, default=4, help="torch output tensors the calls write in turn")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    report = {"async_allocations": os.environ.get("TURBINE_FMHA_CUDA_ASYNC_ALLOCATIONS", "")}

    def record(name, value, note=""):
        report[name] = value
        print(f"{name}: {value}{' ' + note if note else ''}", flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "async_alloc_handoff.json").write_text(json.dumps(report, indent=1))

    wait_value, how = _wait_value_fn()
    record("wait_value_api", how)
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    d = planned_decode(session)
    q, k, v, bt, attn, loaded, call_args = d.q, d.k, d.v, d.bt, d.attn, d.loaded, d.call_args
    reference = attn.run(q, k, v).clone()
    record("variant", d.variant.name)
    record("steps", d.steps)
    device = session.device_of()

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    record("A_run_ms", round(_median_ms(lambda n: [attn.run(q, k, v) for _ in range(n)], args.calls), 4))

    fixed = call_args(q)

    def run_b(n):
        calls = [loaded.enqueue(fixed, own_timeline=True) for _ in range(n)]
        for c in calls:
            c.wait()

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    record("B_enqueue_only_ms", round(_median_ms(run_b, args.calls), 4))

    # The flag and the numbers copied into it, as in h200_async_handoff.py.
    numbers = torch.arange(1, 4 * args.calls + 16, dtype=torch.int32, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    outs = [torch.empty_like(reference) for _ in range(args.ring)]
    torch.cuda.synchronize()
    flag_buf = session.import_torch(flag)._buffer_view.get_buffer()
    out_bufs = [session.import_torch(o)._buffer_view.get_buffer() for o in outs]
    number_bufs = [
        session.import_torch(numbers[i - 1 : i])._buffer_view.get_buffer() for i in range(1, 4 * args.calls + 16)
    ]
    stream = torch.cuda.current_stream().cuda_stream
    state = {"i": 0, "timeline": device.create_semaphore(0), "value": 0}

    def handoff(argv) -> torch.Tensor:
        """The call, its output copied into the next torch tensor of the
        ring, the flag set after it, torch's stream made to wait for the
        flag. Returns the torch tensor (ordered on torch's stream)."""
        call = loaded.enqueue(argv, own_timeline=True)
        state["i"] += 1
        i, tl = state["i"], state["timeline"]
        out = call.results(1)[0]._buffer_view.get_buffer()
        slot = (i - 1) % args.ring
        device.queue_copy(out, out_bufs[slot], call.done, [(tl, state["value"] + 1)])
        device.queue_copy(number_bufs[i - 1], flag_buf, [(tl, state["value"] + 1)], [(tl, state["value"] + 2)])
        state["value"] += 2
        wait_value(stream, flag.data_ptr(), i)
        return outs[slot]

    def reset():
        torch.cuda.synchronize()
        rt.HalFence.create_at(state["timeline"], state["value"]).wait()
        state["i"] = 0
        flag.zero_()
        torch.cuda.synchronize()

    sink = torch.zeros((), dtype=torch.float32, device="cuda")

    def run_g(n):
        nonlocal sink
        reset()
        for _ in range(n):
            sink = sink + handoff(fixed).float().sum()

    try:
        print("step: one handoff", flush=True)
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        reset()
        o = handoff(fixed)
        torch.cuda.synchronize()
        record("G_one_handoff_equal_run", bool(torch.equal(o, reference)))
        record("G_handoff_ms", round(_median_ms(run_g, args.calls), 4))
        # Correctness back to back: each result read by torch right after
        # its wait, before the ring comes round again.
        reset()
        checks = []
        for _ in range(3 * args.ring):
            checks.append(handoff(fixed).clone())
        torch.cuda.synchronize()
        record("G_back_to_back_equal_run", all(torch.equal(c, reference) for c in checks))
        t0 = time.perf_counter()
        run_g(args.calls)
        record("G_host_per_call_us", round((time.perf_counter() - t0) * 1e6 / args.calls, 1))
        torch.cuda.synchronize()
    except Exception as e:
        record("G_error", f"{type(e).__name__}: {e}")

    def run_h(n):
        nonlocal sink
        reset()
        for _ in range(n):
            qq = q * 1.0  # written by torch, as a layer's projection would
            torch.cuda.current_stream().synchronize()
            sink = sink + handoff(call_args(qq)).float().sum()

    try:
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        record("H_sync_then_handoff_ms", round(_median_ms(run_h, args.calls), 4))
    except Exception as e:
        record("H_error", f"{type(e).__name__}: {e}")

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    record(
        "T_torch_gather_sdpa_ms",
        round(_median_ms(lambda n: [torch_gather_sdpa(q, k, v, bt) for _ in range(n)], args.calls), 4),
    )
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
