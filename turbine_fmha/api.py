"""Public entry point: `fmha_fwd_paged`.

Validation happens here, in full, before any kernel is loaded or run; every
error names the offending argument. The kernels see only contiguous arrays,
a block table trimmed to the pages actually used, and resolved mask bounds.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .runtime import Session, default_session
from .variants import UNBOUNDED, Variant

MASK_TYPES = ("none", "top_left", "bottom_right")
DEVICES = ("cpu", "cuda", "hip")

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
    sink_size=0,
    alibi_slopes=None,
    bias=None,
    logits_soft_cap=0.0,
    sinks=None,
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
      sink_size: StreamingLLM sink tokens: keys t < sink_size stay visible when
        a local window has slid past them, unless beyond the row's right
        bound (ck_tile IsOutOfSinkBound). Only with a mask.
      alibi_slopes: [nhead_q] or [batch, nhead_q] float, positive. Adds
        -slope * |i + shift - t| after scaling (shift = seqlen_k - seqlen_q
        unless the mask is top-left); with a causal mask ck_tile's VERTICAL
        form +slope * t (same output, different LSE).
      bias: [batch or 1, nhead_q or 1, seqlen_q, >= max(seqlen_k)] float,
        added to the scaled scores (broadcast over size-1 axes). Passed to the
        kernel as is when it is float32, C-contiguous and its key axis is
        ceil(max(seqlen_k) / page_block_size) * page_block_size long; any
        other bias is copied once per call (cast / padded).
      logits_soft_cap: cap > 0 turns the scaled score s into cap * tanh(s /
        cap) before bias/mask; 0 disables. Not with bias or alibi_slopes.
      sinks: [nhead_q] float32 attention-sink logits (gpt-oss style): each joins
        its head's softmax denominator and contributes no value; LSE includes
        it, and a row without visible keys gets output 0 and LSE = sink.
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
    else:
        scale = _check_float(scale, "scale")
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
    left = _check_int(window_size_left, "window_size_left", minimum=-1)
    right = _check_int(window_size_right, "window_size_right", minimum=-1)
    sink_size = _check_int(sink_size, "sink_size", minimum=0)
    if mask_type == "none" and (left != -1 or right != -1 or sink_size):
        raise ValueError(
            "window_size_left/window_size_right/sink_size need mask_type 'top_left' or "
            f"'bottom_right' (got mask_type='none', windows ({left}, {right}), sink_size {sink_size})"
        )
    cap = _check_float(logits_soft_cap, "logits_soft_cap")
    if cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0 (0 disables), got {cap}")
    if alibi_slopes is not None and bias is not None:
        raise ValueError("alibi_slopes and bias cannot be combined (ck_tile has one bias slot)")
    if cap > 0 and (alibi_slopes is not None or bias is not None):
        raise ValueError(
            "logits_soft_cap cannot be combined with bias or alibi_slopes "
            "(ck_tile forbids soft-cap with any bias)"
        )
    slopes = None
    if alibi_slopes is not None:
        slopes = _float_array(alibi_slopes, "alibi_slopes")
        if slopes.shape not in ((nhead_q,), (batch, nhead_q)):
            raise ValueError(
                f"alibi_slopes must have shape [nhead_q] = [{nhead_q}] or "
                f"[batch, nhead_q] = [{batch}, {nhead_q}], got {list(slopes.shape)}"
            )
        slopes = np.ascontiguousarray(np.broadcast_to(slopes, (batch, nhead_q)), np.float32)
    bias_a = bias_shape = None
    if bias is not None:
        bias_a = _float_array(bias, "bias")
        max_sk = int(seqlen_k.max()) if batch else 0
        if (
            bias_a.ndim != 4
            or bias_a.shape[0] not in (1, batch)
            or bias_a.shape[1] not in (1, nhead_q)
            or bias_a.shape[2] != seqlen_q
            or bias_a.shape[3] < max_sk
        ):
            raise ValueError(
                f"bias must have shape [batch or 1, nhead_q or 1, seqlen_q, >= max(seqlen_k)] = "
                f"[{batch} or 1, {nhead_q} or 1, {seqlen_q}, >= {max_sk}], got {list(bias_a.shape)}"
            )
        bias_shape = ("b" if bias_a.shape[0] != 1 else "1") + ("h" if bias_a.shape[1] != 1 else "1")
    sinks_a = None
    if sinks is not None:
        sinks_a = _float_array(sinks, "sinks")
        if sinks_a.shape != (nhead_q,):
            raise ValueError(f"sinks must have shape [nhead_q] = [{nhead_q}], got {list(sinks_a.shape)}")
        sinks_a = np.ascontiguousarray(sinks_a, np.float32)
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
        problem = dict(
            dtype=dt,
            hdim_q=hdim_q,
            hdim_v=hdim_v,
            nhead_q=nhead_q,
            nhead_k=nhead_k,
            page_block_size=page,
            mask=mask_type,
            bias="alibi" if slopes is not None else ("elementwise" if bias_a is not None else "none"),
            bias_shape=bias_shape or "",
            softcap=cap > 0,
            sinks=sinks_a is not None,
        )
        variant = session.select(problem, seqlen_q, batch)
        width = max(1, int(pages_used.max()))
        call = KernelCall(
            q=np.ascontiguousarray(q),
            block_table=np.ascontiguousarray(block_table[:, :width], dtype=np.int32),
            seqlen_k=np.ascontiguousarray(seqlen_k, dtype=np.int32),
            scale=float(scale),
            softcap=cap,
            seqlen_q=seqlen_q,
            left=UNBOUNDED if left < 0 else left,
            right=UNBOUNDED if right < 0 else right,
            sink_size=sink_size,
            alibi_slopes=slopes,
            bias=bias_a,
            sinks=sinks_a,
        )
        kc = np.ascontiguousarray(k_cache)
        vc = np.ascontiguousarray(v_cache)
        for args, place in plan_calls(variant, call):
            o, l = session.run_variant(variant, args[0], kc, vc, *args[1:])
            place(out, lse, o, l)
    if as_torch:
        out_t = _from_numpy(out, like)
        return (out_t, _from_numpy(lse, like)) if return_lse else out_t
    return (out, lse) if return_lse else out


def _check_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite float, got {value!r}")
    return float(value)


def _float_array(x, name: str) -> np.ndarray:
    a = _to_numpy(x, name)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype != _bf16():
        raise TypeError(f"{name} must be a float array, got {a.dtype}")
    return a.astype(np.float32, copy=False)


@dataclasses.dataclass
class KernelCall:
    """One validated call, in the form the kernels take."""

    q: np.ndarray
    block_table: np.ndarray
    seqlen_k: np.ndarray
    scale: float
    softcap: float
    seqlen_q: int
    left: int
    right: int
    sink_size: int
    alibi_slopes: np.ndarray | None
    bias: np.ndarray | None
    sinks: np.ndarray | None


def plan_calls(variant: Variant, c: KernelCall):
    """Splits one validated call into kernel calls.

    Yields (args, place): args are the kernel arguments without the caches
    (q, block_table, seqlen_k, fparams, iparams, then alibi_slopes / bias /
    sinks where the variant has them), and place(out, lse, o, l) copies a
    call's results into the full outputs. Explicit variants chunk query rows
    to bound the score tile; static (online) variants pad the batch (seqlen_k
    0, page 0) and query rows (zeros; their outputs are dropped) up to the
    variant's tiles.
    """
    q, bt, sk = c.q, c.block_table, c.seqlen_k
    batch, seqlen_q = q.shape[0], c.seqlen_q
    nk = bt.shape[1] * variant.page_block_size
    fparams = np.array([c.scale, c.softcap], np.float32)
    bias = c.bias
    if bias is not None and bias.shape[3] != nk:
        # The kernel reads keys up to the table width; keys past seqlen_k are
        # masked, so the padding value does not matter.
        padded = np.zeros(bias.shape[:3] + (nk,), np.float32)
        n = min(nk, bias.shape[3])
        padded[..., :n] = bias[..., :n]
        bias = padded

    def iparams(s):
        return np.array([s, seqlen_q, c.left, c.right, c.sink_size], np.int32)

    def extras(b0, b1, s, e, bt_pad=None, mq=None):
        out = []
        if c.alibi_slopes is not None:
            a = c.alibi_slopes[b0:b1]
            if bt_pad:
                a = _pad_rows(a, bt_pad)
            out.append(np.ascontiguousarray(a))
        if bias is not None:
            bb = bias[b0:b1] if bias.shape[0] != 1 else bias
            bb = bb[:, :, s:e]
            if bt_pad:
                if bias.shape[0] != 1:
                    bb = _pad_rows(bb, bt_pad)
                bb = _pad_axis(bb, 2, mq)
            out.append(np.ascontiguousarray(bb))
        if c.sinks is not None:
            out.append(c.sinks)
        return out

    if variant.formulation == "explicit":
        per_row = batch * q.shape[2] * nk * (4 + q.itemsize)
        chunk = max(1, _SCORE_BYTES_BUDGET // max(1, per_row))
        for s in range(0, seqlen_q, chunk):
            e = min(seqlen_q, s + chunk)

            def place(out, lse, o, l, s=s, e=e):
                out[:, s:e] = o
                lse[:, :, s:e] = l

            args = [np.ascontiguousarray(q[:, s:e]), bt, sk, fparams, iparams(s)]
            yield args + extras(0, batch, s, e), place
        return
    bt_t, mq = variant.batch_tile, variant.seqlen_q_tile
    for b0 in range(0, batch, bt_t):
        b1 = min(batch, b0 + bt_t)
        nb = b1 - b0
        bt_pad = _pad_rows(bt[b0:b1], bt_t)
        sk_pad = _pad_rows(sk[b0:b1], bt_t)
        for s in range(0, seqlen_q, mq):
            e = min(seqlen_q, s + mq)
            q_pad = _pad_axis(_pad_rows(q[b0:b1, s:e], bt_t), 1, mq)

            def place(out, lse, o, l, b0=b0, b1=b1, nb=nb, s=s, e=e):
                out[b0:b1, s:e] = o[:nb, : e - s]
                lse[b0:b1, :, s:e] = l[:nb, :, : e - s]

            args = [q_pad, bt_pad, sk_pad, fparams, iparams(s)]
            yield args + extras(b0, b1, s, e, bt_t, mq), place


def _pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    return _pad_axis(a, 0, n)


def _pad_axis(a: np.ndarray, axis: int, n: int) -> np.ndarray:
    if a.shape[axis] == n:
        return np.ascontiguousarray(a)
    shape = list(a.shape)
    shape[axis] = n
    out = np.zeros(shape, a.dtype)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(0, a.shape[axis])
    out[tuple(idx)] = a
    return out
