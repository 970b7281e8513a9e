#!/usr/bin/env python3
"""A continuous-batching step as called: decodes and chunked prefills in
one varlen (group-mode) call, against the same work as its two parts and
against torch. As-called target 2: the mixed step at most 1.2x its parts
(docs/devlog/benchmarks-history.md, "The as-called targets: where each
stood").

The step: --decodes BxN (B sequences, one new row each over N keys) and
--prefills PxR+C (P sequences of R new rows over C cached keys, bottom-right
causal), decodes first in q as vLLM orders them; fp16, GQA 32/8, head dim
128, page 16, tables as host int32, the caches and q made by np.random /
torch.randn as a user has them. Columns, wall time of calls back to back
(one torch.cuda.synchronize() per round on a GPU), rounds interleaved:

  mixed        PagedAttention.run() of the step planned once (seqstart_q),
               kv_rows_finite=True
  mixed 1-shot fmha_fwd_paged on the step (plan kept by the plan cache)
  parts        two planned runs: the decodes (batch mode, one row each) and
               the prefills (batch mode, R rows each), on views of the same q
  torch        torch gather+SDPA as a torch user writes the step: one
               batched SDPA for the decodes, one for the prefills
               (causal_lower_right), enable_gqa
  mixed/parts  the target (<= 1.2)

Every output is checked against float32 SDPA of the same inputs (explicit
boolean masks, repeat_interleave for GQA); a row fails above 5e-3.

  .venv/bin/python benchmarks/mixed_step.py --device cpu --compile-missing --cache-dir build/as-called-cpu
  python3 benchmarks/mixed_step.py --device cuda --artifacts artifacts-cuda --decodes 32x4096 --prefills 4x512+8192
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import as_called  # noqa: E402  (its timing, arrays and environment, so that the figures compare)
from as_called import PAGE, D, as_numpy, as_torch, calls_per_round, timed_rounds  # noqa: E402

import turbine_fmha  # noqa: E402  (as_called put the repository on sys.path)

HQ, HK = 32, 8
BOUND = 5e-3


def parse(spec: str, what: str, cached: bool) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)" + (r"\+(\d+)" if cached else ""), spec)
    if not m:
        raise SystemExit(f"--{what} {spec!r}: expected BxN" + ("+C" if cached else ""))
    return int(m[1]), int(m[2]), int(m[3]) if cached else 0


class Step:
    """The step's arrays: q [B + P*R, HQ, D] (decodes first), the caches,
    and the tables of the whole step and of each part."""

    def __init__(self, decodes, prefills, arrays: str, device: str, seed: int):
        rng = np.random.default_rng(seed)
        (b, n, _), (p, r, c) = decodes, prefills
        self.b, self.n, self.p, self.r, self.c = b, n, p, r, c
        keys = [n] * b + [r + c] * p
        pages = [-(-k // PAGE) for k in keys]
        self.num_pages = sum(pages) + 1
        perm = rng.permutation(self.num_pages)
        bt = np.zeros((b + p, max(pages)), np.int32)
        at = 0
        for i, k in enumerate(pages):
            bt[i, :k] = perm[at : at + k]
            at += k
        self.bt, self.sk = bt, np.array(keys, np.int32)
        self.seqstart = np.concatenate([[0], np.cumsum([1] * b + [r] * p)]).astype(np.int32)
        total = int(self.seqstart[-1])
        shapes = [(total, HQ, D), (self.num_pages, PAGE, HK, D), (self.num_pages, PAGE, HK, D)]
        if arrays == "numpy":
            self.q, self.k, self.v = (rng.standard_normal(s, dtype=np.float32).astype(np.float16) for s in shapes)
        else:
            import torch

            g = torch.Generator(device=device).manual_seed(seed)
            self.q, self.k, self.v = (torch.randn(s, dtype=torch.float16, device=device, generator=g) for s in shapes)
        # The parts' q: views of the step's, as a caller splitting it has.
        self.q_dec = self.q[:b].reshape(b, 1, HQ, D)
        self.q_pre = self.q[b:].reshape(p, r, HQ, D)
        self.device = device


def plans(session, st: Step):
    common = dict(
        num_pages=st.num_pages,
        page_block_size=PAGE,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype="f16",
        mask_type="bottom_right",
        window_size_right=0,
        kv_rows_finite=True,
    )
    mixed = turbine_fmha.PagedAttention(session).plan(st.bt, st.sk, seqstart_q=st.seqstart, **common)
    dec = turbine_fmha.PagedAttention(session).plan(st.bt[: st.b], st.sk[: st.b], seqlen_q=1, **common)
    pre = turbine_fmha.PagedAttention(session).plan(st.bt[st.b :], st.sk[st.b :], seqlen_q=st.r, **common)
    return mixed, dec, pre


class Torch:
    """torch gather+SDPA of the step (two batched calls), and the float32
    reference of every sequence."""

    def __init__(self, st: Step):
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.st = torch, F, st
        dev = st.device
        flat = lambda bt: torch.from_numpy(bt.reshape(-1).astype(np.int64)).to(dev)
        self.flat_dec, self.flat_pre = flat(st.bt[: st.b]), flat(st.bt[st.b :])
        from torch.nn.attention.bias import causal_lower_right

        self.causal = causal_lower_right(st.r, st.r + st.c)

    def gathered(self, cache, flat, batch, keys):
        return cache.index_select(0, flat).reshape(batch, -1, HK, D)[:, :keys].transpose(1, 2)

    def call(self, q, k, v):
        st, F = self.st, self.F
        numpy_in = isinstance(q, np.ndarray)
        if numpy_in:
            q, k, v = as_torch(q), as_torch(k), as_torch(v)
        qd = q[: st.b].reshape(st.b, 1, HQ, D).transpose(1, 2)
        qp = q[st.b :].reshape(st.p, st.r, HQ, D).transpose(1, 2)
        kd, vd = (self.gathered(x, self.flat_dec, st.b, st.n) for x in (k, v))
        kp, vp = (self.gathered(x, self.flat_pre, st.p, st.r + st.c) for x in (k, v))
        od = F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=self.causal, enable_gqa=True)
        out = self.torch.cat([od.transpose(1, 2).reshape(st.b, HQ, D), op.transpose(1, 2).reshape(-1, HQ, D)])
        return as_numpy(out) if numpy_in else out

    def reference(self):
        st, torch = self.st, self.torch
        q, k, v = (as_torch(a, st.device).float() for a in (st.q, st.k, st.v))
        outs = []
        for i in range(st.b + st.p):
            rows = slice(int(st.seqstart[i]), int(st.seqstart[i + 1]))
            sq, sk = rows.stop - rows.start, int(st.sk[i])
            flat = torch.from_numpy(st.bt[i].astype(np.int64)).to(st.device)
            kg, vg = (self.gathered(x, flat, 1, sk).repeat_interleave(HQ // HK, 1) for x in (k, v))
            j = torch.arange(sk, device=st.device)[None, :]
            mask = j <= torch.arange(sq, device=st.device)[:, None] + (sk - sq)
            o = self.F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], kg, vg, attn_mask=mask)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    def rel_err(self, out, ref) -> float:
        o = as_torch(np.ascontiguousarray(out), self.st.device) if isinstance(out, np.ndarray) else out
        return float((o.float() - ref).abs().max() / ref.abs().max())


def row(session, decodes, prefills, arrays: str, args) -> dict:
    st = Step(decodes, prefills, arrays, args.device, args.seed)
    mixed, dec, pre = plans(session, st)
    side = Torch(st)
    q, k, v = st.q, st.k, st.v

    def parts():
        return dec.run(st.q_dec, k, v), pre.run(st.q_pre, k, v)

    def one_shot():
        return turbine_fmha.fmha_fwd_paged(
            q, k, v, st.bt, st.sk, seqstart_q=st.seqstart, causal=True, kv_rows_finite=True, session=session
        )

    fns = {
        "mixed": lambda: mixed.run(q, k, v),
        "one_shot": one_shot,
        "parts": parts,
        "torch": lambda: side.call(q, k, v),
    }
    sync = side.torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    syncs = dict.fromkeys(fns, sync)
    ref = side.reference()
    errs = {}
    for name, fn in fns.items():
        out = fn()
        sync()
        if name == "parts":
            xp = np if isinstance(out[0], np.ndarray) else side.torch
            out = xp.concatenate([out[0].reshape(st.b, HQ, D), out[1].reshape(-1, HQ, D)])
        errs[name] = side.rel_err(out, ref)
    calls = args.calls or calls_per_round(fns, syncs, args.round_s, 3 if args.device == "cpu" else 10, 200)
    res = timed_rounds(fns, syncs, dict.fromkeys(fns, calls), args.rounds, args.warmup_s)
    ms = {name: round(m, 4) for name, (m, _) in res.items()}
    return dict(
        name=f"decodes {st.b} x {st.n} + chunked prefills {st.p} x {st.r} over {st.c}",
        arrays="numpy" if arrays == "numpy" else f"torch {args.device}",
        mixed_ms=ms["mixed"],
        one_shot_ms=ms["one_shot"],
        parts_ms=ms["parts"],
        torch_ms=ms["torch"],
        mixed_over_parts=round(ms["mixed"] / ms["parts"], 3),
        x_torch_mixed=round(ms["torch"] / ms["mixed"], 3),
        rounds_ms={name: [round(t, 4) for t in ts] for name, (_, ts) in res.items()},
        calls_per_round=calls,
        rel_err={name: float(f"{e:.3g}") for name, e in errs.items()},
        ok=max(errs.values()) <= BOUND,
        variants_mixed=[mixed._plan.variant(i, True).name for i, p in enumerate(mixed._plan.parts) if p.rows],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--compile-missing", action="store_true")
    ap.add_argument("--cache-dir", default=os.environ.get("TURBINE_FMHA_CACHE", "/tmp/turbine-fmha-as-called"))
    ap.add_argument("--decodes", default=None, help="BxN (default: cpu 8x2048, cuda 32x4096)")
    ap.add_argument("--prefills", default=None, help="PxR+C (default: cpu 1x128+1024, cuda 4x512+8192)")
    ap.add_argument("--arrays", default=None, help="cpu: comma list of numpy,torch (default both); cuda: torch")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (cpu), 7 (cuda)")
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--round-s", type=float, default=None)
    ap.add_argument("--warmup-s", type=float, default=None)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here (default $OUT/mixed_step.json when $OUT is set)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.quick = False
    args.rounds = args.rounds or (5 if cpu else 7)
    args.round_s = args.round_s or (0.3 if cpu else 0.2)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (1.0 if cpu else 0.5)
    decodes = parse(args.decodes or ("8x2048" if cpu else "32x4096"), "decodes", False)
    prefills = parse(args.prefills or ("1x128+1024" if cpu else "4x512+8192"), "prefills", True)
    kinds = (args.arrays or ("numpy,torch" if cpu else "torch")).split(",")
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    session = as_called.make_session(args)
    env = as_called.environment(args, session)
    print("# mixed continuous-batching step, as called")
    for key in ("date", "commit", "device_name", "torch", "iree_runtime", "artifacts", "torch_threads", "command"):
        print(f"- {key}: {env[key]}")
    rows = []
    for arrays in kinds:
        r = row(session, decodes, prefills, arrays, args)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "rounds_ms"}), flush=True)
    print(
        "\n| step | arrays | mixed ms | one-shot ms | parts ms | torch ms | mixed / parts | x torch (mixed) | rel err | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['arrays']} | {r['mixed_ms']:.3f} | {r['one_shot_ms']:.3f} | {r['parts_ms']:.3f} | "
            f"{r['torch_ms']:.3f} | {r['mixed_over_parts']:.2f} | {r['x_torch_mixed']:.2f} | "
            f"{max(r['rel_err'].values()):.1e} | {'ok' if r['ok'] else 'FAIL'} |"
        )
    env["load_average_at_end"] = as_called.load_average()
    path = args.json or (str(Path(os.environ["OUT"]) / "mixed_step.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
