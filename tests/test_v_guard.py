"""The V guard (Variant.v_guard): GPU variants without it skip zeroing the
value rows that hold no key, which halved decode time on the H200. The
runtime may use them only when those rows are finite; these tests put NaN
exactly there and check that the guarded kernel is chosen and the results
stay right, and that clean caches get the unguarded kernel (whose unused
table slots, full of garbage, are pointed at the sequence's own pages)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import make_problem
from test_modes import _check, _gappy_table, _group_problem, _pool
from tolerances import OUT_TOL

import turbine_fmha
from turbine_fmha.calls.plan import stale_rows_finite
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def _run(session, q, k, v, bt, sk, **kw):
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=session, **kw)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **{a: b for a, b in kw.items() if a != "num_splits"})
    _check(out, lse, ref, ref_lse, "f16")
    return session.last_variant


@pytest.mark.parametrize("seqlen_q", [1, 9])
def test_clean_cache_runs_unguarded(online_session, rng, seqlen_q):
    # NaN only in spare pages, reachable through garbage slots: never read.
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=4,
        seqlen_q=seqlen_q,
        seqlens_k=[int(rng.integers(seqlen_q, 70)) for _ in range(4)],
        nhead_q=8,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    variant = _run(online_session, q, k, v, bt, sk, mask_type="bottom_right", window_size_right=0)
    assert not variant.v_guard


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_nonfinite_stale_keys_run_unguarded(online_session, rng, poison):
    """Stale K rows (past seqlen_k) holding NaN or +-Inf, with finite stale V:
    the unguarded kernel is chosen (the score sentinel and the mask remove
    those keys), and the results are exact."""
    lens = [17, 40, 3, 64]
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=4, seqlen_q=2, seqlens_k=lens, nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    q[...] = np.abs(q)  # with positive K too, +Inf rows give +Inf scores
    for b in range(3):
        k[bt[b, (lens[b] - 1) // 16], lens[b] % 16 :] = poison
    variant = _run(online_session, q, k, v, bt, sk, mask_type="bottom_right", window_size_right=0)
    assert not variant.v_guard


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_past_seqlen_k_runs_guarded(online_session, rng, num_splits):
    lens = [17, 40, 3, 64]  # 64 fills its last page: no tail there
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=4, seqlen_q=1, seqlens_k=lens, nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    b = int(rng.integers(0, 3))
    last = bt[b, (lens[b] - 1) // 16]
    v[last, lens[b] % 16 :] = np.nan
    k[last, lens[b] % 16 :] = np.inf
    assert not stale_rows_finite(v, bt, sk, np.zeros(4, np.int32), 16)
    variant = _run(online_session, q, k, v, bt, sk, num_splits=num_splits)
    assert variant.v_guard


def test_nan_before_gappy_offset_runs_guarded(online_session, rng):
    page = 16
    lens, offsets = [30, 12], [5, 20]
    table, num_pages, _ = _gappy_table(rng, lens, offsets, page)
    k, v = _pool(rng, "f16", num_pages, page, 2, 64, 64)
    v[table[0, 0], :5] = np.nan  # the 5 skipped rows of sequence 0's first page
    q = rng.standard_normal((2, 1, 8, 64)).astype(np.float16)
    sk = np.array(lens, np.int32)
    variant = _run(online_session, q, k, v, table, sk, kv_offset=np.array(offsets, np.int32))
    assert variant.v_guard
    v[table[0, 0], :5] = 0.0
    variant = _run(online_session, q, k, v, table, sk, kv_offset=np.array(offsets, np.int32))
    assert not variant.v_guard


@pytest.mark.parametrize("formulation", ["explicit", "online", "online_guarded"])
def test_nan_in_visible_data_propagates_like_the_reference(explicit_session, online_session, rng, formulation):
    """NaN in q, or in a visible key's K or V, makes exactly the rows that
    see it NaN, as in the reference; every other row stays exact. The online
    kernels do this with and without the stale-row guard: "online_guarded"
    also puts NaN/Inf in the stale rows past sequence 2's last key, which
    must not leak, so the runtime picks the guarded kernel (whose NaN-row
    flags restore what its score-side NaN drop loses)."""
    session = explicit_session if formulation == "explicit" else online_session
    lens = [40, 33, 17]
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=3,
        seqlen_q=5,
        seqlens_k=lens,
        nhead_q=8,
        nhead_k=2,
        hdim=64,
        page=16,
        spare_pages=0,
        extra_slots=0,
    )
    q[0, 2, 3, 7] = np.nan  # one query row of one head
    k[bt[1, 0], 4, 1, 0] = np.nan  # key 4 of sequence 1, KV head 1 (query heads 4-7)
    v[bt[2, 1], 0, 0, 5] = np.nan  # key 16 of sequence 2, KV head 0, one dim
    if formulation == "online_guarded":
        k[bt[2, 1], 1:] = np.inf  # keys 17.. of sequence 2 do not exist
        v[bt[2, 1], 1:] = np.nan
    kw = dict(mask_type="bottom_right", window_size_right=0)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=session, **kw)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    out64 = out.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(out64), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(ref).any() and not np.isnan(ref).all()
    fin = ~np.isnan(ref)
    assert np.abs(out64[fin] - ref[fin]).max() <= OUT_TOL["f16"] * np.abs(ref[fin]).max()
    if formulation != "explicit":
        assert session.last_variant.v_guard == (formulation == "online_guarded")


@pytest.mark.parametrize(
    "poison", ["none", "k_tail", "v_tail", "v_tail_inf_pair", "v_gappy_head", "visible", "v_all_max"]
)
def test_stale_rows_check_on_torch_caches(rng, poison):
    """torch caches are checked by the same rows_finite, on their own device
    (here the CPU): same answer as the numpy check for each placement. The
    check sums the rows in float32: +Inf and -Inf in two stale rows (a sum
    of NaN) still say no, and a cache of f16's largest values (a sum that
    would overflow in f16) says yes."""
    torch = pytest.importorskip("torch")

    page, lens, shift = 16, [17, 40, 5], np.array([0, 0, 3], np.int32)
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=1, seqlens_k=[17, 40, 8], nhead_q=4, nhead_k=2, hdim=32, page=page
    )
    sk = np.array(lens, np.int32)
    if poison == "k_tail":
        k[bt[0, 1], 5, 1, 3] = np.inf  # key 21 of sequence 0 (it has 17)
    elif poison == "v_tail":
        v[bt[1, 2], 15] = np.nan  # row 47 of sequence 1 (it has 40)
    elif poison == "v_tail_inf_pair":
        v[bt[1, 2], 15, 0, 0] = np.inf
        v[bt[1, 2], 14, 1, 3] = -np.inf
    elif poison == "v_all_max":
        v[...] = np.float16(65504.0)
    elif poison == "v_gappy_head":
        v[bt[2, 0], 1] = np.nan  # before sequence 2's first key (kv_shift 3)
    elif poison == "visible":
        k[bt[1, 0], 3] = np.nan  # a real key: not a stale row
    want = stale_rows_finite(v, bt, sk, shift, page)
    assert want == (poison in ("none", "visible", "k_tail", "v_all_max"))  # stale K never matters
    got = stale_rows_finite(torch.from_numpy(v), bt, sk, shift, page)
    assert got == want


@pytest.mark.parametrize("formulation", ["explicit", "online_guarded"])
def test_nan_seen_or_not_through_a_window(explicit_session, online_session, rng, formulation):
    """A one-key window (bottom-right, left = right = 0) with more query rows
    than keys: the top rows see no key at all. NaN in such a row's q leaves
    it empty (output 0, LSE -inf) as in the reference; NaN in a key's K
    reaches only the row whose window holds it; NaN q rows with a key are
    NaN. With stale NaN in the pages, the guarded online kernel must agree."""
    session = explicit_session if formulation == "explicit" else online_session
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=2,
        seqlen_q=6,
        seqlens_k=[4, 21],
        nhead_q=4,
        nhead_k=2,
        hdim=32,
        page=16,
        spare_pages=0,
        extra_slots=0,
    )
    q[0, 0, 1, 3] = np.nan  # row 0 of sequence 0 sees no key (4 keys, 6 rows)
    q[0, 4, 2, 0] = np.nan  # row 4 sees key 2
    k[bt[1, 1], 0, 0, 7] = np.nan  # key 16 of sequence 1: row 1 only (shift 15), heads 0-1
    if formulation == "online_guarded":
        v[bt[0, 0], 4:] = np.nan  # past sequence 0's 4 keys
    kw = dict(mask_type="bottom_right", window_size_left=0, window_size_right=0)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=session, **kw)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(ref[0, 4, 2]).all() and np.isnan(ref[1, 1, :2]).all() and not np.isnan(ref[1, 2]).any()
    assert (out[0, 0, 1] == 0).all() and lse[0, 1, 0] == -np.inf
    fin = ~np.isnan(ref)
    assert np.abs(out.astype(np.float64)[fin] - ref[fin]).max() <= OUT_TOL["f16"] * np.abs(ref[fin]).max()
    if formulation != "explicit":
        assert session.last_variant.v_guard


@pytest.mark.parametrize("formulation", ["explicit", "online_guarded"])
def test_nan_in_a_sink_token_with_gappy_kv(explicit_session, online_session, rng, formulation):
    """A sliding window that has passed key 0, which stays visible as a sink
    token (ck_tile's rule, with its conditions), over gappy KV: a NaN in key
    0's K reaches exactly the rows whose sink it is; a NaN in a key the
    window has passed reaches none. The stale rows before the gappy start
    hold NaN, so the online session runs its guarded kernel."""
    session = explicit_session if formulation == "explicit" else online_session
    page, lens, offsets = 16, [40, 25], [5, 18]
    table, num_pages, _ = _gappy_table(rng, lens, offsets, page)
    k, v = _pool(rng, "f16", num_pages, page, 2, 32, 32)
    q = rng.standard_normal((2, 6, 4, 32)).astype(np.float16)
    k[table[0, 0], 5, 1, 2] = np.nan  # key 0 of sequence 0, KV head 1
    k[table[1, 1], 2 + 3, 0, 0] = np.nan  # key 3 of sequence 1: passed by every window
    if formulation == "online_guarded":
        v[table[0, 0], :5] = np.nan  # the 5 skipped rows of sequence 0's first page
    kw = dict(
        mask_type="bottom_right",
        window_size_left=4,
        window_size_right=0,
        sink_size=2,
        kv_offset=np.array(offsets, np.int32),
    )
    sk = np.array(lens, np.int32)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, table, sk, return_lse=True, session=session, **kw)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, table, sk, **kw)
    assert np.isnan(ref[0, :, 2:]).all() and not np.isnan(ref[0, :, :2]).any() and not np.isnan(ref[1]).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    fin = ~np.isnan(ref)
    assert np.abs(out.astype(np.float64)[fin] - ref[fin]).max() <= OUT_TOL["f16"] * np.abs(ref[fin]).max()
    if formulation != "explicit":
        assert session.last_variant.v_guard


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's own inf - inf
@pytest.mark.parametrize("formulation", ["explicit", "online", "online_guarded"])
def test_inf_in_visible_data_like_the_reference(explicit_session, online_session, rng, formulation):
    """Inf in q, K or V behaves as in the reference: +Inf scores make NaN
    rows (inf - inf), a row whose every score is -Inf is empty (output 0,
    LSE -inf), an Inf value row gives Inf/NaN outputs; the NaN, Inf and
    finite patterns of the output and LSE match, and finite values agree.
    With "online_guarded" NaN also sits in stale rows."""
    session = explicit_session if formulation == "explicit" else online_session
    lens = [40, 33, 17, 20]
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=4,
        seqlen_q=3,
        seqlens_k=lens,
        nhead_q=4,
        nhead_k=2,
        hdim=32,
        page=16,
        spare_pages=0,
        extra_slots=0,
    )
    q[0, 1, 0, :] = np.abs(q[0, 1, 0, :])
    k[bt[0, 0], :, 0, :] = np.abs(k[bt[0, 0], :, 0, :])
    q[0, 1, 0, 5] = np.inf  # positive scores against keys 0-15 of head 0: +Inf -> NaN row
    q[1, 2, 3, :] = -np.inf  # every score of that row is +-Inf (mixed signs: NaN)
    k[bt[2, 0], 3, 1, :] = np.inf  # one visible K row of sequence 2, heads 2-3
    k[bt[2, :2], :, 0, 9] = np.abs(k[bt[2, :2], :, 0, 9]) + 0.1
    q[2, 0, 1, 9] = -np.inf  # every score of row 0, head 1 is -Inf: an empty row
    v[bt[3, 1], 2, 0, 7] = np.inf  # one visible V element of sequence 3, heads 0-1
    if formulation == "online_guarded":
        v[bt[3, 1], 4:] = np.nan  # past sequence 3's 20 keys
    kw = dict(mask_type="bottom_right", window_size_right=0)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=session, **kw)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    o = out.astype(np.float64)
    for name, a, b in (("out", o, ref), ("lse", lse.astype(np.float64), ref_lse)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{name} NaN pattern")
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=f"{name} +Inf pattern")
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=f"{name} -Inf pattern")
    assert np.isnan(ref).any() and np.isinf(ref).any()
    assert ref_lse[2, 1, 0] == -np.inf and (ref[2, 0, 1] == 0).all()
    fin = np.isfinite(ref)
    assert np.abs(o[fin] - ref[fin]).max() <= OUT_TOL["f16"] * np.abs(ref[fin]).max()
    if formulation != "explicit":
        assert session.last_variant.v_guard == (formulation == "online_guarded")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's own inf - inf
@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("formulation", ["explicit", "online", "online_guarded"])
def test_nan_or_inf_in_a_key_some_rows_do_not_see(explicit_session, online_session, rng, formulation, poison):
    """A causal mask hides key 6 from rows 0-5. NaN (or +Inf, with q and the
    key positive so its scores are +Inf) in that key's K makes rows 6-7
    NaN and leaves rows 0-5 exact, as in the reference. The online kernels
    used to add the mask to the NaN score and made every row NaN. With
    "online_guarded" the stale rows past the 8 keys hold NaN V and +Inf
    K, which must not leak either."""
    session = explicit_session if formulation == "explicit" else online_session
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=1,
        seqlen_q=8,
        seqlens_k=[8],
        nhead_q=2,
        nhead_k=1,
        hdim=32,
        page=16,
        spare_pages=0,
        extra_slots=0,
    )
    q[...] = np.abs(q)
    if poison == "nan":
        k[bt[0, 0], 6, 0, 3] = np.nan
    else:
        k[bt[0, 0], 6, 0, :] = np.inf
    if formulation == "online_guarded":
        v[bt[0, 0], 9:] = np.nan
        k[bt[0, 0], 10:] = np.inf
    kw = dict(mask_type="top_left", window_size_right=0)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=session, **kw)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    assert np.isnan(ref[0, 6:]).all() and np.isfinite(ref[0, :6]).all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.abs(out[0, :6].astype(np.float64) - ref[0, :6]).max() <= OUT_TOL["f16"] * np.abs(ref[0, :6]).max()
    if formulation != "explicit":
        assert session.last_variant.v_guard == (formulation == "online_guarded")


# On a torch GPU cache, run() checks the stale V rows behind its kernels
# (executor.Executor._defers): the kernels first assume finite rows, and the
# call runs again guarded when the check, read after their wait, says no.
# Patching _defers gives the CPU the same control flow.


@pytest.fixture
def deferring(online_session, monkeypatch):
    from turbine_fmha.runtime import executor

    monkeypatch.setattr(executor.Executor, "_defers", staticmethod(lambda v_cache: True))
    monkeypatch.setattr(executor, "NONFINITE_SEEN", {})
    calls = []
    run_variants = online_session.run_variants

    def counted(variant, *a, **k):
        calls.append(variant)
        return run_variants(variant, *a, **k)

    monkeypatch.setattr(online_session, "run_variants", counted)
    return calls


def _decode_plan(session, bt, sk, k, **kw):
    return turbine_fmha.PagedAttention(session).plan(
        bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=8, nhead_k=2, hdim=64, dtype="f16", **kw
    )


@pytest.mark.parametrize("seqlen_q", [1, 9])
@pytest.mark.parametrize("given_out", [False, True])
def test_deferred_check_reruns_guarded(online_session, deferring, rng, seqlen_q, given_out):
    """NaN in a stale V row: the first run's unguarded result is NaN, so the
    call runs again guarded (two kernel runs) and returns the exact result,
    into a poisoned `out` too; the next run on the same cache checks first
    and runs once, guarded. With the rows made finite, the check before the
    kernels passes, and from then on the kernels run once, unguarded."""
    lens = [17, 40, 30, 64]
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=4, seqlen_q=seqlen_q, seqlens_k=lens, nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    b = int(rng.integers(0, 3))
    last = bt[b, (lens[b] - 1) // 16]
    v[last, lens[b] % 16 :] = np.nan
    kw = dict(mask_type="bottom_right", window_size_right=0)
    attn = _decode_plan(online_session, bt, sk, k, seqlen_q=seqlen_q, **kw)

    def run(expect_calls, guarded):
        deferring.clear()
        out = np.full(q.shape, np.nan, np.float16) if given_out else None
        got, lse = attn.run(q, k, v, out=out, return_lse=True)
        ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
        _check(got, lse, ref, ref_lse, "f16")
        assert given_out is False or got is out
        assert [x.v_guard for x in deferring] == [False] * (expect_calls - 1) + [guarded]
        assert online_session.last_variant.v_guard == guarded

    run(2, True)  # unguarded (NaN), then guarded
    run(1, True)  # checked before: guarded at once
    v[last, lens[b] % 16 :] = 0.5
    run(1, False)  # checked before, finite: forgotten
    run(1, False)  # deferred again, and right


def test_deferred_check_reruns_only_the_part_it_concerns(online_session, deferring, rng):
    """A mixed batch (decodes and prefills, run as two parts): NaN in a stale
    V row of a decode reruns the decode part alone, into the same outputs;
    the prefill part's rows stay as it computed them. Later runs check
    first: the decode part runs guarded, the prefill part (finite rows)
    not, and the cache stays remembered as non-finite."""
    seqlens_q, seqlens_k = [1, 90, 1, 40], [300, 90, 17, 200]
    q, k, v, bt, sk, seqstart = _group_problem(rng, "f16", seqlens_q, seqlens_k)
    v[bt[0, 299 // 16], 300 % 16 :] = np.nan
    kw = dict(mask_type="bottom_right", window_size_right=0)
    attn = _decode_plan(online_session, bt, sk, k, seqstart_q=seqstart, **kw)
    decode, prefill = (functools.partial(attn._plan.variant, i) for i in (0, 1))
    out = np.full((q.shape[0], 8, 64), np.nan, np.float16)
    out, lse = attn.run(q, k, v, out=out, return_lse=True)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, seqstart_q=seqstart, **kw)
    _check(out, lse, ref, ref_lse, "f16")
    assert [x.v_guard for x in deferring] == [False, False, True]
    assert deferring[2] is decode(False) and deferring[1] is prefill(True)
    for _ in range(2):
        deferring.clear()
        out, lse = attn.run(q, k, v, out=np.full_like(out, np.nan), return_lse=True)
        _check(out, lse, ref, ref_lse, "f16")
        assert deferring == [decode(False), prefill(True)]


@pytest.mark.parametrize("stale_nan", [False, True])
def test_deferred_check_without_a_guarded_kernel(online_session, deferring, rng, monkeypatch, stale_nan):
    """Where the artifacts hold no guarded kernel for a rerun, run() checks
    first, as without deferring: finite rows run once, unguarded; a NaN
    stale row fails before any kernel runs, and a given `out` keeps what it
    held."""
    from turbine_fmha.build.artifacts import ArtifactError

    lens = [17, 40]
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=lens, nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    if stale_nan:
        v[bt[1, (lens[1] - 1) // 16], lens[1] % 16 :] = np.nan
    attn = _decode_plan(online_session, bt, sk, k)
    unguarded = attn._plan.variant(0, True)

    def only_unguarded(i, rows_finite):
        if not rows_finite:
            raise ArtifactError("no guarded variant in this artifact set")
        return unguarded

    monkeypatch.setattr(attn._plan, "variant", only_unguarded)
    out = rng.standard_normal(q.shape).astype(np.float16)
    before = out.copy()
    if stale_nan:
        with pytest.raises(ArtifactError, match="no guarded variant"):
            attn.run(q, k, v, out=out)
        assert deferring == []
        np.testing.assert_array_equal(out, before)
    else:
        _, lse = attn.run(q, k, v, out=out, return_lse=True)
        assert deferring == [unguarded]
        _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk), "f16")


def test_device_array_caches_after_a_nonfinite_cache_was_seen(online_session, rng, monkeypatch):
    """A V cache once found non-finite is remembered process-wide
    (executor.NONFINITE_SEEN); a later call on IREE device arrays whose
    rows need no check (kv_rows_finite=True) must not look up their memory
    there: device arrays have no byte range."""
    from turbine_fmha.runtime import executor

    monkeypatch.setattr(executor, "NONFINITE_SEEN", {("cuda:0", (0, 64)): True})
    lens = [17, 40]
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=lens, nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    attn = _decode_plan(online_session, bt, sk, k, kv_rows_finite=True)
    kd, vd = (online_session.device_array(x) for x in (k, v))
    out, lse = attn.run(q, kd, vd, return_lse=True)
    _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk), "f16")
    assert executor.NONFINITE_SEEN == {("cuda:0", (0, 64)): True}
