"""Attention sinks given to run() (PagedAttention.run(sinks=...)) on the
GPU, against the float64 reference (the former probe h200_run_sinks.py):
a plan made with one layer's sinks, then runs with other sinks as a torch
CUDA tensor, as numpy, and none (the plan's). The cases take each path the
sinks go through on the GPU set's sink kernels: a decode in one launch, a
long single decode split and merged on the host, a causal prefill in row
tiles, a chunked prefill, and a mixed varlen batch. Each run's sinks move
the output by far more than the tolerance (checked too), so a run given
the plan's sinks would fail. fp16, 32/8 heads of 128, page 16; spare
pages NaN, unused table slots garbage."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import HK, HQ, MASK, OUT_TOL, PAGE, SINKS_MOVE, D, check, paged, queries, rel_err, seqstart

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

# name: (query rows per sequence, or a list: a varlen batch; keys per sequence)
CASES = {
    "decode b32 x 1024": (1, [1024] * 32),
    "decode b1 x 8192 (split, host merge)": (1, [8192]),
    "prefill 1 x 1024 causal": (1024, [1024]),
    "chunked 4 x 128 over 1024": (128, [1152, 1100, 1152, 1040]),
    "mixed: 6 decodes + a 300-row prefill": ([1, 1, 1, 1, 1, 1, 300], [700, 513, 64, 1000, 33, 257, 300]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sinks_given_to_run(gpu, case):
    rows, lens = CASES[case]
    rng = np.random.default_rng(0)
    k, v, bt, sk = paged(rng, lens)
    kw = dict(MASK)
    if isinstance(rows, list):
        kw["seqstart_q"] = seqstart(rows)
        q, plan_rows = queries(rng, sum(rows)), max(rows)
    else:
        q, plan_rows = queries(rng, rows, batch=len(lens)), rows
    planned = rng.uniform(-2, 0, HQ).astype(np.float32)
    attn = turbine_fmha.PagedAttention(gpu.session).plan(
        bt,
        sk,
        num_pages=k.shape[0],
        page_block_size=PAGE,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        dtype="f16",
        seqlen_q=plan_rows,
        sinks=planned,
        **kw,
    )
    qt, kt, vt = (gpu.tensor(x) for x in (q, k, v))
    ref_planned = fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=planned, **kw)[0]
    # Scores are about N(0, 1): a row's sum is about keys x e^0.5, so sinks
    # near log(keys) and above take a share of each row.
    lift = float(np.log(max(lens)))
    own = [(lift + rng.uniform(0, 2, HQ)).astype(np.float32) for _ in range(2)]
    for given, sinks, want in (
        ("torch", gpu.tensor(own[0]), own[0]),
        ("numpy", own[1], own[1]),
        ("none", None, planned),
    ):
        out, lse = attn.run(qt, kt, vt, return_lse=True, sinks=sinks)
        gpu.sync()
        ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=want, **kw)
        check(out, ref, "f16", lse, ref_lse, what=f"sinks {given} ({gpu.session.last_variant.name})")
        if sinks is not None:
            moved = rel_err(ref_planned, ref)
            assert moved > SINKS_MOVE * OUT_TOL["f16"], f"sinks {given} move the output by only {moved:.1e}"
