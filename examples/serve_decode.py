#!/usr/bin/env python3
"""A small continuous-batching service loop over turbine_fmha.PagedKVCache.

Requests arrive with a prompt and a number of tokens to generate. Each step
admits waiting requests while fewer than --max-batch are running (their
prompts are prefilled), and every running sequence decodes one token.
Prefill and decode rows share one group-mode call of fmha_fwd_paged. Some
requests sample two continuations that share the prompt's pages (fork, with
copy-on-write of the shared last page). Finished sequences free their
pages for the next ones.

The page pool lives on the session's device (PagedKVCache with a session):
each step uploads only the new tokens' K/V, through the append kernel, and
the attention reads the pool in place. There is no model: each token's
q/k/v are random. The attention is the real
work, and every --verify-every'th step is checked against the float64
reference. It prints tokens/s (over the steps, checks excluded) and the
p50/p99 step latency (a step: the cache appends and the attention call).

    .venv/bin/python examples/serve_decode.py                  # CPU, artifacts/
    python3 examples/serve_decode.py --device cuda --artifacts artifacts-cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

TOL = {"f16": 5e-3, "bf16": 2e-2, "f32": 1e-5}  # as in tests/conftest.py


@dataclasses.dataclass
class Request:
    prompt: int
    generate: int
    fork: bool


def run_service(
    session,
    *,
    requests: int,
    max_batch: int,
    nhead_q: int,
    nhead_k: int,
    hdim: int,
    page: int,
    num_pages: int,
    prompt_range=(16, 256),
    generate_range=(8, 64),
    verify_every: int = 10,
    seed: int | None = None,
    log=print,
    torch_q: bool = False,
) -> dict:
    rng = np.random.default_rng(seed)
    dt = np.float16
    # The pool lives on the session's device; appends write only new rows.
    cache = turbine_fmha.PagedKVCache(num_pages, page, nhead_k, hdim, "f16", session=session)
    queue = [
        Request(int(rng.integers(*prompt_range)), int(rng.integers(*generate_range)), bool(rng.random() < 0.25))
        for _ in range(requests)
    ]
    running: dict[int, int] = {}  # sequence -> tokens left to generate
    latencies, tokens, steps, verified = [], 0, 0, 0
    t_start = time.perf_counter()

    def kv(n):
        return (rng.standard_normal((n, nhead_k, hdim)).astype(dt), rng.standard_normal((n, nhead_k, hdim)).astype(dt))

    while queue or running:
        t0 = time.perf_counter()
        rows = []  # (sequence, query rows this step)
        for seq in list(running):  # decode: one new token each
            cache.append(seq, *kv(1))
            rows.append((seq, 1))
        decoding = [s for s, _ in rows]
        # Admit while there is room in the batch and pages for the prompt
        # (plus slack for the running sequences' next tokens).
        while (
            queue and len(running) < max_batch and (cache.num_free_pages - len(running)) * page > queue[0].prompt + page
        ):
            req = queue.pop(0)
            seq = cache.allocate()
            cache.append(seq, *kv(req.prompt))
            rows.append((seq, req.prompt))
            running[seq] = req.generate
            if req.fork and len(running) < max_batch:
                # A second continuation sharing the prompt's pages; it starts
                # decoding next step.
                running[cache.fork(seq)] = req.generate
        if not rows:
            break
        seqs = [s for s, _ in rows]
        seqstart = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int32)
        q = rng.standard_normal((int(seqstart[-1]), nhead_q, hdim)).astype(dt)
        kw = dict(seqstart_q=seqstart, mask_type="bottom_right", window_size_right=0)
        if torch_q:
            # As a model would hand it over: q on the session's device. The
            # output then stays there too (fmha_fwd_paged's torch path).
            import torch

            out = cache.attend(torch.from_numpy(q).to(session.torch_device), seqs, **kw)
            if out.is_cuda:
                torch.cuda.synchronize()
        else:
            out = cache.attend(q, seqs, **kw)
        latencies.append((time.perf_counter() - t0) * 1e3)
        tokens += int(seqstart[-1])
        steps += 1
        if verify_every and (steps - 1) % verify_every == 0:
            # The host mirror holds what the device pool holds (tests check it).
            bt, sk = cache.batch(seqs)
            ref, _ = fmha_fwd_paged_ref(q, cache.k, cache.v, bt, sk, **kw)
            got = out.cpu().numpy() if torch_q else out
            err = float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())
            if not err <= TOL["f16"]:
                raise AssertionError(f"step {steps}: rel err {err:.3e} > {TOL['f16']}")
            verified += 1
            log(
                f"step {steps}: {len(seqs)} sequences, {seqstart[-1]} query rows, "
                f"{cache.num_free_pages} free pages, verified (rel err {err:.1e})"
            )
        for seq in decoding:
            running[seq] -= 1
            if running[seq] <= 0:
                del running[seq]
                cache.free(seq)
    wall = time.perf_counter() - t_start
    lat = np.array(latencies)
    # Throughput over the steps themselves (the float64 checks are not
    # service work).
    stats = dict(
        steps=steps,
        tokens=tokens,
        verified_steps=verified,
        seconds=round(wall, 3),
        tokens_per_s=round(tokens / (lat.sum() / 1e3), 1),
        p50_ms=round(float(np.percentile(lat, 50)), 2),
        p99_ms=round(float(np.percentile(lat, 99)), 2),
        free_pages_after=cache.num_free_pages,
        num_pages=num_pages,
    )
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "hip"])
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=1024)
    ap.add_argument("--verify-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--torch-q",
        action="store_true",
        help="pass q as a torch tensor on the session's device (output comes back there)",
    )
    args = ap.parse_args()
    session = turbine_fmha.Session(args.device, artifact_dir=args.artifacts)
    stats = run_service(
        session,
        requests=args.requests,
        max_batch=args.max_batch,
        nhead_q=32,
        nhead_k=8,
        hdim=128,
        page=16,
        num_pages=args.num_pages,
        verify_every=args.verify_every,
        seed=args.seed,
        torch_q=args.torch_q,
    )
    print(
        f"{stats['steps']} steps, {stats['tokens']} tokens ({stats['seconds']} s with the checks): "
        f"{stats['tokens_per_s']} tokens/s over the steps; "
        f"step latency p50 {stats['p50_ms']} ms, p99 {stats['p99_ms']} ms; "
        f"{stats['verified_steps']} steps verified; {stats['free_pages_after']}/{stats['num_pages']} pages free at the end"
    )
    return 0 if stats["free_pages_after"] == stats["num_pages"] else 1


if __name__ == "__main__":
    sys.exit(main())
