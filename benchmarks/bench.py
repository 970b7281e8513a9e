#!/usr/bin/env python3
"""Benchmark: turbine-fmha vs torch gather-by-block-table + SDPA, same run.

Shapes (GQA 32/8, hdim 128, page 16, fp16 unless --dtypes says more):
  cpu:  decode batch 8 x seqlen_k 2048; prefill 1 x 512 causal bottom-right
  cuda: decode batch 32 x seqlen_k 4096; prefill 1 x 4096 causal bottom-right

Columns:
  ours_ms      device time of the kernel calls on device-resident inputs
               (the runtime's own split count, padding and chunking; the
               merge of split-KV partials is left to ours_run_ms): --repeat
               calls queued back to back, one wait at the end
  ours_host_copy_ms  copying that output to the host (and merging split-KV
               partials there), which the device time leaves out
  ours_api_ms  the public fmha_fwd_paged call on numpy inputs (host->device
               copies, validation and output copies included)
  ours_run_ms  PagedAttention.run() on tables planned once, with q and the
               caches where a service keeps them (torch CUDA tensors on
               cuda, numpy on the CPU), results left there
  ours_one_shot_ms  fmha_fwd_paged on those same arrays (plan + run)
  baseline_ms  torch: index_select pages through the block table, then
               F.scaled_dot_product_attention (4-D, enable_gqa, same mask),
               timed like ours_ms (back to back, one synchronize)
  sdpa_contig_ms  torch SDPA on already-contiguous K/V (no gather): a roof
Decode reports effective KV bandwidth in GB/s (K+V bytes of the used keys
/ time);
prefill reports TFLOP/s over the visible (unmasked) score elements.
--verify also checks small random problems on the device against the
float64 reference. Speed is never asserted here; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import turbine_fmha
from turbine_fmha.build.artifacts import ArtifactError
from turbine_fmha.calls import plan as tf_plan
from turbine_fmha.calls.mask import MaskSpec
from turbine_fmha.calls.plan import KernelCall, combine_splits, kernel_steps, repeat_rows, split_kv
from turbine_fmha.core.arrays import aligned_empty, bf16_dtype
from turbine_fmha.kernels.variants import KV_LAYOUTS, Variant, bias_shape_of, online_variant
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

SHAPES = {
    "cpu": [
        dict(name="decode", batch=8, seqlen_q=1, seqlen_k=2048, mask="none"),
        dict(name="prefill", batch=1, seqlen_q=512, seqlen_k=512, mask="bottom_right"),
    ],
    "cuda": [
        dict(name="decode", batch=32, seqlen_q=1, seqlen_k=4096, mask="none"),
        dict(name="prefill", batch=1, seqlen_q=4096, seqlen_k=4096, mask="bottom_right"),
    ],
}
HQ, HK, D, PAGE = 32, 8, 128, 16
# The caches' page layout (--kv-layout): "NHD" [pages, PAGE, HK, D] or
# "HND" [pages, HK, PAGE, D].
KV_LAYOUT = "NHD"


def as_layout(cache):
    """An NHD cache in KV_LAYOUT (a copy for HND)."""
    return np.ascontiguousarray(cache.transpose(0, 2, 1, 3)) if KV_LAYOUT == "HND" else cache


def np_dtype(name):
    return {"f16": np.dtype(np.float16), "f32": np.dtype(np.float32), "bf16": bf16_dtype()}[name]


def warm_up(fn, sync, calls, seconds):
    # A number of calls and at least `seconds`: on the CPU the first kernel
    # timed in a process ran in a slow mode for several calls
    # (docs/devlog/perf-notes.md, "CPU runtime", "Bimodal timings"), so a
    # fixed two calls is not enough.
    t_end = time.perf_counter() + seconds
    n = 0
    while n < calls or time.perf_counter() < t_end:
        fn()
        sync()
        n += 1


def median_ms(fn, repeat, warmup=2, sync=lambda: None, warmup_s=1.0):
    """Median time of one call, each followed by sync()."""
    warm_up(fn, sync, warmup, warmup_s)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_ms(fn, wait, repeat, warmup=3, warmup_s=1.0):
    """Device time per call: `repeat` calls back to back, one wait at the
    end (both sides of every comparison are timed this way)."""
    warm_up(fn, wait, warmup, warmup_s)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    wait()
    return (time.perf_counter() - t0) * 1e3 / repeat


def make_inputs(rng, shape, dtype):
    b, sq, sk = shape["batch"], shape["seqlen_q"], shape["seqlen_k"]
    pages_per_seq = -(-sk // PAGE)
    num_pages = b * pages_per_seq + 1
    dt = np_dtype(dtype)
    # Random data (never zeros: zeros can run faster than real data).
    # 64-byte aligned, as PagedKVCache and aligned_zeros keep a service's
    # caches: CPU kernels read those in place, and copy any other array per
    # call (arrays.kernel_host_array), which would time a copy of the cache.
    page_shape = (HK, PAGE, D) if KV_LAYOUT == "HND" else (PAGE, HK, D)
    k_cache, v_cache = (aligned_empty((num_pages, *page_shape), dt) for _ in range(2))
    k_cache[...] = rng.standard_normal(k_cache.shape, dtype=np.float32)
    v_cache[...] = rng.standard_normal(v_cache.shape, dtype=np.float32)
    block_table = rng.permutation(num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
    seqlen_k = np.full((b,), sk, np.int32)
    q = rng.standard_normal((b, sq, HQ, D), dtype=np.float32).astype(dt)
    return q, k_cache, v_cache, block_table, seqlen_k


def visible_elements(sq, sk, mask):
    if mask == "none":
        return sq * sk
    shift = sk - sq
    return sum(max(0, min(sk, i + shift + 1)) for i in range(sq))


# Score-side features timed against the plain causal kernel (--features).
# Values: fmha_fwd_paged keyword arguments on top of the causal mask;
# callables get (rng, shape) and return the argument.
FEATURES = {
    "causal": {},
    "window 256": dict(window_size_left=256),
    "window 256 + 4 sink tokens": dict(window_size_left=256, sink_size=4),
    "alibi": dict(alibi_slopes=lambda rng, sh: (2.0 ** (-8.0 * np.arange(1, HQ + 1) / HQ)).astype(np.float32)),
    "bias [1,1,sq,sk]": dict(
        bias=lambda rng, sh: rng.standard_normal((1, 1, sh["seqlen_q"], sh["seqlen_k"]), dtype=np.float32)
    ),
    "bias [1,h,sq,sk]": dict(
        bias=lambda rng, sh: rng.standard_normal((1, HQ, sh["seqlen_q"], sh["seqlen_k"]), dtype=np.float32)
    ),
    "soft-cap 30": dict(logits_soft_cap=30.0),
    "attention sinks": dict(sinks=lambda rng, sh: rng.uniform(-1, 1, HQ).astype(np.float32)),
}


def feature_kwargs(name, rng, shape):
    kw = dict(mask_type=shape["mask"], window_size_left=-1, window_size_right=0 if shape["mask"] != "none" else -1)
    for k, v in FEATURES[name].items():
        kw[k] = v(rng, shape) if callable(v) else v
    return kw


def feature_variant(dtype, shape, kw, tiles=None):
    bias = kw.get("bias")
    problem = Variant(
        dtype,
        D,
        D,
        HQ,
        HK,
        PAGE,
        kw["mask_type"],
        bias="alibi" if kw.get("alibi_slopes") is not None else ("elementwise" if bias is not None else "none"),
        bias_shape=bias_shape_of(bias),
        softcap=kw.get("logits_soft_cap", 0.0) > 0,
        sinks=kw.get("sinks") is not None,
        kv_layout=KV_LAYOUT,
    ).problem
    if tiles is None:
        return problem
    return online_variant(problem, *tiles)


def bench_ours(
    session, shape, inputs, dtype, repeat, kw=None, api=True, num_splits=1, tiles=None, v_guard=False, merge=True
):
    """Times the kernel calls on device-resident inputs. num_splits > 1 runs
    split-KV: merged inside the module where the session has such a variant
    and `merge` allows it, else with the partials copied back and merged on
    the host, as the API does; tiles forces an online variant's (batch
    tile, query rows). The inputs are finite, so like the API it runs GPU
    variants without the V guard unless v_guard is set."""
    import iree.runtime as rt

    q, kc, vc, bt, sk = inputs
    if kw is None:
        kw = dict(mask_type=shape["mask"], window_size_right=0 if shape["mask"] != "none" else -1)
    problem = feature_variant(dtype, shape, kw)
    merged = merge and num_splits > 1 and shape["seqlen_q"] == 1 and num_splits in session.merge_splits_for(problem)
    if num_splits > 1 and not merged:
        problem = dict(problem, sinks=False)
    nb = shape["batch"] * num_splits
    if tiles:
        variant = online_variant(problem, *tiles, v_guard=v_guard)
    else:
        mask = MaskSpec(
            kw["mask_type"], kw.get("window_size_left", -1), kw.get("window_size_right", -1), kw.get("sink_size", 0)
        )
        variant = session.select(
            problem,
            shape["seqlen_q"],
            nb,
            stale_rows_finite=not v_guard,
            merge=num_splits if merged else 0,
            skips_masked=mask.has_right_edge,
        )
    loaded = session._load(variant)
    device = session._iree_config().device
    slopes = kw.get("alibi_slopes")
    call = KernelCall(
        rows=shape["seqlen_q"],
        q_itemsize=q.itemsize,
        nhead_q=HQ,
        block_table=bt,
        page=PAGE,
        seqlen_q=np.full(shape["batch"], shape["seqlen_q"], np.int32),
        seqlen_k=sk,
        kv_shift=np.zeros(shape["batch"], np.int32),
        scale=1.0 / math.sqrt(D),
        softcap=kw.get("logits_soft_cap", 0.0),
        scale_o=1.0,
        scale_p=1.0,
        mask=MaskSpec(
            kw["mask_type"], kw.get("window_size_left", -1), kw.get("window_size_right", -1), kw.get("sink_size", 0)
        ),
        alibi_slopes=None
        if slopes is None
        else np.ascontiguousarray(np.broadcast_to(slopes, (shape["batch"], HQ)), np.float32),
        bias=kw.get("bias"),
        sinks=kw.get("sinks"),
    )
    qq = q
    if num_splits > 1:
        call = split_kv(call, num_splits, merged)
        qq = q if merged else repeat_rows(q, num_splits)
    kc_d = session.device_array(kc)  # as a service holds its caches
    vc_d = session.device_array(vc)
    calls = []
    places = []
    for st in kernel_steps(variant, call):
        dev = [rt.asdevicearray(device, a) for a in [st.q(qq), *st.args]]
        calls.append([dev[0], kc_d, vc_d, *dev[1:]])
        places.append(st.place)
    last = []
    rows = shape["seqlen_q"]
    o_parts = np.empty((nb, rows, HQ, D), q.dtype)
    stats = [np.empty((nb, HQ, rows), np.float32) for _ in range(3)]

    chain = session.device == "cpu"

    def run():
        # Calls queued, none waited for. On a GPU they wait for nothing
        # either: a call that names the previous one as its wait blocks the
        # host in IREE's allocation until that one is done (the device then
        # idles while the next call is recorded), and one stream keeps them
        # in order anyway. CPU calls are chained, as measured before.
        prev = last[-1] if last and chain else None
        last.clear()
        for args in calls:
            prev = loaded.enqueue(args, after=prev if chain else None)
            last.append(prev)

    def to_host():
        res = [c.results(4) for c in last]
        if num_splits == 1 or merged:
            for r in res:
                r[0].to_host()
            return
        for r, place in zip(res, places):
            place((o_parts, *stats), [x.to_host() for x in r])
        combine_splits(o_parts, *stats, num_splits, kw.get("sinks"))

    ms = device_ms(run, lambda: [c.wait() for c in last], repeat)
    copy_ms = median_ms(to_host, max(3, repeat // 3), warmup=1, warmup_s=0.0)
    api_ms = float("nan")
    if api:
        api_ms = median_ms(
            lambda: turbine_fmha.fmha_fwd_paged(
                *inputs, session=session, device=session.device, kv_layout=KV_LAYOUT, **kw
            ),
            max(3, repeat // 3),
            warmup=1,
        )
    return variant, ms, api_ms, len(calls), copy_ms


def auto_splits(session, shape, inputs, kw) -> int:
    """The split count the runtime plans for this call."""
    _, kc, _, bt, sk = inputs
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=kc.shape[0],
        page_block_size=PAGE,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype=kc.dtype,
        seqlen_q=shape["seqlen_q"],
        kv_rows_finite=True,
        kv_layout=KV_LAYOUT,
        **kw,
    )
    return attn._plan.parts[0].splits


def bench_planned(session, shape, inputs, dtype, repeat, kw):
    """(run_ms, one_shot_ms): PagedAttention.run() on tables planned once,
    and the one-shot fmha_fwd_paged, both on arrays where a service keeps
    them: torch tensors on the GPU for cuda, numpy for the CPU. The caches
    are promised finite (kv_rows_finite, as PagedKVCache does)."""
    q, kc, vc, bt, sk = inputs
    sync = lambda: None
    if session.device == "cuda":
        import torch

        from turbine_fmha.core.arrays import numpy_to_torch

        q, kc, vc = (numpy_to_torch(a).to("cuda:0") for a in (q, kc, vc))
        sync = torch.cuda.synchronize
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=kc.shape[0],
        page_block_size=PAGE,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype=dtype,
        seqlen_q=shape["seqlen_q"],
        kv_rows_finite=True,
        kv_layout=KV_LAYOUT,
        **kw,
    )
    run_ms = median_ms(lambda: attn.run(q, kc, vc), repeat, sync=sync)
    one_ms = median_ms(
        lambda: turbine_fmha.fmha_fwd_paged(
            q, kc, vc, bt, sk, session=session, device=session.device, kv_rows_finite=True, kv_layout=KV_LAYOUT, **kw
        ),
        repeat,
        sync=sync,
    )
    return run_ms, one_ms


SPLIT_SHAPES = {
    "cpu": [
        dict(name="decode", batch=1, seqlen_q=1, seqlen_k=16384, mask="none"),
        dict(name="decode", batch=8, seqlen_q=1, seqlen_k=2048, mask="none"),
    ],
    "cuda": [
        dict(name="decode", batch=1, seqlen_q=1, seqlen_k=32768, mask="none"),
        dict(name="decode", batch=1, seqlen_q=1, seqlen_k=4096, mask="none"),
        dict(name="decode", batch=4, seqlen_q=1, seqlen_k=32768, mask="none"),
        dict(name="decode", batch=32, seqlen_q=1, seqlen_k=4096, mask="none"),
    ],
}


def bench_split_kv(session, rng, dtype, repeat, no_torch):
    """Decode with 1 split, the automatic count, and a few others."""
    rows = []
    for shape in SPLIT_SHAPES[session.device]:
        inputs = make_inputs(rng, shape, dtype)
        b, sk = shape["batch"], shape["seqlen_k"]
        auto = auto_splits(session, shape, inputs, dict(mask_type="none"))
        base = float("nan") if no_torch else bench_torch(shape, inputs, dtype, session.device, repeat)[0]
        kv_bytes = b * sk * HK * 2 * D * np_dtype(dtype).itemsize
        for n, merge in sorted({(1, True), (auto, True), (4, True), (16, True), (auto, False)}):
            if n == 1 and not merge:
                continue
            variant, ms, _, ncalls, copy_ms = bench_ours(
                session, shape, inputs, dtype, repeat, api=False, num_splits=n, merge=merge
            )
            row = dict(
                table="split_kv",
                device=session.device,
                dtype=dtype,
                batch=b,
                seqlen_k=sk,
                num_splits=n,
                merged_in_module=bool(variant.merge_splits),
                variant=variant.name,
                auto=n == auto,
                kernel_calls=ncalls,
                ours_ms=round(ms, 3),
                host_copy_merge_ms=round(copy_ms, 3),
                gbs=round(kv_bytes / (ms * 1e-3) / 1e9, 1),
                baseline_ms=round(base, 3),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(
        "| shape | num_splits | merged | device ms | KV GB/s | output (partials) to host + merge ms | torch gather+SDPA ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| decode b{r['batch']} sk{r['seqlen_k']} | {r['num_splits']}{' (auto)' if r['auto'] else ''} | "
            f"{'module' if r['merged_in_module'] else ('host' if r['num_splits'] > 1 else '-')} | "
            f"{r['ours_ms']:.2f} | {r['gbs']:.0f} | {r['host_copy_merge_ms']:.2f} | {r['baseline_ms']:.2f} |"
        )
    return rows


def bench_block_skipping(session, rng, dtype, repeat):
    """Causal prefill computing every block vs skipping those past the
    diagonal (CPU: row chunks of MASKED_CHUNK_ROWS; GPU: q128 tiles vs one
    4096-row tile, and the row tiles $BENCH_PREFILL_TILES lists, e.g.
    "512,1024", where the artifacts have them)."""
    shape = SHAPES[session.device][1]
    inputs = make_inputs(rng, shape, dtype)
    flops = 4.0 * shape["batch"] * HQ * D * visible_elements(shape["seqlen_q"], shape["seqlen_k"], shape["mask"])
    rows = []
    if session.device == "cpu":
        configs = [
            ("one chunk, no skipping", dict(chunk=1 << 30)),
            ("32-row chunks", dict(chunk=32)),
            ("64-row chunks", dict(chunk=64)),
            ("128-row chunks", dict(chunk=128)),
            ("256-row chunks", dict(chunk=256)),
        ]
    else:
        from turbine_fmha.kernels.variants import GPU_PREFILL_TILES

        extra = tuple((1, int(t)) for t in os.environ.get("BENCH_PREFILL_TILES", "").split(",") if t)
        configs = [(f"tile b{bt} q{mq}", dict(tiles=(bt, mq))) for bt, mq in sorted(set(GPU_PREFILL_TILES + extra))]
    saved = tf_plan.MASKED_CHUNK_ROWS
    try:
        for label, cfg in configs:
            tf_plan.MASKED_CHUNK_ROWS = cfg.get("chunk", saved)
            variant, ms, _, ncalls, _ = bench_ours(
                session, shape, inputs, dtype, repeat, api=False, tiles=cfg.get("tiles")
            )
            row = dict(
                table="block_skipping",
                device=session.device,
                dtype=dtype,
                config=label,
                variant=variant.name,
                kernel_calls=ncalls,
                ours_ms=round(ms, 3),
                tflops=round(flops / (ms * 1e-3) / 1e12, 4),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        tf_plan.MASKED_CHUNK_ROWS = saved
    print()
    print(f"| prefill b{shape['batch']} sq{shape['seqlen_q']} causal | calls | ms | TFLOP/s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['kernel_calls']} | {r['ours_ms']:.2f} | {r['tflops']:.3g} |")
    return rows


def bench_features(session, rng, dtype, repeat):
    """Cost of each score-side feature relative to the plain causal kernel,
    same shapes as the main table (causal bottom-right for decode too)."""
    rows = []
    for base in SHAPES[session.device]:
        shape = dict(base, mask="bottom_right")
        inputs = make_inputs(rng, shape, dtype)
        plain = None
        for name in FEATURES:
            kw = feature_kwargs(name, rng, shape)
            variant, ms, _, _, _ = bench_ours(session, shape, inputs, dtype, repeat, kw=kw, api=False)
            plain = plain or ms
            row = dict(
                table="features",
                name=shape["name"],
                feature=name,
                device=session.device,
                dtype=dtype,
                batch=shape["batch"],
                seqlen_q=shape["seqlen_q"],
                seqlen_k=shape["seqlen_k"],
                variant=variant.name,
                ours_ms=round(ms, 3),
                vs_causal=round(ms / plain, 3),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| shape | feature | variant | ms | vs causal |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} b{r['batch']} sq{r['seqlen_q']} sk{r['seqlen_k']} | {r['feature']} | {r['variant']} | {r['ours_ms']:.2f} | {r['vs_causal']:.2f}x |"
        )
    return rows


def feature_variant_names(device):
    """The variants --features needs (for building the CUDA set)."""
    from turbine_fmha.kernels.variants import GPU_DECODE_TILES, GPU_PREFILL_TILES

    rng = np.random.default_rng(0)
    names = set()
    for base in SHAPES[device]:
        shape = dict(base, mask="bottom_right")
        tiles = max(GPU_DECODE_TILES) if shape["seqlen_q"] == 1 else max(GPU_PREFILL_TILES)
        for name in FEATURES:
            # Tiny arrays: only their axes matter for the variant.
            kw = feature_kwargs(name, rng, dict(shape, seqlen_q=1, seqlen_k=1))
            v = feature_variant("f16", shape, kw, tiles)
            names.add(v.name)
            names.add(dataclasses.replace(v, v_guard=False).name)
    return sorted(names)


def bench_torch(shape, inputs, dtype, device, repeat):
    import torch
    import torch.nn.functional as F

    def tt(a):
        if a.dtype == bf16_dtype():
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(a).to(device)

    q, kc, vc, bt, sk = (tt(a) for a in inputs)
    b, sq = shape["batch"], shape["seqlen_q"]
    skn = shape["seqlen_k"]
    causal = shape["mask"] != "none"
    assert not causal or sq == skn  # then bottom-right == top-left == is_causal
    qh = q.transpose(1, 2)
    flat = bt.long().reshape(-1)

    def gathered(cache):  # [b, HK, keys, D]
        pages = cache.index_select(0, flat)
        if KV_LAYOUT == "HND":
            return pages.reshape(b, -1, HK, PAGE, D).transpose(1, 2).reshape(b, HK, -1, D)[:, :, :skn]
        return pages.reshape(b, -1, HK, D)[:, :skn].transpose(1, 2)

    def gather_sdpa():
        return F.scaled_dot_product_attention(qh, gathered(kc), gathered(vc), is_causal=causal, enable_gqa=True)

    kcont, vcont = gathered(kc).contiguous(), gathered(vc).contiguous()

    def sdpa():
        return F.scaled_dot_product_attention(qh, kcont, vcont, is_causal=causal, enable_gqa=True)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        base = device_ms(gather_sdpa, sync, repeat)
        roof = device_ms(sdpa, sync, repeat)
    return base, roof


def copy_bandwidth_gbs():
    a = np.ones(256 << 20, np.uint8)  # 256 MiB, well past the caches
    b = np.empty_like(a)
    ms = median_ms(lambda: np.copyto(b, a), 5)
    return 2 * a.nbytes / (ms * 1e-3) / 1e9


def verify(session, rng, dtypes):
    """Small random problems on the device vs the float64 reference: plain
    decode and causal prefill per dtype, then each score-side feature (fp16)."""
    cases = []
    for dtype in dtypes:
        cases.append((dtype, 1, [300, 17, 1, 0, 45], dict(mask_type="none"), "plain"))
        cases.append((dtype, 150, [200, 150], dict(mask_type="bottom_right", window_size_right=0), "plain"))
    feats = {
        "alibi": lambda b, sq, sks: dict(alibi_slopes=rng.uniform(0.01, 0.5, (b, HQ)).astype(np.float32)),
        "bias": lambda b, sq, sks: dict(bias=rng.standard_normal((b, HQ, sq, max(sks))).astype(np.float32)),
        "soft-cap": lambda b, sq, sks: dict(logits_soft_cap=2.0),
        "sinks": lambda b, sq, sks: dict(sinks=rng.uniform(-1, 2, HQ).astype(np.float32)),
    }
    feats["fp8 KV (e4m3fn)"] = "fp8"
    feats["fp8 static quant (e4m3fn)"] = "squant"
    # Split-KV: forced and automatic, long and empty sequences.
    # 5: merged on the host; 4 (f16, bf16): merged in the module.
    cases.append(("f16", 1, [3000, 17, 0, 1500], dict(mask_type="none", num_splits=5), "split-kv 5"))
    for dtype in dtypes:
        cases.append((dtype, 1, [3000, 17, 0, 1500], dict(mask_type="none", num_splits=4), "split-kv 4"))
    cases.append(("f16", 1, [20000], dict(mask_type="bottom_right", window_size_right=0), "split-kv auto"))
    for fname, make in feats.items():
        cases.append(("f16", 1, [300, 17, 1, 0, 45], dict(mask_type="none", _feature=make), fname))
        cases.append(
            ("f16", 150, [200, 150], dict(mask_type="bottom_right", window_size_right=0, _feature=make), fname)
        )
    rows = []
    for dtype, sq, sks, kw, label in cases:
        kw = dict(kw)
        make = kw.pop("_feature", None)
        b = len(sks)
        if callable(make):
            kw.update(make(b, sq, sks))
        width = max(-(-s // PAGE) for s in sks) + 2
        num_pages = sum(-(-s // PAGE) for s in sks) + 4
        dt = np_dtype(dtype)
        kc = rng.standard_normal((num_pages, PAGE, HK, D)).astype(dt)
        vc = rng.standard_normal((num_pages, PAGE, HK, D)).astype(dt)
        bt = np.full((b, width), -1, np.int32)
        perm = rng.permutation(num_pages)
        i = 0
        for r, s in enumerate(sks):
            n = -(-s // PAGE)
            bt[r, :n] = perm[i : i + n]
            i += n
        if make == "fp8":
            import ml_dtypes

            kw.update(k_scale=0.05, v_scale=0.08)
            kc = (kc.astype(np.float32) / 0.05).astype(ml_dtypes.float8_e4m3fn)
            vc = (vc.astype(np.float32) / 0.08).astype(ml_dtypes.float8_e4m3fn)
        q = rng.standard_normal((b, sq, HQ, D)).astype(dt)
        if make == "squant":
            import ml_dtypes

            f8 = ml_dtypes.float8_e4m3fn
            top = float(ml_dtypes.finfo(f8).max)
            scales = [float(np.abs(x.astype(np.float32)).max()) / top for x in (q, kc, vc)]
            q, kc, vc = ((x.astype(np.float32) / s_).astype(f8) for x, s_ in zip((q, kc, vc), scales))
            kw.update(q_scale=scales[0], k_scale=scales[1], v_scale=scales[2], out_scale=0.01)
        if label == "soft-cap":
            q = q * np.asarray(4, dt)
        sk = np.array(sks, np.int32)
        out, lse = turbine_fmha.fmha_fwd_paged(
            q,
            as_layout(kc),
            as_layout(vc),
            bt,
            sk,
            return_lse=True,
            session=session,
            device=session.device,
            kv_layout=KV_LAYOUT,
            **kw,
        )
        ref, ref_lse = fmha_fwd_paged_ref(q, kc, vc, bt, sk, **{k: a for k, a in kw.items() if k != "num_splits"})
        err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
        fin = np.isfinite(ref_lse)
        lerr = float(np.abs(lse[fin] - ref_lse[fin]).max())
        inf_ok = bool(np.array_equal(np.isneginf(lse), ~fin))
        tol = {"f16": 5e-3, "bf16": 2e-2, "f32": 1e-5}[dtype]
        if make == "squant":
            # fp8 output vs the reference's fp8 value: the fraction that
            # differs at all (tests/test_fp8.py bounds it by 1%, one step).
            err = float(np.count_nonzero(out.astype(np.float64) != ref) / ref.size)
            tol = 0.01
        ok = err <= tol and lerr <= 3e-2 and inf_ok
        rows.append(
            dict(dtype=dtype, seqlen_q=sq, mask=kw["mask_type"], feature=label, rel_err=err, lse_abs_err=lerr, ok=ok)
        )
        print(
            f"verify {session.device} {dtype} sq={sq} {kw['mask_type']} {label}: rel err {err:.2e}, lse err {lerr:.2e}, -inf rows ok {inf_ok} -> {'OK' if ok else 'FAIL'}",
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--dtypes", default="f16")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--json", default=None, help="write rows as a JSON list")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--verify-only", action="store_true", help="verify on the device, time nothing")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--features", action="store_true", help="also time each score-side feature vs plain causal (fp16)")
    ap.add_argument(
        "--list-feature-variants", action="store_true", help="print the variants --features needs, then exit"
    )
    ap.add_argument("--split-kv", action="store_true", help="also time decode with split-KV at several split counts")
    ap.add_argument(
        "--block-skipping", action="store_true", help="also time causal prefill with and without masked-block skipping"
    )
    ap.add_argument("--kv-layout", choices=KV_LAYOUTS, default="NHD", help="the caches' page layout")
    args = ap.parse_args()
    global KV_LAYOUT
    KV_LAYOUT = args.kv_layout
    if args.list_feature_variants:
        print(",".join(feature_variant_names(args.device)))
        return 0
    dtypes = args.dtypes.split(",")
    repeat = args.repeat or (5 if args.device == "cpu" else 20)
    rng = np.random.default_rng()
    session = turbine_fmha.Session(args.device, artifact_dir=args.artifacts)
    if args.device == "cpu" and not args.no_torch:
        import torch

        torch.set_num_threads(2)
    rows = []
    if args.verify or args.verify_only:
        vrows = verify(session, rng, dtypes)
        if not all(r["ok"] for r in vrows):
            print("verification FAILED", file=sys.stderr)
            return 1
        if args.verify_only:
            print(f"verified {len(vrows)} problems on {args.device}")
            return 0
    extra = {}
    if args.device == "cpu":
        extra["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 2)
        print(f"cpu copy bandwidth (read+write): {extra['copy_bandwidth_gbs']} GB/s", flush=True)
    if args.device == "cpu":
        # Warm the process up first. The same CPU decode kernel also runs in
        # a fast or a far slower mode depending on where its inputs landed
        # in memory (not proven: numpy asks for transparent huge pages and
        # may not get them; docs/devlog/perf-notes.md, "CPU runtime",
        # "Bimodal timings"), which warm-up does not fix.
        first = SHAPES["cpu"][0]
        t_end = time.perf_counter() + 6.0
        while time.perf_counter() < t_end:
            bench_ours(session, first, make_inputs(rng, first, dtypes[0]), dtypes[0], 3, api=False)
    for dtype in dtypes:
        for shape in SHAPES[args.device]:
            inputs = make_inputs(rng, shape, dtype)
            kw = dict(mask_type=shape["mask"], window_size_right=0 if shape["mask"] != "none" else -1)
            splits = auto_splits(session, shape, inputs, kw)
            variant, ours, ours_api, ncalls, copy_ms = bench_ours(
                session, shape, inputs, dtype, repeat, num_splits=splits
            )
            guarded = float("nan")
            if args.device != "cpu":
                # The same call through the variant with the V guard (what
                # runs when stale value rows are not finite).
                try:
                    guarded = bench_ours(
                        session, shape, inputs, dtype, repeat, api=False, v_guard=True, num_splits=splits
                    )[1]
                except ArtifactError as e:  # an artifact directory without guarded variants
                    print(f"no guarded variant: {str(e).splitlines()[0]}", flush=True)
            run_ms, one_ms = bench_planned(session, shape, inputs, dtype, repeat, kw)
            base = roof = float("nan")
            if not args.no_torch:
                base, roof = bench_torch(shape, inputs, dtype, args.device, repeat)
            b, sq, sk = shape["batch"], shape["seqlen_q"], shape["seqlen_k"]
            row = dict(
                name=shape["name"],
                device=args.device,
                dtype=dtype,
                batch=b,
                seqlen_q=sq,
                seqlen_k=sk,
                nhead_q=HQ,
                nhead_k=HK,
                hdim=D,
                page=PAGE,
                kv_layout=KV_LAYOUT,
                mask=shape["mask"],
                variant=variant.name,
                kernel_calls=ncalls,
                num_splits=splits,
                ours_ms=round(ours, 3),
                ours_host_copy_ms=round(copy_ms, 3),
                ours_v_guard_ms=round(guarded, 3),
                ours_api_ms=round(ours_api, 3),
                ours_run_ms=round(run_ms, 3),
                ours_one_shot_ms=round(one_ms, 3),
                baseline_ms=round(base, 3),
                sdpa_contig_ms=round(roof, 3),
                **extra,
            )
            if shape["name"] == "decode":
                kv_bytes = b * sk * HK * 2 * D * np_dtype(dtype).itemsize
                row["unit"] = "GB/s KV"
                for key in ("ours", "baseline", "sdpa_contig"):
                    row[f"{key}_rate"] = round(kv_bytes / (row[f"{key}_ms"] * 1e-3) / 1e9, 2)
            else:
                flops = 4.0 * b * HQ * D * visible_elements(sq, sk, shape["mask"])
                row["unit"] = "TFLOP/s"
                for key in ("ours", "baseline", "sdpa_contig"):
                    row[f"{key}_rate"] = round(flops / (row[f"{key}_ms"] * 1e-3) / 1e12, 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(
        f"| shape | dtype | ours ms (device) | output to host ms | ours with V guard ms | ours (API, numpy) ms | run() ms | one-shot ms | torch gather+SDPA ms | torch SDPA contiguous ms | ours {'/'.join(sorted({r['unit'] for r in rows}))} | torch gather+SDPA | speedup vs torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        shape = f"{r['name']} b{r['batch']} sq{r['seqlen_q']} sk{r['seqlen_k']}"
        print(
            f"| {shape} | {r['dtype']} | {r['ours_ms']:.2f} | {r['ours_host_copy_ms']:.2f} | {r['ours_v_guard_ms']:.2f} | {r['ours_api_ms']:.2f} | "
            f"{r['ours_run_ms']:.2f} | {r['ours_one_shot_ms']:.2f} | {r['baseline_ms']:.2f} | "
            f"{r['sdpa_contig_ms']:.2f} | {r['ours_rate']:.3g} {r['unit']} | {r['baseline_rate']:.3g} | "
            f"{r['baseline_ms'] / r['ours_ms']:.2f}x |"
        )
    if args.features:
        print()
        rows += bench_features(session, rng, "f16", repeat)
    if args.split_kv:
        print()
        rows += bench_split_kv(session, rng, dtypes[0], repeat, args.no_torch)
    if args.block_skipping:
        print()
        rows += bench_block_skipping(session, rng, dtypes[0], repeat)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
