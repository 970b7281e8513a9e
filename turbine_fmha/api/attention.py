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

from ..calls.options import bind, declared, names
from ..calls.planner import make_plan
from ..calls.problem import layout_of_params, problem, scores, tables
from ..core.arrays import check_tensor_devices, to_numpy
from ..core.checks import check_int
from ..core.tracing import untraced_methods
from ..runtime.executor import Executor
from ..runtime.session import Session, resolve_session
from .conventions import with_conventions


@untraced_methods
class PagedAttention:
    """Paged-KV attention planned once per batch step and run per layer.

        attn = turbine_fmha.PagedAttention(session, device="cuda")
        attn.plan(block_table, seqlen_k, num_pages=..., page_block_size=16,
                  nhead_q=32, nhead_k=8, hdim=128, dtype="f16", mask_type="bottom_right")
        for layer in layers:
            out = attn.run(q[layer], k_cache[layer], v_cache[layer])

    plan() takes the tables, the layout the caches have, and every option
    of fmha_fwd_paged that is not an array of one layer; it validates them
    (invalid tables raise there, naming the argument, before anything
    runs), chooses the kernels, cuts the work into kernel calls and puts
    the tables on the device. run() takes one layer's q and caches, checks
    them against the plan and runs it, returning what fmha_fwd_paged
    returns. help(PagedAttention.plan) and help(PagedAttention.run) list
    their arguments.

    Args:
      session: the turbine_fmha.Session that runs the plans; default the
        default session of `device`.
      device: "cpu", "cuda", "cuda:N", "hip", "hip:N" or a torch.device,
        keyword-only; default the session's, or "cpu" without a session.
    """

    def __init__(self, session: Session | None = None, *, device: str | None = None):
        device = device or (session.device if isinstance(session, Session) else "cpu")
        self.session = resolve_session(session, device)
        self._plan: Executor | None = None

    @declared("plan")
    def plan(self, block_table, seqlen_k, **given) -> PagedAttention:
        """Plans a batch step: its tables, the caches' layout, the options.

        Validates everything a run does not bring (invalid tables raise
        here, naming the argument, before anything runs), chooses the
        kernels, cuts the work into kernel calls (chunks, tiles, split-KV)
        and puts the tables on the device once, for every layer's run().
        The options are fmha_fwd_paged's, but the arrays of one layer (q,
        the caches, out: run's) and device and session (the object's).

        Args: declared in turbine_fmha/calls/options.py.

        Returns:
          This PagedAttention, planned (attn.plan(...).run(...) chains).
        """
        # Every option by name (those not given at their defaults), and
        # flash-attn's spellings mapped onto the runtime's; what is left
        # after the layout, the modes and the planning is the score terms.
        score_terms = with_conventions(bind("plan", given, "PagedAttention.plan()"))
        layout = {n: score_terms.pop(n) for n in names("plan", group="layout")}
        seqlen_q, seqstart_q, kv_offset, min_seqlen_q, num_splits, kv_rows_finite = (
            score_terms.pop(n)
            for n in ("seqlen_q", "seqstart_q", "kv_offset", "min_seqlen_q", "num_splits", "kv_rows_finite")
        )
        check_tensor_devices(
            self.session.device_name,
            block_table=block_table,
            seqlen_k=seqlen_k,
            seqstart_q=seqstart_q,
            kv_offset=kv_offset,
            **{n: score_terms[n] for n in names("plan", group="score terms", kind="array")},
        )
        layout = layout_of_params(**layout)
        if seqstart_q is None:
            rows = np.shape(to_numpy(block_table, "block_table"))
            q_shape = (rows[0] if rows else 0, check_int(seqlen_q, "seqlen_q", minimum=0))
        else:
            starts = to_numpy(seqstart_q, "seqstart_q")
            q_shape = (int(starts[-1]) if starts.ndim == 1 and starts.size else 0,)
        t = tables(block_table, seqlen_k, layout, q_shape=q_shape, seqstart_q=seqstart_q, kv_offset=kv_offset)
        s = scores(layout, t, **score_terms)
        p = problem(layout, t, s, min_seqlen_q=min_seqlen_q, num_splits=num_splits, kv_rows_finite=kv_rows_finite)
        self._plan = Executor(make_plan(p, self.session), self.session)
        return self

    @declared("run")
    def run(self, q, k_cache, v_cache, *, out=None, return_lse: bool = False, sinks=None):
        """Runs the plan on one layer's arrays.

        q and the caches must match the plan (its batch, rows, heads, head
        dims, dtypes and page layout; refused by name otherwise), on the
        session's device or in host memory. Host caches that are
        C-contiguous and aligned are read in place, their import kept by
        the plan for the next step. With kv_rows_finite=None at plan(),
        each run checks its V cache's stale rows (a look at one or two
        pages per sequence; on torch GPU caches behind the unguarded
        kernels, which run again guarded if a row was not finite).

        Args: declared in turbine_fmha/calls/options.py.

        Returns:
          out, or (out, lse) with return_lse, as fmha_fwd_paged: out [batch,
            seqlen_q, nhead_q, hdim_v] (group mode [total_q, nhead_q,
            hdim_v]) in q's dtype, lse float32 [batch, nhead_q, seqlen_q]
            (group mode [nhead_q, total_q]); numpy arrays, or torch tensors
            on q's device when q is a torch tensor.

        Raises:
          RuntimeError: run() before plan().
          ValueError or TypeError naming the argument, before anything runs.
        """
        if self._plan is None:
            raise RuntimeError("PagedAttention.run() before plan()")
        return self._plan.run(q, k_cache, v_cache, out=out, return_lse=return_lse, sinks=sinks)
