"""Public entry points: `fmha_fwd_paged`, `fmha_fwd_kvcache` and
`fmha_fwd_paged_async`.

Data flows one way: arguments -> a validated Problem (turbine_fmha.problem)
-> a plan (turbine_fmha.attention) -> kernel calls -> results. Everything
is validated before any kernel is loaded or run, and every error names the
offending argument.
"""

from __future__ import annotations

import functools

from .arrays import _check_tensor_devices, _is_torch, overlapping
from .attention import PagedAttention, _Plan, resolve_session
from .flash_attn import conventions, kvcache_seqlens
from .modes import paged_view
from .plan_cache import call_key
from .problem import from_arrays
from .runtime import Session, default_session
from .tracing import check_no_grad, compiling


def _routed(fn):
    """Inside torch.compile the call goes to the custom op (torch_ops) with the arguments as
    given: dynamo traces this wrapper, not the eager body (locals() and closures it cannot)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if compiling():
            return _torch_ops().call_op("paged", **dict(zip(("q", "k_cache", "v_cache", "block_table", "seqlen_k"),
                                                             args)), **kwargs)
        return fn(*args, **kwargs)
    return call


@_routed
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
    kv_layout="NHD",
    q_scale=None,
    k_scale=None,
    v_scale=None,
    p_scale=None,
    out_scale=None,
    num_splits=None,
    kv_rows_finite=None,
    return_lse=False,
    causal=False,
    softmax_scale=None,
    window_size=None,
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
      k_cache: [num_pages, page_block_size, nhead_k, hdim_q] (kv_layout
        "NHD"; "HND": [num_pages, nhead_k, page_block_size, hdim_q]), same
        dtype as q:
        a numpy array / torch tensor, or an iree.runtime DeviceArray on the
        session's device (used in place, no copy; PagedKVCache with a
        session keeps its pool that way). torch CUDA/HIP caches are imported
        zero-copy through DLPack when the session is for cuda/hip (after a
        torch.cuda.synchronize); other torch tensors are copied.
      v_cache: like k_cache with hdim_v, same dtype; with v_layout="col",
        [num_pages, nhead_k, hdim_v, page_block_size] under either
        kv_layout.
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
        (and sink_size) past every key are windows that reach every key.
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
      logits_soft_cap: cap > 0: s -> cap * tanh(s / cap) before the mask; not with bias or ALiBi.
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
        (PagedKVCache tracks it): GPU kernels then skip the stale-row guard.
        None (default) checks the V rows that hold no key where the cache
        lives (DeviceArray caches are not looked at: guarded kernels).
      return_lse: also return LSE (float32, natural log; -inf, output 0, for
        rows with no visible key).
      causal / softmax_scale / window_size: flash-attn's spellings: causal=True
        is mask_type="bottom_right" with window_size_right=0; window_size is
        (left, right), bottom-right aligned unless mask_type is given. Two
        spellings that disagree raise ValueError naming both.
      device: "cpu" (llvm-cpu on IREE's local-task driver), "cuda" or "hip".
      session: a `Session` to run on (default: one shared per device).

    Returns out, or (out, lse): numpy arrays, or torch tensors on q's device
    when q is a torch tensor; on the session's own device (Session.
    torch_device) they are made there, never through the host. Non-contiguous
    inputs are accepted (copied).

    Devices: numpy arrays and CPU torch tensors go to every session; a torch
    tensor or DeviceArray on another device than the session's raises
    ValueError naming the argument.

    Inside torch.compile the call goes through torch.ops.turbine_fmha. No
    backward: a tensor that requires grad raises ValueError (grad mode on).
    """
    terms = conventions(scale=scale, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        mask_type=mask_type, window_size_left=window_size_left, window_size_right=window_size_right)
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seqlen_k=seqlen_k,
                 seqstart_q=seqstart_q, kv_offset=kv_offset, alibi_slopes=alibi_slopes, bias=bias, sinks=sinks)
    _check_tensor_devices(session.device if isinstance(session, Session) else device, **given, out=out)
    settings = dict(v_layout=v_layout, kv_layout=kv_layout, min_seqlen_q=min_seqlen_q, num_splits=num_splits,
                    kv_rows_finite=kv_rows_finite, sink_size=sink_size, logits_soft_cap=logits_soft_cap,
                    q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, p_scale=p_scale, out_scale=out_scale, **terms)
    check_no_grad(dict(given, out=out))
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    # Rows are written chunk by chunk while later chunks still read the
    # inputs: an out sharing their memory corrupts the result.
    clash = overlapping(out, given) if out is not None and hasattr(out, "shape") else None
    if clash:
        raise ValueError(f"out overlaps {clash} in memory; pass a separate output buffer")
    attn = PagedAttention(resolve_session(session, device))
    # A call equal to a recent one (a model's next layer) reuses its plan (plan_cache).
    attn._plan = attn.session.plans.get(call_key(dict(given, **settings)), lambda: _Plan(from_arrays(
        **given, **settings), attn.session, keep_binds=False))
    return attn.run(q, k_cache, v_cache, out=out, return_lse=return_lse)


def fmha_fwd_kvcache(q, k_cache, v_cache, seqlen_k=None, *, cache_seqlens=None, cache_batch_idx=None, **kwargs):
    """Attention over a non-paged KV cache (ck_tile's non-paged kvcache mode).

    Args:
      k_cache: [batch_cache, max_seqlen_k, nhead_k, hdim_q]; v_cache likewise
        with hdim_v. Sequence b reads cache row cache_batch_idx[b] (default b).
      seqlen_k: [batch] int32 <= max_seqlen_k, or one int for every sequence
        (default max_seqlen_k); cache_seqlens is flash-attn's name for it.
      cache_batch_idx: optional [batch] int32 in [0, batch_cache).
      Everything else as fmha_fwd_paged (batch or group mode, masks, ALiBi,
      bias, soft-cap, sinks, LSE, out, session).

    The cache is viewed, without copying, as pages of the largest of 128, 64,
    32, 16 and 1 rows that divides max_seqlen_k (and that the session has
    kernels for), and run by the paged kernels.
    """
    seqlen_k = kvcache_seqlens(q, k_cache, seqlen_k, cache_seqlens, kwargs.get("seqstart_q"))
    if compiling():
        return _torch_ops().call_op("kvcache", q=q, k_cache=k_cache, v_cache=v_cache, seqlen_k=seqlen_k,
                                    cache_batch_idx=cache_batch_idx, **kwargs)
    for name, paged in (("v_layout", "row"), ("kv_layout", "NHD")):
        if kwargs.get(name, paged) != paged:
            raise ValueError(f"{name}={kwargs[name]!r} is supported for paged caches only (fmha_fwd_paged)")
    if kwargs.get("session") is None:
        kwargs["session"] = default_session(kwargs.get("device", "cpu"))
    k_pages, v_pages, block_table, sk = paged_view(k_cache, v_cache, seqlen_k, cache_batch_idx, kwargs["session"])
    return fmha_fwd_paged(q, k_pages, v_pages, block_table, sk, **kwargs)


def fmha_fwd_paged_async(*args, session: Session | None = None, device: str = "cpu", **kwargs):
    """fmha_fwd_paged on the session's worker threads: returns a
    concurrent.futures.Future of its result. Arguments are validated in the
    worker, so errors surface from Future.result(). The caller must not
    modify the arrays it passed until the future is done."""
    if session is None:
        session = default_session(device)
    return session.submit(fmha_fwd_paged, *args, session=session, device=device, **kwargs)


def _torch_ops():
    from . import torch_ops  # imports torch and registers the ops: only once torch tensors are seen

    return torch_ops
