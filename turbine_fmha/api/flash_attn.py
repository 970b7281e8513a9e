"""flash-attn's `flash_attn_with_kvcache`, run eagerly by fmha_fwd_paged
(with a block table) or fmha_fwd_kvcache (without), after its in-call
appends (reshape_and_cache). `attention_call` is the mapping from its
arguments to the attention's, which torch_ops also runs while
torch.compile traces a call without appends.
"""

from __future__ import annotations

import numbers
import sys

import numpy as np

from ..core.arrays import is_device_array, is_torch
from ..core.checks import check_int, int_array
from ..core.tracing import compiling
from .conventions import kvcache_seqlens
from .eager import fmha_fwd_kvcache, fmha_fwd_paged
from .kv_write import reshape_and_cache


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    session=None,
    device=None,
):
    """flash-attn's `flash_attn_with_kvcache`, with its argument names and
    semantics, run by fmha_fwd_paged (with block_table) or fmha_fwd_kvcache
    (without).

    Differences from flash-attn: a query row that sees no key has LSE -inf
    (flash-attn: +inf; the output is 0 in both); rotary without k and v,
    and rotary with cache_leftpad, raise NotImplementedError; conflicting
    arguments raise instead of one silently winning (causal=True with a
    positive window_size[1], cache_batch_idx with block_table, softcap
    with alibi_slopes).

    Args:
      Arrays (numpy arrays, or torch tensors in host memory or on the
          session's GPU):
        q: [batch, seqlen_q, nheads, headdim]; float16, bfloat16 or
            float32.
        k_cache: [batch_cache, seqlen_cache, nheads_k, headdim] without
            block_table, or pages [num_blocks, page_block_size, nheads_k,
            headdim] with it (any page size); q's dtype.
        v_cache: as k_cache, with headdim_v.
        cache_seqlens: [batch] int32, or one int for every sequence,
            default None: the whole cache row, or the block table's
            capacity. The keys each sequence has (before k and v).
        cache_batch_idx: [batch] int32, default None (row b for sequence
            b). The cache row each sequence reads; not with block_table.
        cache_leftpad: [batch] int32, default None. Sequence b's keys
            start at cache position cache_leftpad[b] (paged caches too,
            through gappy KV).
        block_table: [batch, max_num_blocks_per_seq] int32, default None.
            Each sequence's pages: the caches are paged.
        alibi_slopes: [nheads] or [batch, nheads] float32, default None.
            ALiBi: -slope * |i + seqlen_k - seqlen_q - j| is added to the
            score of query row i and key j.
      In-call appends (the caches must be writable in place, as
          reshape_and_cache requires; a call that fails afterwards writes
          the overwritten rows back):
        k: [batch, seqlen_new, nheads_k, headdim], default None. New keys,
            written at positions cache_seqlens[b] + i (cache_seqlens is
            required with them); the attention then sees cache_seqlens +
            seqlen_new keys.
        v: [batch, seqlen_new, nheads_k, headdim_v], default None. New
            values, with k.
        rotary_cos: [seqlen_ro, rotary_dim / 2], default None. With
            rotary_sin, the new keys are rotated at their positions before
            the write, and q at cache_seqlens + i when the call is causal
            or local (else every row at cache_seqlens).
        rotary_sin: as rotary_cos, default None.
        rotary_interleaved: bool, default True. True rotates GPT-J's pairs
            (0, 1), (2, 3), ...; False GPT-NeoX's halves.
      Scores and mask:
        softmax_scale: float, default None (1 / sqrt(headdim)). The
            scaling of q k^T before the softmax.
        causal: bool, default False. The bottom-right aligned causal mask.
        window_size: (left, right), default (-1, -1). Local attention: row
            i sees keys in [i + shift - left, i + shift + right], shift =
            seqlen_k - seqlen_q; -1 unbounded.
        softcap: float >= 0, default 0.0. A cap > 0 turns the score s into
            softcap * tanh(s / softcap); not with alibi_slopes.
      Planning and outputs:
        num_splits: int >= 0, default 0 (the heuristic). Split-KV: the
            keys of each sequence in this many runs.
        return_softmax_lse: bool, default False. Also return the LSE.
      Device (keyword-only):
        session: a turbine_fmha.Session, default None (the default session
            of device).
        device: 'cpu', 'cuda', 'cuda:N', 'hip', 'hip:N' or a torch.device,
            default None (the session's, else 'cpu').

    Returns:
      out: [batch, seqlen_q, nheads, headdim_v] in q's dtype; or (out,
        softmax_lse) with return_softmax_lse, softmax_lse float32 [batch,
        nheads, seqlen_q].

    Raises:
      ValueError or TypeError naming the argument before anything runs or
        is written; NotImplementedError for what is listed above.
    """
    undo = None
    if appends(k, v, rotary_cos, rotary_sin):
        local = window_size is not None and tuple(window_size) != (-1, -1)
        q, cache_seqlens, undo = _append(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens,
            block_table,
            cache_batch_idx,
            cache_leftpad,
            (rotary_cos, rotary_sin, rotary_interleaved),
            causal or local,
            session,
            device,
        )
    try:
        kind, args, kw = attention_call(
            q,
            k_cache,
            v_cache,
            cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad,
            block_table=block_table,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            num_splits=num_splits,
            return_softmax_lse=return_softmax_lse,
            session=session,
            device=device,
        )
        return (fmha_fwd_paged if kind == "paged" else fmha_fwd_kvcache)(*args, **kw)
    except BaseException:
        if undo is not None:  # the call failed: the caches get their old rows back
            undo()
        raise


def appends(k, v, rotary_cos, rotary_sin) -> bool:
    """Whether a call writes into the caches (in-call appends, rotary)."""
    return k is not None or v is not None or rotary_cos is not None or rotary_sin is not None


def attention_call(
    q,
    k_cache,
    v_cache,
    *,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    num_splits,
    return_softmax_lse,
    session,
    device,
) -> tuple[str, tuple, dict]:
    """The attention a flash_attn_with_kvcache call (its appends done) runs:
    ("paged" or "kvcache", the positional arguments, the keywords of
    fmha_fwd_paged or fmha_fwd_kvcache). Traceable: torch_ops calls it
    while torch.compile traces."""
    if alibi_slopes is not None and isinstance(softcap, numbers.Real) and softcap > 0:
        raise ValueError("softcap cannot be combined with alibi_slopes here (ck_tile forbids soft-cap with any bias)")
    splits = check_int(num_splits, "num_splits", minimum=0)
    common = dict(
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        logits_soft_cap=softcap,
        alibi_slopes=alibi_slopes,
        num_splits=splits or None,
        return_lse=return_softmax_lse,
        session=session,
        device=device,
        kv_offset=cache_leftpad,
    )
    eager = not compiling()
    if block_table is None:
        seqlen_k = _leftpad(kvcache_seqlens(q, k_cache, cache_seqlens=cache_seqlens), cache_leftpad, eager=eager)
        return "kvcache", (q, k_cache, v_cache, seqlen_k), dict(common, cache_batch_idx=cache_batch_idx)
    if cache_batch_idx is not None:
        raise ValueError(
            "cache_batch_idx cannot be combined with block_table (as in flash-attn): a paged "
            "sequence's pages are its block_table row"
        )
    if cache_seqlens is None:  # flash-attn: each sequence fills its block table row
        bt, kc = tuple(getattr(block_table, "shape", ())), tuple(getattr(k_cache, "shape", ()))
        cache_seqlens = int(bt[1]) * int(kc[1]) if len(bt) == 2 and len(kc) == 4 else 0
    seqlen_k = _leftpad(kvcache_seqlens(q, k_cache, cache_seqlens=cache_seqlens), cache_leftpad, eager=eager)
    return "paged", (q, k_cache, v_cache, block_table, seqlen_k), common


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


def _append(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    block_table,
    cache_batch_idx,
    cache_leftpad,
    rotary,
    has_mask,
    session,
    device,
):
    """flash-attn's in-call append (see flash_attn_with_kvcache). Returns
    (q, rotated when rotary is given; the key counts after the append; a
    function that writes the overwritten rows back, or None for caches
    this side cannot read)."""
    cos, sin, interleaved = rotary
    if k is None or v is None:
        if k is not None or v is not None:
            raise ValueError("k and v come together: pass both new keys and new values, or neither")
        raise NotImplementedError(
            "rotary_cos/rotary_sin without k/v (rotating q alone) is not supported: rotate q before the call"
        )
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin come together")
    if cos is not None and cache_leftpad is not None:
        raise NotImplementedError("rotary_cos/rotary_sin with cache_leftpad is not supported")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required with k/v: the new keys go after cache_seqlens[b] keys")
    k_shape, kc_shape = tuple(getattr(k, "shape", ())), tuple(getattr(k_cache, "shape", ()))
    if len(k_shape) != 4 or len(kc_shape) != 4:
        raise ValueError(
            f"k must be [batch, seqlen_new, nheads_k, headdim] and k_cache 4-D, got shapes {k_shape} and {kc_shape}"
        )
    lens = int_array(kvcache_seqlens(q, k_cache, cache_seqlens=cache_seqlens), "cache_seqlens", 1).astype(np.int64)
    if lens.shape[0] != k_shape[0]:
        raise ValueError(f"cache_seqlens has {lens.shape[0]} entries, k a batch of {k_shape[0]}")
    if (lens < 0).any():
        b = int(np.argmax(lens < 0))
        raise ValueError(f"cache_seqlens[{b}] = {lens[b]} is negative")
    pos = lens[:, None] + np.arange(k_shape[1])[None, :]
    slots = _append_slots(pos, kc_shape, block_table, cache_batch_idx)
    old = _rows(k_cache, slots), _rows(v_cache, slots)
    rot = (
        dict(
            q=q, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=bool(interleaved), seqlen_k=lens, has_mask=has_mask
        )
        if cos is not None
        else {}
    )
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
        raise ValueError(
            f"cache_seqlens[{b}] = {pos[b, 0]} plus {pos.shape[1]} new keys exceeds the cache's "
            f"{cap} positions for sequence {b}"
        )
    bad = np.nonzero((page_ids < 0) | (page_ids >= kc_shape[0]))
    if bad[0].size:
        b, i = int(bad[0][0]), int(bad[1][0])
        raise ValueError(
            f"new key {i} of sequence {b} lands on page {page_ids[b, i]}, outside the cache's {kc_shape[0]} pages"
        )
    return (page_ids.astype(np.int64) * rows + pos % rows).astype(np.int32)


def _rows(cache, slots: np.ndarray):
    """The cache rows at `slots` (a copy), or None for an IREE DeviceArray."""
    if is_device_array(cache) or not hasattr(cache, "reshape"):
        return None
    flat = cache.reshape(-1, *tuple(cache.shape)[2:])
    if is_torch(cache):
        torch = sys.modules["torch"]
        return flat[torch.as_tensor(slots, device=cache.device).long()].clone()
    return flat[slots].copy()
