"""Validation: arguments -> a frozen `Problem`.

A Problem is what a call computes, checked in full, with every error
naming the argument: the layout of q and the caches (`Layout`), the tables
of a batch step (`Tables`) and the score terms (`Scores`). Its `key` is
exactly the key of the variants that can serve it (Variant.problem). Nothing
here looks at the values of q or the caches.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..core.arrays import dtype_name, fp8_max, fp8_name, np_dtype, torch_np_dtype
from ..core.checks import F32_MAX, check_float, check_int, float_array, int_array
from ..kernels.variants import FP8_DTYPES, KV_LAYOUTS, V_LAYOUTS
from .mask import MaskSpec

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What q and the caches look like (a model's attention layer)."""

    dtype: str  # the variant dtype: f16/bf16/f32, or q's fp8 format (static quantization)
    q_dtype: np.dtype
    kv_dtype: str  # fp8 format of the caches under fp16/bf16 q, else ""
    cache_dtype: np.dtype
    nhead_q: int
    nhead_k: int
    hdim_q: int
    hdim_v: int
    page_block_size: int
    num_pages: int
    v_layout: str = "row"
    kv_layout: str = "NHD"

    @property
    def static_quant(self) -> bool:
        return self.dtype in FP8_DTYPES

    def _page_shape(self, hdim: int) -> tuple:
        rows = (self.nhead_k, self.page_block_size)
        return (self.num_pages, *(rows if self.kv_layout == "HND" else rows[::-1]), hdim)

    @property
    def k_shape(self) -> tuple:
        return self._page_shape(self.hdim_q)

    @property
    def v_shape(self) -> tuple:
        if self.v_layout == "col":
            return (self.num_pages, self.nhead_k, self.hdim_v, self.page_block_size)
        return self._page_shape(self.hdim_v)

    def result_shapes(self, q_shape: tuple, group: bool) -> tuple[tuple, tuple]:
        """(out, LSE) shapes for q of `q_shape`: out is q's rows by hdim_v;
        LSE is [batch, nhead_q, seqlen_q], or [nhead_q, total_q] in group mode."""
        rows = tuple(q_shape[:-1])
        return rows + (self.hdim_v,), ((self.nhead_q, rows[0]) if group else (rows[0], self.nhead_q, rows[1]))


def _check_layouts(kv_layout, v_layout) -> None:
    for name, value, allowed in (("kv_layout", kv_layout, KV_LAYOUTS), ("v_layout", v_layout, V_LAYOUTS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


_PAGE_DIMS = {"NHD": "[num_pages, page_block_size, nhead_k, {}]", "HND": "[num_pages, nhead_k, page_block_size, {}]"}


def layout_of_arrays(q, k_cache, v_cache, v_layout: str, group: bool, kv_layout: str = "NHD") -> Layout:
    """The layout q and the caches have (anything with shape, ndim and a
    numpy dtype), checked against each other."""
    _check_layouts(kv_layout, v_layout)
    if q.ndim != (3 if group else 4):
        what = "[total_q, nhead_q, hdim] with seqstart_q" if group else "[batch, seqlen_q, nhead_q, hdim]"
        raise ValueError(f"q must have {3 if group else 4} dims {what}, got shape {q.shape}")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {a.shape}")
    dt, kv_fp8 = _check_dtypes(q.dtype, k_cache.dtype, v_cache.dtype)
    nhead_q, hdim_q = q.shape[-2:]
    num_pages, page, nhead_k, hdim_k = k_cache.shape
    if kv_layout == "HND":
        page, nhead_k = nhead_k, page
    if hdim_k != hdim_q:
        raise ValueError(
            f"k_cache head dim {hdim_k} differs from q head dim {hdim_q} (k_cache is "
            f"{_PAGE_DIMS[kv_layout].format('hdim')} for kv_layout={kv_layout!r})"
        )
    hdim_v = v_cache.shape[3] if v_layout == "row" else v_cache.shape[2]
    # Sizes as given, not int(): torch.compile's fake tensors have symbolic
    # sizes, and int() would pin the compiled graph to these values.
    layout = Layout(
        dt,
        np.dtype(q.dtype),
        kv_fp8 or "",
        np.dtype(k_cache.dtype),
        nhead_q,
        nhead_k,
        hdim_q,
        hdim_v,
        page,
        num_pages,
        v_layout,
        kv_layout,
    )
    if tuple(v_cache.shape) != layout.v_shape:
        want = (
            _PAGE_DIMS[kv_layout].format("hdim_v") + f" (kv_layout={kv_layout!r})"
            if v_layout == "row"
            else "[num_pages, nhead_k, hdim_v, page_block_size] (v_layout='col')"
        )
        raise ValueError(f"v_cache shape {v_cache.shape} must be {want} matching k_cache {k_cache.shape}")
    _check_heads(layout, f"q must have at least one head, got nhead_q = {nhead_q} (shape {q.shape})")
    if num_pages < 1 or page < 1 or hdim_q < 1 or hdim_v < 1:
        raise ValueError(f"k_cache/v_cache must be non-empty, got {k_cache.shape} / {v_cache.shape}")
    return layout


def layout_of_params(
    *,
    num_pages,
    page_block_size,
    nhead_q,
    nhead_k,
    hdim,
    hdim_v=None,
    dtype="f16",
    kv_dtype=None,
    v_layout="row",
    kv_layout="NHD",
) -> Layout:
    """A layout given by its numbers (PagedAttention.plan)."""
    sizes = {
        n: check_int(v, n, minimum=1)
        for n, v in (
            ("num_pages", num_pages),
            ("page_block_size", page_block_size),
            ("nhead_q", nhead_q),
            ("nhead_k", nhead_k),
            ("hdim", hdim),
            ("hdim_v", hdim if hdim_v is None else hdim_v),
        )
    }
    q_dt = _np_dtype(dtype, "dtype")
    kv_dt = q_dt if kv_dtype is None else _np_dtype(kv_dtype, "kv_dtype")
    dt, kv_fp8 = _check_dtypes(q_dt, kv_dt, kv_dt)
    _check_layouts(kv_layout, v_layout)
    layout = Layout(
        dt,
        q_dt,
        kv_fp8 or "",
        kv_dt,
        sizes["nhead_q"],
        sizes["nhead_k"],
        sizes["hdim"],
        sizes["hdim_v"],
        sizes["page_block_size"],
        sizes["num_pages"],
        v_layout,
        kv_layout,
    )
    _check_heads(layout, "nhead_q must be >= 1")
    return layout


def _check_heads(layout: Layout, no_heads: str) -> None:
    if layout.nhead_q < 1:
        raise ValueError(no_heads)
    if layout.nhead_k == 0 or layout.nhead_q % layout.nhead_k:
        raise ValueError(f"nhead_q ({layout.nhead_q}) must be a multiple of nhead_k ({layout.nhead_k})")


def _np_dtype(d, name: str) -> np.dtype:
    if d in ("f16", "bf16", "f32"):
        return np_dtype(d)
    if type(d).__module__.startswith("torch"):
        return torch_np_dtype(d)
    try:
        return np.dtype(d)
    except TypeError:
        raise TypeError(f"{name} must be a dtype (numpy, torch, or 'f16'/'bf16'/'f32'), got {d!r}") from None


def _check_dtypes(q_dt, k_dt, v_dt) -> tuple[str, str | None]:
    """(variant dtype, fp8 KV format or None) of a dtype combination."""
    squant = fp8_name(q_dt)  # fp8 q: static quantization
    dt = squant or dtype_name(q_dt)
    if dt is None:
        raise TypeError(f"q must be float16, bfloat16, float32 or an ml_dtypes fp8 type, got {q_dt}")
    kv_fp8 = fp8_name(k_dt)
    if squant:
        for name, a in (("k_cache", k_dt), ("v_cache", v_dt)):
            if a != q_dt:
                raise TypeError(f"{name} dtype {a} must be q's fp8 format {q_dt} (static quantization)")
    elif kv_fp8:
        if dt == "f32":
            raise TypeError("an fp8 KV cache needs float16 or bfloat16 q")
        if v_dt != k_dt:
            raise TypeError(f"v_cache dtype {v_dt} differs from k_cache dtype {k_dt}")
    else:
        for name, a in (("k_cache", k_dt), ("v_cache", v_dt)):
            if a != q_dt:
                raise TypeError(f"{name} dtype {a} differs from q dtype {q_dt}")
    return dt, None if squant else kv_fp8


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
    """A batch step: which query rows and which pages each sequence has."""

    seqlens_q: np.ndarray  # [batch] int64
    seqstart: np.ndarray | None  # [batch + 1] int64 in group mode
    total_q: int  # rows of q: batch * seqlen_q, or seqstart[-1]
    seqlen_q: int  # batch mode: q.shape[1] (0 in group mode)
    block_table: np.ndarray  # [batch, max_pages] as given
    seqlen_k: np.ndarray  # [batch] int64
    offsets: np.ndarray  # [batch] int64 (kv_offset, 0 without)
    first_page: np.ndarray  # first table column each sequence reads
    end_page: np.ndarray  # one past its last

    @property
    def batch(self) -> int:
        return self.seqlens_q.shape[0]

    @property
    def group(self) -> bool:
        return self.seqstart is not None


def tables(block_table, seqlen_k, layout: Layout, *, q_shape: tuple, seqstart_q=None, kv_offset=None) -> Tables:
    """q_shape: q's [batch, seqlen_q] (batch mode) or [total_q] (group mode)."""
    if seqstart_q is not None:
        q_rows = q_shape[0]
        seqstart = int_array(seqstart_q, "seqstart_q", 1).astype(np.int64)
        if seqstart.shape[0] < 1 or seqstart[0] != 0:
            raise ValueError(f"seqstart_q must start at 0 and have batch + 1 entries, got {seqstart.tolist()[:8]}")
        if np.any(np.diff(seqstart) < 0):
            raise ValueError("seqstart_q must be non-decreasing")
        if seqstart[-1] != q_rows:
            raise ValueError(f"seqstart_q[-1] = {seqstart[-1]} must equal total_q = q.shape[0] = {q_rows}")
        seqlens_q, total_q, seqlen_q = np.diff(seqstart), q_rows, 0
    else:
        seqstart = None
        batch, seqlen_q = q_shape[:2]
        seqlens_q = np.full((batch,), seqlen_q, np.int64)
        total_q = batch * seqlen_q
    batch = seqlens_q.shape[0]
    block_table = int_array(block_table, "block_table", 2)
    seqlen_k = int_array(seqlen_k, "seqlen_k", 1).astype(np.int64)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected batch = {batch}")
    if seqlen_k.shape[0] != batch:
        raise ValueError(f"seqlen_k has {seqlen_k.shape[0]} entries, expected batch = {batch}")
    if batch and seqlen_k.min() < 0:
        raise ValueError(f"seqlen_k must be >= 0, got {seqlen_k.min()}")
    offsets = np.zeros((batch,), np.int64)
    if kv_offset is not None:
        offsets = int_array(kv_offset, "kv_offset", 1).astype(np.int64)
        if offsets.shape[0] != batch:
            raise ValueError(f"kv_offset has {offsets.shape[0]} entries, expected batch = {batch}")
        if batch and offsets.min() < 0:
            raise ValueError(f"kv_offset must be >= 0, got {offsets.min()}")
    first, end = _pages_used(block_table, seqlen_k, offsets, layout, kv_offset is not None)
    return Tables(seqlens_q, seqstart, int(total_q), int(seqlen_q), block_table, seqlen_k, offsets, first, end)


def _pages_used(block_table, seqlen_k, offsets, layout: Layout, gappy: bool):
    page = layout.page_block_size
    capacity = block_table.shape[1] * page
    end = offsets + seqlen_k
    if end.size and end.max() > capacity:
        b = int(np.argmax(end))
        raise ValueError(
            f"seqlen_k[{b}] = {seqlen_k[b]}"
            + (f" + kv_offset[{b}] = {offsets[b]}" if gappy else "")
            + f" exceeds the block table capacity ({block_table.shape[1]} pages x {page} = {capacity})"
        )
    first_page = offsets // page
    end_page = np.where(seqlen_k > 0, -(-end // page), first_page)
    slots = np.arange(block_table.shape[1])[None, :]
    used = (slots >= first_page[:, None]) & (slots < end_page[:, None])
    bad = used & ((block_table < 0) | (block_table >= layout.num_pages))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {block_table[b, j]} is not a page id in "
            f"[0, {layout.num_pages}) (slot used by seqlen_k[{b}] = {seqlen_k[b]})"
        )
    return first_page, end_page


@dataclasses.dataclass(frozen=True, eq=False)
class Scores:
    """The score terms, in ck_tile's order: scale, soft-cap, ALiBi or bias,
    mask; sinks join the denominator. fp8 scales are descales."""

    scale: float
    softcap: float
    mask: MaskSpec
    alibi_slopes: np.ndarray | None  # [batch, nhead_q] f32
    bias: np.ndarray | None  # f32, as given (batch or group layout)
    sinks: np.ndarray | None  # [nhead_q] f32
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    p_scale: float = 1.0
    out_scale: float = 1.0


def scores(
    layout: Layout,
    t: Tables,
    *,
    scale=None,
    mask_type="none",
    window_size_left=-1,
    window_size_right=-1,
    sink_size=0,
    alibi_slopes=None,
    bias=None,
    logits_soft_cap=0.0,
    sinks=None,
    **quant,
) -> Scores:
    quant = _quant_scales(layout, quant)
    scale = 1.0 / math.sqrt(layout.hdim_q) if scale is None else check_float(scale, "scale")
    mask = MaskSpec.from_args(mask_type, window_size_left, window_size_right, sink_size)
    cap = check_float(logits_soft_cap, "logits_soft_cap")
    if cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0 (0 disables), got {cap}")
    # The kernels fold these into f32 products (the online ones also times
    # log2(e)): each product must stay a float32.
    for what, value in (
        ("scale x q_scale x k_scale", abs(scale) * quant["q_scale"] * quant["k_scale"] * LOG2E),
        ("logits_soft_cap", cap * LOG2E),
        ("v_scale / (p_scale x out_scale)", quant["v_scale"] / (quant["p_scale"] * quant["out_scale"])),
    ):
        if not value <= F32_MAX:
            raise ValueError(f"{what} overflows float32 in the kernels (with log2(e) folded in: {value:.4g})")
    if alibi_slopes is not None and bias is not None:
        raise ValueError("alibi_slopes and bias cannot be combined (ck_tile has one bias slot)")
    if cap > 0 and (alibi_slopes is not None or bias is not None):
        raise ValueError(
            "logits_soft_cap cannot be combined with bias or alibi_slopes (ck_tile forbids soft-cap with any bias)"
        )
    slopes = None if alibi_slopes is None else _slopes(alibi_slopes, layout, t)
    bias_a = None if bias is None else _bias(bias, layout, t)
    sinks_a = None if sinks is None else sinks_array(sinks, layout.nhead_q)
    return Scores(scale, cap, mask, slopes, bias_a, sinks_a, **quant)


def sinks_array(sinks, nhead_q: int) -> np.ndarray:
    """Attention sinks (one finite logit per query head) as the kernels take
    them: contiguous float32 [nhead_q]."""
    a = float_array(sinks, "sinks", finite=True)
    if a.shape != (nhead_q,):
        raise ValueError(f"sinks must have shape [nhead_q] = [{nhead_q}], got {list(a.shape)}")
    return np.ascontiguousarray(a, np.float32)


def _quant_scales(layout: Layout, given: dict) -> dict:
    unknown = set(given) - {"q_scale", "k_scale", "v_scale", "p_scale", "out_scale"}
    if unknown:
        raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
    squant = layout.static_quant
    kv_fp8 = squant or bool(layout.kv_dtype)  # static quantization has fp8 caches too
    quant = {}
    for name, allowed, why in (
        ("q_scale", squant, "fp8 q"),
        ("k_scale", kv_fp8, "fp8 KV caches"),
        ("v_scale", kv_fp8, "fp8 KV caches"),
        ("p_scale", squant, "fp8 q"),
        ("out_scale", squant, "fp8 q"),
    ):
        val = given.get(name)
        if val is None:
            quant[name] = fp8_max(layout.q_dtype) if name == "p_scale" and squant else 1.0
            continue
        if not allowed:
            raise ValueError(f"{name} is for {why} only (q is {layout.q_dtype}, k_cache is {layout.cache_dtype})")
        val = check_float(val, name)
        if val <= 0:
            raise ValueError(f"{name} must be > 0, got {val}")
        quant[name] = val
    return quant


def _slopes(alibi_slopes, layout: Layout, t: Tables) -> np.ndarray:
    hq, batch = layout.nhead_q, t.batch
    slopes = float_array(alibi_slopes, "alibi_slopes", finite=True)
    if slopes.shape not in ((hq,), (batch, hq)):
        raise ValueError(
            f"alibi_slopes must have shape [nhead_q] = [{hq}] or "
            f"[batch, nhead_q] = [{batch}, {hq}], got {list(slopes.shape)}"
        )
    slopes = np.broadcast_to(slopes, (batch, hq))
    # The term is slope * distance (or * key position, causal): it must stay
    # a float32 for every key and row the call has.
    reach = (int(t.seqlens_q.max()) + int(t.seqlen_k.max())) if batch else 0
    steep = float(np.abs(slopes).max()) if slopes.size else 0.0
    if steep * reach > F32_MAX:
        raise ValueError(f"alibi_slopes: |slope| {steep:.4g} x distances up to {reach} overflow float32")
    return slopes


def _bias(bias, layout: Layout, t: Tables) -> np.ndarray:
    hq, batch = layout.nhead_q, t.batch
    max_sk = int(t.seqlen_k.max()) if batch else 0
    b = float_array(bias, "bias")
    if t.group:
        ok = b.ndim == 3 and b.shape[0] in (1, hq) and b.shape[1] == t.total_q
        want = f"[nhead_q or 1, total_q, >= max(seqlen_k)] = [{hq} or 1, {t.total_q}, >= {max_sk}]"
    else:
        rows = t.seqlen_q
        ok = b.ndim == 4 and b.shape[0] in (1, batch) and b.shape[1] in (1, hq) and b.shape[2] == rows
        want = (
            f"[batch or 1, nhead_q or 1, seqlen_q, >= max(seqlen_k)] = [{batch} or 1, {hq} or 1, {rows}, >= {max_sk}]"
        )
    if not ok or b.shape[-1] < max_sk:
        raise ValueError(f"bias must have shape {want}, got {list(b.shape)}")
    return b


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    layout: Layout
    tables: Tables
    scores: Scores
    min_seqlen_q: int = 0
    num_splits: int | None = None
    kv_rows_finite: bool | None = None

    @property
    def key(self) -> dict:
        """The fields a variant must match (Variant.problem); bias_shape is
        that of the bias the kernel call passes, known once it is laid out."""
        lay, s = self.layout, self.scores
        return dict(
            dtype=lay.dtype,
            hdim_q=lay.hdim_q,
            hdim_v=lay.hdim_v,
            nhead_q=lay.nhead_q,
            nhead_k=lay.nhead_k,
            group=0,
            page_block_size=lay.page_block_size,
            mask=s.mask.type,
            bias="alibi" if s.alibi_slopes is not None else ("elementwise" if s.bias is not None else "none"),
            bias_shape="",
            softcap=s.softcap > 0,
            sinks=s.sinks is not None,
            kv_layout=lay.kv_layout,
            v_layout=lay.v_layout,
            kv_dtype=lay.kv_dtype,
        )


def problem(layout: Layout, t: Tables, s: Scores, *, min_seqlen_q=0, num_splits=None, kv_rows_finite=None) -> Problem:
    min_seqlen_q = check_int(min_seqlen_q, "min_seqlen_q", minimum=0)
    if min_seqlen_q and not t.group:
        raise ValueError("min_seqlen_q (skip_min_seqlen_q) needs group mode (seqstart_q)")
    if num_splits is not None:
        num_splits = check_int(num_splits, "num_splits", minimum=1)
        if num_splits > 1 and layout.static_quant:
            raise ValueError("num_splits > 1 cannot be combined with fp8 q (the partial outputs would be fp8)")
    if kv_rows_finite is not None and not isinstance(kv_rows_finite, bool):
        raise TypeError(f"kv_rows_finite must be a bool or None, got {type(kv_rows_finite).__name__}")
    return Problem(layout, t, s, min_seqlen_q, num_splits, kv_rows_finite)


def from_arrays(
    q,
    k_cache,
    v_cache,
    block_table,
    seqlen_k,
    *,
    seqstart_q=None,
    kv_offset=None,
    v_layout="row",
    kv_layout="NHD",
    min_seqlen_q=0,
    num_splits=None,
    kv_rows_finite=None,
    **score_terms,
) -> Problem:
    """The Problem of fmha_fwd_paged's arguments. Only shapes and dtypes of
    q and the caches are looked at (a torch GPU q stays on its device)."""
    from ..core.arrays import DeviceCache, TensorInfo, cache_array, is_torch, to_numpy

    qi = TensorInfo(q) if is_torch(q) and q.device.type != "cpu" else to_numpy(q, "q")
    kc, vc = cache_array(k_cache, "k_cache"), cache_array(v_cache, "v_cache")
    if isinstance(kc, DeviceCache) != isinstance(vc, DeviceCache):
        raise TypeError("k_cache and v_cache must both be host arrays or both IREE device arrays")
    layout = layout_of_arrays(qi, kc, vc, v_layout, seqstart_q is not None, kv_layout)
    t = tables(block_table, seqlen_k, layout, q_shape=tuple(qi.shape[:-2]), seqstart_q=seqstart_q, kv_offset=kv_offset)
    s = scores(layout, t, **score_terms)
    return problem(layout, t, s, min_seqlen_q=min_seqlen_q, num_splits=num_splits, kv_rows_finite=kv_rows_finite)
