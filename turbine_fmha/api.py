"""Public entry point: `fmha_fwd_paged`.

Validation happens here, in full, before any kernel is loaded or run; every
error names the offending argument. Every mode is brought to one batch-mode
kernel call (turbine_fmha.plan): group mode pads query rows per sequence,
gappy KV shifts block-table rows by whole pages and passes the remainder as
kv_shift, and a non-paged cache is viewed as pages without copying.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .arrays import (
    _bf16,
    _cache_array,
    _check_tensor_devices,
    _DeviceCache,
    _dtype_name,
    _fp8_max,
    _fp8_name,
    _from_numpy,
    _is_torch,
    _Results,
    _TensorInfo,
    _TorchDeviceCache,
    _to_numpy,
    _torch_np_dtype,
    kernel_host_array,
)
from .plan import (
    KernelCall,
    bias_in_table_rows,
    fill_unused_slots,
    num_splits_heuristic,
    plan_calls,
    split_kv,
    stale_rows_finite,
    torch_rows_finite,
)
from .runtime import Session, default_session
from .variants import UNBOUNDED, bias_shape_of

MASK_TYPES = ("none", "top_left", "bottom_right")
DEVICES = ("cpu", "cuda", "hip")


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
    seqstart_q=None,
    kv_offset=None,
    min_seqlen_q=0,
    out=None,
    scale=None,
    mask_type="none",
    window_size_left=-1,
    window_size_right=-1,
    sink_size=0,
    alibi_slopes=None,
    bias=None,
    logits_soft_cap=0.0,
    sinks=None,
    v_layout="row",
    q_scale=None,
    k_scale=None,
    v_scale=None,
    p_scale=None,
    out_scale=None,
    num_splits=None,
    kv_rows_finite=None,
    return_lse=False,
    device="cpu",
    session: Session | None = None,
):
    """Paged-KV flash-attention forward (ck_tile FmhaFwdPagedKVKernel).

    Batch mode (seqstart_q None):
      q: [batch, seqlen_q, nhead_q, hdim_q], float16 / bfloat16 / float32.
      output [batch, seqlen_q, nhead_q, hdim_v]; LSE [batch, nhead_q, seqlen_q].
    Group (varlen) mode:
      q: [total_q, nhead_q, hdim_q] with seqstart_q [batch + 1] int32 (0, ...,
      total_q, non-decreasing): sequence b owns rows seqstart_q[b]:seqstart_q[b+1].
      Decode (1 row) and prefill sequences can share a call.
      output [total_q, nhead_q, hdim_v]; LSE [nhead_q, total_q].

    Args:
      k_cache: [num_pages, page_block_size, nhead_k, hdim_q], same dtype as q:
        a numpy array / torch tensor, or an iree.runtime DeviceArray on the
        session's device (used in place, no copy; PagedKVCache with a
        session keeps its pool that way). torch CUDA/HIP caches are imported
        zero-copy through DLPack when the session is for cuda/hip (after a
        torch.cuda.synchronize); other torch tensors are copied.
      v_cache: [num_pages, page_block_size, nhead_k, hdim_v], same dtype; with
        v_layout="col", [num_pages, nhead_k, hdim_v, page_block_size].
        An fp8 KV cache (ml_dtypes/torch float8_e4m3fn, _e4m3fnuz, _e5m2,
        _e5m2fnuz) goes with fp16/bf16 queries and per-tensor descales
        k_scale / v_scale (true K = k_scale * K_fp8). On GPUs these run the
        explicit formulation (no matrix cores yet; docs/repro/).
        fp8 q with fp8 caches of the same format is ck_tile's static
        quantization (fp8 output): see q_scale, p_scale, out_scale.
      block_table: [batch, max_pages_per_seq] int32. Key t of sequence b is
        table position p = kv_offset[b] + t: row p % page_block_size of page
        block_table[b, p // page_block_size]. Slots holding no key are unused
        and may hold anything (e.g. -1).
      seqlen_k: [batch] int32, keys per sequence (0 allowed).
      kv_offset: [batch] int32 >= 0, gappy paged KV (ck_tile's kv_l2p_offset):
        the first kv_offset[b] table positions are skipped. Mask and ALiBi
        positions still count from t = 0. Default 0.
      min_seqlen_q: group mode only: sequences with seqlen_q <= min_seqlen_q
        are skipped (ck_tile's skip_min_seqlen_q). Their output rows are left
        untouched in a caller-provided `out`, zero otherwise; their LSE is -inf.
      out: optional C-contiguous array of the output's shape and dtype to
        write into (returned): numpy, or, with a torch q on the session's
        device, a torch tensor on that device. It must not share memory
        with any input (ValueError naming it).
      scale: softmax scale, default 1/sqrt(hdim_q). Scalars and float
        arrays (alibi_slopes, sinks: finite too) must be float32 values;
        larger ones are refused by name rather than turned into Inf.
      mask_type: "none", "top_left" or "bottom_right" (ck_tile's generic mask;
        bottom_right shifts the diagonal by seqlen_k - seqlen_q per sequence).
      window_size_left / window_size_right: local window sides, -1 = unbounded.
        Causal is (-1, 0). Only with a mask_type other than "none". Sides
        (and sink_size) past every key, 2^31 and more included, are
        windows that reach every key.
      sink_size: StreamingLLM sink tokens: keys t < sink_size stay visible when
        a local window has slid past them, unless beyond the row's right
        bound (ck_tile IsOutOfSinkBound). Only with a mask.
      alibi_slopes: [nhead_q] or [batch, nhead_q] float, finite, of any
        sign (ck_tile's formula does not depend on it). Adds
        -slope * |i + shift - t| after scaling (shift = seqlen_k - seqlen_q
        unless the mask is top-left); with a causal mask ck_tile's VERTICAL
        form +slope * t (same output, different LSE).
      bias: batch mode [batch or 1, nhead_q or 1, seqlen_q, >= max(seqlen_k)];
        group mode [nhead_q or 1, total_q, >= max(seqlen_k)]. Float, added to
        the scaled scores (broadcast over size-1 axes). Passed to the kernel
        as is when it is float32, C-contiguous and its key axis is
        ceil(max(seqlen_k) / page_block_size) * page_block_size long in batch
        mode; otherwise copied once per call (cast / padded / regrouped).
      logits_soft_cap: cap > 0 turns the scaled score s into cap * tanh(s /
        cap) before bias/mask; 0 disables. Not with bias or alibi_slopes.
      sinks: [nhead_q] float32 attention-sink logits (gpt-oss style): each joins
        its head's softmax denominator and contributes no value; LSE includes
        it, and a row without visible keys gets output 0 and LSE = sink.
      q_scale / k_scale / v_scale: per-tensor fp8 descales (true Q = q_scale *
        Q_fp8, likewise K, V); default 1. k_scale/v_scale need fp8 caches,
        q_scale fp8 q.
      p_scale: fp8 q only: the probabilities (in [0, 1], unnormalized
        against the row max) are quantized as fp8(p * p_scale) before the PV
        product; default the format's max (ck_tile's range_p = 1).
      out_scale: fp8 q only: the output's descale, out_fp8 =
        saturate(fp8(out / out_scale)); default 1. In ck_tile's terms, scale_s
        = scale * q_scale * k_scale and scale_o = v_scale / (p_scale *
        out_scale). LSE is of the dequantized scores, unaffected.
      num_splits: split-KV. Each sequence's keys are cut into num_splits runs
        of pages computed as separate work items, then merged by their LSEs
        (in f32; the partial outputs are rounded to q's dtype once). None
        (default) chooses from batch * nhead_q * query blocks against the
        session's compute_units (ck_tile's heuristic; splits of >= 512
        keys); 1 disables. Not with fp8 q.
      kv_rows_finite: True promises that every row of v_cache is finite
        (PagedKVCache tracks it), which lets GPU kernels skip the stale-row
        guard without looking at the caches (K rows never matter). None
        (default) checks the V rows that hold no key: in host memory for
        host caches, on the GPU (a small torch gather and one sync) for
        torch CUDA caches; IREE DeviceArray caches are assumed unchecked
        (guarded kernels).
      return_lse: also return LSE (float32, natural log); -inf for rows with
        no visible key (whose output is 0).
      device: "cpu" (llvm-cpu on IREE's local-task driver), "cuda" or "hip".
      session: a `Session` to run on (default: one shared per device).

    Returns out, or (out, lse); numpy arrays, or torch tensors on q's device
    when q is a torch tensor. When that device is the session's own
    (Session.torch_device: "cpu", or "cuda:0" for a cuda/hip session), the
    results are made there: the kernels' outputs reach torch on the device
    (DLPack views, or device copies where the driver does not export them)
    and are arranged there, never copied to the host;
    q stays there too (padded into tiles by torch), and only the small
    tables are built on the host.
    Non-contiguous inputs are accepted (copied).

    Devices: numpy arrays and CPU torch tensors are accepted by every
    session. torch tensors on any other device than the session's GPU
    (cuda:0), including any GPU tensor for a "cpu" session, raise
    ValueError naming the argument; so do DeviceArrays of another device.
    """
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seqlen_k=seqlen_k,
                 seqstart_q=seqstart_q, kv_offset=kv_offset, alibi_slopes=alibi_slopes, bias=bias, sinks=sinks)
    _check_tensor_devices(session.device if isinstance(session, Session) else device, **given, out=out)
    as_torch = _is_torch(q)
    like = q
    # A torch GPU q is looked at through its shape and dtype only: its data
    # stays on the device unless the call needs it on the host (below).
    q = _TensorInfo(q) if as_torch and q.device.type != "cpu" else _to_numpy(q, "q")
    k_cache = _cache_array(k_cache, "k_cache")
    v_cache = _cache_array(v_cache, "v_cache")
    on_device = isinstance(k_cache, _DeviceCache)
    if on_device != isinstance(v_cache, _DeviceCache):
        raise TypeError("k_cache and v_cache must both be host arrays or both IREE device arrays")
    group = seqstart_q is not None
    if q.ndim != (3 if group else 4):
        what = "[total_q, nhead_q, hdim] with seqstart_q" if group else "[batch, seqlen_q, nhead_q, hdim]"
        raise ValueError(f"q must have {3 if group else 4} dims {what}, got shape {q.shape}")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {a.shape}")
    squant = _fp8_name(q.dtype)  # fp8 q: static quantization
    dt = squant or _dtype_name(q.dtype)
    if dt is None:
        raise TypeError(f"q must be float16, bfloat16, float32 or an ml_dtypes fp8 type, got {q.dtype}")
    kv_fp8 = _fp8_name(k_cache.dtype)
    if squant:
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
            if a.dtype != q.dtype:
                raise TypeError(f"{name} dtype {a.dtype} must be q's fp8 format {q.dtype} (static quantization)")
    elif kv_fp8:
        if dt == "f32":
            raise TypeError("an fp8 KV cache needs float16 or bfloat16 q")
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    else:
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
            if a.dtype != q.dtype:
                raise TypeError(f"{name} dtype {a.dtype} differs from q dtype {q.dtype}")
    quant = {}
    for name, val, allowed, why in (
        ("q_scale", q_scale, squant, "fp8 q"),
        ("k_scale", k_scale, kv_fp8, "fp8 KV caches"),
        ("v_scale", v_scale, kv_fp8, "fp8 KV caches"),
        ("p_scale", p_scale, squant, "fp8 q"),
        ("out_scale", out_scale, squant, "fp8 q"),
    ):
        if val is None:
            quant[name] = _fp8_max(q.dtype) if name == "p_scale" and squant else 1.0
            continue
        if not allowed:
            raise ValueError(f"{name} is for {why} only (q is {q.dtype}, k_cache is {k_cache.dtype})")
        val = _check_float(val, name)
        if val <= 0:
            raise ValueError(f"{name} must be > 0, got {val}")
        quant[name] = val
    nhead_q, hdim_q = q.shape[-2:]
    num_pages, page, nhead_k, hdim_k = k_cache.shape
    if hdim_k != hdim_q:
        raise ValueError(f"k_cache head dim {hdim_k} differs from q head dim {hdim_q}")
    if v_layout not in ("row", "col"):
        raise ValueError(f"v_layout must be 'row' or 'col', got {v_layout!r}")
    if v_layout == "row":
        v_ok, hdim_v = v_cache.shape[:3] == k_cache.shape[:3], v_cache.shape[3]
        v_want = "[num_pages, page_block_size, nhead_k, hdim_v]"
    else:
        v_ok = (v_cache.shape[0], v_cache.shape[1], v_cache.shape[3]) == (num_pages, nhead_k, page)
        hdim_v = v_cache.shape[2]
        v_want = "[num_pages, nhead_k, hdim_v, page_block_size] (v_layout='col')"
    if not v_ok:
        raise ValueError(
            f"v_cache shape {v_cache.shape} must be {v_want} matching k_cache {k_cache.shape}"
        )
    if nhead_q < 1:
        raise ValueError(f"q must have at least one head, got nhead_q = {nhead_q} (shape {q.shape})")
    if nhead_k == 0 or nhead_q % nhead_k:
        raise ValueError(f"nhead_q ({nhead_q}) must be a multiple of nhead_k ({nhead_k})")
    if num_pages < 1 or page < 1 or hdim_q < 1 or hdim_v < 1:
        raise ValueError(f"k_cache/v_cache must be non-empty, got {k_cache.shape} / {v_cache.shape}")

    if group:
        seqstart = _int_array(seqstart_q, "seqstart_q", 1).astype(np.int64)
        total_q = q.shape[0]
        if seqstart.shape[0] < 1 or seqstart[0] != 0:
            raise ValueError(f"seqstart_q must start at 0 and have batch + 1 entries, got {seqstart.tolist()[:8]}")
        if np.any(np.diff(seqstart) < 0):
            raise ValueError("seqstart_q must be non-decreasing")
        if seqstart[-1] != total_q:
            raise ValueError(f"seqstart_q[-1] = {seqstart[-1]} must equal total_q = q.shape[0] = {total_q}")
        batch = seqstart.shape[0] - 1
        seqlens_q = np.diff(seqstart)
    else:
        batch = q.shape[0]
        seqlens_q = np.full((batch,), q.shape[1], np.int64)

    block_table = _int_array(block_table, "block_table", 2)
    seqlen_k = _int_array(seqlen_k, "seqlen_k", 1).astype(np.int64)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected batch = {batch}")
    if seqlen_k.shape[0] != batch:
        raise ValueError(f"seqlen_k has {seqlen_k.shape[0]} entries, expected batch = {batch}")
    if batch and seqlen_k.min() < 0:
        raise ValueError(f"seqlen_k must be >= 0, got {seqlen_k.min()}")
    if kv_offset is None:
        offsets = np.zeros((batch,), np.int64)
    else:
        offsets = _int_array(kv_offset, "kv_offset", 1).astype(np.int64)
        if offsets.shape[0] != batch:
            raise ValueError(f"kv_offset has {offsets.shape[0]} entries, expected batch = {batch}")
        if batch and offsets.min() < 0:
            raise ValueError(f"kv_offset must be >= 0, got {offsets.min()}")
    capacity = block_table.shape[1] * page
    end = offsets + seqlen_k
    if batch and end.max() > capacity:
        b = int(np.argmax(end))
        raise ValueError(
            f"seqlen_k[{b}] = {seqlen_k[b]}" + (f" + kv_offset[{b}] = {offsets[b]}" if kv_offset is not None else "")
            + f" exceeds the block table capacity ({block_table.shape[1]} pages x {page} = {capacity})"
        )
    first_page = offsets // page
    end_page = np.where(seqlen_k > 0, -(-end // page), first_page)
    slots = np.arange(block_table.shape[1])[None, :]
    used = (slots >= first_page[:, None]) & (slots < end_page[:, None])
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
    left = _window(_check_int(window_size_left, "window_size_left", minimum=-1))
    right = _window(_check_int(window_size_right, "window_size_right", minimum=-1))
    sink_size = _window(_check_int(sink_size, "sink_size", minimum=0))
    if mask_type == "none" and (left != -1 or right != -1 or sink_size):
        raise ValueError(
            "window_size_left/window_size_right/sink_size need mask_type 'top_left' or "
            f"'bottom_right' (got mask_type='none', windows ({left}, {right}), sink_size {sink_size})"
        )
    min_seqlen_q = _check_int(min_seqlen_q, "min_seqlen_q", minimum=0)
    if min_seqlen_q and not group:
        raise ValueError("min_seqlen_q (skip_min_seqlen_q) needs group mode (seqstart_q)")
    cap = _check_float(logits_soft_cap, "logits_soft_cap")
    if cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0 (0 disables), got {cap}")
    # The kernels fold these into f32 products (the online ones also times
    # log2(e)): each product must stay a float32.
    for what, value in (
        ("scale x q_scale x k_scale", abs(scale) * quant["q_scale"] * quant["k_scale"] * math.log2(math.e)),
        ("logits_soft_cap", cap * math.log2(math.e)),
        ("v_scale / (p_scale x out_scale)", quant["v_scale"] / (quant["p_scale"] * quant["out_scale"])),
    ):
        if not value <= F32_MAX:
            raise ValueError(f"{what} overflows float32 in the kernels (with log2(e) folded in: {value:.4g})")
    if alibi_slopes is not None and bias is not None:
        raise ValueError("alibi_slopes and bias cannot be combined (ck_tile has one bias slot)")
    if cap > 0 and (alibi_slopes is not None or bias is not None):
        raise ValueError(
            "logits_soft_cap cannot be combined with bias or alibi_slopes "
            "(ck_tile forbids soft-cap with any bias)"
        )
    slopes = None
    if alibi_slopes is not None:
        slopes = _float_array(alibi_slopes, "alibi_slopes", finite=True)
        if slopes.shape not in ((nhead_q,), (batch, nhead_q)):
            raise ValueError(
                f"alibi_slopes must have shape [nhead_q] = [{nhead_q}] or "
                f"[batch, nhead_q] = [{batch}, {nhead_q}], got {list(slopes.shape)}"
            )
        slopes = np.broadcast_to(slopes, (batch, nhead_q))
        # The term is slope * distance (or * key position, causal): it must
        # stay a float32 for every key and row the call has.
        reach = (int(seqlens_q.max()) if batch else 0) + (int(seqlen_k.max()) if batch else 0)
        steep = float(np.abs(slopes).max()) if slopes.size else 0.0
        if steep * reach > F32_MAX:
            raise ValueError(
                f"alibi_slopes: |slope| {steep:.4g} x distances up to {reach} overflow float32"
            )
    max_sk = int(seqlen_k.max()) if batch else 0
    bias_a = None
    if bias is not None:
        bias_a = _float_array(bias, "bias")
        if group:
            ok = bias_a.ndim == 3 and bias_a.shape[0] in (1, nhead_q) and bias_a.shape[1] == q.shape[0]
            want = f"[nhead_q or 1, total_q, >= max(seqlen_k)] = [{nhead_q} or 1, {q.shape[0]}, >= {max_sk}]"
        else:
            ok = (
                bias_a.ndim == 4
                and bias_a.shape[0] in (1, batch)
                and bias_a.shape[1] in (1, nhead_q)
                and bias_a.shape[2] == q.shape[1]
            )
            want = f"[batch or 1, nhead_q or 1, seqlen_q, >= max(seqlen_k)] = [{batch} or 1, {nhead_q} or 1, {q.shape[1]}, >= {max_sk}]"
        if not ok or bias_a.shape[-1] < max_sk:
            raise ValueError(f"bias must have shape {want}, got {list(bias_a.shape)}")
    sinks_a = None
    if sinks is not None:
        sinks_a = _float_array(sinks, "sinks", finite=True)
        if sinks_a.shape != (nhead_q,):
            raise ValueError(f"sinks must have shape [nhead_q] = [{nhead_q}], got {list(sinks_a.shape)}")
        sinks_a = np.ascontiguousarray(sinks_a, np.float32)
    if num_splits is not None:
        num_splits = _check_int(num_splits, "num_splits", minimum=1)
        if num_splits > 1 and squant:
            raise ValueError("num_splits > 1 cannot be combined with fp8 q (the partial outputs would be fp8)")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    out_shape = q.shape[:-1] + (hdim_v,)
    if out is not None:
        if _is_torch(out):
            if not as_torch or out.device != like.device:
                raise TypeError("a torch out needs q to be a torch tensor on the same device")
            out_dtype = _torch_np_dtype(out.dtype)
            if tuple(out.shape) != out_shape or out_dtype != q.dtype:
                raise ValueError(f"out must have shape {list(out_shape)} and dtype {q.dtype}, got {list(out.shape)} {out_dtype}")
            if not out.is_contiguous():
                raise ValueError("out must be a contiguous tensor")
        elif not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array or a torch tensor, got {type(out).__name__}")
        elif out.shape != out_shape or out.dtype != q.dtype:
            raise ValueError(f"out must have shape {list(out_shape)} and dtype {q.dtype}, got {list(out.shape)} {out.dtype}")
        elif not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be a writeable C-contiguous array")
        # Rows are written chunk by chunk while later chunks still read the
        # inputs: an out sharing their memory corrupts the result.
        clash = _overlapping(out, given)
        if clash:
            raise ValueError(f"out overlaps {clash} in memory; pass a separate output buffer")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if session is None:
        session = default_session(device)
    elif not isinstance(session, Session):
        raise TypeError(f"session must be a turbine_fmha.Session, got {type(session).__name__}")
    elif session.device != device:
        raise ValueError(f"session is for device {session.device!r}, call asked for {device!r}")
    if kv_rows_finite is not None and not isinstance(kv_rows_finite, bool):
        raise TypeError(f"kv_rows_finite must be a bool or None, got {type(kv_rows_finite).__name__}")
    if on_device:
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(a, _TorchDeviceCache):  # its device was checked on entry
                a.bind(session)
            elif a.array._device is not session.device_of():
                raise ValueError(f"{name} is a DeviceArray of another device than the session's ({session.device})")

    # --- everything below runs only on validated arguments ---------------
    torch_results = (as_torch and not squant and (out is None or _is_torch(out))
                     and str(like.device) == session.torch_device)
    if _is_torch(out) and not torch_results:
        raise ValueError(f"a torch out needs q on the session's device ({session.torch_device}) and not fp8")
    results = _Results(session, like if torch_results else None)
    if isinstance(q, _TensorInfo) and not torch_results:
        q = _to_numpy(like, "q")
    if out is None:
        out = results.empty(out_shape, q.dtype, fill=0 if min_seqlen_q else None)
    lse = results.empty((batch, nhead_q, q.shape[1]) if not group else (nhead_q, q.shape[0]), np.float32, fill=-np.inf)
    active = np.nonzero(seqlens_q > min_seqlen_q)[0] if group else np.arange(batch)
    if active.size and seqlens_q[active].max() > 0:
        problem = dict(
            dtype=dt,
            hdim_q=hdim_q,
            hdim_v=hdim_v,
            nhead_q=nhead_q,
            nhead_k=nhead_k,
            page_block_size=page,
            mask=mask_type,
            bias="alibi" if slopes is not None else ("elementwise" if bias_a is not None else "none"),
            bias_shape="",
            softcap=cap > 0,
            sinks=sinks_a is not None,
            v_layout=v_layout,
            kv_dtype="" if squant else (kv_fp8 or ""),
        )
        rows = int(seqlens_q[active].max())
        # q by sequence: torch q stays torch (on its device) on the torch
        # path, where plan_calls pads it with torch too.
        q_src = like.detach() if torch_results else q
        if group:
            # Varlen rows <-> [sequence, row] padded rows, as one gather /
            # scatter each way (one launch on a GPU, not one per sequence).
            lens = seqlens_q[active]
            owner = np.repeat(np.arange(active.size), lens)
            within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
            src = results.index(seqstart[active][owner] + within)  # rows of q / out
            dst = results.index(owner * rows + within)  # rows of the padded [active * rows]
            qb = results.empty((active.size, rows) + q.shape[1:], q.dtype, fill=0)
            qb.reshape((active.size * rows,) + q.shape[1:])[dst] = q_src[src]
        else:
            qb = q_src.contiguous() if torch_results else np.ascontiguousarray(q)
        # Gappy KV: drop whole pages in front of each sequence's first key;
        # the remainder (< page) is the kernel's kv_shift.
        shift = (offsets - first_page * page)[active]
        width = max(1, int((end_page - first_page)[active].max()))
        bt = np.zeros((active.size, width), np.int32)
        n_used = (end_page - first_page)[active]
        for i, b in enumerate(active):
            bt[i, : n_used[i]] = block_table[b, first_page[b] : end_page[b]]
        fill_unused_slots(bt, n_used)
        bias_b = None
        if bias_a is not None:
            if group:
                bias_b = np.zeros((active.size, bias_a.shape[0], rows, bias_a.shape[2]), np.float32)
                for i, b in enumerate(active):
                    bias_b[i, :, : seqlens_q[b]] = bias_a[:, seqstart[b] : seqstart[b + 1]]
            else:
                bias_b = bias_a
            if shift.any():
                # The kernels index the bias by gathered row, which gappy KV
                # shifts per sequence: re-lay it out (per sequence).
                bias_b = bias_in_table_rows(bias_b, shift, width * page)
            problem["bias_shape"] = bias_shape_of(bias_b)
        call = KernelCall(
            q=qb.view(np.int8) if squant else qb,  # fp8 travels as i8
            block_table=bt,
            seqlen_q=seqlens_q[active].astype(np.int32),
            seqlen_k=seqlen_k[active].astype(np.int32),
            kv_shift=shift.astype(np.int32),
            scale=float(scale) * quant["q_scale"] * quant["k_scale"],
            softcap=cap,
            scale_o=quant["v_scale"] / (quant["p_scale"] * quant["out_scale"]) if squant else quant["v_scale"],
            scale_p=quant["p_scale"],
            left=UNBOUNDED if left < 0 else left,
            right=UNBOUNDED if right < 0 else right,
            sink_size=sink_size,
            alibi_slopes=None if slopes is None else np.ascontiguousarray(slopes[active], np.float32),
            bias=bias_b,
            sinks=sinks_a,
        )
        if on_device:
            kc, vc = k_cache.array, v_cache.array
        else:
            # CPU sessions read host caches in place (a strided view is
            # copied once, aligned, and read in place too) instead of IREE
            # uploading the whole pool on every call. The imported buffer
            # holds its source array, so a copy lives as long as the buffer.
            kc, vc = kernel_host_array(k_cache), kernel_host_array(v_cache)
            if kv_fp8:  # the kernels take fp8 caches as i8 and decode them
                kc, vc = kc.view(np.int8), vc.view(np.int8)
            kc_d, vc_d = session.import_host(kc), session.import_host(vc)
            if kc_d is not None and vc_d is not None:
                kc, vc = kc_d, vc_d
        if group:
            out_b = results.empty((active.size, rows, nhead_q, hdim_v), q.dtype)
            lse_b = results.empty((active.size, nhead_q, rows), np.float32)
        else:
            out_b, lse_b = out, lse
        # Variants without the stale-row guard (GPU) need the V rows that
        # hold no key to be finite; checking costs a look at one or two pages
        # per sequence.
        # torch device caches are checked on their device; IREE DeviceArrays
        # are not looked at (PagedKVCache passes what it tracks).
        def check_rows():
            if not on_device:
                return stale_rows_finite(v_cache, bt, call.seqlen_k, call.kv_shift, page)
            if isinstance(k_cache, _TorchDeviceCache):
                return stale_rows_finite(v_cache.tensor, bt, call.seqlen_k, call.kv_shift, page,
                                         rows_finite=torch_rows_finite)
            return False

        rows_finite = (
            session._formulation_for(problem) == "online"
            and v_layout == "row"
            and not kv_fp8
            and (kv_rows_finite if kv_rows_finite is not None else check_rows())
        )
        # A bottom-right mask with no left edge hides nothing from one-row
        # (decode) queries: the mask-free kernels may run them, when the
        # session has them (GPU default sets have decode tiles only without
        # a mask). ALiBi keeps the mask (its causal form differs).
        maskless_decode = mask_type == "bottom_right" and left < 0 and slopes is None and rows == 1

        def run(c: KernelCall, prob: dict, *dst):
            # The variant is chosen for the bias layout the call really
            # passes (gappy KV and split-KV re-lay it out per entry).
            prob = dict(prob, bias_shape=bias_shape_of(c.bias))
            if maskless_decode and session.serves(dict(prob, mask="none")):
                prob["mask"] = "none"
            variant = session.select(prob, rows, c.q.shape[0], rows_finite)
            for args, place in plan_calls(variant, c):
                place(dst, results.run(variant, args[0], kc, vc, *args[1:], stats=len(dst) > 2))

        if num_splits is None:
            keys = int(seqlen_k[active].max())
            # Work items: sequences x query heads x 64-row query blocks, as
            # in ck_tile: the tuned GPU decode runs one workgroup per query
            # head (docs/perf-notes.md has the measurements behind it).
            work = active.size * nhead_q * -(-rows // 64)
            splits = 1 if squant else num_splits_heuristic(work, session.compute_units, keys)
        else:
            splits = num_splits
        splits = min(splits, width)
        if splits == 1:
            run(call, problem, out_b.view(np.int8) if squant else out_b, lse_b)
        else:
            # Split-KV: partial results per run of pages (sinks left out),
            # merged by their LSEs.
            parts = split_kv(call, page, splits)
            o_parts = results.empty((parts.q.shape[0], rows, nhead_q, hdim_v), q.dtype)
            stats = [results.empty((parts.q.shape[0], nhead_q, rows), np.float32) for _ in range(3)]
            run(parts, dict(problem, sinks=False), o_parts, *stats)
            o_c, l_c = results.combine(o_parts, *stats, splits, sinks_a)
            out_b[...] = o_c  # rounded to q's dtype once
            lse_b[...] = l_c
        if group:
            out[src] = out_b.reshape((active.size * rows, nhead_q, hdim_v))[dst]
            lse[:, src] = lse_b.swapaxes(0, 1).reshape((nhead_q, active.size * rows))[:, dst]
    if torch_results:
        return (out, lse) if return_lse else out
    if as_torch:
        out_t = _from_numpy(out, like)
        return (out_t, _from_numpy(lse, like)) if return_lse else out_t
    return (out, lse) if return_lse else out


def fmha_fwd_kvcache(q, k_cache, v_cache, seqlen_k, *, cache_batch_idx=None, **kwargs):
    """Attention over a non-paged KV cache (ck_tile's non-paged kvcache mode).

    Args:
      k_cache: [batch_cache, max_seqlen_k, nhead_k, hdim_q]; v_cache likewise
        with hdim_v. Sequence b reads cache row cache_batch_idx[b] (default b).
      seqlen_k: [batch] int32 <= max_seqlen_k.
      cache_batch_idx: optional [batch] int32 in [0, batch_cache).
      Everything else as fmha_fwd_paged (batch or group mode, masks, ALiBi,
      bias, soft-cap, sinks, LSE, out, session).

    The cache is viewed, without copying, as pages of the largest of 128, 64,
    32, 16 and 1 rows that divides max_seqlen_k, and run by the paged kernels.
    """
    if kwargs.get("v_layout", "row") != "row":
        raise ValueError("v_layout='col' is supported for paged caches only (fmha_fwd_paged)")
    # torch caches stay torch tensors (reshaped as views on their device);
    # everything else becomes numpy.
    k_src = k_cache if _is_torch(k_cache) else _to_numpy(k_cache, "k_cache")
    v_src = v_cache if _is_torch(v_cache) else _to_numpy(v_cache, "v_cache")
    for name, a in (("k_cache", k_src), ("v_cache", v_src)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have 4 dims [batch_cache, max_seqlen_k, nhead_k, hdim], got shape {a.shape}")
    if tuple(v_src.shape[:3]) != tuple(k_src.shape[:3]):
        raise ValueError(f"v_cache shape {v_src.shape} must match k_cache {k_src.shape} in its first 3 dims")
    batch_cache, max_sk = k_src.shape[:2]
    sk = _int_array(seqlen_k, "seqlen_k", 1)
    batch = sk.shape[0]
    if batch and (sk.max() > max_sk or sk.min() < 0):
        b = int(np.argmax(sk)) if sk.max() > max_sk else int(np.argmin(sk))
        raise ValueError(f"seqlen_k[{b}] = {sk[b]} must be in [0, max_seqlen_k = {max_sk}]")
    if cache_batch_idx is None:
        if batch > batch_cache:
            raise ValueError(f"batch {batch} exceeds the cache's {batch_cache} rows; pass cache_batch_idx")
        rows_idx = np.arange(batch)
    else:
        rows_idx = _int_array(cache_batch_idx, "cache_batch_idx", 1).astype(np.int64)
        if rows_idx.shape[0] != batch:
            raise ValueError(f"cache_batch_idx has {rows_idx.shape[0]} entries, expected batch = {batch}")
        if batch and (rows_idx.min() < 0 or rows_idx.max() >= batch_cache):
            b = int(np.argmax((rows_idx < 0) | (rows_idx >= batch_cache)))
            raise ValueError(f"cache_batch_idx[{b}] = {rows_idx[b]} is not a cache row in [0, {batch_cache})")
    # The largest page dividing max_seqlen_k that the session has kernels
    # for (GPU default sets have pages 16 and 64 only), else the largest.
    fits = [p for p in (128, 64, 32, 16, 1) if max_sk % p == 0] if max_sk else [1]
    session = kwargs.get("session")
    if session is None:
        session = kwargs["session"] = default_session(kwargs.get("device", "cpu"))
    served = set() if getattr(session, "compile_missing", True) else {
        v.page_block_size for v in session.available_variants()
        if v.hdim_q == k_src.shape[3] and v.nhead_k == k_src.shape[2]}
    page = next((p for p in fits if p in served), fits[0])
    per_row = max(1, max_sk // page)

    def pages_of(a):
        a = a.contiguous() if _is_torch(a) else np.ascontiguousarray(a)
        return a.reshape(batch_cache * per_row, page, *a.shape[2:]) if max_sk else a.reshape(batch_cache, 1, *a.shape[2:])

    k_pages, v_pages = pages_of(k_src), pages_of(v_src)
    block_table = (rows_idx[:, None] * per_row + np.arange(per_row)[None, :]).astype(np.int32)
    return fmha_fwd_paged(q, k_pages, v_pages, block_table, sk, **kwargs)


F32_MAX = float(np.finfo(np.float32).max)


def _check_float(value, name: str) -> float:
    """A finite float that float32 holds (the kernels' scalars are f32)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite float, got {value!r}")
    if abs(value) > F32_MAX:
        raise ValueError(f"{name} = {value!r} overflows float32 (|{name}| <= {F32_MAX:.4g})")
    return float(value)


def _float_array(x, name: str, *, finite: bool = False) -> np.ndarray:
    """x as float32. Values float32 cannot hold are refused by name rather
    than becoming Inf; with finite=True, NaN and Inf are too."""
    a = _to_numpy(x, name)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype != _bf16():
        raise TypeError(f"{name} must be a float array, got {a.dtype}")
    wide = a.astype(np.float64, copy=False)
    given = np.isfinite(wide)
    if finite and not given.all():
        idx = tuple(int(i) for i in np.argwhere(~given)[0])
        raise ValueError(f"{name}{list(idx)} = {wide[idx]} must be finite")
    big = given & (np.abs(wide) > F32_MAX)
    if big.any():
        idx = tuple(int(i) for i in np.argwhere(big)[0])
        raise ValueError(f"{name}{list(idx)} = {wide[idx]:.6g} overflows float32")
    return a.astype(np.float32, copy=False)


def _window(value: int) -> int:
    """A window side or sink count as the kernels take it (int32): values
    beyond any sequence are equivalent to UNBOUNDED - 1, which stays a
    bounded window (ALiBi's causal form needs an unbounded left side
    exactly) yet reaches past every key: no sequence has 2^30 keys."""
    return min(value, UNBOUNDED - 1)


def _overlapping(out, arrays: dict) -> str | None:
    """The name of the first array whose memory overlaps `out`'s."""
    lo, hi = _byte_range(out)
    dev = _device_of(out)
    for name, a in arrays.items():
        if a is None or not (_is_torch(a) or isinstance(a, np.ndarray)) or _device_of(a) != dev:
            continue
        a_lo, a_hi = _byte_range(a)
        if a_lo < hi and lo < a_hi and a_hi > a_lo:
            if isinstance(a, np.ndarray) and isinstance(out, np.ndarray):
                try:
                    if not np.shares_memory(a, out, max_work=10**6):
                        continue
                except _TooHardError:
                    pass
            return name
    return None


def _byte_range(a) -> tuple[int, int]:
    if isinstance(a, np.ndarray):
        return _byte_bounds(a) if a.size else (0, 0)
    if a.numel() == 0:
        return (0, 0)
    lo = hi = a.data_ptr()
    for n, st in zip(a.shape, a.stride()):
        span = (n - 1) * st * a.element_size()
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return lo, hi + a.element_size()


# numpy 2 moved these; numpy 1.24 (the oldest this package takes) has them at the top.
_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds
_TooHardError = getattr(getattr(np, "exceptions", np), "TooHardError")


def _device_of(a) -> str:
    return str(a.device) if _is_torch(a) else "cpu"


def fmha_fwd_paged_async(*args, session: Session | None = None, device: str = "cpu", **kwargs):
    """fmha_fwd_paged on the session's worker threads: returns a
    concurrent.futures.Future of its result. Arguments are validated in the
    worker, so errors surface from Future.result(). The caller must not
    modify the arrays it passed until the future is done."""
    if session is None:
        session = default_session(device)
    return session.submit(fmha_fwd_paged, *args, session=session, device=device, **kwargs)
