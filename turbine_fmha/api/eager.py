"""The one-shot attention calls, eagerly: `fmha_fwd_paged`,
`fmha_fwd_kvcache` and `fmha_fwd_paged_async` (turbine_fmha.api.public
routes the first two to their torch ops while torch.compile traces).

Data flows one way: arguments -> a validated Problem (calls.problem) -> a
plan (calls.planner) -> kernel calls (runtime.executor) -> results. Everything is validated
before any kernel is loaded or run, and every error names the offending
argument.
"""

from __future__ import annotations

from ..calls.modes import paged_view
from ..calls.planner import make_plan
from ..calls.problem import from_arrays
from ..core.arrays import _check_tensor_devices, overlapping
from ..core.tracing import check_no_grad
from ..runtime.executor import Executor
from ..runtime.plan_cache import call_key
from ..runtime.session import Session, default_session, resolve_session
from .attention import PagedAttention
from .conventions import conventions, kvcache_seqlens


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
    device=None,
    session: Session | None = None,
):
    """Paged-KV flash-attention forward (ck_tile's FmhaFwdPagedKVKernel).

    Args, by group (docs/user-guide.md, "Calling the attention", says what
    each one takes and means):
      arrays: q ([batch, seqlen_q, nhead_q, hdim], or [total_q, nhead_q,
        hdim] with seqstart_q), k_cache and v_cache (pages laid out as
        kv_layout "NHD" or "HND"; v_layout "col" for column-major V),
        block_table [batch, max_pages] and seqlen_k [batch]: numpy arrays,
        torch tensors, or DeviceArrays of the session's device.
      tables: seqstart_q (group mode), kv_offset (gappy KV), min_seqlen_q.
      mask: mask_type, window_size_left, window_size_right, sink_size; or
        flash-attn's causal and window_size.
      scores: scale (or softmax_scale), alibi_slopes, bias,
        logits_soft_cap, sinks.
      fp8 scales: q_scale, k_scale, v_scale, p_scale, out_scale.
      run: num_splits (split-KV), kv_rows_finite (whether the stale-row
        guard may be skipped), out, return_lse, session / device.

    Returns out ([..., nhead_q, hdim_v] in q's dtype), or (out, lse) with
    return_lse: numpy arrays, or torch tensors on q's device.

    Raises ValueError or TypeError naming the argument, before any kernel
    is loaded or run.
    """
    terms = conventions(
        scale=scale,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        mask_type=mask_type,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
    )
    given = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seqlen_k=seqlen_k,
        seqstart_q=seqstart_q,
        kv_offset=kv_offset,
        alibi_slopes=alibi_slopes,
        bias=bias,
        sinks=sinks,
    )
    _check_tensor_devices(session.device_name if isinstance(session, Session) else device or "cpu", **given, out=out)
    settings = dict(
        v_layout=v_layout,
        kv_layout=kv_layout,
        min_seqlen_q=min_seqlen_q,
        num_splits=num_splits,
        kv_rows_finite=kv_rows_finite,
        sink_size=sink_size,
        logits_soft_cap=logits_soft_cap,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        p_scale=p_scale,
        out_scale=out_scale,
        **terms,
    )
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
    attn._plan = attn.session.plans.get(
        call_key(dict(given, **settings)),
        lambda: Executor(make_plan(from_arrays(**given, **settings), attn.session), attn.session, keep_binds=False),
    )
    return attn.run(q, k_cache, v_cache, out=out, return_lse=return_lse, sinks=sinks)


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
    for name, paged in (("v_layout", "row"), ("kv_layout", "NHD")):
        if kwargs.get(name, paged) != paged:
            raise ValueError(f"{name}={kwargs[name]!r} is supported for paged caches only (fmha_fwd_paged)")
    if kwargs.get("session") is None:
        kwargs["session"] = default_session(kwargs.get("device") or "cpu")
    name = "cache_seqlens" if cache_seqlens is not None else "seqlen_k"
    k_pages, v_pages, block_table, sk = paged_view(
        k_cache, v_cache, seqlen_k, cache_batch_idx, kwargs["session"], name=name
    )
    return fmha_fwd_paged(q, k_pages, v_pages, block_table, sk, **kwargs)


def fmha_fwd_paged_async(*args, session: Session | None = None, device: str | None = None, **kwargs):
    """fmha_fwd_paged on the session's worker threads: returns a
    concurrent.futures.Future of its result. Arguments are validated in the
    worker, so errors surface from Future.result(). The caller must not
    modify the arrays it passed until the future is done."""
    if session is None:
        session = default_session(device or "cpu")
    return session.submit(fmha_fwd_paged, *args, session=session, device=device, **kwargs)
