#!/usr/bin/env python3
"""As-called benchmark: what a user of the public API gets, beside device time.

Every row times the public calls on the arrays a user has (torch CUDA
tensors on a GPU; numpy arrays and torch CPU tensors on the CPU, made by
np.random / torch.randn, not specially aligned), as wall time of calls back
to back, against torch gathering the pages through the block table
(index_select) and running F.scaled_dot_product_attention (4-D, the same
mask; enable_gqa, or repeat_interleave with --torch-gqa repeat) timed the
same way in the same process. Rounds of every column are interleaved; the
figure is the median over rounds of (wall time of N calls, then one
torch.cuda.synchronize() on the GPU) / N.

Columns (all milliseconds per call unless said):
  run(finite)  PagedAttention.run() on tables planned once with
               kv_rows_finite=True (what PagedKVCache promises)
  run()        the same plan made with kv_rows_finite=None (the default):
               each run checks the V rows past the keys (on torch
               CUDA caches behind its kernels)
  one-shot     fmha_fwd_paged with its defaults (plan + run per call)
  torch        torch gather+SDPA, as above
  x torch      torch / ours for run(finite), run(), one-shot (> 1: turbine-fmha faster)
  rate         decode: GB/s of K+V read (the used keys); prefill: TFLOP/s of
               visible (unmasked) score elements, 4 FLOPs per element per
               head-dim lane
  device       the kernels run(finite) launches, alone, on device-resident
               arguments: N calls queued back to back, one wait at the end
               (as benchmarks/bench.py times device work); it never stands
               alone, always beside the as-called columns
  err          max |out - ref| / max |ref| against float32 SDPA on the same
               inputs (explicit boolean mask, repeat_interleave for GQA), for
               every output: ours (each column, the device one included) and
               torch's; a row fails above 5e-3 (f16) or 2e-2 (bf16)

Shapes: fp16, GQA 32/8, head dim 128, page 16 unless the spec says more.
--shape SPEC (repeatable) replaces the defaults: KIND:BxN[+C][:HQ/HK][:HND][:W<left>]
with KIND decode (B sequences, N keys), prefill (B sequences of N rows,
causal) or chunked (B sequences of N new rows over C cached keys: N + C
keys, bottom-right causal); W<left> adds a sliding window of that left
side (window_size_left; torch gets the same boolean mask), also to a
decode.

--hf adds a Hugging Face Llama-shaped model step: a random model from a
LlamaConfig (nothing downloaded), HF "sdpa" with DynamicCache against
turbine_fmha.integrations.transformers with PagedCache, in the same process:
one decode step on a filled cache, the prompt forward, and generate() of
--hf-new-tokens tokens beside HF dynamic and cache_implementation="static".

No compiling unless --compile-missing: on a machine with only
iree-base-runtime, pass prebuilt artifacts with --artifacts DIR
(--list-variants prints the variants the rows select there).

  python benchmarks/as_called.py --device cpu --quick --compile-missing --cache-dir /tmp/tf-as-called
  python3 benchmarks/as_called.py --device cuda --artifacts artifacts-cuda --hf
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import turbine_fmha  # noqa: E402
from turbine_fmha.calls.plan import combine_splits, kernel_steps, repeat_rows  # noqa: E402  (device time, as bench.py)
from turbine_fmha.runtime.executor import (  # noqa: E402  (row entries, as run() places them)
    Results,
    from_entries,
    to_entries,
)

D, PAGE = 128, 16
BOUND = {"f16": 5e-3, "bf16": 2e-2}

SHAPES = {
    "cuda": [
        "decode:32x4096",
        "decode:4x32768",
        "decode:1x32768",
        "prefill:1x4096",
        "prefill:4x1024",
        "chunked:4x512+8192",
        "decode:32x4096:28/4:HND",
        "prefill:1x2048:28/4:HND",
    ],
    "cpu": ["decode:8x2048", "prefill:1x512", "chunked:2x128+1024"],
}
QUICK_SHAPES = {
    "cuda": ["decode:8x1024", "prefill:1x512", "chunked:2x128+1024", "decode:8x1024:28/4:HND"],
    "cpu": ["decode:2x256", "prefill:1x128", "chunked:2x32+128"],
}
# HF model steps: (batch, context) of the decode step and prompt forward.
HF_STEPS = {"full": [(1, 2048), (8, 512), (32, 128)], "quick": [(1, 128), (2, 64), (4, 32)]}
HF_GENERATE = {"full": (8, 512), "quick": (2, 32)}


# -- shapes ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # decode | prefill | chunked
    batch: int
    rows: int  # decode: keys; prefill: rows (= keys); chunked: new rows
    cached: int = 0  # chunked: keys before the new rows
    hq: int = 32
    hk: int = 8
    layout: str = "NHD"
    window: int = -1  # a sliding window's left side (window_size_left), -1: none

    @property
    def seqlen_q(self) -> int:
        return 1 if self.kind == "decode" else self.rows

    @property
    def seqlen_k(self) -> int:
        return self.rows + self.cached

    @property
    def causal(self) -> bool:
        return self.kind != "decode" or self.window >= 0

    @property
    def label(self) -> str:
        if self.kind == "decode":
            s = f"decode b{self.batch} x {self.rows}"
        elif self.kind == "prefill":
            s = f"prefill {self.batch} x {self.rows} causal" if self.batch > 1 else f"prefill {self.rows} causal"
        else:
            s = f"chunked prefill {self.batch} x {self.rows} over {self.cached}"
        if (self.hq, self.hk) != (32, 8):
            s += f", {self.hq}/{self.hk}"
        s += f", window {self.window}" if self.window >= 0 else ""
        return s + (f", {self.layout}" if self.layout != "NHD" else "")


def parse_shape(spec: str) -> Shape:
    parts = spec.split(":")
    kind = parts[0]
    if kind not in ("decode", "prefill", "chunked"):
        raise ValueError(f"shape {spec!r}: the kind must be decode, prefill or chunked")
    kw = {}
    for p in parts[1:]:
        m = re.fullmatch(r"(\d+)x(\d+)(?:\+(\d+))?", p)
        if m:
            kw.update(batch=int(m[1]), rows=int(m[2]), cached=int(m[3] or 0))
        elif re.fullmatch(r"\d+/\d+", p):
            kw["hq"], kw["hk"] = map(int, p.split("/"))
        elif p.upper() in ("NHD", "HND"):
            kw["layout"] = p.upper()
        elif re.fullmatch(r"W\d+", p):
            kw["window"] = int(p[1:])
        else:
            raise ValueError(f"shape {spec!r}: cannot read {p!r} (KIND:BxN[+C][:HQ/HK][:HND][:W<left>])")
    if "batch" not in kw:
        raise ValueError(f"shape {spec!r}: no BxN part")
    if (kind == "chunked") != (kw["cached"] > 0):
        raise ValueError(f"shape {spec!r}: +C (cached keys) is for chunked prefill only, and it needs one")
    return Shape(kind, **kw)


def visible_elements(sq: int, sk: int, causal: bool, window: int = -1) -> int:
    if not causal:
        return sq * sk
    shift = sk - sq  # bottom-right: row i sees keys [i + shift - window, i + shift]
    lo = (lambda i: 0) if window < 0 else (lambda i: max(0, i + shift - window))
    return sum(max(0, min(sk, i + shift + 1) - lo(i)) for i in range(sq))


# -- arrays ---------------------------------------------------------------------


def torch_dtype(name):
    import torch

    return {"f16": torch.float16, "bf16": torch.bfloat16}[name]


def numpy_dtype(name):
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def as_torch(a, device="cpu"):
    """A torch view of a numpy array (bf16 through its bits), on `device`."""
    import torch

    if isinstance(a, np.ndarray):
        t = (
            torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
            if a.dtype.name == "bfloat16"
            else torch.from_numpy(a)
        )
        return t.to(device)
    return a


def as_numpy(t):
    """A numpy view (or host copy) of a torch tensor or numpy array."""
    if isinstance(t, np.ndarray):
        return t
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(numpy_dtype("bf16"))
    return t.numpy()


def address(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.ctypes.data


@dataclasses.dataclass
class Case:
    shape: Shape
    arrays: str  # numpy | torch
    dtype: str
    device: str  # cpu | cuda
    q: object
    k: object
    v: object
    block_table: object
    seqlen_k: object
    bt_np: np.ndarray
    num_pages: int


def make_case(shape: Shape, arrays: str, dtype: str, device: str, seed: int) -> Case:
    """Random inputs as a user has them: np.random arrays or torch.randn
    tensors (never zeros: zeros can run faster than real data), no special
    alignment. Tables are host int32 (numpy for numpy rows, torch CPU
    tensors for torch rows), each sequence's pages a random permutation."""
    rng = np.random.default_rng(seed)
    b, sk = shape.batch, shape.seqlen_k
    pps = -(-sk // PAGE)
    num_pages = b * pps + 1
    bt = rng.permutation(num_pages)[: b * pps].reshape(b, pps).astype(np.int32)
    skv = np.full(b, sk, np.int32)
    page_shape = (PAGE, shape.hk, D) if shape.layout == "NHD" else (shape.hk, PAGE, D)
    q_shape = (b, shape.seqlen_q, shape.hq, D)
    if arrays == "numpy":
        dt = numpy_dtype(dtype)
        q = rng.standard_normal(q_shape, dtype=np.float32).astype(dt)
        k = rng.standard_normal((num_pages, *page_shape), dtype=np.float32).astype(dt)
        v = rng.standard_normal((num_pages, *page_shape), dtype=np.float32).astype(dt)
        tables = bt, skv
    else:
        import torch

        g = torch.Generator(device=device).manual_seed(seed)
        tdt = torch_dtype(dtype)
        q, k, v = (
            torch.randn(s, dtype=tdt, device=device, generator=g)
            for s in (q_shape, (num_pages, *page_shape), (num_pages, *page_shape))
        )
        tables = torch.from_numpy(bt), torch.from_numpy(skv)
    return Case(shape, arrays, dtype, device, q, k, v, *tables, bt, num_pages)


def mask_kwargs(shape: Shape) -> dict:
    # Causal = bottom-right (flash-attn's causal=True): with as many rows as
    # keys it is also top-left.
    return (
        dict(mask_type="bottom_right", window_size_left=shape.window, window_size_right=0)
        if shape.causal
        else dict(mask_type="none")
    )


def plan_kwargs(case: Case) -> dict:
    """PagedAttention.plan's keyword arguments for the case, its mask included
    (the tables and kv_rows_finite are the caller's)."""
    sh = case.shape
    return dict(
        num_pages=case.num_pages,
        page_block_size=PAGE,
        nhead_q=sh.hq,
        nhead_k=sh.hk,
        hdim=D,
        dtype=case.q.dtype,
        seqlen_q=sh.seqlen_q,
        kv_layout=sh.layout,
        **mask_kwargs(sh),
    )


# -- torch: the alternative and the reference -----------------------------------


class TorchSide:
    """torch gather+SDPA on the case's arrays, and the float32 reference."""

    def __init__(self, case: Case, gqa: str):
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.case, self.gqa = torch, F, case, gqa
        sh = case.shape
        self.dev = case.device
        self.flat = torch.from_numpy(case.bt_np.reshape(-1).astype(np.int64)).to(self.dev)  # once, as a service would
        self.group = sh.hq // sh.hk
        sq, sk = sh.seqlen_q, sh.seqlen_k
        self.is_causal = sh.causal and sq == sk and sh.window < 0
        self.bias, self.mask_kind = None, "is_causal" if self.is_causal else "none"
        if sh.window >= 0:  # no torch mask object for a window: a boolean one
            self.bias, self.mask_kind = self.bool_mask(), "bool"
        elif sh.causal and sq != sk:
            try:
                from torch.nn.attention.bias import causal_lower_right

                self.bias, self.mask_kind = causal_lower_right(sq, sk), "causal_lower_right"
            except ImportError:  # older torch: a materialized boolean mask
                self.bias, self.mask_kind = self.bool_mask(), "bool"

    def bool_mask(self):
        sh = self.case.shape
        sq, sk = sh.seqlen_q, sh.seqlen_k
        i = self.torch.arange(sq, device=self.dev)[:, None]
        j = self.torch.arange(sk, device=self.dev)[None, :]
        visible = j <= i + (sk - sq)
        return visible & (j >= i + (sk - sq) - sh.window) if sh.window >= 0 else visible

    def gathered(self, cache):
        """[batch, nhead_k, keys, dim] from the pages of the block table."""
        sh = self.case.shape
        b, sk, hk = sh.batch, sh.seqlen_k, sh.hk
        pages = cache.index_select(0, self.flat)
        if sh.layout == "HND":
            return pages.reshape(b, -1, hk, PAGE, D).transpose(1, 2).reshape(b, hk, -1, D)[:, :, :sk]
        return pages.reshape(b, -1, hk, D)[:, :sk].transpose(1, 2)

    def call(self, q, k, v):
        """One call as a torch user makes it: returns [b, sq, hq, d] (a
        numpy array for numpy inputs, through zero-copy views)."""
        numpy_in = isinstance(q, np.ndarray)
        if numpy_in:
            q, k, v = as_torch(q), as_torch(k), as_torch(v)
        kg, vg = self.gathered(k), self.gathered(v)
        kw = {}
        if self.gqa == "repeat" and self.group > 1:
            kg, vg = kg.repeat_interleave(self.group, 1), vg.repeat_interleave(self.group, 1)
        elif self.group > 1:
            kw["enable_gqa"] = True
        out = self.F.scaled_dot_product_attention(
            q.transpose(1, 2), kg, vg, attn_mask=self.bias, is_causal=self.is_causal, **kw
        ).transpose(1, 2)
        return as_numpy(out) if numpy_in else out

    def reference(self):
        """float32 SDPA of the same inputs: explicit boolean mask,
        repeat_interleave for GQA."""
        c = self.case
        q, k, v = (as_torch(a, self.dev) for a in (c.q, c.k, c.v))
        kg = self.gathered(k).float().repeat_interleave(self.group, 1)
        vg = self.gathered(v).float().repeat_interleave(self.group, 1)
        mask = self.bool_mask() if c.shape.causal else None
        out = self.F.scaled_dot_product_attention(q.float().transpose(1, 2), kg, vg, attn_mask=mask)
        return out.transpose(1, 2).contiguous()

    def rel_err(self, out, ref) -> float:
        o = as_torch(np.ascontiguousarray(out), self.dev) if isinstance(out, np.ndarray) else out
        o = o.to(self.dev).float()
        return float((o - ref).abs().max() / ref.abs().max())

    def sync(self):
        if self.dev == "cuda":
            self.torch.cuda.synchronize()


# -- ours -----------------------------------------------------------------------


class DeviceLoop:
    """The kernels of a plan's run(finite), alone: their arguments put on the
    device once (q and tables by IREE's upload, the caches imported from the
    user's torch CUDA tensors or copied into device memory on the CPU), then
    the calls queued back to back and one wait, as bench.py times device
    work (chained on the CPU, unchained on a GPU)."""

    def __init__(self, session, attn, case: Case):
        import iree.runtime as rt

        if attn._plan.plan.mixed:
            raise NotImplementedError("device time of a mixed batch")
        if attn._plan.plan.tiles is not None:
            self._tiles(session, attn._plan.plan, case)
            return
        plan = attn._plan.parts[0]
        self.plan, self.session = plan, session
        self.variant = attn._plan.variant(0, plan.guard_free)  # what run() with kv_rows_finite=True selects
        self.steps = kernel_steps(self.variant, plan.call)
        dev = session.device_of()
        q = np.ascontiguousarray(as_numpy(case.q))
        self.split = plan.splits > max(1, plan.merge)  # partials merged on the host by run()
        qb = repeat_rows(q, plan.splits) if self.split else q
        if plan.entries:  # the prefill's rows as entries of 128 (plan.row_entries)
            qb = to_entries(qb, plan.entries, qb.dtype, Results(session))
        if case.device == "cuda":
            kd, vd = session.import_torch(case.k), session.import_torch(case.v)
        else:
            kd, vd = (session.device_array(np.ascontiguousarray(as_numpy(a))) for a in (case.k, case.v))
        self.calls = [
            [
                rt.asdevicearray(dev, st.q(qb)),
                kd,
                vd,
                *[rt.asdevicearray(dev, np.ascontiguousarray(a)) for a in st.args],
            ]
            for st in self.steps
        ]
        self.loaded = [session._load(self.variant)] * len(self.calls)  # one module per call
        self.transient_bytes = 0
        self.chain = session.device == "cpu"
        self.last = []
        self.q_shape, self.q_dtype = q.shape, q.dtype

    def _tiles(self, session, plan, case: Case):
        """The calls of a prefill through contiguous tiles, one kernel each."""
        import iree.runtime as rt

        dev = session.device_of()
        q = np.ascontiguousarray(as_numpy(case.q))
        self.variant, self.split, self.plan = plan.tiles[0].kernel, False, None
        self.steps = [None] * len(plan.tiles)
        if case.device == "cuda":
            kd, vd = session.import_torch(case.k), session.import_torch(case.v)
        else:
            kd, vd = (session.device_array(np.ascontiguousarray(as_numpy(a))) for a in (case.k, case.v))
        qf = q.reshape((-1,) + q.shape[-2:])
        self.calls = [
            [rt.asdevicearray(dev, qf[c.start : c.stop]), kd, vd, *[rt.asdevicearray(dev, a) for a in c.plan.args]]
            for c in plan.tiles
        ]
        self.loaded = [session._load(c.kernel) for c in plan.tiles]
        self.transient_bytes = sum(_tiles_transient_bytes(c, q.dtype.itemsize) for c in plan.tiles)
        self.chain = session.device == "cpu"
        self.last = []
        self.q_shape, self.q_dtype = q.shape, q.dtype

    def __call__(self):
        prev = self.last[-1] if self.last and self.chain else None
        self.last.clear()
        for lk, args in zip(self.loaded, self.calls):
            prev = lk.enqueue(args, after=prev if self.chain else None)
            self.last.append(prev)

    def wait(self):
        for c in self.last:
            c.wait()

    def output(self) -> np.ndarray:
        """The last call's output on the host, placed and merged as run() does."""
        self.wait()
        b, rows, hq, dv = self.q_shape
        plan = self.plan
        if plan is None:  # the tiles' calls: q's rows, in order
            return np.concatenate([c.results(1)[0].to_host() for c in self.last]).reshape(self.q_shape)
        n = plan.call.batch
        if self.split:
            dst = [np.empty((n, rows, hq, dv), self.q_dtype)] + [np.empty((n, hq, rows), np.float32) for _ in range(3)]
        elif plan.entries:
            r = plan.call.rows
            dst = [np.empty((n, r, hq, dv), self.q_dtype), np.empty((n, hq, r), np.float32)]
        else:
            dst = [np.empty((b, rows, hq, dv), self.q_dtype), np.empty((b, hq, rows), np.float32)]
        for st, c in zip(self.steps, self.last):
            st.place(dst, [r.to_host() for r in c.results(len(dst))])
        if self.split:
            return combine_splits(*dst, plan.splits, None)[0]
        if plan.entries:
            return from_entries(dst[0], dst[1], plan.entries, rows)[0]
        return dst[0]


def _tiles_transient_bytes(call, itemsize: int) -> int:
    """What one tile call allocates while it runs: its f32 partials, the
    K/V region and the head-major q tiles."""
    k = call.kernel
    slots, q_rows = call.plan.args[0], call.plan.args[2]
    region = 2 * slots.shape[0] * k.page_block_size * k.nhead_k * k.hdim * itemsize
    q_tiles = q_rows.size * k.nhead_q * k.hdim * itemsize
    return call.plan.partial_bytes(k.nhead_q, k.hdim) + region + q_tiles


def _cuda_pool_bytes() -> int:
    """What IREE's CUDA caching pool holds at most (the session's caching
    allocator spec, caching:device_local=<largest>;<capacity>;<count>, the
    environment's override included); queued calls whose transients pass
    it pay a plain cuMemAlloc and a synchronizing cuMemFree each."""
    from turbine_fmha.runtime.session import cuda_allocator_specs

    caching = next(s for s in cuda_allocator_specs() if s.startswith("caching:"))
    capacity = caching.split("=", 1)[1].split(";")[1].lower()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    return int(capacity[:-3]) * units[capacity[-3:]] if capacity[-3:] in units else int(capacity)


# -- timing ---------------------------------------------------------------------


def timed_rounds(fns: dict, syncs: dict, calls: dict, rounds: int, warmup_s: float) -> dict:
    """Median over `rounds` of (wall time of calls[name] calls back to
    back, then one sync) / calls[name], in ms, per entry of fns; every
    round times each entry once, in an order rotated per round."""
    for name, fn in fns.items():
        t_end = time.perf_counter() + warmup_s
        n = 0
        while n < 2 or time.perf_counter() < t_end:
            fn()
            syncs[name]()
            n += 1
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, sync, n = fns[name], syncs[name], calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3 / n)
    return {name: (statistics.median(ts), ts) for name, ts in times.items()}


def calls_per_round(fns: dict, syncs: dict, target_s: float, lo: int, hi: int) -> int:
    """Calls per round so that the slowest column's round takes ~target_s."""
    worst = 0.0
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        syncs[name]()
        worst = max(worst, time.perf_counter() - t0)
    return int(min(hi, max(lo, round(target_s / max(worst, 1e-6)))))


# -- one row --------------------------------------------------------------------


def bench_row(session, case: Case, args) -> dict:
    sh = case.shape
    kw = mask_kwargs(sh)
    side = TorchSide(case, args.torch_gqa)
    noop = lambda: None
    plan_args = plan_kwargs(case)
    attn_f = turbine_fmha.PagedAttention(session).plan(
        case.block_table, case.seqlen_k, kv_rows_finite=True, **plan_args
    )
    attn_d = turbine_fmha.PagedAttention(session).plan(case.block_table, case.seqlen_k, **plan_args)
    q, k, v = case.q, case.k, case.v
    variants = {}

    def run_f():
        return attn_f.run(q, k, v)

    def run_d():
        return attn_d.run(q, k, v)

    def one_shot():
        return turbine_fmha.fmha_fwd_paged(
            q, k, v, case.block_table, case.seqlen_k, session=session, device=session.device, kv_layout=sh.layout, **kw
        )

    fns = {"run_finite": run_f, "run_default": run_d, "one_shot": one_shot, "torch": lambda: side.call(q, k, v)}
    sync = side.sync if case.device == "cuda" else noop
    syncs = dict.fromkeys(fns, sync)

    # Verify first (this also loads, or with --compile-missing compiles, the kernels).
    ref = side.reference()
    errs = {}
    for name, fn in fns.items():
        out = fn()
        sync()
        errs[name] = side.rel_err(out, ref)
        if name != "torch":
            variants[name] = session.last_variant.name if session.last_variant else None
    loop = DeviceLoop(session, attn_f, case)
    loop()
    errs["device"] = side.rel_err(loop.output(), ref)
    del ref
    fns["device"] = loop
    syncs["device"] = loop.wait

    # At most 200 calls a round: the device column queues them all before
    # one wait, and IREE's CUDA pool keeps 256 call buffers
    # (runtime.session.DEFAULT_CUDA_ALLOCATORS).
    calls = args.calls or calls_per_round(fns, syncs, args.round_s, 3 if case.device == "cpu" else 10, 200)
    per_name = dict.fromkeys(fns, calls)
    if case.device != "cpu":
        # The device column holds every queued kernel call's buffers until
        # its one wait. IREE's CUDA pool retains at most 256 buffers and 2
        # GiB, and never evicts: 128 calls in flight filled it with this
        # row's sizes, and the later rows' run() calls then paid a plain
        # cuMemAlloc and a device-synchronizing cuMemFree per buffer, which
        # slowed even their device time (docs/devlog/perf-notes.md,
        # "Performance as called", item "The entries rule on the device, and
        # a slowdown that was the pool"). 32 calls keep them well inside it.
        per_name["device"] = max(1, min(calls, 32 // len(loop.steps)))
        if loop.transient_bytes:  # the prefill tiles: their partials in flight
            per_name["device"] = max(1, min(per_name["device"], _cuda_pool_bytes() // loop.transient_bytes))
    res = timed_rounds(fns, syncs, per_name, args.rounds, args.warmup_s)
    ms = {k_: round(m, 4) for k_, (m, _) in res.items()}
    bound = BOUND[case.dtype]
    ours_err = max(errs[n] for n in ("run_finite", "run_default", "one_shot", "device"))
    b, sq, sk = sh.batch, sh.seqlen_q, sh.seqlen_k
    if sh.kind == "decode":
        used = sk if sh.window < 0 else min(sk, sh.window + 1)
        unit, work = "GB/s", b * used * sh.hk * 2 * D * numpy_dtype(case.dtype).itemsize / 1e9
    else:
        unit, work = "TFLOP/s", 4.0 * b * sh.hq * D * visible_elements(sq, sk, True, sh.window) / 1e12
    row = dict(
        name=sh.label,
        kind=sh.kind,
        arrays=f"{'torch ' + case.device if case.arrays == 'torch' else 'numpy'}",
        device=case.device,
        dtype=case.dtype,
        batch=b,
        seqlen_q=sq,
        seqlen_k=sk,
        cached=sh.cached,
        nhead_q=sh.hq,
        nhead_k=sh.hk,
        hdim=D,
        page=PAGE,
        kv_layout=sh.layout,
        causal=sh.causal,
        cache_aligned_64=address(case.k) % 64 == 0 and address(case.v) % 64 == 0,
        variant_run_finite=variants["run_finite"],
        variant_run_default=variants["run_default"],
        variant_one_shot=variants["one_shot"],
        variant_device=loop.variant.name,
        kernel_calls=len(loop.steps),
        num_splits=attn_f._plan.parts[0].splits,
        merged_in_module=bool(getattr(loop.variant, "merge_splits", 0)),
        calls_per_round=calls,
        device_calls_per_round=per_name["device"],
        rounds=args.rounds,
        run_finite_ms=ms["run_finite"],
        run_default_ms=ms["run_default"],
        one_shot_ms=ms["one_shot"],
        torch_ms=ms["torch"],
        device_ms=ms["device"],
        rounds_ms={k_: [round(t, 4) for t in ts] for k_, (_, ts) in res.items()},
        unit=unit,
        rel_err={k_: float(f"{e:.3g}") for k_, e in errs.items()},
        rel_err_ours=float(f"{ours_err:.3g}"),
        bound=bound,
        ok=ours_err <= bound and errs["torch"] <= bound,
        torch_gqa=args.torch_gqa,
        torch_mask=side.mask_kind,
    )
    for key in ("run_finite", "run_default", "one_shot"):
        row[f"x_torch_{key}"] = round(ms["torch"] / ms[key], 3)
    for key in ("run_finite", "run_default", "one_shot", "torch", "device"):
        row[f"{key}_rate"] = round(work / (ms[key] * 1e-3), 4)
    return row


def fmt_rate(x: float) -> str:
    return f"{x:.3g}"


def print_table(rows: list[dict]) -> None:
    print(
        "| row | arrays | run(finite) ms | run() ms | one-shot ms | torch gather+SDPA ms | x torch: run(finite) / run() / one-shot "
        "| rate: run(finite) / torch | device ms (rate) | max rel err: ours / torch | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['arrays']} | FAILED: {r['error']} |" + " |" * 8)
            continue
        print(
            f"| {r['name']} | {r['arrays']} | {r['run_finite_ms']:.3f} | {r['run_default_ms']:.3f} | "
            f"{r['one_shot_ms']:.3f} | {r['torch_ms']:.3f} | "
            f"{r['x_torch_run_finite']:.2f} / {r['x_torch_run_default']:.2f} / {r['x_torch_one_shot']:.2f} | "
            f"{fmt_rate(r['run_finite_rate'])} / {fmt_rate(r['torch_rate'])} {r['unit']} | "
            f"{r['device_ms']:.3f} ({fmt_rate(r['device_rate'])} {r['unit']}) | "
            f"{r['rel_err_ours']:.1e} / {r['rel_err']['torch']:.1e} | {'ok' if r['ok'] else 'FAIL'} |"
        )


# -- variants a run needs -------------------------------------------------------


def list_variants(args, shapes) -> int:
    """For each row: the variant run(finite) selects from --artifacts
    without compiling, or 'missing' and what a compiling session would
    build. Plans only: nothing runs, so no device is needed."""
    import tempfile

    from turbine_fmha import ArtifactError

    plain = make_session(args, compile_missing=False)
    with tempfile.TemporaryDirectory() as tmp:
        compiling = turbine_fmha.Session(
            args.device, artifact_dir=plain.artifact_dir, compile_missing=True, cache_dir=tmp
        )
        missing = []
        problems = [(sh.label, sh, args.dtype) for sh in shapes]
        for label, sh, dtype in problems + hf_problems(args):
            kw = mask_kwargs(sh)
            pps = -(-sh.seqlen_k // PAGE)
            bt = np.arange(sh.batch * pps, dtype=np.int32).reshape(sh.batch, pps)
            sk = np.full(sh.batch, sh.seqlen_k, np.int32)
            plan_args = dict(
                num_pages=sh.batch * pps,
                page_block_size=PAGE,
                nhead_q=sh.hq,
                nhead_k=sh.hk,
                hdim=D,
                dtype=dtype,
                seqlen_q=sh.seqlen_q,
                kv_layout=sh.layout,
                kv_rows_finite=True,
                **kw,
            )
            try:
                e = turbine_fmha.PagedAttention(plain).plan(bt, sk, **plan_args)._plan
                p = e.parts[0]
                print(f"{label} ({dtype}): {e.variant(0, p.guard_free).name} ({p.splits} splits)")
            except ArtifactError:
                e = turbine_fmha.PagedAttention(compiling).plan(bt, sk, **plan_args)._plan
                name = e.variant(0, e.parts[0].guard_free).name
                missing.append(name)
                print(f"{label} ({dtype}): missing in {plain.artifact_dir}; a compiling session builds {name}")
    if missing:
        print("to build: " + ",".join(sorted(set(missing))))
    return 1 if missing else 0


def hf_problems(args) -> list:
    """The attention calls of the --hf model steps (decode and prefill of
    each step shape, and the generate shape), for --list-variants."""
    if not args.hf:
        return []
    mode = "quick" if args.quick else "full"
    dtype = "f32" if args.device == "cpu" else args.dtype
    out = []
    for b, n in HF_STEPS[mode] + [HF_GENERATE[mode]]:
        # A decode step of the HF integration: one row, bottom-right causal.
        out.append((f"hf decode b{b} x {n}", Shape("chunked", b, 1, cached=n), dtype))
        out.append((f"hf prompt b{b} x {n}", Shape("prefill", b, n), dtype))
    return out


# -- Hugging Face model step ----------------------------------------------------


def hf_bench(session, args) -> dict:
    try:
        import torch
        import transformers
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        msg = f"--hf skipped: transformers is not importable here ({e})"
        print(msg)
        return dict(skipped=msg)
    from turbine_fmha.integrations import transformers as fmha_hf

    mode = "quick" if args.quick else "full"
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    dtype = torch.float32 if args.device == "cpu" else torch_dtype(args.dtype)
    hidden = args.hf_hidden or (512 if args.quick else 4096)
    inter = args.hf_intermediate or (512 if args.quick else 1024)
    init = args.hf_init if args.hf_init is not None else (0.2 if dtype == torch.float32 else 0.02)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=args.hf_vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=args.hf_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).to(dtype).to(dev).eval()
    info = dict(
        transformers=transformers.__version__,
        layers=args.hf_layers,
        hidden=hidden,
        intermediate=inter,
        vocab=args.hf_vocab,
        heads="32/8",
        head_dim=128,
        dtype=str(dtype).replace("torch.", ""),
        initializer_range=init,
        page=PAGE,
    )
    print(
        f"\nHF model: Llama config, {args.hf_layers} layers, hidden {hidden}, intermediate {inter}, "
        f"vocab {args.hf_vocab}, 32/8 heads of 128, {info['dtype']} on {dev}; transformers {transformers.__version__}"
    )

    def sync():
        if dev != "cpu":
            torch.cuda.synchronize()

    def sdpa():
        model.set_attn_implementation("sdpa")

    def ours():
        fmha_hf.enable(model)

    def dynamic_cache():
        try:
            return DynamicCache(config=model.config)
        except TypeError:
            return DynamicCache()

    def paged_cache(b, n):
        return fmha_hf.PagedCache(session=session, num_pages=b * (-(-(n + 64) // PAGE) + 1), device_pool=pool)

    pool = True if args.hf_device_pool else None  # None: on the device for GPU sessions, host memory on the CPU
    info["device_pool"] = args.device != "cpu" or args.hf_device_pool
    rounds = args.rounds
    steps = []
    with torch.no_grad():

        def one_step(b, n):
            prompt = torch.randint(0, args.hf_vocab, (b, n), device=dev)
            caches = {}
            tok = None
            for name, switch, make in (("hf", sdpa, dynamic_cache), ("ours", ours, lambda: paged_cache(b, n))):
                switch()
                caches[name] = make()
                out = model(prompt, past_key_values=caches[name], use_cache=True)
                tok = out.logits[:, -1:].argmax(-1) if tok is None else tok
            sync()
            calls = args.calls or (3 if args.device == "cpu" else 10)
            step_ms = {"hf": [], "ours": []}
            prompt_ms = {"hf": [], "ours": []}
            for r in range(rounds + 1):  # round 0 warms up
                for name, switch, make in (("hf", sdpa, dynamic_cache), ("ours", ours, lambda: paged_cache(b, n)))[
                    :: 1 if r % 2 else -1
                ]:
                    switch()
                    cache = caches[name]
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        model(tok, past_key_values=cache, use_cache=True)
                    sync()
                    t = (time.perf_counter() - t0) * 1e3 / calls
                    cache.crop(-calls)  # back to n keys: every round decodes at the same length
                    if cache.get_seq_length() != n:
                        raise RuntimeError(f"{name}: the cache holds {cache.get_seq_length()} keys after crop, not {n}")
                    t0 = time.perf_counter()
                    for _ in range(max(1, calls // 3)):
                        model(prompt, past_key_values=make(), use_cache=True)
                    sync()
                    tp = (time.perf_counter() - t0) * 1e3 / max(1, calls // 3)
                    if r:
                        step_ms[name].append(t)
                        prompt_ms[name].append(tp)
            row = dict(
                batch=b,
                context=n,
                calls_per_round=calls,
                rounds=rounds,
                decode_hf_ms=round(statistics.median(step_ms["hf"]), 3),
                decode_ours_ms=round(statistics.median(step_ms["ours"]), 3),
                prompt_hf_ms=round(statistics.median(prompt_ms["hf"]), 3),
                prompt_ours_ms=round(statistics.median(prompt_ms["ours"]), 3),
                rounds_ms=dict(decode=step_ms, prompt=prompt_ms),
            )
            row["decode_x_hf"] = round(row["decode_hf_ms"] / row["decode_ours_ms"], 3)
            row["prompt_x_hf"] = round(row["prompt_hf_ms"] / row["prompt_ours_ms"], 3)
            del caches
            return row

        for b, n in HF_STEPS[mode]:
            try:
                row = one_step(b, n)
            except Exception as e:  # this shape fails, the others and generate still run
                traceback.print_exc()
                row = dict(batch=b, context=n, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            steps.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds_ms"}), flush=True)

        # generate: HF dynamic, HF static, ours.
        b, n = HF_GENERATE[mode]
        new = args.hf_new_tokens
        prompt = torch.randint(0, args.hf_vocab, (b, n), device=dev)
        gen_kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        static_kw = dict(cache_implementation="static")
        if args.hf_static_no_compile:
            static_kw["disable_compile"] = True

        def gen_hf():
            sdpa()
            return model.generate(prompt, **gen_kw)

        def gen_static():
            sdpa()
            return model.generate(prompt, **gen_kw, **static_kw)

        def gen_ours():
            return fmha_hf.generate(
                model, prompt, session=session, num_pages=b * (-(-(n + new) // PAGE) + 1), device_pool=pool, **gen_kw
            )

        def gen_hf_no_cudnn():
            # torch's cuDNN attention builds a plan for every new key length,
            # which costs far more than the step's attention
            # (docs/devlog/perf-notes.md, "Performance as called", item "HF
            # in generation, and an exported HF-shaped step"): without it,
            # HF's dynamic cache at its best.
            torch.backends.cuda.enable_cudnn_sdp(False)
            try:
                return gen_hf()
            finally:
                torch.backends.cuda.enable_cudnn_sdp(True)

        gens = {"hf_dynamic": gen_hf, "hf_static": gen_static, "ours": gen_ours}
        if dev != "cpu":
            gens["hf_dynamic_no_cudnn"] = gen_hf_no_cudnn
        seqs, t_first, gen_errors = {}, {}, {}
        for name, fn in list(gens.items()):  # warm-up (transformers may compile the static one on a GPU)
            t0 = time.perf_counter()
            try:
                seqs[name] = fn()
                sync()
            except Exception as e:  # reported, and the others still timed
                gen_errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"generate, {name}: failed: {gen_errors[name]}", flush=True)
                del gens[name]
                continue
            t_first[name] = round(time.perf_counter() - t0, 3)
        gen_ms = {name: [] for name in gens}
        names = list(gens)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                gens[name]()
                sync()
                gen_ms[name].append((time.perf_counter() - t0) * 1e3)
        gen = dict(
            batch=b,
            prompt=n,
            new_tokens=new,
            rounds=rounds,
            first_call_s=t_first,
            errors=gen_errors,
            static_auto_compile=dev != "cpu" and not args.hf_static_no_compile,
            rounds_ms=gen_ms,
            **{
                f"{k}_ms": round(statistics.median(gen_ms[k]), 2) if gen_ms.get(k) else None
                for k in ("hf_dynamic", "hf_dynamic_no_cudnn", "hf_static", "ours")
            },
        )
        for key in ("hf_dynamic", "hf_dynamic_no_cudnn", "hf_static"):
            a, o = gen[f"{key}_ms"], gen["ours_ms"]
            gen[f"ours_x_{key}"] = round(a / o, 3) if a and o else None
        for key, name in (("tokens_equal_hf_sdpa_dynamic", "hf_dynamic"), ("tokens_equal_hf_static", "hf_static")):
            gen[key] = bool(torch.equal(seqs[name], seqs["ours"])) if name in seqs and "ours" in seqs else None

        check = None
        if dtype == torch.float32 and "ours" in seqs:
            # HF eager fp32 against ours: the tokens must be identical.
            model.set_attn_implementation("eager")
            eager = model.generate(prompt, **gen_kw)
            check = dict(
                reference="HF eager fp32",
                tokens_equal=bool(torch.equal(eager, seqs["ours"])),
                first_tokens_hf_eager=eager[0, n : n + 8].tolist(),
                first_tokens_ours=seqs["ours"][0, n : n + 8].tolist(),
            )
    print()
    print("| HF model step | HF sdpa + DynamicCache ms | turbine-fmha + PagedCache ms | x HF |")
    print("|---|---|---|---|")
    for s in steps:
        if "error" in s:
            print(f"| b{s['batch']} x {s['context']} | FAILED: {s['error']} | | |")
            continue
        print(
            f"| decode step b{s['batch']} x {s['context']} | {s['decode_hf_ms']:.2f} | {s['decode_ours_ms']:.2f} | {s['decode_x_hf']:.2f} |"
        )
        print(
            f"| prompt forward b{s['batch']} x {s['context']} | {s['prompt_hf_ms']:.2f} | {s['prompt_ours_ms']:.2f} | {s['prompt_x_hf']:.2f} |"
        )
    print()
    print(
        f"| generate b{b} x {n} + {new} tokens | HF sdpa dynamic ms | HF static ms{' (auto-compiled)' if gen['static_auto_compile'] else ''} | "
        "turbine-fmha ms | x HF dynamic | x HF static | tokens equal (ours vs HF dynamic / static) |"
    )
    print("|---|---|---|---|---|---|---|")

    def cell(x, f):
        return "failed" if x is None else format(x, f)

    print(
        f"| generate | {cell(gen['hf_dynamic_ms'], '.1f')} | {cell(gen['hf_static_ms'], '.1f')} | "
        f"{cell(gen['ours_ms'], '.1f')} | {cell(gen['ours_x_hf_dynamic'], '.2f')} | "
        f"{cell(gen['ours_x_hf_static'], '.2f')} | "
        f"{gen['tokens_equal_hf_sdpa_dynamic']} / {gen['tokens_equal_hf_static']} |"
    )
    if gen.get("hf_dynamic_no_cudnn_ms") is not None:
        print(
            f"HF sdpa dynamic with torch's cuDNN attention off: {gen['hf_dynamic_no_cudnn_ms']:.1f} ms "
            f"(turbine-fmha x it: {cell(gen['ours_x_hf_dynamic_no_cudnn'], '.2f')})"
        )
    if check:
        print(
            f"\ntokens, HF eager fp32 vs turbine-fmha fp32 ({new} new tokens x {b} sequences): "
            f"{'identical' if check['tokens_equal'] else 'DIFFER'}"
        )
    return dict(model=info, steps=steps, generate=gen, token_check=check)


# -- run ------------------------------------------------------------------------


def make_session(args, compile_missing=None):
    compile_missing = args.compile_missing if compile_missing is None else compile_missing
    artifacts = args.artifacts or (args.cache_dir if args.compile_missing else None)
    if artifacts is None:
        raise SystemExit("pass --artifacts DIR (prebuilt artifacts), or --compile-missing [--cache-dir DIR]")
    return turbine_fmha.Session(
        args.device,
        artifact_dir=artifacts,
        compile_missing=compile_missing,
        cache_dir=args.cache_dir if compile_missing else None,
        prefill_tiles={"on": True, "off": False}.get(args.prefill_tiles),
    )


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(
                ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("TURBINE_FMHA_COMMIT")


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical CPUs)"


def load_average():
    """The host's 1/5/15-minute load averages (other work on a shared
    machine skews every column, torch's threads most)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(args, session) -> dict:
    import iree.runtime.version
    import torch

    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        device=args.device,
        device_name=device_name(args.device),
        python=platform.python_version(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        iree_runtime=iree.runtime.version.VERSION,
        turbine_fmha=turbine_fmha.__version__,
        turbine_fmha_path=str(Path(turbine_fmha.__file__).parent),
        artifacts=str(session.artifact_dir),
        compile_missing=args.compile_missing,
        compute_units=session.compute_units,
        quick=args.quick,
        command=" ".join(sys.argv),
        load_average_at_start=load_average(),
    )
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--artifacts", default=None, help="prebuilt artifact directory (Session(device, artifact_dir=DIR))")
    ap.add_argument(
        "--compile-missing", action="store_true", help="compile variants missing from --artifacts into --cache-dir"
    )
    ap.add_argument(
        "--cache-dir",
        default=os.environ.get("TURBINE_FMHA_CACHE", "/tmp/turbine-fmha-as-called"),
        help="where --compile-missing compiles (default $TURBINE_FMHA_CACHE, else %(default)s)",
    )
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU smoke runs)")
    ap.add_argument(
        "--shape",
        action="append",
        default=None,
        metavar="SPEC",
        help="a row, KIND:BxN[+C][:HQ/HK][:HND][:W<left>] (repeatable; replaces the defaults)",
    )
    ap.add_argument("--arrays", default=None, help="cpu: comma list of numpy,torch (default both); cuda: torch")
    ap.add_argument("--dtype", choices=sorted(BOUND), default="f16")
    ap.add_argument("--calls", type=int, default=None, help="calls per round (default: ~--round-s per round)")
    ap.add_argument("--round-s", type=float, default=None, help="target seconds per round (default 0.2 cuda, 0.3 cpu)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per column (default 7 cuda, 3 cpu)")
    ap.add_argument(
        "--warmup-s", type=float, default=None, help="warm-up seconds per column (default 0.5; cpu 1.0, quick 0.3)"
    )
    ap.add_argument(
        "--torch-gqa",
        choices=["enable", "repeat"],
        default="enable",
        help="torch's GQA: SDPA's enable_gqa, or K/V repeat_interleave'd to the query heads",
    )
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prefill-tiles",
        choices=["on", "off", "default"],
        default="default",
        help="Session(prefill_tiles=): prefill through contiguous tiles (default: the target's own, on for GPUs)",
    )
    ap.add_argument("--json", default=None, help="write the rows here (default $OUT/as_called.json when $OUT is set)")
    ap.add_argument("--list-variants", action="store_true", help="print the variants the rows select, run nothing")
    ap.add_argument("--hf", action="store_true", help="also time a Llama-shaped HF model step (needs transformers)")
    ap.add_argument("--hf-only", action="store_true", help="only the --hf part")
    ap.add_argument("--hf-layers", type=int, default=4)
    ap.add_argument("--hf-hidden", type=int, default=None, help="default 4096 (quick: 512)")
    ap.add_argument("--hf-intermediate", type=int, default=None, help="default 1024 (quick: 512)")
    ap.add_argument("--hf-vocab", type=int, default=1024)
    ap.add_argument("--hf-init", type=float, default=None, help="initializer_range (default 0.2 in fp32, 0.02 in fp16)")
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument(
        "--hf-device-pool",
        action="store_true",
        help="PagedCache(device_pool=True) on the CPU too (a GPU session's default; needs the append kernels)",
    )
    ap.add_argument(
        "--hf-static-no-compile",
        action="store_true",
        help="generate(cache_implementation='static') with disable_compile=True (a GPU auto-compiles it otherwise)",
    )
    args = ap.parse_args()
    args.hf = args.hf or args.hf_only
    cpu = args.device == "cpu"
    args.rounds = args.rounds or (3 if cpu else 7)
    args.round_s = args.round_s or (0.3 if cpu else 0.2)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else ((0.3 if args.quick else 1.0) if cpu else 0.5)
    specs = args.shape or (QUICK_SHAPES if args.quick else SHAPES)[args.device]
    shapes = [parse_shape(s) for s in specs]
    arrays_kinds = (args.arrays or ("numpy,torch" if cpu else "torch")).split(",")
    if not cpu and arrays_kinds != ["torch"]:
        raise SystemExit("--device cuda takes torch CUDA tensors (--arrays torch)")
    if any(a not in ("numpy", "torch") for a in arrays_kinds):
        raise SystemExit("--arrays: numpy and/or torch")
    if args.list_variants:
        return list_variants(args, shapes)

    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    session = make_session(args)
    env = environment(args, session)
    print("# as-called benchmark" + (" (quick: smoke-run shapes)" if args.quick else ""))
    for key in (
        "date",
        "commit",
        "device_name",
        "python",
        "torch",
        "transformers",
        "iree_runtime",
        "turbine_fmha_path",
        "artifacts",
        "compute_units",
        "torch_threads",
        "load_average_at_start",
    ):
        print(f"- {key}: {env[key]}")
    print(flush=True)
    rows = []
    failed = False
    if not args.hf_only:
        for i, sh in enumerate(shapes):
            for arrays in arrays_kinds:
                case = make_case(sh, arrays, args.dtype, args.device, args.seed + i)
                if args.device != "cpu":
                    # Each row from an empty pool, as in a fresh process.
                    session.device_of().allocator.trim()
                try:
                    row = bench_row(session, case, args)
                except Exception as e:  # the row fails, the others still run (a GPU lease is short)
                    what = "no artifact" if isinstance(e, turbine_fmha.ArtifactError) else type(e).__name__
                    first = str(e).splitlines()[0] if str(e) else ""
                    print(f"{sh.label}, {arrays}: FAILED, {what}: {first}", flush=True)
                    if not isinstance(e, turbine_fmha.ArtifactError):
                        traceback.print_exc()
                    rows.append(
                        dict(
                            name=sh.label,
                            arrays="numpy" if arrays == "numpy" else f"torch {args.device}",
                            error=f"{what}: {first}",
                            ok=False,
                        )
                    )
                    failed = True
                    continue
                del case
                failed |= not row["ok"]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "rounds_ms"}), flush=True)
        print()
        print_table(rows)
    hf = None
    if args.hf:
        try:
            hf = hf_bench(session, args)
        except Exception as e:
            traceback.print_exc()
            hf = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(f"--hf FAILED: {hf['error']}", flush=True)
            failed = True
    if hf and (
        (hf.get("token_check") and not hf["token_check"]["tokens_equal"])
        or "ours" in hf.get("generate", {}).get("errors", {})
        or any("error" in s for s in hf.get("steps", []))
    ):
        failed = True
    env["load_average_at_end"] = load_average()
    print(f"\n- load_average_at_end: {env['load_average_at_end']}")
    path = args.json or (str(Path(os.environ["OUT"]) / "as_called.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(dict(environment=env, rows=rows, hf=hf), indent=1))
        print(f"\nJSON: {path}")
    if failed:
        print("some rows FAILED (see ok / error)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
