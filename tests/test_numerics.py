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
        prob = make_problem(rng, dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlens_k=seqlens,
                            nhead_q=4, nhead_k=2, hdim=64, page=page)
        run_and_check(explicit_session, prob, dtype=dtype, mask_type=mask,
                      window_size_left=left, window_size_right=right)


@pytest.mark.parametrize("mask,left,right", MASKS)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_explicit_masks_and_heads(explicit_session, rng, mask, left, right, heads):
    nq, nk = heads
    seqlen_q = int(rng.integers(1, 40))
    batch, seqlens = _random_case(rng, 16, seqlen_q)
    prob = make_problem(rng, dtype="f16", batch=batch, seqlen_q=seqlen_q, seqlens_k=seqlens,
                        nhead_q=nq, nhead_k=nk, hdim=128, page=16)
    run_and_check(explicit_session, prob, dtype="f16", mask_type=mask,
                  window_size_left=left, window_size_right=right)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("mask,left,right", MASKS[:3])
def test_online_formulation_on_cpu(online_session, rng, dtype, mask, left, right):
    """The GPU formulation, executed on the CPU: decode (batch tile 8, one
    row) and prefill tiles (128 rows) with runtime padding and chunking."""
    for seqlen_q, batch in ((1, int(rng.integers(1, 11))), (int(rng.integers(2, 300)), int(rng.integers(1, 3)))):
        _, seqlens = _random_case(rng, 16, seqlen_q, batch)
        prob = make_problem(rng, dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlens_k=seqlens,
                            nhead_q=8, nhead_k=2, hdim=64, page=16)
        run_and_check(online_session, prob, dtype=dtype, mask_type=mask,
                      window_size_left=left, window_size_right=right)


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
def test_edge_cases(explicit_session, online_session, rng, formulation, name, seqlen_q, seqlens, page, mask, left, right):
    session = explicit_session if formulation == "explicit" else online_session
    prob = make_problem(rng, dtype="f32", batch=len(seqlens), seqlen_q=seqlen_q, seqlens_k=seqlens,
                        nhead_q=4, nhead_k=2, hdim=64, page=page)
    run_and_check(session, prob, dtype="f32", mask_type=mask, window_size_left=left, window_size_right=right)


def test_window_fully_masks_rows(explicit_session, rng):
    # top-left window (0, 0) with seqlen_q > seqlen_k: rows past seqlen_k see nothing.
    prob = make_problem(rng, dtype="f32", batch=2, seqlen_q=12, seqlens_k=[5, 9],
                        nhead_q=4, nhead_k=4, hdim=64, page=16)
    out, lse = run_and_check(explicit_session, prob, dtype="f32", mask_type="top_left",
                             window_size_left=0, window_size_right=0)
    assert (lse[0, :, 5:] == float("-inf")).all() and (out[0, 5:] == 0).all()


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_long_prefill_chunked(explicit_session, rng, dtype):
    """Prefill of 1100 rows over 2000 keys: the runtime chunks query rows so
    the score tile stays bounded; the mask must stay in absolute positions."""
    prob = make_problem(rng, dtype=dtype, batch=1, seqlen_q=1100, seqlens_k=[2000],
                        nhead_q=8, nhead_k=2, hdim=64, page=32)
    import turbine_fmha.plan as plan

    old = plan.SCORE_BYTES_BUDGET
    plan.SCORE_BYTES_BUDGET = 8 << 20  # force several chunks
    try:
        run_and_check(explicit_session, prob, dtype=dtype, mask_type="bottom_right",
                      window_size_left=-1, window_size_right=0)
    finally:
        plan.SCORE_BYTES_BUDGET = old
