"""flash-attn's spellings of the attention's arguments, mapped onto the
runtime's own, for fmha_fwd_paged, fmha_fwd_kvcache and
PagedAttention.plan.

- `conventions`: `causal=True`, `softmax_scale` and `window_size=(left,
  right)` as mask_type / scale / window_size_left and window_size_right
  (the functions take both spellings); `with_conventions` applies it to a
  dict of a call's options, as every front end does.
- `kvcache_seqlens`: fmha_fwd_kvcache's key counts given as `seqlen_k` or
  `cache_seqlens`, an int or an array.

Nothing here imports torch or touches array data: it runs as it is inside
torch.compile, before a call reaches its op (torch_ops).
"""

from __future__ import annotations

import inspect
import numbers
import sys

import numpy as np

from ..core.arrays import is_torch
from ..core.checks import check_int


def conventions(
    *,
    scale=None,
    softmax_scale=None,
    causal=False,
    window_size=None,
    mask_type="none",
    window_size_left=-1,
    window_size_right=-1,
) -> dict:
    """scale, mask_type, window_size_left and window_size_right from either
    spelling. Two spellings of one thing that disagree raise ValueError
    naming both; values are checked later, by the Problem."""
    if softmax_scale is not None:
        if scale is not None:
            raise ValueError(
                "scale and softmax_scale are the same argument (softmax_scale is flash-attn's name): pass one of them"
            )
        scale = softmax_scale
    right_name = "window_size_right"
    if window_size is not None:
        if (window_size_left, window_size_right) != (-1, -1):
            raise ValueError(
                "window_size and window_size_left/window_size_right are the same argument: pass "
                "either window_size=(left, right) or the two sides"
            )
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
            raise ValueError(
                f"causal=True (a right window side of 0) conflicts with {right_name} = {window_size_right}"
            )
        mask_type, window_size_right = "bottom_right", 0
    return dict(
        scale=scale, mask_type=mask_type, window_size_left=window_size_left, window_size_right=window_size_right
    )


# The options conventions() reads, each at its default (the declaration's,
# calls/options.py; tests/test_options.py checks conventions() agrees).
SPELLINGS = {n: p.default for n, p in inspect.signature(conventions).parameters.items()}


def with_conventions(options: dict) -> dict:
    """A copy of a call's `options` (name -> value) with flash-attn's
    spellings (causal, softmax_scale, window_size) mapped onto the
    runtime's: scale, mask_type, window_size_left and window_size_right
    from `conventions`, the spellings dropped; any of them not in `options`
    at its default. The other options are kept as they are."""
    kw = dict(options)
    spelled = {n: kw.pop(n, d) for n, d in SPELLINGS.items()}
    kw.update(conventions(**spelled))
    return kw


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
            raise ValueError(
                "seqlen_k and cache_seqlens are the same argument (cache_seqlens is flash-attn's "
                "name): pass one of them"
            )
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
    if is_torch(q):
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
