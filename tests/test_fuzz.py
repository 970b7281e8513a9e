"""Differential property test: random valid problems across the
supported space, against the float64 reference. Hypothesis draws the
problem, and on a failure it shrinks it to a minimal one. Add that one to
the @example list below so it stays a regression test.

The space covers dtypes, head layouts (MHA, GQA, MQA), hdim_q != hdim_v,
pages of 1 and 16 rows, every mask with windows and sink tokens, ALiBi, a
bias, soft-cap and attention sinks, batch and group mode, gappy KV, split-KV,
and both formulations. The block tables have permuted pages, pages shared
between sequences, and garbage in unused slots. Head dims are kept small
so the variants it needs compile quickly.

Hostile values too: NaN and +-Inf anywhere in q, K and V
(visible keys, stale rows, pages no sequence uses), tiny and default
scales, biases of huge magnitude (every score shifted by up to 3e37, which
leaves the softmax unchanged), and out buffers that alias an input (refused
by name, nothing changed). NaN/Inf rows must match the reference's
exactly; finite ones within the usual tolerance.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import np_dtype
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from tolerances import LSE_TOL, OUT_TOL

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HEADS = [(4, 2), (4, 4), (4, 1)]
FEATURES = ["none", "alibi", "bias", "softcap", "sinks", "offset"]
# A bias of one constant on every key: a float32 and a float64 sum both
# lose the score beside it, so kernel and reference agree on a uniform
# softmax over the visible keys (an f32 LSE cannot hold log(sum) there).
OFFSETS = [-1e30, 1e20, -3e37, 3e37]
POISON = ["none", "none", "q_nan", "k_nan", "k_inf", "k_ninf", "v_nan", "v_inf"]
ALIASES = [None] * 6 + ["q", "k_cache", "v_cache"]


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(["f16", "bf16", "f32"]))
    hq, hk = draw(st.sampled_from(HEADS))
    d, dv = 32, draw(st.sampled_from([32, 16]))
    page = draw(st.sampled_from([1, 16]))
    batch = draw(st.integers(1, 3))
    group = draw(st.booleans())
    lens_q = [draw(st.integers(1, 12)) for _ in range(batch)] if group else [draw(st.integers(1, 12))] * batch
    lens_k = [draw(st.integers(0, 70)) for _ in range(batch)]
    offsets = [draw(st.integers(0, 20)) for _ in range(batch)] if draw(st.booleans()) else None
    mask = draw(st.sampled_from(["none", "top_left", "bottom_right"]))
    kw = dict(mask_type=mask)
    if mask != "none":
        kw["window_size_left"] = draw(st.sampled_from([-1, 0, 3, 17]))
        kw["window_size_right"] = draw(st.sampled_from([-1, 0, 2]))
        kw["sink_size"] = draw(st.sampled_from([0, 0, 2]))
    feature = draw(st.sampled_from(FEATURES))
    splits = draw(st.sampled_from([None, 1, 2, 3]))
    formulation = draw(st.sampled_from(["explicit", "online"]))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([None, None, 1e-6, 1e-30]))
    offset = draw(st.sampled_from(OFFSETS)) if feature == "offset" else None
    poison = draw(st.sampled_from(POISON))
    alias = draw(st.sampled_from(ALIASES))
    return dict(
        dtype=dtype,
        hq=hq,
        hk=hk,
        d=d,
        dv=dv,
        page=page,
        lens_q=lens_q,
        lens_k=lens_k,
        offsets=offsets,
        group=group,
        kw=kw,
        feature=feature,
        splits=splits,
        formulation=formulation,
        seed=seed,
        scale=scale,
        offset=offset,
        poison=poison,
        alias=alias,
    )


def _build(p):
    rng = np.random.default_rng(p["seed"])
    dt = np_dtype(p["dtype"])
    page, batch = p["page"], len(p["lens_k"])
    offsets = p["offsets"] or [0] * batch
    ends = [o + n for o, n in zip(offsets, p["lens_k"])]
    width = max([-(-e // page) for e in ends] + [1]) + 1
    num_pages = batch * width // 2 + 3  # fewer pages than slots: some are shared
    k = rng.standard_normal((num_pages, page, p["hk"], p["d"])).astype(dt)
    v = rng.standard_normal((num_pages, page, p["hk"], p["dv"])).astype(dt)
    bt = rng.choice(np.array([-1, -9, num_pages, 2**31 - 1]), size=(batch, width)).astype(np.int32)
    for b, (o, e) in enumerate(zip(offsets, ends)):
        first, last = o // page, -(-e // page) if e > o else o // page
        bt[b, first:last] = rng.integers(0, num_pages, last - first)  # permuted, shared
    kw = dict(p["kw"])
    total = sum(p["lens_q"])
    if p["group"]:
        q = rng.standard_normal((total, p["hq"], p["d"])).astype(dt)
        kw["seqstart_q"] = np.concatenate([[0], np.cumsum(p["lens_q"])]).astype(np.int32)
    else:
        q = rng.standard_normal((batch, p["lens_q"][0], p["hq"], p["d"])).astype(dt)
    if p["offsets"]:
        kw["kv_offset"] = np.array(p["offsets"], np.int32)
    f = p["feature"]
    if f == "alibi":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, p["hq"]).astype(np.float32)
    elif f == "bias":
        keys = max(p["lens_k"] + [1])
        kw["bias"] = (
            rng.standard_normal((p["hq"], total, keys))
            if p["group"]
            else rng.standard_normal((1, p["hq"], p["lens_q"][0], keys))
        ).astype(np.float32)
    elif f == "softcap":
        kw["logits_soft_cap"] = 2.5
    elif f == "sinks":
        kw["sinks"] = rng.uniform(-1, 2, p["hq"]).astype(np.float32)
    elif f == "offset":
        keys = max(p["lens_k"] + [1])
        kw["bias"] = np.full(
            (p["hq"], total, keys) if p["group"] else (1, 1, p["lens_q"][0], keys), p.get("offset", -1e30), np.float32
        )
    if p.get("scale") is not None:
        kw["scale"] = p["scale"]
    poison = p.get("poison", "none")
    if poison != "none":
        # One element anywhere: a visible key, a stale row, an unused page.
        target, what = poison.split("_")
        a = {"q": q, "k": k, "v": v}[target]
        a[tuple(int(rng.integers(n)) for n in a.shape)] = {"nan": np.nan, "inf": np.inf, "ninf": -np.inf}[what]
    return (q, k, v, bt, np.array(p["lens_k"], np.int32)), kw


# Found by this test: split-KV gave each split entry its own copy of a
# batch-broadcast bias, and the kernel was chosen for the broadcast shape.
FOUND_SPLIT_BIAS = dict(
    dtype="f16",
    hq=4,
    hk=2,
    d=32,
    dv=32,
    page=1,
    lens_q=[1],
    lens_k=[2],
    offsets=None,
    group=False,
    kw={"mask_type": "none"},
    feature="bias",
    splits=2,
    formulation="explicit",
    seed=0,
)


# Found by this test: a NaN in the V of a key no row sees, in a page past
# the causal diagonal, is NaN in the reference (0 x NaN) but never read by
# the kernels (masked-block skipping).
FOUND_MASKED_V_NAN = dict(
    dtype="f16",
    hq=4,
    hk=2,
    d=32,
    dv=32,
    page=1,
    lens_q=[1, 1],
    lens_k=[0, 7],
    offsets=None,
    group=False,
    kw={"mask_type": "top_left", "window_size_left": -1, "window_size_right": 0, "sink_size": 0},
    feature="none",
    splits=None,
    formulation="explicit",
    seed=0,
    scale=None,
    offset=None,
    poison="v_nan",
    alias=None,
)


# Found by this test: an Inf in the V of a key that every row sees, in a
# sequence's first page, which its unused table slots read again (masked):
# 0 x Inf made the guard-free kernels' output NaN where the reference's is
# Inf, because the stale-row check looked only past the last key.
FOUND_FIRST_PAGE_INF = dict(
    dtype="f16",
    hq=4,
    hk=1,
    d=32,
    dv=16,
    page=16,
    lens_q=[7, 7, 7],
    lens_k=[33, 0, 2],
    offsets=None,
    group=False,
    kw={"mask_type": "none"},
    feature="none",
    splits=None,
    formulation="online",
    seed=10677198,
    scale=None,
    offset=None,
    poison="v_inf",
    alias=None,
)


# Found by this test: an Inf in the V of a key whose probability for a row
# (ALiBi at distance 38, slope 0.5: ~7e-9) is below what the kernels' P
# (in q's dtype, as ck_tile's) can hold: P is 0 there and 0 x Inf is NaN
# where the float64 reference's output is Inf.
FOUND_UNDERFLOWED_P_INF = dict(
    dtype="f16",
    hq=4,
    hk=2,
    d=32,
    dv=32,
    page=1,
    lens_q=[3, 3],
    lens_k=[1, 48],
    offsets=None,
    group=False,
    kw={"mask_type": "none"},
    feature="alibi",
    splits=None,
    formulation="explicit",
    seed=1,
    scale=None,
    offset=None,
    poison="v_inf",
    alias=None,
)


# Pages of one row, one of them twice in the sequence's table, so that the
# key the row sees (causal) and a key its mask hides are the same V row,
# +Inf there. The reference's output is Inf + 0 x Inf = NaN; the kernels
# that skip the masked key give +Inf, which the comparison must accept.
FOUND_SEEN_AND_HIDDEN_V_INF = dict(
    dtype="f16",
    hq=4,
    hk=2,
    d=32,
    dv=16,
    page=1,
    lens_q=[1],
    lens_k=[9],
    offsets=None,
    group=False,
    kw={"mask_type": "top_left", "window_size_left": -1, "window_size_right": 0, "sink_size": 0},
    feature="none",
    splits=None,
    formulation="explicit",
    seed=0,
    scale=None,
    offset=None,
    poison="v_inf",
    alias=None,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(p=problems())
@example(p=FOUND_SPLIT_BIAS)
@example(p=FOUND_MASKED_V_NAN)
@example(p=FOUND_FIRST_PAGE_INF)
@example(p=FOUND_UNDERFLOWED_P_INF)
@example(p=dict(FOUND_UNDERFLOWED_P_INF, dtype="bf16"))  # the bound read for a dtype numpy's finfo lacks
@example(p=FOUND_SEEN_AND_HIDDEN_V_INF)
def test_random_problems_match_the_reference(explicit_session, online_session, p):
    # Not promised (docs/reliability.md): the online kernels get q scaled
    # in q's dtype (IREE folds scale * log2 e into q), so a scale of 1e-30
    # flushes f16 q to 0, and 0 x Inf in K is NaN where the reference, in
    # f64, sees +-Inf.
    assume(
        not (
            p["formulation"] == "online"
            and p["dtype"] == "f16"
            and (p.get("scale") or 1.0) < 1e-4
            and p.get("poison") in ("k_inf", "k_ninf")
        )
    )
    args, kw = _build(p)
    session = explicit_session if p["formulation"] == "explicit" else online_session
    if p.get("alias"):
        _check_alias_refused(session, args, kw, p)
        return
    out, lse = turbine_fmha.fmha_fwd_paged(*args, return_lse=True, num_splits=p["splits"], session=session, **kw)
    with np.errstate(invalid="ignore", over="ignore"):
        ref, ref_lse = fmha_fwd_paged_ref(*args, **kw)
    # Output elements where the kernels may give NaN instead of ref's value.
    may_be_nan = np.zeros(ref.shape, bool)
    if p.get("poison", "none").startswith("v_"):
        # A NaN/Inf in the V of a key that a row's mask hides reaches the
        # reference's output as 0 x NaN (or 0 x Inf): NaN. Kernels that skip
        # the masked blocks (causal and local chunks) never read that key
        # and give the output of the row's visible keys alone. Where a row
        # has such a key, and only there, the kernels may give either: NaN,
        # or the reference over a V whose poisoned element is 0, plus that
        # element times its probability where the row also sees it (pages
        # are shared: the same V row can be a visible key and a hidden one).
        seen, hidden = _poisoned_keys(args, kw)
        hidden &= np.isnan(ref)  # not in rows without a visible key: their output is 0
        if hidden.any():
            v = args[2].copy()
            bad = ~np.isfinite(v)
            value = float(v[bad][0])
            v[bad] = 0
            with np.errstate(invalid="ignore", over="ignore"):
                clean = fmha_fwd_paged_ref(*args[:2], v, *args[3:], **kw)[0]
                visible = np.where(seen, _poison_probability(args, kw)[0] * value, 0.0)
            ref = np.where(hidden, clean + visible, ref)
            may_be_nan |= hidden
    if p.get("poison") in ("v_inf", "v_ninf"):
        may_be_nan |= np.isinf(ref) & _underflows(args, kw, p)
    _compare(out.astype(np.float64), ref, OUT_TOL[p["dtype"]], relative=True, may_be_nan=may_be_nan)
    _compare(lse.astype(np.float64), ref_lse, LSE_TOL[p["dtype"]], relative=False)


def _underflows(args, kw, p):
    """Where the poisoned V element meets a probability below the smallest
    normal number of the kernels' P (q's dtype, as ck_tile's; float32 P
    for float32; a subnormal may be flushed): P may be 0 there, and 0 x
    Inf is NaN where the float64 reference's output is +-Inf. The
    reference over a V that is 1 at the poisoned element and 0 elsewhere
    gives each output element that element's probability (normalized: at
    most the kernels' unnormalized P, so a probability at or above the
    bound never underflows)."""
    prob, _ = _poison_probability(args, kw)
    # ml_dtypes' finfo: numpy's has no bfloat16.
    return ~(np.abs(prob) >= ml_dtypes.finfo(np_dtype(p["dtype"])).tiny)


def _poison_probability(args, kw):
    """The reference (output, LSE) over a V that is 1 at the poisoned
    element and 0 elsewhere: each output element gets the probability of
    its row's keys that hold the poisoned element (in its column; 0 in
    the other columns)."""
    q, k, v, bt, sk = args
    probe = np.zeros(v.shape, np.float32)
    probe[~np.isfinite(v)] = 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        return fmha_fwd_paged_ref(q, k, probe.astype(v.dtype), bt, sk, **kw)


# The score terms and the mask, as fmha_fwd_paged_ref takes them.
SCORE_ARGS = ("scale", "alibi_slopes", "bias", "logits_soft_cap", "sinks")
MASK_ARGS = ("mask_type", "window_size_left", "window_size_right", "sink_size")


def _poisoned_keys(args, kw):
    """Per output element: does its row see a key that holds the poisoned
    V element (in the element's column), and does its mask hide one? With
    every score 0 (q of zeros, no score terms) a row's probabilities are
    1/n over its n visible keys and its LSE is log(n), so the poisoned
    element's probability times e^LSE counts the row's keys that hold it:
    with the mask (the visible ones) and without (all of the sequence's)."""
    q, k, v, bt, sk = args
    plain = {a: b for a, b in kw.items() if a not in SCORE_ARGS}

    def count(kw):
        prob, lse = _poison_probability((np.zeros_like(q), k, v, bt, sk), kw)
        keys = np.exp(lse.transpose(0, 2, 1) if lse.ndim == 3 else lse.T)[..., None]  # out's [.., hq, 1]
        return np.rint(prob * keys)

    seen = count(plain)
    every = count({a: b for a, b in plain.items() if a not in MASK_ARGS})
    return seen > 0, every > seen


def _compare(got, want, tol, *, relative, may_be_nan=None):
    """NaN and +-Inf exactly where the reference has them (same sign);
    finite values within tol (relative to the largest finite |want|).
    Where may_be_nan is set, got may be NaN instead."""
    if may_be_nan is not None:
        keep = ~(may_be_nan & np.isnan(got))
        got, want = got[keep], want[keep]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN pattern differs")
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf], err_msg="Inf values differ")
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all(), "non-finite where the reference is finite"
    if fin.any():
        scale = max(np.abs(want[fin]).max(), 1e-30) if relative else 1.0
        err = np.abs(got[fin] - want[fin]).max() / scale
        assert err <= tol, f"{'rel' if relative else 'abs'} err {err:.3e} > {tol}"


def _check_alias_refused(session, args, kw, p):
    """An out sharing memory with an input is refused by name before
    anything runs, and every input is left as it was."""
    q, k, v, bt, sk = args
    src = {"q": q, "k_cache": k, "v_cache": v}[p["alias"]]
    shape = q.shape[:-1] + (p["dv"],)
    n = int(np.prod(shape))
    if src.size < n:
        return
    out = src.reshape(-1)[:n].reshape(shape)
    before = [a.copy() for a in args]
    with pytest.raises(ValueError, match=f"out overlaps {p['alias']}"):
        turbine_fmha.fmha_fwd_paged(*args, out=out, num_splits=p["splits"], session=session, **kw)
    for a, b in zip(args, before):
        assert a.tobytes() == b.tobytes()  # bitwise: NaN poison included
