#!/usr/bin/env python3
"""The two-GPU run: two GPUs of one machine (the device tool's
`nvidia-h200-x2`), one process and two.

One process, a Session per GPU, each with its own paged caches as torch
CUDA tensors on its GPU:
  own      decode and causal prefill on each session, results on the
           session's GPU, each against the float64 reference;
  interleaved  the two sessions' calls alternating, each checked;
  threads  one thread per session, several rounds each, each checked;
  refused  a tensor of one GPU passed to the other's session is refused by
           name (q on the other GPU; caches on the other GPU);
  memory   while one session runs, the other GPU's free memory does not
           move (torch.cuda.mem_get_info sees IREE's allocations too);
  timing   decode b32 x 4096 (fp16, GQA 32/8, head dim 128, page 16),
           planned once, run() back to back: each session alone, then both
           at once from two threads; the ratio says whether they share a
           host bottleneck (the issue's bound: 10%); the outputs of the
           concurrent runs equal the lone runs' bit for bit.
Two processes, one per GPU with both visible (as vLLM's and
torch.distributed's workers run: torch.cuda.set_device(rank),
Session(f"cuda:{rank}")), the same artifact directory: each checks its
decode and prefill against the reference and times the decode while the
other runs.

Prints one line per check, writes $OUT/h200_two_gpus.json, exits 1 if a
check failed. With one GPU it runs the checks one GPU allows and says so.

    .venv/bin/python benchmarks/build_cuda_subset.py --artifacts artifacts-cuda   # here: every kernel it calls
    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/h200_two_gpus.py --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

TOL = 5e-3  # fp16 output: a few ulps of |out| <= max|V| plus f32 accumulation
HQ, HK, D, PAGE = 32, 8, 128, 16
CAUSAL_REF = dict(mask_type="bottom_right", window_size_right=0)


def problem(rng, kind: str, batch: int, keys: int):
    """numpy f16 q, caches (pages shuffled, garbage in the unused pages) and
    the int32 tables: `kind` decode (one row per sequence) or prefill (keys
    rows, causal)."""
    rows = 1 if kind == "decode" else keys
    width = keys // PAGE
    pages = batch * width + 3
    k = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    table = rng.permutation(pages)[: batch * width].reshape(batch, width).astype(np.int32)
    seqlen = np.full(batch, keys, np.int32)
    q = rng.standard_normal((batch, rows, HQ, D), dtype=np.float32).astype(np.float16)
    return q, k, v, table, seqlen


def checked_call(session, rng, kind: str, batch: int = 3, keys: int = 256) -> tuple[float, str]:
    """One public call on torch tensors on the session's GPU: (rel err
    against the float64 reference, the result's device)."""
    q, k, v, table, seqlen = problem(rng, kind, batch, keys)
    dev = session.torch_device
    out = turbine_fmha.fmha_fwd_paged(
        *(torch.from_numpy(a).to(dev) for a in (q, k, v)),
        table,
        seqlen,
        session=session,
        causal=kind == "prefill",
    )
    ref = fmha_fwd_paged_ref(q, k, v, table, seqlen, **(CAUSAL_REF if kind == "prefill" else {}))[0]
    err = float(np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max())
    return err, str(out.device)


class Decode:
    """The timing case on one session: b32 x 4096 planned once."""

    def __init__(self, session, seed: int, batch: int = 32, keys: int = 4096):
        q, k, v, table, seqlen = problem(np.random.default_rng(seed), "decode", batch, keys)
        dev = session.torch_device
        self.q, self.k, self.v = (torch.from_numpy(a).to(dev) for a in (q, k, v))
        self.attn = turbine_fmha.PagedAttention(session).plan(
            table,
            seqlen,
            num_pages=k.shape[0],
            page_block_size=PAGE,
            nhead_q=HQ,
            nhead_k=HK,
            hdim=D,
            dtype="f16",
            kv_rows_finite=True,
        )
        self.device = torch.device(dev)
        self.out = self.run(1)

    def run(self, n: int):
        for _ in range(n):
            out = self.attn.run(self.q, self.k, self.v)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def ms(self, n: int = 200, rounds: int = 5) -> float:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.run(n)
            times.append((time.perf_counter() - t0) * 1e3 / n)
        return statistics.median(times)


def worker(rank: int, artifacts: str) -> int:
    """One process of the two: its GPU chosen as a tensor-parallel worker
    chooses it; prints one JSON line."""
    torch.cuda.set_device(rank)
    session = turbine_fmha.Session(f"cuda:{rank}", artifact_dir=artifacts)
    rng = np.random.default_rng(100 + rank)
    res = {"rank": rank}
    for kind in ("decode", "prefill"):
        res[f"{kind}_err"], res[f"{kind}_device"] = checked_call(session, rng, kind)
    res["decode_ms_with_other_process"] = round(Decode(session, seed=rank).ms(), 4)
    print(json.dumps(res), flush=True)
    ok = all(res[f"{k}_err"] < TOL and res[f"{k}_device"] == f"cuda:{rank}" for k in ("decode", "prefill"))
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--artifacts", required=True)
    p.add_argument("--worker", type=int, default=None, help="run as the worker of this rank (internal)")
    args = p.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.artifacts)
    out_dir = Path(os.environ.get("OUT", "."))
    report: dict = {"gpus": torch.cuda.device_count(), "checks": {}}
    failed = 0

    def check(name, ok, detail=""):
        nonlocal failed
        failed += not ok
        report["checks"][name] = {"ok": bool(ok), "detail": str(detail)}
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)

    gpus = report["gpus"]
    print(f"{gpus} GPU(s): {[torch.cuda.get_device_name(i) for i in range(gpus)]}", flush=True)
    sessions = [turbine_fmha.Session(f"cuda:{i}", artifact_dir=args.artifacts) for i in range(gpus)]
    rng = np.random.default_rng(0)

    for s in sessions:
        for kind in ("decode", "prefill"):
            err, dev = checked_call(s, rng, kind)
            check(f"own: {s.device_name} {kind}", err < TOL and dev == s.device_name, f"err {err:.2e}, result on {dev}")
    if gpus < 2:
        print("one GPU: the two-GPU checks need nvidia-h200-x2", flush=True)
        return _finish(report, out_dir, failed)

    s0, s1 = sessions[:2]
    for i in range(4):
        s = sessions[i % 2]
        kind = ("decode", "prefill")[(i // 2) % 2]
        err, dev = checked_call(s, rng, kind)
        check(f"interleaved {i}: {s.device_name} {kind}", err < TOL and dev == s.device_name, f"err {err:.2e}")

    errors: dict = {}

    def rounds(s, seed):
        r = np.random.default_rng(seed)
        errors[s.device_name] = [checked_call(s, r, kind) for _ in range(3) for kind in ("decode", "prefill")]

    threads = [threading.Thread(target=rounds, args=(s, 10 + i)) for i, s in enumerate((s0, s1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in (s0, s1):
        got = errors.get(s.device_name, [])
        ok = len(got) == 6 and all(e < TOL and d == s.device_name for e, d in got)
        check(f"threads: {s.device_name}", ok, f"errs {[f'{e:.1e}' for e, _ in got]}")

    q, k, v, table, seqlen = problem(rng, "decode", 2, 64)
    for name, args_ in (
        ("q", (torch.from_numpy(q).to("cuda:1"), torch.from_numpy(k).to("cuda:0"), torch.from_numpy(v).to("cuda:0"))),
        (
            "k_cache",
            (torch.from_numpy(q).to("cuda:0"), torch.from_numpy(k).to("cuda:1"), torch.from_numpy(v).to("cuda:0")),
        ),
    ):
        try:
            turbine_fmha.fmha_fwd_paged(*args_, table, seqlen, session=s0)
            check(f"refused: {name} on cuda:1 for the cuda:0 session", False, "accepted")
        except ValueError as e:
            check(f"refused: {name} on cuda:1 for the cuda:0 session", name in str(e) and "cuda:1" in str(e), str(e))

    decodes = [Decode(s, seed=i) for i, s in enumerate((s0, s1))]
    for i, d in enumerate(decodes):
        other = 1 - i
        torch.cuda.synchronize(other)
        free_before = torch.cuda.mem_get_info(other)[0]
        d.run(100)
        free_after = torch.cuda.mem_get_info(other)[0]
        moved = free_before - free_after
        # Device allocations come in pages of at least 2 MiB: anything
        # this session put on the other GPU would show.
        check(f"memory: cuda:{other} unmoved while cuda:{i} runs", abs(moved) < 2 << 20, f"{moved} bytes")

    alone = [d.ms() for d in decodes]
    both: list = [None, None]
    outs: list = [None, None]

    def timed(i):
        both[i] = decodes[i].ms()
        outs[i] = decodes[i].run(1)

    threads = [threading.Thread(target=timed, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        ratio = both[i] / alone[i]
        report[f"cuda:{i}_decode_ms"] = {"alone": round(alone[i], 4), "both_threads": round(both[i], 4)}
        check(
            f"timing: cuda:{i} decode with the other GPU busy",
            ratio <= 1.10,
            f"{alone[i]:.4f} -> {both[i]:.4f} ms ({ratio:.2f}x)",
        )
        check(f"timing: cuda:{i} concurrent output equals alone", torch.equal(outs[i], decodes[i].out))

    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--artifacts", args.artifacts, "--worker", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(procs):
        text, _ = proc.communicate(timeout=300)
        lines = [ln for ln in text.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {}
        report[f"process_{rank}"] = res
        detail = res if res else text[-2000:]
        check(f"process {rank}: cuda:{rank} decode and prefill", proc.returncode == 0, detail)
        if "decode_ms_with_other_process" in res:
            print(
                f"     process {rank} decode {res['decode_ms_with_other_process']} ms (one process alone: {alone[rank]:.4f})"
            )
    return _finish(report, out_dir, failed)


def _finish(report: dict, out_dir: Path, failed: int) -> int:
    report["failed"] = failed
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h200_two_gpus.json").write_text(json.dumps(report, indent=1))
    print(f"{report['gpus']} GPU(s), {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
