#!/usr/bin/env python3
"""How IREE 3.13's CUDA calls can hand their results to torch without a
host wait (issue 27 target 1). On the H200, with the b32 x 4096 decode of
docs/benchmarks.md (fp16, GQA 32/8, head dim 128, page 16) planned once:

  A  run() back to back (today: each call waits on the host for its work);
  B  the same kernel enqueued back to back, one wait at the end: the
     device's own rate, the floor of any handoff;
  C  B, plus per call a 4-byte queue_copy of the call's number into a flag
     (waiting on the call's fence) and cuStreamWaitValue32 on torch's
     stream for it, then a torch op on the results: IREE -> torch ordered
     on the device; checked against A's results;
  D  C, but q made by torch right before each call (a model's next
     layer), with torch's stream synchronized before the call (the
     torch -> IREE order a host sync gives);
  E  D with the torch -> IREE order from a bridge thread: the caller
     records a torch event and returns; a thread waits for the event, then
     enqueues the call and its flag copy;
  F  whether an IREE call with a wait fence not yet signaled returns at
     once (enqueue) or blocks (its allocations wait on the host).

Prints one line per measurement and writes them to $OUT/async_handoff.json.

    python3 benchmarks/probes/h200_async_handoff.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import iree.runtime as rt
import torch

import turbine_fmha
from turbine_fmha.core.arrays import _Results


def _wait_value_fn():
    """cuStreamWaitValue32(stream, address, value, GEQ) from cuda-python, or
    libcuda through ctypes."""
    try:
        from cuda.bindings import driver

        def wait(stream: int, address: int, value: int) -> None:
            (err,) = driver.cuStreamWaitValue32(
                driver.CUstream(stream),
                driver.CUdeviceptr(address),
                value,
                driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
            )
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuStreamWaitValue32: {err}")

        return wait, "cuda.bindings"
    except ImportError:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

        def wait(stream: int, address: int, value: int) -> None:
            err = fn(ctypes.c_void_p(stream), address, value, 0)
            if err:
                raise RuntimeError(f"cuStreamWaitValue32: CUresult {err}")

        return wait, "ctypes"


def _problem(device, batch=32, keys=4096, hq=32, hk=8, d=128, page=16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = batch * keys // page
    k = torch.randn(pages, page, hk, d, generator=g, dtype=torch.float16).to(device)
    v = torch.randn(pages, page, hk, d, generator=g, dtype=torch.float16).to(device)
    bt = torch.randperm(pages, generator=g).to(torch.int32).reshape(batch, keys // page)
    sk = torch.full((batch,), keys, dtype=torch.int32)
    q = torch.randn(batch, 1, hq, d, generator=g, dtype=torch.float16).to(device)
    return q, k, v, bt, sk


def planned_decode(session):
    """The b32 x 4096 decode planned once on `session` (kv_rows_finite),
    with what the probes call its kernel with: `loaded` (the variant's
    module) and `call_args(q)` (its arguments for a q)."""
    import types

    q, k, v, bt, sk = _problem("cuda")
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=k.shape[0],
        page_block_size=16,
        nhead_q=32,
        nhead_k=8,
        hdim=128,
        dtype="f16",
        kv_rows_finite=True,
    )
    plan = attn._plan
    variant = plan._variant(True)
    results = _Results(session, q)
    steps = plan._device_steps(variant, results)
    _, kcc, vcc, _ = plan._arrays(q, k, v, None)
    kc, vc = (session.kernel_cache(c, False, plan._imports) for c in (kcc, vcc))

    def call_args(qq):
        qb = plan._batch_q(qq, results)
        return [session.import_torch(steps[0].q(qb)), kc, vc, *steps[0].args]

    return types.SimpleNamespace(
        q=q,
        k=k,
        v=v,
        bt=bt,
        attn=attn,
        variant=variant,
        steps=len(steps),
        loaded=session._load(variant),
        call_args=call_args,
    )


def _median_ms(fn, n: int, rounds: int = 5) -> float:
    fn(n)  # warm up
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(n)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / n)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    report = {}

    def record(name, value, note=""):
        report[name] = value
        print(f"{name}: {value}{' ' + note if note else ''}", flush=True)

    wait_value, how = _wait_value_fn()
    record("wait_value_api", how)
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    d = planned_decode(session)
    q, k, v, bt, attn, loaded, call_args = d.q, d.k, d.v, d.bt, d.attn, d.loaded, d.call_args
    attn.run(q, k, v)
    record("variant", d.variant.name)
    record("steps", d.steps)

    # A: run() as called.
    def run_a(n):
        for _ in range(n):
            attn.run(q, k, v)

    record("A_run_ms", round(_median_ms(run_a, args.calls), 4))

    # B: enqueue back to back, one wait at the end.
    fixed = call_args(q)
    first = loaded.enqueue(fixed)
    first.wait()
    expected = session.to_torch(*first.results(1))[0].clone()

    def run_b(n):
        calls = [loaded.enqueue(fixed, own_timeline=True) for _ in range(n)]
        for c in calls:
            c.wait()

    record("B_enqueue_only_ms", round(_median_ms(run_b, args.calls), 4))
    t0 = time.perf_counter()
    calls = [loaded.enqueue(fixed, own_timeline=True) for _ in range(args.calls)]
    record("B_host_enqueue_us", round((time.perf_counter() - t0) * 1e6 / args.calls, 1))
    for c in calls:
        c.wait()

    # The flag: 4 bytes of torch memory IREE copies the call's number into;
    # the numbers come from one buffer of 1..N filled once.
    n_max = 1 << 20
    numbers = torch.arange(1, n_max + 1, dtype=torch.int32, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    flag_buf = session.import_torch(flag)._buffer_view.get_buffer()
    device = session.device_of()
    counter = [0]

    # HalBuffer has no sub-buffer constructor in the Python API: import a
    # one-element torch view per number instead (cached for the probe).
    views = {}

    def number_buffer(i):
        b = views.get(i)
        if b is None:
            b = views[i] = session.import_torch(numbers[i - 1 : i])._buffer_view.get_buffer()
        return b

    for i in range(1, 3 * args.calls + 8):
        number_buffer(i)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream

    def enqueue_with_flag(argv):
        call = loaded.enqueue(argv, own_timeline=True)
        counter[0] += 1
        i = counter[0]
        device.queue_copy(number_buffer(i), flag_buf, call.done, [(device.create_semaphore(0), 1)])
        return call, i

    # The pieces alone first, so that a failure names its step.
    print("step: one flag copy", flush=True)
    call, i = enqueue_with_flag(fixed)
    call.wait()
    torch.cuda.synchronize()
    record("flag_after_one_copy", int(flag.item()))
    print("step: one cuStreamWaitValue32", flush=True)
    wait_value(stream, flag.data_ptr(), 1)
    torch.cuda.synchronize()
    record("wait_value_returned", True)

    # C: IREE -> torch on the device.
    sink = torch.zeros((), dtype=torch.float32, device="cuda")
    outs = []

    def run_c(n, keep=False):
        nonlocal sink
        counter[0] = 0
        flag.zero_()
        torch.cuda.synchronize()
        pending = []
        for _ in range(n):
            call, i = enqueue_with_flag(fixed)
            wait_value(stream, flag.data_ptr(), i)
            o = session.to_torch(*call.results(1))[0]
            sink = sink + o.float().sum()
            pending.append(call)
            if keep:
                outs.append(o)
        return pending

    try:
        record("C_flag_handoff_ms", round(_median_ms(lambda n: run_c(n), args.calls), 4))
        outs.clear()
        run_c(8, keep=True)
        torch.cuda.synchronize()
        bad = [j for j, o in enumerate(outs) if not torch.equal(o, expected)]
        record("C_results_equal_run", not bad, f"(differing calls: {bad[:5]})" if bad else "")
    except Exception as e:
        record("C_error", f"{type(e).__name__}: {e}")

    # D: q from torch before each call, torch synchronized before IREE.
    def run_d(n):
        counter[0] = 0
        flag.zero_()
        for _ in range(n):
            qq = q * 1.0  # a new q, written by torch
            torch.cuda.current_stream().synchronize()
            call, i = enqueue_with_flag(call_args(qq))
            wait_value(stream, flag.data_ptr(), i)

    try:
        record("D_sync_then_flag_ms", round(_median_ms(run_d, args.calls), 4))
    except Exception as e:
        record("D_error", f"{type(e).__name__}: {e}")

    # E: a bridge thread orders torch -> IREE.
    jobs: queue.Queue = queue.Queue()

    def bridge():
        while True:
            job = jobs.get()
            if job is None:
                return
            event, argv, i = job
            event.synchronize()
            call = loaded.enqueue(argv, own_timeline=True)
            device.queue_copy(number_buffer(i), flag_buf, call.done, [(device.create_semaphore(0), 1)])

    worker = threading.Thread(target=bridge, daemon=True)
    worker.start()

    def run_e(n):
        counter[0] = 0
        flag.zero_()
        for _ in range(n):
            qq = q * 1.0
            argv = call_args(qq)
            event = torch.cuda.Event()
            event.record()
            counter[0] += 1
            jobs.put((event, argv, counter[0]))
            wait_value(stream, flag.data_ptr(), counter[0])

    try:
        record("E_bridge_ms", round(_median_ms(run_e, args.calls), 4))
        t0 = time.perf_counter()
        run_e(args.calls)
        record("E_host_per_call_us", round((time.perf_counter() - t0) * 1e6 / args.calls, 1))
        torch.cuda.synchronize()
    except Exception as e:
        record("E_error", f"{type(e).__name__}: {e}")
    jobs.put(None)

    # F: an unsignaled wait fence.
    sem = device.create_semaphore(0)
    fence = rt.HalFence.create_at(sem, 1)
    done_sem = device.create_semaphore(0)
    done = rt.HalFence.create_at(done_sem, 1)
    fn, arg_list = loaded.function, rt.VmVariantList(len(fixed) + 2)
    for a in fixed:
        arg_list.push_ref(a._buffer_view.ref)
    arg_list.push_ref(fence.ref)
    arg_list.push_ref(done.ref)
    signaller = threading.Timer(0.05, lambda: sem.signal(1))
    signaller.start()
    t0 = time.perf_counter()
    fn._vm_context.invoke(fn.vm_function, arg_list, rt.VmVariantList(4))
    record(
        "F_invoke_with_unsignaled_fence_ms",
        round((time.perf_counter() - t0) * 1e3, 2),
        "(50 ms until the fence is signaled: ~50 means the call blocks)",
    )
    done.wait()

    torch_ms = _median_ms(lambda n: [torch_gather_sdpa(q, k, v, bt) for _ in range(n)], args.calls)
    record("torch_gather_sdpa_ms", round(torch_ms, 4))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "async_handoff.json").write_text(json.dumps(report, indent=1))
    return 0


def torch_gather_sdpa(q, k, v, bt):
    batch, pages = bt.shape
    idx = bt.to(q.device).reshape(-1).long()
    kk = k.index_select(0, idx).reshape(batch, pages * k.shape[1], k.shape[2], k.shape[3]).transpose(1, 2)
    vv = v.index_select(0, idx).reshape(batch, pages * v.shape[1], v.shape[2], v.shape[3]).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True)


if __name__ == "__main__":
    sys.exit(main())
