"""The call modes, each brought to the batch-mode kernel call.

- Group (varlen) mode: each sequence's rows, padded to the longest, become
  one batch entry (`regroup`).
- Gappy KV: the whole pages before each sequence's first key are dropped
  from its table row; the remainder (< page) is the kernel's kv_shift
  (`gappy_table`), and a bias follows the rows it lands on (`bias_rows`).
- Non-paged caches: viewed as pages without copying (`paged_view`).
"""

from __future__ import annotations

import numpy as np

from ..core.arrays import is_torch, to_numpy
from ..core.checks import int_array
from .plan import bias_in_table_rows, fill_unused_slots
from .problem import Tables


def active_sequences(t: Tables, min_seqlen_q: int) -> np.ndarray:
    """The sequences a call computes (group mode skips those with at most
    min_seqlen_q rows: ck_tile's skip_min_seqlen_q)."""
    return np.nonzero(t.seqlens_q > min_seqlen_q)[0] if t.group else np.arange(t.batch)


def regroup(t: Tables, active: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst): row src[i] of the varlen q (and out) is row dst[i] of the
    padded [active, rows] batch, flattened. One gather and one scatter per
    call, not one copy per sequence."""
    lens = t.seqlens_q[active]
    owner = np.repeat(np.arange(active.size), lens)
    within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return t.seqstart[active][owner] + within, owner * rows + within


def gappy_table(t: Tables, active: np.ndarray, page: int) -> tuple[np.ndarray, np.ndarray]:
    """(block table [active, width] int32, kv_shift [active]): each row's
    used columns from its first page, unused ones pointing at a page the
    sequence owns (fill_unused_slots)."""
    shift = (t.offsets - t.first_page * page)[active]
    n_used = (t.end_page - t.first_page)[active]
    width = max(1, int(n_used.max())) if active.size else 1
    bt = np.zeros((active.size, width), np.int32)
    for i, b in enumerate(active):
        bt[i, : n_used[i]] = t.block_table[b, t.first_page[b] : t.end_page[b]]
    fill_unused_slots(bt, n_used)
    return bt, shift


def bias_rows(bias: np.ndarray, t: Tables, active: np.ndarray, rows: int, shift: np.ndarray, nk: int) -> np.ndarray:
    """The bias laid out as the kernels read it: batch entries of `rows`
    query rows (group mode regrouped), keys by gathered row (gappy KV)."""
    if t.group:
        out = np.zeros((active.size, bias.shape[0], rows, bias.shape[2]), np.float32)
        for i, b in enumerate(active):
            out[i, :, : t.seqlens_q[b]] = bias[:, t.seqstart[b] : t.seqstart[b + 1]]
        bias = out
    if shift.any():
        bias = bias_in_table_rows(bias, shift, nk)
    return bias


# Page sizes a non-paged cache may be viewed as, largest first.
VIEW_PAGES = (128, 64, 32, 16, 1)


def paged_view(k_cache, v_cache, seqlen_k, cache_batch_idx, session, name="seqlen_k"):
    """(k pages, v pages, block_table, seqlen_k) over a non-paged cache
    [batch_cache, max_seqlen_k, nhead_k, hdim], without copying it: pages of
    the largest size that divides max_seqlen_k and that the session has
    kernels for (GPU default sets have pages 16 and 64 only), else the
    largest. torch caches stay torch views on their device. A cache of no
    rows (max_seqlen_k 0) has no page to view: one zero page stands in,
    never read since every seqlen_k is then 0. `name` is the seqlen_k
    argument's name in errors (cache_seqlens is flash-attn's)."""
    k_src = k_cache if is_torch(k_cache) else to_numpy(k_cache, "k_cache")
    v_src = v_cache if is_torch(v_cache) else to_numpy(v_cache, "v_cache")
    for cache, a in (("k_cache", k_src), ("v_cache", v_src)):
        if a.ndim != 4:
            raise ValueError(
                f"{cache} must have 4 dims [batch_cache, max_seqlen_k, nhead_k, hdim], got shape {a.shape}"
            )
    if tuple(v_src.shape[:3]) != tuple(k_src.shape[:3]):
        raise ValueError(f"v_cache shape {v_src.shape} must match k_cache {k_src.shape} in its first 3 dims")
    batch_cache, max_sk = k_src.shape[:2]
    sk = int_array(seqlen_k, name, 1)
    rows_idx = _cache_rows(sk, cache_batch_idx, batch_cache, max_sk, name)
    # An empty cache may be viewed as pages of any size: one row is the
    # least to allocate, unless the session serves other sizes only.
    fits = [p for p in VIEW_PAGES if max_sk % p == 0] if max_sk else [1, *VIEW_PAGES[:-1]]
    served = (
        set()
        if getattr(session, "compile_missing", True)
        else {
            v.page_block_size
            for v in session.available_variants()
            if v.hdim_q == k_src.shape[3] and v.nhead_k == k_src.shape[2]
        }
    )
    page = next((p for p in fits if p in served), fits[0])
    if not max_sk:
        return _zero_page(k_src, page), _zero_page(v_src, page), np.zeros((sk.shape[0], 1), np.int32), sk
    per_row = max_sk // page

    def pages_of(a):
        a = a.contiguous() if is_torch(a) else np.ascontiguousarray(a)
        return a.reshape(batch_cache * per_row, page, *a.shape[2:])

    block_table = (rows_idx[:, None] * per_row + np.arange(per_row)[None, :]).astype(np.int32)
    return pages_of(k_src), pages_of(v_src), block_table, sk


def _zero_page(a, page: int):
    """One page [1, page, nhead_k, hdim] of zeros in a's dtype, on its device."""
    shape = (1, page, *a.shape[2:])
    if is_torch(a):
        import torch

        return torch.zeros(shape, dtype=a.dtype, device=a.device)
    return np.zeros(shape, a.dtype)


def _cache_rows(sk: np.ndarray, cache_batch_idx, batch_cache: int, max_sk: int, name: str) -> np.ndarray:
    batch = sk.shape[0]
    if batch and (sk.max() > max_sk or sk.min() < 0):
        b = int(np.argmax(sk)) if sk.max() > max_sk else int(np.argmin(sk))
        empty = " (k_cache has no rows: k_cache.shape[1] is 0)" if not max_sk else ""
        raise ValueError(f"{name}[{b}] = {sk[b]} must be in [0, max_seqlen_k = {max_sk}]{empty}")
    if cache_batch_idx is None:
        if batch > batch_cache:
            raise ValueError(f"batch {batch} exceeds the cache's {batch_cache} rows; pass cache_batch_idx")
        return np.arange(batch)
    rows_idx = int_array(cache_batch_idx, "cache_batch_idx", 1).astype(np.int64)
    if rows_idx.shape[0] != batch:
        raise ValueError(f"cache_batch_idx has {rows_idx.shape[0]} entries, expected batch = {batch}")
    if batch and (rows_idx.min() < 0 or rows_idx.max() >= batch_cache):
        b = int(np.argmax((rows_idx < 0) | (rows_idx >= batch_cache)))
        raise ValueError(f"cache_batch_idx[{b}] = {rows_idx[b]} is not a cache row in [0, {batch_cache})")
    return rows_idx
