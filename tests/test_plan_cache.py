"""One-shot calls reuse the plan of an earlier call with equal inputs
(turbine_fmha.plan_cache), and only then: a plan kept for other tables,
scalars or score terms would give wrong results, so every change of an
input must miss. Each result is checked against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem
from tolerances import OUT_TOL

import turbine_fmha
from turbine_fmha.runtime.plan_cache import PLAN_CACHE_SIZE, call_key
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

SHAPE = dict(dtype="f16", batch=3, seqlen_q=1, seqlens_k=[40, 17, 33], nhead_q=4, nhead_k=2, hdim=64, page=16)


def _call(session, prob, **kw):
    out = turbine_fmha.fmha_fwd_paged(*prob, session=session, **kw)
    ref, _ = fmha_fwd_paged_ref(*prob, **kw)
    err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL["f16"], f"rel err {err:.3e}"
    return out


def _plans(session):
    return list(session.plans._plans.values())


def test_equal_calls_share_a_plan(explicit_session, rng):
    explicit_session.plans.clear()
    prob = make_problem(rng, **SHAPE)
    for _ in range(3):  # layers: same tables, fresh q and caches each time
        q = rng.standard_normal(prob[0].shape).astype(np.float16)
        _call(explicit_session, (q, *prob[1:]))
    assert len(_plans(explicit_session)) == 1


@pytest.mark.parametrize("change", ["block_table", "seqlen_k", "scale", "mask", "alibi"])
def test_any_change_misses(explicit_session, rng, change):
    """The second call differs from the first in one input; it must get its
    own plan and its own (correct) result."""
    explicit_session.plans.clear()
    q, k, v, bt, sk = make_problem(rng, **SHAPE)
    _call(explicit_session, (q, k, v, bt, sk))
    kw = {}
    if change == "block_table":
        bt = bt.copy()
        bt[0, 0], bt[1, 0] = bt[1, 0], bt[0, 0]  # two sequences swap their first pages
    elif change == "seqlen_k":
        sk = sk.copy()
        sk[0] -= 3
    elif change == "scale":
        kw = dict(scale=0.5)
    elif change == "mask":
        kw = dict(mask_type="bottom_right", window_size_left=5, window_size_right=0)
    else:
        kw = dict(alibi_slopes=rng.uniform(0.01, 0.5, 4).astype(np.float32))
    _call(explicit_session, (q, k, v, bt, sk), **kw)
    assert len(_plans(explicit_session)) == 2


def test_key_sees_every_table_byte_and_no_cache_value(rng):
    q, k, v, bt, sk = make_problem(rng, **SHAPE)

    def key(**kw):
        return call_key(dict(dict(q=q, k_cache=k, v_cache=v, block_table=bt, seqlen_k=sk), **kw))

    base = key()
    assert key(block_table=bt.copy(), seqlen_k=sk.copy()) == base
    assert key(q=q + 1, k_cache=k * 2) == base  # values of q and the caches do not shape a plan
    for i in range(bt.size):  # any one table entry, used slots and garbage alike
        bt2 = bt.copy()
        bt2.flat[i] = (max(int(bt.flat[i]), 0) + 1) % k.shape[0]
        assert key(block_table=bt2) != base
    assert key(kv_rows_finite=True) != base
    assert key(logits_soft_cap=1e-9) != base
    assert key(q=q[:, :, :, :32]) != base  # q's layout does
    import ml_dtypes

    fp8 = [q.astype(getattr(ml_dtypes, f)) for f in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")]
    assert len({key(q=a) for a in fp8}) == 3  # one byte each, three formats
    assert key(block_table={"rows": bt}) is None  # not digested: validated (and refused) as usual


def test_size_is_bounded(explicit_session, rng):
    explicit_session.plans.clear()
    q, k, v, bt, sk = make_problem(rng, **SHAPE)
    for i in range(PLAN_CACHE_SIZE + 3):
        _call(explicit_session, (q, k, v, bt, sk), scale=0.1 + i / 100)
    assert len(_plans(explicit_session)) == PLAN_CACHE_SIZE


def test_shared_plans_keep_no_caches(explicit_session, rng):
    """A kept plan must not keep the caller's caches alive."""
    import weakref

    explicit_session.plans.clear()
    prob = make_problem(rng, **SHAPE)
    k = prob[1].copy()
    ref = weakref.ref(k)
    _call(explicit_session, (prob[0], k, *prob[2:]))
    del k
    assert ref() is None
