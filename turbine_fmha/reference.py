"""Float64 numpy reference of the paged-KV attention forward.

Deliberately plain: one (batch, head) at a time, keys gathered through the
block table, ck_tile's generic mask evaluated per element. Tests and the demo
compare the kernels against it.
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
) -> np.ndarray:
    """Boolean [seqlen_q, seqlen_k]: may query row i attend to key t?

    ck_tile's generic mask (make_generic_attention_mask_coordinates_from_lr_window
    followed by IsOutOfBound): with shift = seqlen_k - seqlen_q for bottom-right
    and 0 for top-left, key t is visible from row i iff
        i + shift - left <= t <= i + shift + right,
    where a window size of -1 leaves that side unbounded. Causal is (-1, 0).
    """
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
    i = np.arange(seqlen_q)[:, None]
    t = np.arange(seqlen_k)[None, :]
    if mask_type == "none":
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    shift = seqlen_k - seqlen_q if mask_type == "bottom_right" else 0
    vis = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if window_size_left >= 0:
        vis &= t >= i + shift - window_size_left
    if window_size_right >= 0:
        vis &= t <= i + shift + window_size_right
    return vis


def gather_pages(cache: np.ndarray, pages: np.ndarray, seqlen: int) -> np.ndarray:
    """Rows 0..seqlen-1 of a sequence whose pages are `pages` (in order)."""
    page = cache.shape[1]
    n_used = -(-seqlen // page)
    rows = cache[pages[:n_used]].reshape(n_used * page, *cache.shape[2:])
    return rows[:seqlen]


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
):
    """Returns (out [b, sq, hq, dv] float64, lse [b, hq, sq] float64).

    A row with no visible key gets output 0 and LSE -inf.
    """
    q = np.asarray(q, dtype=np.float64)
    k_cache = np.asarray(k_cache, dtype=np.float64)
    v_cache = np.asarray(v_cache, dtype=np.float64)
    block_table = np.asarray(block_table)
    seqlen_k = np.asarray(seqlen_k)
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    dv = v_cache.shape[3]
    group = hq // hk
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    out = np.zeros((b, sq, hq, dv))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        sk = int(seqlen_k[bi])
        k = gather_pages(k_cache, block_table[bi], sk)  # [sk, hk, d]
        v = gather_pages(v_cache, block_table[bi], sk)
        vis = visible_mask(sq, sk, mask_type, window_size_left, window_size_right)
        for h in range(hq):
            s = scale * (q[bi, :, h, :] @ k[:, h // group, :].T)  # [sq, sk]
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=1, initial=-np.inf)
            has_key = np.isfinite(m)
            p = np.exp(s - np.where(has_key, m, 0.0)[:, None])
            l = p.sum(axis=1)
            o = p @ v[:, h // group, :]
            out[bi, :, h, :] = np.where(has_key[:, None], o / np.where(has_key, l, 1.0)[:, None], 0.0)
            lse[bi, h, :] = np.where(has_key, m + np.log(np.where(has_key, l, 1.0)), -np.inf)
    return out, lse
