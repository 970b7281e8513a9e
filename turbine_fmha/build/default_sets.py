"""The default variant sets: what `turbine-fmha build` compiles for a
target when no variants are named (host: the explicit formulation; GPUs:
the online one, in decode and prefill tiles)."""

from __future__ import annotations

import dataclasses
import itertools

from ..kernels.append_kernel import AppendKernel
from ..kernels.tiles_kernel import TILE_ROWS, TILES_CLASSES, TilesKernel
from ..kernels.variants import (
    FORMULATIONS,
    GPU_DECODE_TILE,
    GPU_DECODE_TILES,
    GPU_ENTRY_TILES,
    GPU_PREFILL_TILE,
    GPU_PREFILL_TILES,
    MASKS,
    MERGED_STATIC_TILES,
    MERGED_TILES,
    Variant,
    group_rows_for,
    online_unsupported,
    online_variant,
)

# Model head configurations in the default set: GQA 32/8 (Llama-3-8B style),
# and MHA 8/8 for small services.
DEFAULT_HEADS = ((32, 8), (8, 8))
DEFAULT_PAGES = (1, 16, 32, 64, 128)
# The explicit variants' pages: 16 compiled for its size, every other page
# size by kernels of any page (Variant.page_block_size 0), which run about
# as fast as the exact page's with exact head counts on the CPU, and with
# fewer kernels build the host set in much less time
# (docs/devlog/perf-notes.md, "Building the default sets faster", item
# "Kernels of any page size for the host set"). (The GPUs' explicit
# fallback had pages 16 and 64, with the same ISA at 64 and any page on
# gfx942: no MFMA either way.)
HOST_PAGES = (16, 0)
DEFAULT_HDIMS = (64, 128)
# Any head counts (run-time heads, any GQA group: Variant.group) for these
# head dims, in the explicit formulation: every model of them runs without
# compiling, on any target (on GPUs slower than the online kernels, which
# need the group static: built per model, `turbine-fmha build
# --model-config`, or on first use).
ANY_HEADS_HDIMS = (64, 128, 256)

# Score-side features in the default sets (one feature at a time, plus
# sinks with ALiBi): (bias, bias_shape, softcap, sinks).
FEATURES = (
    ("alibi", "", False, False),
    ("elementwise", "11", False, False),
    ("elementwise", "1h", False, False),
    ("elementwise", "bh", False, False),
    ("none", "", True, False),
    ("none", "", False, True),
    ("alibi", "", False, True),
)


def _feature_variants(dtype, page, mask, tiles=None) -> list[Variant]:
    """Each of FEATURES for GQA 32/8, hdim 128: explicit variants, or online
    ones with `tiles` (batch tile, query rows)."""
    out = [
        Variant(dtype, 128, 128, 32, 8, page, mask, bias, shape, softcap, sinks)
        for bias, shape, softcap, sinks in FEATURES
    ]
    return [online_variant(v.problem, *tiles) for v in out] if tiles else out


def host_default_set() -> list[Variant]:
    """The CPU set: explicit formulation, dynamic batch and query rows.

    Every dtype, head dim 64/128, GQA 32/8 and MHA 8/8, every mask, at
    page 16 and at any page size (HOST_PAGES), and the same for any head
    counts with head dims 64/128/256 (ANY_HEADS_HDIMS), also over head-major
    (HND) pages; plus
    each score-side feature for fp16/bf16, hdim 128, GQA 32/8, page 16,
    with the causal masks; column-major V; fp8 (e4m3) KV caches
    and fp8 (e4m3) static quantization.
    """
    out = plain_variants("explicit", ("f16", "bf16", "f32"), [(h, h) for h in DEFAULT_HDIMS], DEFAULT_HEADS, HOST_PAGES)
    out += any_heads_variants(("f16", "bf16", "f32"), HOST_PAGES)
    out += head_major(any_heads_variants(("f16", "bf16", "f32"), HOST_PAGES))
    for dtype in ("f16", "bf16"):
        for mask in ("top_left", "bottom_right"):
            out += _feature_variants(dtype, 16, mask)
        for mask in ("none", "bottom_right"):
            out.append(Variant(dtype, 128, 128, 32, 8, 16, mask, v_layout="col"))
            for kv in ("f8e4m3fn", "f8e4m3fnuz"):
                out.append(Variant(dtype, 128, 128, 32, 8, 16, mask, kv_dtype=kv))
    out += _static_quant_variants()
    return out


def _static_quant_variants() -> list[Variant]:
    # e4m3 is the inference format (e5m2 is built on request); explicit
    # formulation on every target (online_unsupported).
    return [
        Variant(f8, 128, 128, 32, 8, 16, mask) for f8 in ("f8e4m3fn", "f8e4m3fnuz") for mask in ("none", "bottom_right")
    ]


def gpu_default_set() -> list[Variant]:
    """The GPU set: online formulation, decode and prefill buckets.

    Kept to the shapes services run (fp16/bf16, hdim 128, GQA 32/8, page 16
    and 64); everything else is built on request with --variants. Each
    score-side feature comes for page 16 with the decode b8 tile (no mask)
    and the prefill q128 tile (bottom-right mask), as does column-major V;
    fp8 (e4m3fn, e4m3fnuz) KV caches come in the online decode tiles (those
    merging splits included) and in the explicit formulation for the rest,
    fp8 static quantization in the explicit one. Row-major online variants
    of fp16/bf16 caches come with and without the V guard. Other head
    counts run the online variants for any group (head dim 128, page 16,
    groups up to 16: _any_group_gpu_defaults), else the explicit variants
    of any_heads_variants (head dims 64/128/256, page 16 and any page
    size); both also over head-major (HND) pages of 16 rows.
    """
    out = []
    for dtype in ("f16", "bf16"):
        out += plain_variants("online", (dtype,), ((128, 128),), ((32, 8),), (16, 64))
        out += _feature_variants(dtype, 16, "none", GPU_DECODE_TILE)
        out += _feature_variants(dtype, 16, "bottom_right", GPU_PREFILL_TILE)
        for tiles, mask in ((GPU_DECODE_TILE, "none"), (GPU_PREFILL_TILE, "bottom_right")):
            out.append(online_variant(Variant(dtype, 128, 128, 32, 8, 16, mask, v_layout="col").problem, *tiles))
            # fp8 caches beyond the decode tiles run the explicit formulation
            # on GPUs (see online_unsupported); it compiles for every target.
            for kv in ("f8e4m3fn", "f8e4m3fnuz"):
                out.append(Variant(dtype, 128, 128, 32, 8, 16, mask, kv_dtype=kv))
        for kv in ("f8e4m3fn", "f8e4m3fnuz"):
            out += decode_variants(Variant(dtype, 128, 128, 32, 8, 16, "none", kv_dtype=kv).problem)
    out += _any_group_gpu_defaults()
    out += without_v_guard(out)
    out += _static_quant_variants()
    out += any_heads_variants(("f16", "bf16"), HOST_PAGES)
    out += head_major(any_heads_variants(("f16", "bf16"), (16,)))
    return out


# The padded GQA groups of the online prefill variants for any head counts:
# a call runs the smallest that holds its group (decodes pad every group to
# MMA_ROWS rows). Not 1: IREE 3.13 gives a group padded to 1 row (a unit
# dim among the attention's M dims) no MFMA on gfx942; MHA pads to 2.
ANY_GROUP_PREFILL_PADS = (2, 4, 8, 16)


def any_group_online_variants(problem: dict, prefill_tiles=GPU_PREFILL_TILES, merged_tiles=MERGED_TILES):
    """The online variants of `problem` (run-time head counts, any group):
    the decode tiles, those merging split-KV partials in `merged_tiles`, and
    each of `prefill_tiles` for each padded group of ANY_GROUP_PREFILL_PADS,
    without a mask and bottom-right."""
    out = [online_variant(problem, t, 1) for t, _ in GPU_DECODE_TILES]
    out += [online_variant(problem, t, 1, merge_any=True) for t in merged_tiles]
    out += [online_variant(problem, t, 1, merge_splits=n) for t, n in MERGED_STATIC_TILES if t in merged_tiles]
    for (bt, mq), m, gp in itertools.product(prefill_tiles, ("none", "bottom_right"), ANY_GROUP_PREFILL_PADS):
        out.append(online_variant(dict(problem, mask=m), bt, mq, group_rows=gp * mq))
    return out


def _any_group_gpu_defaults() -> list[Variant]:
    # fp16/bf16, head dim 128, page 16; merges in the 128-entry tile only
    # (every split count fits one launch of it) and the 128- and 1024-row
    # prefill tiles: the GPU set's compile time stays within CI's.
    # The same over HND pages, whose rows stay hdim apart whatever the head
    # count: there run-time heads cost nothing (docs/devlog/perf-notes.md).
    out = [
        v
        for dtype in ("f16", "bf16")
        for v in any_group_online_variants(
            Variant(dtype, 128, 128, 0, 0, 16).problem,
            GPU_PREFILL_TILES[:2] + GPU_ENTRY_TILES,
            (128,),
        )
    ]
    return out + head_major(out)


def head_major(variants: list[Variant]) -> list[Variant]:
    """`variants` again over head-major (HND) pages."""
    return [dataclasses.replace(v, kv_layout="HND") for v in variants]


def any_heads_variants(dtypes, pages) -> list[Variant]:
    """Explicit variants for any head counts (ANY_HEADS_HDIMS, every mask)."""
    return plain_variants("explicit", dtypes, [(h, h) for h in ANY_HEADS_HDIMS], ((0, 0),), pages)


def without_v_guard(variants: list[Variant]) -> list[Variant]:
    """Each online variant of a row-major fp16/bf16/f32 cache again without
    the V guard: the runtime's choice when the stale V rows are finite
    (Variant.v_guard)."""
    return [
        dataclasses.replace(v, v_guard=False)
        for v in variants
        if v.formulation == "online" and v.v_layout == "row" and not v.kv_dtype
    ]


def plain_variants(formulation: str, dtypes, hdims, heads, pages) -> list[Variant]:
    """The featureless variants the runtime selects (selection.py) for each
    combination of dtypes, (hdim_q, hdim_v), heads (heads_fields) and pages in
    `formulation`. Explicit: one per mask. Online: decode tiles without a
    mask (attention._Plan drops a causal decode row's), those that merge
    split-KV partials in the module, prefill tiles without a mask and
    bottom-right; the explicit ones where online_unsupported. Split-KV's
    partial calls otherwise use the same kernels."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    out = []
    for dtype, (hq, hv), h, page in itertools.product(dtypes, hdims, heads, pages):
        shape = dict(dtype=dtype, hdim_q=hq, hdim_v=hv, page_block_size=page, **heads_fields(h))
        p = Variant(**shape).problem
        if formulation == "online" and not online_unsupported(p):
            out += decode_variants(p)
            out += [
                online_variant(dict(p, mask=m), *t)
                for t in GPU_PREFILL_TILES + GPU_ENTRY_TILES
                for m in ("none", "bottom_right")
            ]
        else:
            out += [Variant(**shape, mask=m) for m in MASKS]
    return out


def heads_fields(heads: tuple) -> dict:
    """The Variant fields of a head configuration: (nhead_q, nhead_k), or
    (0, 0, group) for run-time head counts (group 0: any)."""
    return dict(zip(("nhead_q", "nhead_k", "group"), heads))


def decode_variants(problem: dict) -> list[Variant]:
    """The online decode variants of a mask-free `problem`: each decode tile,
    and where the group is padded (the decodes the runtime splits by items,
    plan.py) those that merge split-KV partials in the module."""
    out = [online_variant(problem, t, 1) for t, _ in GPU_DECODE_TILES]
    if group_rows_for(problem, 1):
        out += [online_variant(problem, t, 1, merge_any=True) for t in MERGED_TILES]
        out += [online_variant(problem, t, 1, merge_splits=n) for t, n in MERGED_STATIC_TILES]
    return out


def default_append_kernels(gpu: bool) -> list[AppendKernel]:
    """Append kernels for the default sets' cache shapes."""
    if gpu:
        return [AppendKernel(dt, 8, 128, 128, page) for dt in ("f16", "bf16", "i8") for page in (16, 64)]
    return [
        AppendKernel(dt, 8, hd, hd, page)
        for dt in ("f16", "bf16", "f32")
        for hd in DEFAULT_HDIMS
        for page in DEFAULT_PAGES
    ]


def default_tiles_kernels(gpu: bool) -> list[TilesKernel]:
    """The prefill tile kernels of the GPU set's plain shapes (f16/bf16, 32/8
    heads of 128, pages of 16 and 64), one per class count; none on the CPU,
    where the explicit kernels are faster."""
    if not gpu:
        return []
    return [
        TilesKernel(dt, 32, 8, 128, page, TILE_ROWS, c)
        for dt in ("f16", "bf16")
        for page in (16, 64)
        for c in TILES_CLASSES
    ]


def check_set(variants: list[Variant]) -> list[Variant]:
    """The distinct kernels of a set, for compile checks: a few dozen that
    hold every value of every field the kernels specialize on (template
    path and tile family, dtype, cache format, head dims, page, mask, each
    score term and bias shape, layouts, the V guard, head counts, batch and
    row tiles, merged splits, group padding) and the pairs that choose a
    kernel's structure (dtype, head dims and guard by tile family; layout by
    head counts and tile family). Picked greedily, in the set's order, so
    the same set gives the same kernels."""

    def family(v: Variant) -> str:
        if v.formulation == "explicit":
            return "explicit"
        return "merged" if v.merging else ("decode" if v.batch_tile > 1 else "prefill")

    def values(v: Variant) -> set:
        heads = "exact" if not v.runtime_heads else ("group" if v.group else "any")
        fields = dict(
            formulation=v.formulation,
            dtype=v.dtype,
            kv_dtype=v.kv_dtype,
            hdims=(v.hdim_q, v.hdim_v),
            page=v.page_block_size,
            mask=v.mask,
            bias=(v.bias, v.bias_shape),
            softcap=v.softcap,
            sinks=v.sinks,
            kv_layout=v.kv_layout,
            v_layout=v.v_layout,
            v_guard=v.v_guard,
            heads=heads,
            family=family(v),
            batch_tile=v.batch_tile,
            seqlen_q_tile=v.seqlen_q_tile,
            merge_splits=(v.merge_splits, v.merge_any),
            group_rows=v.group_rows,
            dtype_family=(v.dtype, family(v)),
            hdims_family=((v.hdim_q, v.hdim_v), family(v)),
            guard_family=(v.v_guard, family(v)),
            layout_heads=(v.kv_layout, heads, family(v)),
        )
        return set(fields.items())

    wanted = set().union(*map(values, variants)) if variants else set()
    chosen, covered = [], set()
    while covered != wanted:
        best = max(variants, key=lambda v: len(values(v) - covered))
        chosen.append(best)
        covered |= values(best)
    return chosen
