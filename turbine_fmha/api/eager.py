"""The one-shot attention calls, eagerly: `fmha_fwd_paged`,
`fmha_fwd_kvcache` and `fmha_fwd_paged_async` (turbine_fmha.api.public
routes the first two to their torch ops while torch.compile traces).

Data flows one way: arguments -> a validated Problem (calls.problem) -> a
plan (calls.planner) -> kernel calls (runtime.executor) -> results. Everything is validated
before any kernel is loaded or run, and every error names the offending
argument.
"""

from __future__ import annotations

from ..calls import options
from ..calls.modes import paged_view
from ..calls.planner import make_plan
from ..calls.problem import from_arrays
from ..core.arrays import check_tensor_devices, overlapping
from ..core.tracing import check_no_grad
from ..runtime.executor import Executor
from ..runtime.plan_cache import call_key
from ..runtime.session import Session, default_session, resolve_session
from .attention import PagedAttention
from .conventions import kvcache_seqlens, with_conventions


@options.declared("eager")
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

    softmax(scale * q k^T + score terms, masked) v over each sequence's
    keys, read from the pages its block_table row lists: a numpy array in,
    a numpy array out; torch tensors on the session's GPU in, torch
    tensors on it out. docs/user-guide.md, "Calling the attention", has
    examples and what each option costs.

    Args: declared in turbine_fmha/calls/options.py.

    Returns:
      out: [batch, seqlen_q, nhead_q, hdim_v] (group mode: [total_q,
        nhead_q, hdim_v]) in q's dtype; or, with return_lse, (out, lse):
        lse float32 [batch, nhead_q, seqlen_q] (group mode: [nhead_q,
        total_q]). numpy arrays, or torch tensors on q's device when q is
        a torch tensor.

    Raises:
      ValueError or TypeError naming the argument, before any kernel is
        loaded or run (a refused call changes nothing).
      ArtifactError: no artifact serves the call (the message gives the
        command that builds it).
    """
    # Every option by name (nothing else is bound yet), flash-attn's
    # spellings mapped onto the runtime's.
    kw = with_conventions(locals())
    out, return_lse, device, session = (kw.pop(n) for n in ("out", "return_lse", "device", "session"))
    arrays = {n: kw[n] for n in _ARRAYS}
    check_tensor_devices(session.device_name if isinstance(session, Session) else device or "cpu", **arrays, out=out)
    check_no_grad(dict(arrays, out=out))
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    # Rows are written chunk by chunk while later chunks still read the
    # inputs: an out sharing their memory corrupts the result.
    clash = overlapping(out, arrays) if out is not None and hasattr(out, "shape") else None
    if clash:
        raise ValueError(f"out overlaps {clash} in memory; pass a separate output buffer")
    attn = PagedAttention(resolve_session(session, device))
    # A call equal to a recent one (a model's next layer) reuses its plan
    # (plan_cache); kw is the Problem's arguments: the others are CALL_ONLY.
    attn._plan = attn.session.plans.get(
        call_key(kw),
        lambda: Executor(make_plan(from_arrays(**kw), attn.session), attn.session, keep_binds=False),
    )
    return attn.run(q, k_cache, v_cache, out=out, return_lse=return_lse, sinks=sinks)


# The arrays of a call (but out): checked for their device, grad and overlap with out.
_ARRAYS = tuple(o.name for o in options.front("eager") if o.kind == "array" and o.name not in options.CALL_ONLY)


@options.declared("kvcache")
def fmha_fwd_kvcache(q, k_cache, v_cache, seqlen_k=None, *, cache_seqlens=None, cache_batch_idx=None, **kwargs):
    """Attention over a non-paged KV cache (ck_tile's non-paged kvcache mode).

    fmha_fwd_paged over caches of whole rows, one per sequence (or shared
    through cache_batch_idx): every other option is fmha_fwd_paged's.

    Args: declared in turbine_fmha/calls/options.py.

    Returns:
      out, or (out, lse) with return_lse, as fmha_fwd_paged: out [batch,
        seqlen_q, nhead_q, hdim_v] (group mode [total_q, nhead_q, hdim_v])
        in q's dtype, lse float32 [batch, nhead_q, seqlen_q] (group mode
        [nhead_q, total_q]).

    Raises:
      ValueError or TypeError naming the argument before anything runs;
        ValueError for a v_layout or kv_layout other than the default (they
        are for paged caches).
    """
    seqlen_k = kvcache_seqlens(q, k_cache, seqlen_k, cache_seqlens, kwargs.get("seqstart_q"))
    for name in ("v_layout", "kv_layout"):
        if kwargs.get(name, options.DEFAULTS[name]) != options.DEFAULTS[name]:
            raise ValueError(f"{name}={kwargs[name]!r} is supported for paged caches only (fmha_fwd_paged)")
    if kwargs.get("session") is None:
        kwargs["session"] = default_session(kwargs.get("device") or "cpu")
    name = "cache_seqlens" if cache_seqlens is not None else "seqlen_k"
    k_pages, v_pages, block_table, sk = paged_view(
        k_cache, v_cache, seqlen_k, cache_batch_idx, kwargs["session"], name=name
    )
    return fmha_fwd_paged(q, k_pages, v_pages, block_table, sk, **kwargs)


@options.documented("eager")
def fmha_fwd_paged_async(*args, session: Session | None = None, device: str | None = None, **kwargs):
    """fmha_fwd_paged on the session's worker threads (4 per session).

    Takes fmha_fwd_paged's arguments. They are validated in the worker, so
    errors surface from Future.result(). The caller must not modify the
    arrays it passed until the future is done.

    Args: declared in turbine_fmha/calls/options.py.

    Returns:
      A concurrent.futures.Future of fmha_fwd_paged's result.
    """
    if session is None:
        session = default_session(device or "cpu")
    return session.submit(fmha_fwd_paged, *args, session=session, device=device, **kwargs)
