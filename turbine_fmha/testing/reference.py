"""Float64 numpy reference of the paged-KV attention forward.

Deliberately plain: one (batch, head) at a time, keys gathered through the
block table, and every term written the way ck_tile's host reference and
fwd pipeline define it (block_masking.hpp, block_position_encoding.hpp,
variants.hpp). Tests and the demo compare the kernels against it.

Score of query row i and key t for head h, in this order:
    s = scale * q.k
    s = cap * tanh(s / cap)                   logits_soft_cap = cap > 0
    s += alibi(h, i, t)                       alibi_slopes
    s += bias[b, h, i, t]                     bias (broadcast over size-1 axes)
    s = -inf where the mask hides t
Softmax over the visible keys; a per-head attention sink (sinks) joins the
denominator as exp(sink - m) and contributes no value. A row without visible
keys gets output 0 and LSE -inf (LSE = sink with sinks).

Static quantization (q an ml_dtypes fp8 array, ck_tile's kDoFp8StaticQuant):
Q, K, V are dequantized by q_scale / k_scale / v_scale; the probabilities
exp(s - m), m the row max of the visible scores, are rounded to
fp8(p * p_scale) for the PV product while the denominator stays exact; the
output is fp8(out / out_scale), saturated, returned as float64 values of the
fp8 grid (what the kernel's fp8 output decodes to).
"""

from __future__ import annotations

import numpy as np

MASK_TYPES = ("none", "top_left", "bottom_right")


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    mask_type: str = "none",
    window_size_left: int = -1,
    window_size_right: int = -1,
    sink_size: int = 0,
) -> np.ndarray:
    """Boolean [seqlen_q, seqlen_k]: may query row i attend to key t?

    ck_tile's make_generic_attention_mask_coordinates_from_lr_window and
    GenericAttentionMask::IsOutOfSinkBound, transcribed.
    """
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
    i = np.arange(seqlen_q)[:, None]
    t = np.arange(seqlen_k)[None, :]
    if mask_type == "none":
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    top_left = mask_type == "top_left"
    sq, sk = seqlen_q, seqlen_k
    left = window_size_left if window_size_left >= 0 else (sq - 1 if top_left else sk - 1)
    right = window_size_right if window_size_right >= 0 else (sk - 1 if top_left else sq - 1)
    x_tmp = 0 if top_left else sk - sq
    y_tmp = 0 if top_left else sq - sk
    x = 1 + right + x_tmp
    y = 1 + left + y_tmp
    x_start = -y + i + 1
    x_end = np.minimum(i + x, sk)
    in_window = (t >= x_start) & (t < x_end)
    is_sink = (t < sink_size) & (t < i + x) & (y < sq) & (i < sk)
    return in_window | is_sink


def alibi_bias(
    slope: float, seqlen_q: int, seqlen_k: int, mask_type: str, window_size_left: int, window_size_right: int
) -> np.ndarray:
    """ck_tile's ALiBi term [seqlen_q, seqlen_k] for one head (slope > 0).

    make_alibi_from_lr_mask: a causal mask (left < 0, right == 0) uses the
    VERTICAL form +slope * t; otherwise -slope * |i + shift - t|, shift =
    seqlen_k - seqlen_q except for top-left masks (bottom-right alignment when
    there is no mask).
    """
    i = np.arange(seqlen_q)[:, None]
    t = np.arange(seqlen_k)[None, :]
    if mask_type != "none" and window_size_left < 0 and window_size_right == 0:
        return slope * np.broadcast_to(t, (seqlen_q, seqlen_k)).astype(np.float64)
    shift = 0 if mask_type == "top_left" else seqlen_k - seqlen_q
    return -slope * np.abs(i + shift - t).astype(np.float64)


def fp8_round(x, dtype) -> np.ndarray:
    """x rounded to the nearest value of ml_dtypes fp8 `dtype` (ties to
    even), saturated to +-max, as float64."""
    import ml_dtypes

    top = float(ml_dtypes.finfo(dtype).max)
    return np.clip(np.asarray(x, np.float64), -top, top).astype(dtype).astype(np.float64)


def _fp8_dtype(a):
    dt = getattr(a, "dtype", None)
    return dt if dt is not None and "float8" in str(dt) else None


class _Scaled:
    """A cache in its own dtype with its dequantization scale."""

    def __init__(self, array, scale):
        self.array, self.scale = array, scale
        self.shape = array.shape

    def gather(self, pages, seqlen, offset):
        return gather_pages(self.array, pages, seqlen, offset).astype(np.float64) * self.scale


def gather_pages(cache: np.ndarray, pages: np.ndarray, seqlen: int, offset: int = 0) -> np.ndarray:
    """Keys 0..seqlen-1 of a sequence whose pages are `pages` (in order): key
    t is table position offset + t (offset > 0: gappy KV)."""
    page = cache.shape[1]
    pos = offset + np.arange(seqlen)
    return cache[pages[pos // page], pos % page] if seqlen else cache[:0, 0]


def fmha_fwd_paged_ref(
    q,
    k_cache,
    v_cache,
    block_table,
    seqlen_k,
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
    seqstart_q=None,
    kv_offset=None,
    v_layout="row",
    kv_layout="NHD",
    q_scale=None,
    k_scale=None,
    v_scale=None,
    p_scale=None,
    out_scale=None,
):
    """Batch mode: (out [b, sq, hq, dv], lse [b, hq, sq]), float64.

    Group mode (seqstart_q given, q [total_q, hq, d]): each sequence is
    computed on its own rows, giving (out [total_q, hq, dv], lse [hq,
    total_q]); bias is then [hq or 1, total_q, keys]. kv_offset: key t of
    sequence b is table position kv_offset[b] + t.
    """
    quant = None
    fmt = _fp8_dtype(q)
    if fmt is not None:
        import ml_dtypes

        quant = (
            fmt,
            float(ml_dtypes.finfo(fmt).max) if p_scale is None else p_scale,
            1.0 if out_scale is None else out_scale,
        )
    q = np.asarray(q).astype(np.float64) * (1.0 if q_scale is None else q_scale)
    # The caches stay in their dtype (a pool may be far larger than what a
    # call reads); each sequence's gathered rows are converted and scaled.
    k_cache = _Scaled(np.asarray(k_cache), 1.0 if k_scale is None else k_scale)
    v_cache = _Scaled(np.asarray(v_cache), 1.0 if v_scale is None else v_scale)
    if kv_layout == "HND":  # [pages, nhead_k, page, dim] -> NHD
        k_cache = _Scaled(k_cache.array.transpose(0, 2, 1, 3), k_cache.scale)
        if v_layout == "row":
            v_cache = _Scaled(v_cache.array.transpose(0, 2, 1, 3), v_cache.scale)
    if v_layout == "col":  # [pages, nhead_k, hdim_v, page] -> row-major
        v_cache = _Scaled(v_cache.array.transpose(0, 3, 1, 2), v_cache.scale)
    block_table = np.asarray(block_table)
    seqlen_k = np.asarray(seqlen_k)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    hq = q.shape[-2]
    kw = dict(
        scale=scale,
        mask_type=mask_type,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        sink_size=sink_size,
        logits_soft_cap=logits_soft_cap,
        sinks=None if sinks is None else np.asarray(sinks, np.float64),
        quant=quant,
    )
    if seqstart_q is None:
        return _batch_ref(q, k_cache, v_cache, block_table, seqlen_k, kv_offset, alibi_slopes, bias, **kw)
    total_q = q.shape[0]
    batch = len(seqstart_q) - 1
    out = np.zeros((total_q, hq, v_cache.shape[3]))
    lse = np.full((hq, total_q), -np.inf)
    for b in range(batch):
        s0, s1 = int(seqstart_q[b]), int(seqstart_q[b + 1])
        if s1 == s0:
            continue
        o, row_sum = _batch_ref(
            q[None, s0:s1],
            k_cache,
            v_cache,
            block_table[b : b + 1],
            seqlen_k[b : b + 1],
            None if kv_offset is None else np.asarray(kv_offset)[b : b + 1],
            None if alibi_slopes is None else np.broadcast_to(alibi_slopes, (batch, hq))[b : b + 1],
            None if bias is None else np.asarray(bias)[None, :, s0:s1],
            **kw,
        )
        out[s0:s1] = o[0]
        lse[:, s0:s1] = row_sum[0]
    return out, lse


def _batch_ref(
    q,
    k_cache,
    v_cache,
    block_table,
    seqlen_k,
    kv_offset,
    alibi_slopes,
    bias,
    *,
    scale,
    mask_type,
    window_size_left,
    window_size_right,
    sink_size,
    logits_soft_cap,
    sinks,
    quant,
):
    """Batch mode on dequantized float64 inputs (v_cache row-major)."""
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    dv = v_cache.shape[3]
    group = hq // hk
    if alibi_slopes is not None:
        alibi_slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), (b, hq))
    if bias is not None:
        bias = np.asarray(bias, np.float64)
    out = np.zeros((b, sq, hq, dv))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        sk = int(seqlen_k[bi])
        off = 0 if kv_offset is None else int(kv_offset[bi])
        k = k_cache.gather(block_table[bi], sk, off)  # [sk, hk, d] float64
        v = v_cache.gather(block_table[bi], sk, off)
        vis = visible_mask(sq, sk, mask_type, window_size_left, window_size_right, sink_size)
        for h in range(hq):
            s = scale * (q[bi, :, h, :] @ k[:, h // group, :].T)  # [sq, sk]
            if logits_soft_cap > 0:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            if alibi_slopes is not None:
                s = s + alibi_bias(alibi_slopes[bi, h], sq, sk, mask_type, window_size_left, window_size_right)
            if bias is not None:
                s = s + bias[bi % bias.shape[0], h % bias.shape[1], :, :sk]
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=1, initial=-np.inf)
            if quant is not None:
                # P is quantized against the visible max (the sink does not
                # move it); the sink only joins the denominator.
                fmt, p_scale, out_scale = quant
                m0 = np.where(np.isneginf(m), 0.0, m)
                p = np.exp(s - m0[:, None])
                row_sum = p.sum(axis=1) + (0.0 if sinks is None else np.exp(sinks[h] - m0))
                o = (fp8_round(p * p_scale, fmt) @ v[:, h // group, :]) / p_scale
                out[bi, :, h, :] = fp8_round(_normalize(o, row_sum) / out_scale, fmt)
            if sinks is not None:
                m = np.maximum(m, sinks[h])
            # A row without visible keys has max -inf: shift by 0 so that its
            # sum is exactly 0 (output 0, LSE -inf). NaN (or +inf) scores are
            # not special-cased: they propagate NaN, as exp() does in ck_tile.
            m0 = np.where(np.isneginf(m), 0.0, m)
            p = np.exp(s - m0[:, None])
            row_sum = p.sum(axis=1)
            if sinks is not None:
                row_sum = row_sum + np.exp(sinks[h] - m0)
            empty = row_sum == 0
            with np.errstate(divide="ignore", invalid="ignore"):
                lse[bi, h, :] = np.where(empty, -np.inf, m0 + np.log(np.where(empty, 1.0, row_sum)))
            if quant is None:
                out[bi, :, h, :] = _normalize(p @ v[:, h // group, :], row_sum)
    return out, lse


def _normalize(o, row_sum):
    """o / l per row; rows whose sum is exactly 0 (no visible key) are 0."""
    empty = row_sum == 0
    with np.errstate(invalid="ignore"):
        return np.where(empty[:, None], 0.0, o / np.where(empty, 1.0, row_sum)[:, None])
