"""Plan once, run many times: `PagedAttention` (FlashInfer's plan/run).

A serving engine calls attention once per layer per step with the same
tables. `plan` validates the tables and the score terms, chooses the
variants, cuts the work into kernel calls (chunks, tiles, split-KV) and puts
every table on the device once; `run` checks only what may differ between
layers (q, the caches, out) and invokes. `fmha_fwd_paged` is a plan and a
run on the arrays it is given.
"""

from __future__ import annotations

import numpy as np

from ..calls.planner import make_plan
from ..calls.problem import layout_of_params, problem, scores, tables
from ..core.arrays import _check_tensor_devices, _to_numpy
from ..core.checks import check_int
from ..core.tracing import untraced_methods
from ..runtime.executor import Executor
from ..runtime.session import Session, resolve_session
from .conventions import conventions


@untraced_methods
class PagedAttention:
    """Paged-KV attention planned once per batch step and run per layer.

        attn = turbine_fmha.PagedAttention(session, device="cuda")
        attn.plan(block_table, seqlen_k, num_pages=..., page_block_size=16,
                  nhead_q=32, nhead_k=8, hdim=128, dtype="f16", mask_type="bottom_right")
        for layer in layers:
            out = attn.run(q[layer], k_cache[layer], v_cache[layer])

    plan() takes the tables and every argument of fmha_fwd_paged that is
    not an array of the layer (see there for their meaning), plus the
    layout the caches have: num_pages, page_block_size, nhead_q, nhead_k,
    hdim (hdim_v), dtype (q's: numpy/torch dtype or "f16"/"bf16"/"f32"),
    kv_dtype (an fp8 cache format), kv_layout and v_layout; in batch mode
    seqlen_q (q rows per sequence, default 1), in group mode seqstart_q. Invalid tables
    raise there, naming the argument, before anything runs.

    run(q, k_cache, v_cache, out=None, return_lse=False, sinks=None) takes
    the layer's arrays, which must match the plan (q [batch, seqlen_q,
    nhead_q, hdim] or [total_q, nhead_q, hdim]; caches of the planned
    layout), on the session's device or the host, and returns like
    fmha_fwd_paged. Attention sinks are weights of each layer (gpt-oss):
    a plan made with sinks runs with the plan's, or with a run's own
    `sinks` (float [nhead_q], finite; a host array costs no device wait
    to check), so that every layer of a step shares one plan. With
    kv_rows_finite=None, each run checks its V cache's stale rows (a look at
    one or two pages per sequence; on torch GPU caches behind the unguarded
    kernels, which run again guarded if a row was not finite); True skips
    the check.
    """

    def __init__(self, session: Session | None = None, *, device: str | None = None):
        device = device or (session.device if isinstance(session, Session) else "cpu")
        self.session = resolve_session(session, device)
        self._plan: Executor | None = None

    def plan(
        self,
        block_table,
        seqlen_k,
        *,
        num_pages,
        page_block_size,
        nhead_q,
        nhead_k,
        hdim,
        hdim_v=None,
        dtype="f16",
        kv_dtype=None,
        v_layout="row",
        kv_layout="NHD",
        seqlen_q=1,
        seqstart_q=None,
        kv_offset=None,
        min_seqlen_q=0,
        num_splits=None,
        kv_rows_finite=None,
        causal=False,
        softmax_scale=None,
        window_size=None,
        **score_terms,
    ) -> PagedAttention:
        score_terms.update(
            conventions(  # flash-attn's spellings (flash_attn.py)
                scale=score_terms.pop("scale", None),
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                mask_type=score_terms.pop("mask_type", "none"),
                window_size_left=score_terms.pop("window_size_left", -1),
                window_size_right=score_terms.pop("window_size_right", -1),
            )
        )
        _check_tensor_devices(
            self.session.device_name,
            block_table=block_table,
            seqlen_k=seqlen_k,
            seqstart_q=seqstart_q,
            kv_offset=kv_offset,
            **{k: v for k, v in score_terms.items() if k in ("alibi_slopes", "bias", "sinks")},
        )
        layout = layout_of_params(
            num_pages=num_pages,
            page_block_size=page_block_size,
            nhead_q=nhead_q,
            nhead_k=nhead_k,
            hdim=hdim,
            hdim_v=hdim_v,
            dtype=dtype,
            kv_dtype=kv_dtype,
            v_layout=v_layout,
            kv_layout=kv_layout,
        )
        if seqstart_q is None:
            rows = np.shape(_to_numpy(block_table, "block_table"))
            q_shape = (rows[0] if rows else 0, check_int(seqlen_q, "seqlen_q", minimum=0))
        else:
            starts = _to_numpy(seqstart_q, "seqstart_q")
            q_shape = (int(starts[-1]) if starts.ndim == 1 and starts.size else 0,)
        t = tables(block_table, seqlen_k, layout, q_shape=q_shape, seqstart_q=seqstart_q, kv_offset=kv_offset)
        s = scores(layout, t, **score_terms)
        p = problem(layout, t, s, min_seqlen_q=min_seqlen_q, num_splits=num_splits, kv_rows_finite=kv_rows_finite)
        self._plan = Executor(make_plan(p, self.session), self.session)
        return self

    def run(self, q, k_cache, v_cache, *, out=None, return_lse: bool = False, sinks=None):
        if self._plan is None:
            raise RuntimeError("PagedAttention.run() before plan()")
        return self._plan.run(q, k_cache, v_cache, out=out, return_lse=return_lse, sinks=sinks)
