"""Public entry point: `fmha_fwd_paged`.

Validation happens here, in full, before any kernel is loaded or run; every
error names the offending argument. The kernels see only contiguous arrays,
a block table trimmed to the pages actually used, and resolved mask bounds.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .runtime import Session, default_session
from .variants import Variant

MASK_TYPES = ("none", "top_left", "bottom_right")
DEVICES = ("cpu", "cuda", "hip")

# A window side of -1 is unbounded; the kernels take a bound no sequence
# reaches instead (int32, with headroom so i + shift + bound cannot overflow
# the kernels' 64-bit index arithmetic).
_UNBOUNDED = 1 << 30

# The explicit (CPU) kernel materializes [batch, heads, rows, keys] f32 scores
# plus probabilities; query rows are chunked to keep that under this size.
_SCORE_BYTES_BUDGET = 256 << 20


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _dtype_name(dt: np.dtype) -> str | None:
    if dt == np.float16:
        return "f16"
    if dt == np.float32:
        return "f32"
    if dt == _bf16():
        return "bf16"
    return None


def _is_torch(x) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def _to_numpy(x, name: str):
    if _is_torch(x):
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(_bf16())
        return t.numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")


def _from_numpy(a: np.ndarray, like):
    import torch

    if a.dtype == _bf16():
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t.to(like.device)


def _check_int(value, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _int_array(x, name: str, ndim: int) -> np.ndarray:
    a = _to_numpy(x, name)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array (int32), got {a.dtype}")
    return a


def fmha_fwd_paged(
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
    return_lse=False,
    device="cpu",
    session: Session | None = None,
):
    """Paged-KV flash-attention forward (batch mode).

    Args:
      q: [batch, seqlen_q, nhead_q, hdim_q], float16 / bfloat16 / float32.
      k_cache: [num_pages, page_block_size, nhead_k, hdim_q], same dtype.
      v_cache: [num_pages, page_block_size, nhead_k, hdim_v], same dtype.
      block_table: [batch, max_pages_per_seq] int32. Key t of sequence b is row
        t % page_block_size of page block_table[b, t // page_block_size].
        Slots at or past ceil(seqlen_k[b] / page_block_size) are unused and may
        hold anything (e.g. -1).
      seqlen_k: [batch] int32, keys per sequence (0 allowed).
      scale: softmax scale, default 1/sqrt(hdim_q).
      mask_type: "none", "top_left" or "bottom_right" (ck_tile's generic mask;
        bottom_right shifts the diagonal by seqlen_k - seqlen_q).
      window_size_left / window_size_right: local window sides, -1 = unbounded.
        Causal is (-1, 0). Only with a mask_type other than "none".
      return_lse: also return LSE [batch, nhead_q, seqlen_q] float32 (natural
        log); -inf for rows with no visible key (whose output is 0).
      device: "cpu" (llvm-cpu on IREE's local-task driver), "cuda" or "hip".
      session: a `Session` to run on (default: one shared per device).

    Returns out [batch, seqlen_q, nhead_q, hdim_v] in q's dtype, or
    (out, lse); numpy arrays, or torch tensors when q is a torch tensor.
    Non-contiguous inputs are accepted (copied).
    """
    as_torch = _is_torch(q)
    like = q
    q = _to_numpy(q, "q")
    k_cache = _to_numpy(k_cache, "k_cache")
    v_cache = _to_numpy(v_cache, "v_cache")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {a.shape}")
    dt = _dtype_name(q.dtype)
    if dt is None:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.dtype != q.dtype:
            raise TypeError(f"{name} dtype {a.dtype} differs from q dtype {q.dtype}")
    batch, seqlen_q, nhead_q, hdim_q = q.shape
    num_pages, page, nhead_k, hdim_k = k_cache.shape
    if hdim_k != hdim_q:
        raise ValueError(f"k_cache head dim {hdim_k} differs from q head dim {hdim_q}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"v_cache shape {v_cache.shape} must match k_cache {k_cache.shape} "
            "in num_pages, page_block_size and nhead_k"
        )
    hdim_v = v_cache.shape[3]
    if nhead_k == 0 or nhead_q % nhead_k:
        raise ValueError(f"nhead_q ({nhead_q}) must be a multiple of nhead_k ({nhead_k})")
    if num_pages < 1 or page < 1 or hdim_q < 1 or hdim_v < 1:
        raise ValueError(f"k_cache/v_cache must be non-empty, got {k_cache.shape} / {v_cache.shape}")

    block_table = _int_array(block_table, "block_table", 2)
    seqlen_k = _int_array(seqlen_k, "seqlen_k", 1)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, q has batch {batch}")
    if seqlen_k.shape[0] != batch:
        raise ValueError(f"seqlen_k has {seqlen_k.shape[0]} entries, q has batch {batch}")
    capacity = block_table.shape[1] * page
    if batch and seqlen_k.min() < 0:
        raise ValueError(f"seqlen_k must be >= 0, got {seqlen_k.min()}")
    if batch and seqlen_k.max() > capacity:
        b = int(np.argmax(seqlen_k))
        raise ValueError(
            f"seqlen_k[{b}] = {seqlen_k[b]} exceeds the block table capacity "
            f"({block_table.shape[1]} pages x {page} = {capacity})"
        )
    pages_used = -(-seqlen_k.astype(np.int64) // page)
    used = np.arange(block_table.shape[1])[None, :] < pages_used[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {block_table[b, j]} is not a page id in "
            f"[0, {num_pages}) (slot used by seqlen_k[{b}] = {seqlen_k[b]})"
        )

    if scale is None:
        scale = 1.0 / math.sqrt(hdim_q)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
    left = _check_int(window_size_left, "window_size_left", minimum=-1)
    right = _check_int(window_size_right, "window_size_right", minimum=-1)
    if mask_type == "none" and (left != -1 or right != -1):
        raise ValueError(
            "window_size_left/window_size_right need mask_type 'top_left' or "
            f"'bottom_right' (got mask_type='none', windows ({left}, {right}))"
        )
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if session is None:
        session = default_session(device)
    elif not isinstance(session, Session):
        raise TypeError(f"session must be a turbine_fmha.Session, got {type(session).__name__}")
    elif session.device != device:
        raise ValueError(f"session is for device {session.device!r}, call asked for {device!r}")

    out = np.empty((batch, seqlen_q, nhead_q, hdim_v), dtype=q.dtype)
    lse = np.empty((batch, nhead_q, seqlen_q), dtype=np.float32)
    if batch and seqlen_q:
        problem = (dt, hdim_q, hdim_v, nhead_q, nhead_k, page, mask_type)
        variant = session.select(problem, seqlen_q, batch)
        width = max(1, int(pages_used.max()))
        _run(
            session,
            variant,
            np.ascontiguousarray(q),
            np.ascontiguousarray(k_cache),
            np.ascontiguousarray(v_cache),
            np.ascontiguousarray(block_table[:, :width], dtype=np.int32),
            np.ascontiguousarray(seqlen_k, dtype=np.int32),
            float(scale),
            (seqlen_q, _UNBOUNDED if left < 0 else left, _UNBOUNDED if right < 0 else right),
            out,
            lse,
        )
    if as_torch:
        out_t = _from_numpy(out, like)
        return (out_t, _from_numpy(lse, like)) if return_lse else out_t
    return (out, lse) if return_lse else out


def plan_calls(variant: Variant, q, bt, sk, scale, mask):
    """Splits one validated call into kernel calls.

    Yields (args, place) where args are the 7 kernel arguments (numpy,
    contiguous) and place(out, lse, o, l) copies a call's results into the
    full outputs. Explicit variants chunk query rows to bound the score tile;
    static (online) variants pad the batch (seqlen_k 0, page 0) and query
    rows (zeros; their outputs are dropped) up to the variant's tiles.
    """
    seqlen_q, left, right = mask
    batch = q.shape[0]
    scale_arr = np.asarray(scale, dtype=np.float32).reshape(())

    def params(s):
        return np.array([s, seqlen_q, left, right], np.int32)

    if variant.formulation == "explicit":
        nk = bt.shape[1] * variant.page_block_size
        per_row = batch * q.shape[2] * nk * (4 + q.itemsize)
        chunk = max(1, _SCORE_BYTES_BUDGET // max(1, per_row))
        for s in range(0, seqlen_q, chunk):
            e = min(seqlen_q, s + chunk)

            def place(out, lse, o, l, s=s, e=e):
                out[:, s:e] = o
                lse[:, :, s:e] = l

            yield (np.ascontiguousarray(q[:, s:e]), None, None, bt, sk, scale_arr, params(s)), place
        return
    bt_t, mq = variant.batch_tile, variant.seqlen_q_tile
    for b0 in range(0, batch, bt_t):
        b1 = min(batch, b0 + bt_t)
        nb = b1 - b0
        bt_pad = np.zeros((bt_t, bt.shape[1]), np.int32)
        bt_pad[:nb] = bt[b0:b1]
        sk_pad = np.zeros((bt_t,), np.int32)
        sk_pad[:nb] = sk[b0:b1]
        for s in range(0, seqlen_q, mq):
            e = min(seqlen_q, s + mq)
            q_pad = np.zeros((bt_t, mq) + q.shape[2:], q.dtype)
            q_pad[:nb, : e - s] = q[b0:b1, s:e]

            def place(out, lse, o, l, b0=b0, b1=b1, nb=nb, s=s, e=e):
                out[b0:b1, s:e] = o[:nb, : e - s]
                lse[b0:b1, :, s:e] = l[:nb, :, : e - s]

            yield (q_pad, None, None, bt_pad, sk_pad, scale_arr, params(s)), place


def _run(session, variant: Variant, q, kc, vc, bt, sk, scale, mask, out, lse):
    for (qc, _, _, btc, skc, sc, pc), place in plan_calls(variant, q, bt, sk, scale, mask):
        o, l = session.run_variant(variant, qc, kc, vc, btc, skc, sc, pc)
        place(out, lse, o, l)
