"""Kernels vs the float64 reference on the CPU, both formulations.

Every case draws fresh random data (seed printed), shuffles pages across
sequences, fills unused block-table slots with garbage ids and spare pages
with NaN, and checks every output element (rows with no visible key must be
exactly 0 with LSE -inf). Tolerances are justified in conftest.py.
"""

from __future__ import annotations

import pytest
from conftest import make_problem, run_and_check

MASKS = [
    ("none", -1, -1),
    ("top_left", -1, 0),  # causal, top-left
    ("bottom_right", -1, 0),  # causal, bottom-right
    ("bottom_right", 7, 3),  # local window
    ("top_left", 0, -1),
]


def _random_case(rng, page, seqlen_q, batch=None):
    batch = batch or int(rng.integers(1, 4))
    # seqlen_k deliberately not a multiple of the page size, plus 0 and 1.
    seqlens = [int(rng.integers(1, 5 * page + 40)) for _ in range(batch)]
    seqlens[0] = seqlens[0] // page * page + (page // 2 + 1 if page > 1 else 0)
    return batch, seqlens


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("page", [1, 16, 32, 64, 128])
def test_explicit_decode_and_prefill(explicit_session, rng, dtype, page):
    for seqlen_q in (1, int(rng.integers(2, 70))):
        mask, left, right = MASKS[int(rng.integers(len(MASKS)))]
        batch, seqlens = _random_case(rng, page, seqlen_q)
        prob = make_problem(
            rng,
            dtype=dtype,
            batch=batch,
            seqlen_q=seqlen_q,
            seqlens_k=seqlens,
            nhead_q=4,
            nhead_k=2,
            hdim=64,
            page=page,
        )
        run_and_check(
            explicit_session, prob, dtype=dtype, mask_type=mask, window_size_left=left, window_size_right=right
        )


@pytest.mark.parametrize("mask,left,right", MASKS)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_explicit_masks_and_heads(explicit_session, rng, mask, left, right, heads):
    nq, nk = heads
    seqlen_q = int(rng.integers(1, 40))
    batch, seqlens = _random_case(rng, 16, seqlen_q)
    prob = make_problem(
        rng, dtype="f16", batch=batch, seqlen_q=seqlen_q, seqlens_k=seqlens, nhead_q=nq, nhead_k=nk, hdim=128, page=16
    )
    run_and_check(explicit_session, prob, dtype="f16", mask_type=mask, window_size_left=left, window_size_right=right)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("mask,left,right", MASKS[:3])
def test_online_formulation_on_cpu(online_session, rng, dtype, mask, left, right):
    """The GPU formulation, executed on the CPU: decode (batch tile 8, one
    row) and prefill tiles (128 rows) with runtime padding and chunking."""
    for seqlen_q, batch in ((1, int(rng.integers(1, 11))), (int(rng.integers(2, 300)), int(rng.integers(1, 3)))):
        _, seqlens = _random_case(rng, 16, seqlen_q, batch)
        prob = make_problem(
            rng, dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlens_k=seqlens, nhead_q=8, nhead_k=2, hdim=64, page=16
        )
        run_and_check(online_session, prob, dtype=dtype, mask_type=mask, window_size_left=left, window_size_right=right)


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize(
    "name,seqlen_q,seqlens,page,mask,left,right",
    [
        ("seqlen_k_0", 3, [0, 5], 16, "none", -1, -1),
        ("seqlen_k_1", 1, [1, 1], 16, "none", -1, -1),
        ("sq_gt_sk_bottom_right", 9, [4, 2], 16, "bottom_right", -1, 0),
        ("window_0_0_bottom_right", 6, [40], 16, "bottom_right", 0, 0),
        ("page_size_1", 5, [7, 3], 1, "top_left", -1, 0),
        ("single_page", 4, [16], 16, "bottom_right", -1, 0),
        ("all_empty", 2, [0, 0], 16, "top_left", -1, 0),
    ],
)
def test_edge_cases(
    explicit_session, online_session, rng, formulation, name, seqlen_q, seqlens, page, mask, left, right
):
    session = explicit_session if formulation == "explicit" else online_session
    prob = make_problem(
        rng,
        dtype="f32",
        batch=len(seqlens),
        seqlen_q=seqlen_q,
        seqlens_k=seqlens,
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        page=page,
    )
    run_and_check(session, prob, dtype="f32", mask_type=mask, window_size_left=left, window_size_right=right)


def test_window_fully_masks_rows(explicit_session, rng):
    # top-left window (0, 0) with seqlen_q > seqlen_k: rows past seqlen_k see nothing.
    prob = make_problem(
        rng, dtype="f32", batch=2, seqlen_q=12, seqlens_k=[5, 9], nhead_q=4, nhead_k=4, hdim=64, page=16
    )
    out, lse = run_and_check(
        explicit_session, prob, dtype="f32", mask_type="top_left", window_size_left=0, window_size_right=0
    )
    assert (lse[0, :, 5:] == float("-inf")).all() and (out[0, 5:] == 0).all()


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_long_prefill_chunked(explicit_session, rng, dtype):
    """Prefill of 1100 rows over 2000 keys: the runtime chunks query rows so
    the score tile stays bounded; the mask must stay in absolute positions."""
    prob = make_problem(
        rng, dtype=dtype, batch=1, seqlen_q=1100, seqlens_k=[2000], nhead_q=8, nhead_k=2, hdim=64, page=32
    )
    import turbine_fmha.calls.plan as plan

    old = plan.SCORE_BYTES_BUDGET
    plan.SCORE_BYTES_BUDGET = 8 << 20  # force several chunks
    try:
        run_and_check(
            explicit_session, prob, dtype=dtype, mask_type="bottom_right", window_size_left=-1, window_size_right=0
        )
    finally:
        plan.SCORE_BYTES_BUDGET = old


def _hot_keys_problem(rng, dtype, c, nhead_q):
    """Three identical 'hot' keys in different pages whose score is c^2 (q
    and K are c along one axis, scale 1); every other key scores about c at
    most, so its weight exp(~c - c^2) is 0 and the exact output is the mean
    of the three hot V rows, whatever c is."""
    q, k, v, bt, sk = make_problem(
        rng, dtype=dtype, batch=2, seqlen_q=2, seqlens_k=[40, 35], nhead_q=nhead_q, nhead_k=2, hdim=64, page=16
    )
    q[...] = 0
    q[..., 0] = c
    for b in range(2):
        for t in (3, 20, 33):
            k[bt[b, t // 16], t % 16, :, :] = 0
            k[bt[b, t // 16], t % 16, :, 0] = c
    return q, k, v, bt, sk


# LSE: the scores are exact in f32 up to its rounding (2^-24 relative); the
# online formulation also rounds scale * log2(e) * q to the input dtype
# (2^-11 f16, 2^-8 bf16), which moves the LSE by that fraction of it.
_LSE_REL = {
    ("explicit", "f16"): 2**-22,
    ("explicit", "bf16"): 2**-22,
    ("explicit", "f32"): 2**-22,
    ("online", "f16"): 2**-10,
    ("online", "bf16"): 2**-7,
    ("online", "f32"): 2**-22,
}


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("c", [100.0, 1000.0, 9984.0])  # scores 1e4, 1e6, ~1e8 (9984 is exact in bf16)
def test_large_scores_exact(explicit_session, online_session, rng, formulation, dtype, c):
    """The output used to be normalized as acc * exp(m -
    lse) with lse = m + log(sum) in f32, which loses log(sum) when |m| is
    large: 2.6% off at scores of 1e6, 3x the answer at 1e8. Split-KV puts
    the hot keys in three different splits, so the merge is checked too."""
    import numpy as np
    from tolerances import LSE_TOL, OUT_TOL

    import turbine_fmha
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    session = explicit_session if formulation == "explicit" else online_session
    prob = _hot_keys_problem(rng, dtype, c, 4 if formulation == "explicit" else 8)
    ref, ref_lse = fmha_fwd_paged_ref(*prob, scale=1.0)
    for splits in (1, 3):
        out, lse = turbine_fmha.fmha_fwd_paged(*prob, scale=1.0, num_splits=splits, return_lse=True, session=session)
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert err <= OUT_TOL[dtype], f"splits={splits}: output rel err {err:.3e}"
        lerr = np.abs(lse - ref_lse).max()
        bound = LSE_TOL[dtype] + np.abs(ref_lse).max() * _LSE_REL[formulation, dtype]
        assert lerr <= bound, f"splits={splits}: lse abs err {lerr:.3e} > {bound:.3e}"


@pytest.mark.parametrize("formulation", ["explicit", "online"])
def test_large_finite_bias_on_every_key(explicit_session, online_session, rng, formulation):
    """A bias of -1e30 on every visible key (a common finite 'masked'
    value) shifts all scores equally: the softmax must not change. It gave
    3x the right answer before the normalization fix."""
    import numpy as np
    from conftest import make_problem
    from tolerances import OUT_TOL

    import turbine_fmha
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    session = explicit_session if formulation == "explicit" else online_session
    prob = make_problem(
        rng,
        dtype="f16",
        batch=2,
        seqlen_q=3,
        seqlens_k=[40, 21],
        nhead_q=4 if formulation == "explicit" else 8,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    bias = np.full((1, 1, 3, 48), -1e30, np.float32)
    ref, _ = fmha_fwd_paged_ref(*prob, bias=bias)
    for splits in (1, 2):
        out = turbine_fmha.fmha_fwd_paged(*prob, bias=bias, num_splits=splits, session=session)
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert err <= OUT_TOL["f16"], f"splits={splits}: output rel err {err:.3e}"


def test_nan_key_under_large_negative_bias_stays_nan(online_session, rng):
    """The online kernels replace a NaN score by a sentinel and make rows
    whose max is the sentinel NaN. A bias of -1e30 once pulled a 1e30
    sentinel under the NaN limit: the NaN key then counted as an ordinary
    one and the row came out finite where the reference is NaN."""
    import numpy as np
    from conftest import make_problem

    import turbine_fmha
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[40, 21], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    k[bt[0, 1], 3, 0, 5] = np.nan  # key 19 of sequence 0, KV head 0
    bias = np.full((1, 1, 1, 48), -1e30, np.float32)
    out = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, bias=bias, session=online_session)
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, bias=bias)
    assert np.isnan(ref[0, :, :4]).all() and not np.isnan(ref[1]).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
