"""flash-attn's conventions, mapped onto fmha_fwd_paged / fmha_fwd_kvcache.

- `conventions`: `causal=True`, `softmax_scale` and `window_size=(left,
  right)` as the runtime's own mask_type / scale / window_size_left and
  window_size_right (fmha_fwd_paged takes both spellings).
- `kvcache_seqlens`: fmha_fwd_kvcache's key counts given as `seqlen_k` or
  `cache_seqlens`, an int or an array.
- `flash_attn_with_kvcache`: flash-attn's function of that name, with its
  argument names and semantics.

Nothing here imports torch or touches array data, except the in-call
appends: it runs as it is inside torch.compile, before the call reaches
the registered op (torch_ops); with in-call appends the whole call goes
to the op, which runs it eagerly.
"""

from __future__ import annotations

import numbers
import sys

import numpy as np

from .arrays import _is_device_array, _is_torch
from .checks import check_int, int_array
from .tracing import compiling


def conventions(*, scale=None, softmax_scale=None, causal=False, window_size=None, mask_type="none",
                window_size_left=-1, window_size_right=-1) -> dict:
    """scale, mask_type, window_size_left and window_size_right from either
    spelling. Two spellings of one thing that disagree raise ValueError
    naming both; values are checked later, by the Problem."""
    if softmax_scale is not None:
        if scale is not None:
            raise ValueError("scale and softmax_scale are the same argument (softmax_scale is flash-attn's "
                             "name): pass one of them")
        scale = softmax_scale
    right_name = "window_size_right"
    if window_size is not None:
        if (window_size_left, window_size_right) != (-1, -1):
            raise ValueError("window_size and window_size_left/window_size_right are the same argument: pass "
                             "either window_size=(left, right) or the two sides")
        window_size_left, window_size_right = _pair(window_size)
        right_name = "window_size[1]"
        # flash-attn's local windows are aligned like its causal mask: to
        # the bottom right (the top-left form needs mask_type to say so).
        if mask_type == "none" and (window_size_left, window_size_right) != (-1, -1):
            mask_type = "bottom_right"
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        if mask_type == "top_left":
            raise ValueError("causal=True (the bottom-right causal mask) conflicts with mask_type='top_left'")
        # An unbounded right side (-1) is the default of both spellings:
        # only a positive one contradicts causal.
        if isinstance(window_size_right, numbers.Integral) and window_size_right > 0:
            raise ValueError(f"causal=True (a right window side of 0) conflicts with {right_name} = "
                             f"{window_size_right}")
        mask_type, window_size_right = "bottom_right", 0
    return dict(scale=scale, mask_type=mask_type, window_size_left=window_size_left,
                window_size_right=window_size_right)


def _pair(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    return tuple(check_int(v, f"window_size[{i}]", minimum=-1) for i, v in enumerate(window_size))


def kvcache_seqlens(q, k_cache, seqlen_k=None, cache_seqlens=None, seqstart_q=None):
    """The key count of each sequence of a non-paged cache: an array given
    as seqlen_k or cache_seqlens (flash-attn's name), an int for every
    sequence, or None for the whole cache row (k_cache.shape[1]), as
    flash-attn does. An int becomes an array beside q (numpy, or a torch
    tensor in host memory: the tables are read on the host)."""
    if cache_seqlens is not None:
        if seqlen_k is not None:
            raise ValueError("seqlen_k and cache_seqlens are the same argument (cache_seqlens is flash-attn's "
                             "name): pass one of them")
        seqlen_k, name = cache_seqlens, "cache_seqlens"
    else:
        name = "seqlen_k"
    if seqlen_k is None:
        shape = tuple(getattr(k_cache, "shape", ()))
        seqlen_k = int(shape[1]) if len(shape) == 4 else 0
    if not isinstance(seqlen_k, numbers.Integral) or isinstance(seqlen_k, bool):
        return seqlen_k
    n = check_int(seqlen_k, name, minimum=0)
    batch = _batch(q, seqstart_q)
    if _is_torch(q):
        torch = sys.modules["torch"]
        return torch.full((batch,), n, dtype=torch.int64)
    return np.full((batch,), n, np.int64)


def _batch(q, seqstart_q) -> int:
    if seqstart_q is None:
        shape = tuple(getattr(q, "shape", ()))
        return int(shape[0]) if shape else 0
    shape = tuple(getattr(seqstart_q, "shape", ()))
    if len(shape) != 1:
        raise ValueError(f"seqstart_q must have 1 dims, got shape {shape}")
    return max(int(shape[0]) - 1, 0)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, session=None, device="cpu"):
    """flash-attn's `flash_attn_with_kvcache`, run by fmha_fwd_paged (with
    block_table) or fmha_fwd_kvcache (without).

    Same argument names and semantics: q [batch, seqlen_q, nheads, headdim];
    k_cache / v_cache [batch_cache, seqlen_cache, nheads_k, headdim], or
    [num_blocks, page_block_size, nheads_k, headdim] with block_table
    [batch, max_blocks_per_seq] (any page size here, not only multiples of
    256); cache_seqlens an int or [batch] (default: the whole cache row, or
    the block table's capacity); cache_batch_idx (non-paged caches only, as
    in flash-attn); cache_leftpad [batch] (keys start there; here with
    paged caches too); causal (bottom-right aligned); window_size (left,
    right), -1 unbounded, bottom-right aligned; softcap (0 = off);
    alibi_slopes [nheads] or [batch, nheads]; num_splits (0 = heuristic);
    return_softmax_lse (LSE [batch, nheads, seqlen_q] float32). GQA/MQA as
    in flash-attn. Returns out, or (out, softmax_lse).

    Differences: a query row that sees no key has LSE -inf (flash-attn
    returns +inf; the output is 0 in both). Conflicting arguments raise
    instead of one silently winning: causal=True with a positive
    window_size[1], cache_batch_idx with block_table, softcap with
    alibi_slopes (ck_tile forbids it). `session` and `device` are as in
    fmha_fwd_paged.

    In-call appends, as in flash-attn: k, v [batch, seqlen_new, nheads_k,
    headdim] are written into the caches in place (reshape_and_cache) at
    positions cache_seqlens[b] + i (required with them), through
    block_table or into cache row cache_batch_idx[b], and attention sees
    cache_seqlens + seqlen_new keys. With rotary_cos / rotary_sin
    [seqlen_ro, rotary_dim / 2] the new keys are rotated at their positions
    before the write, and q at positions cache_seqlens + i when causal or
    local (else all rows at cache_seqlens); rotary_interleaved picks
    GPT-J's pairs (flash-attn's default) or GPT-NeoX's halves. If the
    attention then fails, the overwritten cache rows are restored. Rotary
    not with cache_leftpad.
    """
    from .api import fmha_fwd_kvcache, fmha_fwd_paged

    undo = None
    appends = k is not None or v is not None or rotary_cos is not None or rotary_sin is not None
    if appends and compiling():
        # The appends need the tables' values: the op runs this function
        # eagerly when the compiled code runs.
        from . import torch_ops

        return torch_ops.call_flash_attn(
            q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits,
            return_softmax_lse=return_softmax_lse, session=session, device=device)
    if appends:
        local = window_size is not None and tuple(window_size) != (-1, -1)
        q, cache_seqlens, undo = _append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                                         cache_leftpad, (rotary_cos, rotary_sin, rotary_interleaved),
                                         causal or local, session, device)
    eager = not compiling()
    try:
        if alibi_slopes is not None and isinstance(softcap, numbers.Real) and softcap > 0:
            raise ValueError("softcap cannot be combined with alibi_slopes here (ck_tile forbids soft-cap "
                             "with any bias)")
        splits = check_int(num_splits, "num_splits", minimum=0)
        common = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, logits_soft_cap=softcap,
                      alibi_slopes=alibi_slopes, num_splits=splits or None, return_lse=return_softmax_lse,
                      session=session, device=device)
        if block_table is None:
            seqlen_k = _leftpad(kvcache_seqlens(q, k_cache, cache_seqlens=cache_seqlens), cache_leftpad, eager=eager)
            return fmha_fwd_kvcache(q, k_cache, v_cache, seqlen_k, cache_batch_idx=cache_batch_idx,
                                    kv_offset=cache_leftpad, **common)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (as in flash-attn): a paged "
                             "sequence's pages are its block_table row")
        if cache_seqlens is None:  # flash-attn: each sequence fills its block table row
            bt, kc = tuple(getattr(block_table, "shape", ())), tuple(getattr(k_cache, "shape", ()))
            cache_seqlens = int(bt[1]) * int(kc[1]) if len(bt) == 2 and len(kc) == 4 else 0
        seqlen_k = _leftpad(kvcache_seqlens(q, k_cache, cache_seqlens=cache_seqlens), cache_leftpad, eager=eager)
        return fmha_fwd_paged(q, k_cache, v_cache, block_table, seqlen_k, kv_offset=cache_leftpad, **common)
    except BaseException:
        if undo is not None:  # the call failed: the caches get their old rows back
            undo()
        raise


def _leftpad(seqlen_k, cache_leftpad, *, eager: bool):
    """flash-attn's cache_leftpad as gappy KV: sequence b's keys are cache
    positions cache_leftpad[b] .. cache_seqlens[b] - 1, so it has
    cache_seqlens - cache_leftpad keys, reached through kv_offset."""
    if cache_leftpad is None:
        return seqlen_k
    if not eager:  # traced: values are known only when the op runs, which refuses seqlen_k < 0
        return seqlen_k.to(cache_leftpad.device) - cache_leftpad
    pad, ends = int_array(cache_leftpad, "cache_leftpad", 1), int_array(seqlen_k, "cache_seqlens", 1)
    if pad.shape != ends.shape:
        raise ValueError(f"cache_leftpad has {pad.shape[0]} entries, expected batch = {ends.shape[0]}")
    bad = np.nonzero(pad > ends)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"cache_leftpad[{b}] = {pad[b]} is past cache_seqlens[{b}] = {ends[b]}")
    return ends.astype(np.int64) - pad


def _append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary,
            has_mask, session, device):
    """flash-attn's in-call append (see flash_attn_with_kvcache). Returns
    (q, rotated when rotary is given; the key counts after the append; a
    function that writes the overwritten rows back, or None for caches
    this side cannot read)."""
    from .kv_write import reshape_and_cache

    cos, sin, interleaved = rotary
    if k is None or v is None:
        if k is not None or v is not None:
            raise ValueError("k and v come together: pass both new keys and new values, or neither")
        raise NotImplementedError("rotary_cos/rotary_sin without k/v (rotating q alone) is not supported: "
                                  "rotate q before the call")
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin come together")
    if cos is not None and cache_leftpad is not None:
        raise NotImplementedError("rotary_cos/rotary_sin with cache_leftpad is not supported")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required with k/v: the new keys go after cache_seqlens[b] keys")
    k_shape, kc_shape = tuple(getattr(k, "shape", ())), tuple(getattr(k_cache, "shape", ()))
    if len(k_shape) != 4 or len(kc_shape) != 4:
        raise ValueError(f"k must be [batch, seqlen_new, nheads_k, headdim] and k_cache 4-D, got shapes "
                         f"{k_shape} and {kc_shape}")
    lens = int_array(kvcache_seqlens(q, k_cache, cache_seqlens=cache_seqlens), "cache_seqlens", 1).astype(np.int64)
    if lens.shape[0] != k_shape[0]:
        raise ValueError(f"cache_seqlens has {lens.shape[0]} entries, k a batch of {k_shape[0]}")
    if (lens < 0).any():
        b = int(np.argmax(lens < 0))
        raise ValueError(f"cache_seqlens[{b}] = {lens[b]} is negative")
    pos = lens[:, None] + np.arange(k_shape[1])[None, :]
    slots = _append_slots(pos, kc_shape, block_table, cache_batch_idx)
    old = _rows(k_cache, slots), _rows(v_cache, slots)
    rot = dict(q=q, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=bool(interleaved), seqlen_k=lens,
               has_mask=has_mask) if cos is not None else {}
    rotated = reshape_and_cache(k, v, k_cache, v_cache, slots, session=session, device=device, **rot)

    def undo():
        reshape_and_cache(*old, k_cache, v_cache, slots, session=session, device=device)

    return (q if rotated is None else rotated), lens + k_shape[1], (undo if old[0] is not None else None)


def _append_slots(pos: np.ndarray, kc_shape: tuple, block_table, cache_batch_idx) -> np.ndarray:
    """The cache slot (page * page_size + row) of each new key's position:
    through block_table, or in row cache_batch_idx[b] (default b) of a
    non-paged cache, seen as pages of a whole row."""
    rows = kc_shape[1]
    if block_table is not None:
        bt = int_array(block_table, "block_table", 2)
        cap = bt.shape[1] * rows
        pages = np.minimum(pos // rows, bt.shape[1] - 1)
        page_ids = np.take_along_axis(bt, pages, axis=1)
    else:
        cap = rows
        idx = np.arange(pos.shape[0]) if cache_batch_idx is None else int_array(cache_batch_idx, "cache_batch_idx", 1)
        if idx.shape[0] != pos.shape[0]:
            raise ValueError(f"cache_batch_idx has {idx.shape[0]} entries, expected batch = {pos.shape[0]}")
        page_ids = np.broadcast_to(idx[:, None], pos.shape)
    over = np.nonzero(pos[:, -1] >= cap)[0] if pos.shape[1] else []
    if len(over):
        b = int(over[0])
        raise ValueError(f"cache_seqlens[{b}] = {pos[b, 0]} plus {pos.shape[1]} new keys exceeds the cache's "
                         f"{cap} positions for sequence {b}")
    bad = np.nonzero((page_ids < 0) | (page_ids >= kc_shape[0]))
    if bad[0].size:
        b, i = int(bad[0][0]), int(bad[1][0])
        raise ValueError(f"new key {i} of sequence {b} lands on page {page_ids[b, i]}, outside the cache's "
                         f"{kc_shape[0]} pages")
    return (page_ids.astype(np.int64) * rows + pos % rows).astype(np.int32)


def _rows(cache, slots: np.ndarray):
    """The cache rows at `slots` (a copy), or None for an IREE DeviceArray."""
    if _is_device_array(cache) or not hasattr(cache, "reshape"):
        return None
    flat = cache.reshape(-1, *tuple(cache.shape)[2:])
    if _is_torch(cache):
        torch = sys.modules["torch"]
        return flat[torch.as_tensor(slots, device=cache.device).long()].clone()
    return flat[slots].copy()
