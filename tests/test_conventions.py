"""The spellings users know from flash-attn (causal=True,
softmax_scale, window_size=(left, right), cache_seqlens) and
turbine_fmha.flash_attn.flash_attn_with_kvcache, against the float64
reference on fresh random inputs (garbage in unused block-table slots, NaN
in spare pages: conftest.make_problem)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem, run_and_check
from test_kv_write import _check_rotated, _rope
from tolerances import LSE_TOL, OUT_TOL

import turbine_fmha
from turbine_fmha import flash_attn_with_kvcache
from turbine_fmha.api.cache import aligned_zeros
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def _small(rng, nhead_q=4, seqlen_q=3, seqlens_k=(20, 5)):
    return make_problem(
        rng,
        dtype="f16",
        batch=len(seqlens_k),
        seqlen_q=seqlen_q,
        seqlens_k=list(seqlens_k),
        nhead_q=nhead_q,
        nhead_k=2,
        hdim=64,
        page=16,
    )


# (flash-attn spelling, the same call in the runtime's own arguments)
ALIASES = {
    "causal": (dict(causal=True), dict(mask_type="bottom_right", window_size_right=0)),
    "softmax_scale": (dict(softmax_scale=0.07), dict(scale=0.07)),
    "window_size": (dict(window_size=(5, 2)), dict(mask_type="bottom_right", window_size_left=5, window_size_right=2)),
    "causal_window": (
        dict(causal=True, window_size=(4, -1)),
        dict(mask_type="bottom_right", window_size_left=4, window_size_right=0),
    ),
    "top_left_window": (
        dict(mask_type="top_left", window_size=[3, 1]),
        dict(mask_type="top_left", window_size_left=3, window_size_right=1),
    ),
    "causal_with_sides": (
        dict(causal=True, mask_type="bottom_right", window_size_left=6),
        dict(mask_type="bottom_right", window_size_left=6, window_size_right=0),
    ),
}


@pytest.mark.parametrize("case", sorted(ALIASES))
def test_alias_is_the_same_call(explicit_session, rng, case):
    """The alias gives exactly the bits of the call it stands for (same
    kernel, same inputs), and that call matches the reference. The
    alias writes into a NaN-poisoned out that it must fill entirely."""
    alias, own = ALIASES[case]
    prob = _small(rng, seqlen_q=7, seqlens_k=(40, 9, 0))
    want, want_lse = run_and_check(explicit_session, prob, dtype="f16", **own)
    out = np.full_like(want, np.nan)
    got, lse = turbine_fmha.fmha_fwd_paged(*prob, out=out, return_lse=True, session=explicit_session, **alias)
    assert got is out
    np.testing.assert_array_equal(out.view(np.int16), want.view(np.int16))
    np.testing.assert_array_equal(lse, want_lse)


BAD = {
    "scale_twice": (dict(scale=0.1, softmax_scale=0.1), ValueError, ["scale", "softmax_scale"]),
    "causal_top_left": (dict(causal=True, mask_type="top_left"), ValueError, ["causal", "mask_type='top_left'"]),
    "causal_right_side": (dict(causal=True, window_size_right=3), ValueError, ["causal", "window_size_right = 3"]),
    "causal_window_right": (dict(causal=True, window_size=(2, 1)), ValueError, ["causal", "window_size[1] = 1"]),
    "window_twice": (dict(window_size=(1, 1), window_size_left=2), ValueError, ["window_size", "window_size_left"]),
    "causal_int": (dict(causal=1), TypeError, ["causal", "bool"]),
    "window_single": (dict(window_size=(1,)), TypeError, ["window_size", "pair"]),
    "window_float": (dict(window_size=(1.5, 0)), TypeError, ["window_size[0]", "int"]),
    "window_below_minus_one": (dict(window_size=(0, -2)), ValueError, ["window_size[1]", ">= -1"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_conflicting_or_bad_spellings(trap, rng, case):
    """Refused by name before anything runs (the trap session fails the
    test if a kernel is selected or run), in both public functions."""
    kw, exc, words = BAD[case]
    q, k, v, bt, sk = _small(rng)
    calls = (
        lambda: turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, session=trap, **kw),
        lambda: turbine_fmha.fmha_fwd_kvcache(q, k[:2], v[:2], np.minimum(sk, 16), session=trap, **kw),
    )
    for call in calls:
        with pytest.raises(exc) as info:
            call()
        for w in words:
            assert w in str(info.value), f"{w!r} not in {info.value}"


def _dense(rng, batch_cache=3, max_sk=48, nhead_k=2, hdim=64):
    k = rng.standard_normal((batch_cache, max_sk, nhead_k, hdim)).astype(np.float16)
    v = rng.standard_normal((batch_cache, max_sk, nhead_k, hdim)).astype(np.float16)
    return k, v


def _dense_ref(q, k, v, rows, seqlen_k, kv_offset=None, **kw):
    """The reference over a non-paged cache: each cache row is one page of
    max_seqlen_k keys, and sequence b's table is [rows[b]]."""
    return fmha_fwd_paged_ref(
        q, k, v, np.asarray(rows, np.int32)[:, None], np.asarray(seqlen_k, np.int32), kv_offset=kv_offset, **kw
    )


def _close(out, ref, lse=None, ref_lse=None):
    # f16 through the same kernels as run_and_check: conftest's bounds (derived there).
    err = np.abs(np.asarray(out, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= OUT_TOL["f16"], f"output rel err {err:.3e}"
    if lse is not None:
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        assert np.abs(lse[finite] - ref_lse[finite]).max(initial=0) <= LSE_TOL["f16"]


def test_kvcache_seqlens_int_array_or_whole_row(explicit_session, rng):
    """cache_seqlens as an int, as an array and left out (the whole cache
    row, flash-attn's default) against the reference; seqlen_k and
    cache_seqlens are one argument."""
    k, v = _dense(rng)
    q = rng.standard_normal((2, 4, 4, 64)).astype(np.float16)
    rows = np.array([2, 0], np.int32)
    for given, lens in (
        (dict(cache_seqlens=30), [30, 30]),
        (dict(cache_seqlens=np.array([48, 7], np.int32)), [48, 7]),
        (dict(seqlen_k=11), [11, 11]),
        ({}, [48, 48]),
    ):
        out, lse = turbine_fmha.fmha_fwd_kvcache(
            q, k, v, cache_batch_idx=rows, causal=True, return_lse=True, session=explicit_session, **given
        )
        ref, ref_lse = _dense_ref(q, k, v, rows, lens, mask_type="bottom_right", window_size_right=0)
        _close(out, ref, lse, ref_lse)
    with pytest.raises(ValueError, match="seqlen_k and cache_seqlens"):
        turbine_fmha.fmha_fwd_kvcache(q, k, v, np.array([1, 2], np.int32), cache_seqlens=3, session=explicit_session)
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        turbine_fmha.fmha_fwd_kvcache(q, k, v, cache_seqlens=-1, session=explicit_session)


def _slopes(rng, nhead):
    return (2.0 ** (-8.0 * np.arange(1, nhead + 1) / nhead) * rng.uniform(0.5, 1.5)).astype(np.float32)


# flash-attn arguments -> the reference's (flash-attn's causal and windows
# are bottom-right aligned).
FLASH_CASES = {
    "causal": (dict(causal=True), dict(mask_type="bottom_right", window_size_right=0)),
    "window": (dict(window_size=(6, 2)), dict(mask_type="bottom_right", window_size_left=6, window_size_right=2)),
    "alibi_causal": (dict(causal=True, alibi=True), dict(mask_type="bottom_right", window_size_right=0, alibi=True)),
    "softcap_causal": (
        dict(causal=True, softcap=4.0, softmax_scale=0.5),
        dict(mask_type="bottom_right", window_size_right=0, logits_soft_cap=4.0, scale=0.5),
    ),
    "leftpad_local": (
        dict(window_size=(9, 0), leftpad=True),
        dict(mask_type="bottom_right", window_size_left=9, window_size_right=0, leftpad=True),
    ),
}


def _flash_kwargs(rng, fa, ref, batch, nhead, lens):
    """Slopes and left pads drawn fresh, handed to both sides."""
    fa, ref = dict(fa), dict(ref)
    if fa.pop("alibi", False):
        ref.pop("alibi")
        fa["alibi_slopes"] = ref["alibi_slopes"] = _slopes(rng, nhead)
    if fa.pop("leftpad", False):
        ref.pop("leftpad")
        fa["cache_leftpad"] = ref["kv_offset"] = np.array([rng.integers(0, n + 1) for n in lens], np.int32)
    return fa, ref


@pytest.mark.parametrize("case", sorted(FLASH_CASES))
def test_flash_attn_with_kvcache_paged(explicit_session, rng, case):
    prob = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=5, seqlens_k=[70, 9, 33], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    q, k, v, bt, lens = prob
    fa, ref_kw = _flash_kwargs(rng, *FLASH_CASES[case], 3, 8, lens)
    out, lse = flash_attn_with_kvcache(
        q, k, v, cache_seqlens=lens, block_table=bt, return_softmax_lse=True, session=explicit_session, **fa
    )
    pads = ref_kw.get("kv_offset")
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, lens if pads is None else lens - pads, **ref_kw)
    assert out.shape == q.shape and lse.shape == (3, 8, 5)  # flash-attn's [batch, nheads, seqlen_q]
    _close(out, ref, lse, ref_lse)


def test_flash_attn_with_kvcache_dense(explicit_session, rng):
    """Non-paged caches with cache_batch_idx, an int cache_seqlens, left
    padding and num_splits=0 (the heuristic)."""
    k, v = _dense(rng, batch_cache=4)
    q = rng.standard_normal((3, 6, 8, 64)).astype(np.float16)
    rows, pads = np.array([3, 1, 0], np.int32), np.array([0, 17, 40], np.int32)
    out, lse = flash_attn_with_kvcache(
        q,
        k,
        v,
        cache_seqlens=44,
        cache_batch_idx=rows,
        cache_leftpad=pads,
        causal=True,
        num_splits=0,
        return_softmax_lse=True,
        session=explicit_session,
    )
    ref, ref_lse = _dense_ref(q, k, v, rows, 44 - pads, kv_offset=pads, mask_type="bottom_right", window_size_right=0)
    _close(out, ref, lse, ref_lse)
    whole = flash_attn_with_kvcache(q, k, v, cache_batch_idx=rows, session=explicit_session)
    _close(whole, _dense_ref(q, k, v, rows, [48] * 3)[0])


FLASH_BAD = {
    "append_k_alone": (dict(k="k"), ValueError, ["k and v come together"]),
    "append_v_alone": (dict(v="v"), ValueError, ["k and v come together"]),
    "rotary_without_k": (
        dict(rotary_cos="cos", rotary_sin="sin"),
        NotImplementedError,
        ["rotary_cos/rotary_sin without k/v"],
    ),
    "append_without_seqlens": (dict(k="k", v="v"), ValueError, ["cache_seqlens is required"]),
    "append_negative_seqlens": (
        dict(k="knew", v="vnew", cache_seqlens=np.array([3, -1], np.int32), paged=True),
        ValueError,
        ["cache_seqlens[1] = -1"],
    ),
    "paged_batch_idx": (
        dict(cache_batch_idx=np.zeros(2, np.int32), paged=True),
        ValueError,
        ["cache_batch_idx", "block_table"],
    ),
    "num_splits": (dict(num_splits=-1), ValueError, ["num_splits"]),
    "leftpad_past_end": (
        dict(cache_seqlens=np.array([20, 5], np.int32), cache_leftpad=np.array([3, 6], np.int32), paged=True),
        ValueError,
        ["cache_leftpad[1] = 6", "cache_seqlens[1] = 5"],
    ),
    "softcap_alibi": (dict(softcap=5.0, alibi_slopes=np.ones(4, np.float32)), ValueError, ["softcap", "alibi_slopes"]),
    "causal_and_right": (dict(causal=True, window_size=(-1, 4)), ValueError, ["causal", "window_size[1]"]),
}


@pytest.mark.parametrize("case", sorted(FLASH_BAD))
def test_flash_attn_with_kvcache_refuses(trap, rng, case):
    kw, exc, words = FLASH_BAD[case]
    kw = dict(kw)
    q, k, v, bt, _ = _small(rng)
    if kw.pop("paged", False):
        kw["block_table"] = bt
    for name in ("k", "v"):  # new rows of the right shape where the case wants them
        if isinstance(kw.get(name), str) and kw[name] == name + "new":
            kw[name] = np.zeros((2, 1, 2, 64), np.float16)
    with pytest.raises(exc) as info:
        flash_attn_with_kvcache(q, k, v, session=trap, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


APPEND_CASES = {  # (paged, rotary: None / "interleaved" / "halves", causal)
    "paged": (True, None, False),
    "paged_rotary_interleaved_causal": (True, "interleaved", True),
    "paged_rotary_halves": (True, "halves", False),
    "dense_rotary_causal": (False, "interleaved", True),
}


def _aligned(a):
    out = aligned_zeros(a.shape, a.dtype)
    out[...] = a
    return out


def _appended(rng, paged, lens, new):
    """q, caches with room for `new` keys after `lens`, the block table (or
    the dense rows), the new K/V, and the slot of each new key."""
    if paged:
        q, kc, vc, bt, _ = make_problem(
            rng,
            dtype="f16",
            batch=len(lens),
            seqlen_q=new,
            seqlens_k=list(lens + new),
            nhead_q=8,
            nhead_k=2,
            hdim=64,
            page=16,
        )
        pos = lens[:, None] + np.arange(new)
        slots = np.take_along_axis(bt, pos // 16, axis=1) * 16 + pos % 16
    else:
        kc, vc = _dense(rng, batch_cache=4)
        q = rng.standard_normal((len(lens), new, 8, 64)).astype(np.float16)
        bt = np.array([3, 0, 2], np.int32)[: len(lens)]  # the cache rows (cache_batch_idx)
        slots = bt[:, None] * kc.shape[1] + lens[:, None] + np.arange(new)
    k_new = rng.standard_normal((len(lens), new, 2, 64)).astype(np.float16)
    v_new = rng.standard_normal((len(lens), new, 2, 64)).astype(np.float16)
    return q, _aligned(kc), _aligned(vc), bt, k_new, v_new, slots.reshape(-1)


@pytest.mark.parametrize("case", sorted(APPEND_CASES))
def test_flash_attn_with_kvcache_appends(explicit_session, rng, case):
    """flash-attn's in-call append: the new keys land at cache_seqlens + i
    (rotated first with rotary, q too), nothing else in the caches moves,
    and attention sees them."""
    paged, rotary, causal = APPEND_CASES[case]
    lens, new = np.array([30, 5, 17], np.int32), 3
    q, kc, vc, tab, k_new, v_new, slots = _appended(rng, paged, lens, new)
    kc0, vc0 = kc.copy(), vc.copy()
    kw = dict(block_table=tab) if paged else dict(cache_batch_idx=tab)
    if rotary:
        theta = rng.uniform(0, 2 * np.pi, (64, 16))  # rotary_dim 32 < hdim 64
        cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary == "interleaved")
    mask = dict(mask_type="bottom_right", window_size_right=0) if causal else {}
    out, lse = flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k=k_new,
        v=v_new,
        cache_seqlens=lens,
        causal=causal,
        return_softmax_lse=True,
        session=explicit_session,
        **kw,
    )
    pos = (lens[:, None] + np.arange(new)).reshape(-1)
    flat_k, flat_v = kc.reshape(-1, 2, 64), vc.reshape(-1, 2, 64)
    if rotary:
        _check_rotated(
            flat_k[slots], k_new.reshape(-1, 2, 64), pos, cos, sin, rotary == "interleaved", "float16", "new keys"
        )
        q_pos = pos if causal else np.repeat(lens, new)  # flash-attn: q rotated with the keys when causal/local
        q_ref = _rope(q.reshape(-1, 8, 64), q_pos, cos, sin, rotary == "interleaved")[0].reshape(q.shape)
    else:
        np.testing.assert_array_equal(flat_k[slots], k_new.reshape(-1, 2, 64))
        q_ref = q
    np.testing.assert_array_equal(flat_v[slots], v_new.reshape(-1, 2, 64))
    rest = np.setdiff1d(np.arange(flat_k.shape[0]), slots)
    np.testing.assert_array_equal(flat_k[rest].view(np.uint16), kc0.reshape(-1, 2, 64)[rest].view(np.uint16))
    np.testing.assert_array_equal(flat_v[rest].view(np.uint16), vc0.reshape(-1, 2, 64)[rest].view(np.uint16))
    if paged:
        ref, ref_lse = fmha_fwd_paged_ref(q_ref, kc, vc, tab, lens + new, **mask)
    else:
        ref, ref_lse = _dense_ref(q_ref, kc, vc, tab, lens + new, **mask)
    _close(out, ref, lse, ref_lse)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_flash_attn_with_kvcache_append_failure_leaves_the_caches(explicit_session, rng, kind):
    """A call whose attention fails after its append (soft-cap with ALiBi is
    refused there) gets the overwritten rows back; an append past the
    block table's capacity is refused before anything is written."""
    lens, new = np.array([30, 5, 17], np.int32), 3
    q, kc, vc, bt, k_new, v_new, _ = _appended(rng, True, lens, new)
    kc0, vc0 = kc.copy(), vc.copy()
    if kind == "torch":
        import torch

        q, kc, vc, k_new, v_new = (torch.from_numpy(a) for a in (q, kc, vc, k_new, v_new))
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k=k_new,
            v=v_new,
            cache_seqlens=lens,
            block_table=bt,
            softcap=5.0,
            alibi_slopes=np.ones(8, np.float32),
            session=explicit_session,
        )
    with pytest.raises(ValueError, match="cache_seqlens\\[0\\]"):
        flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k=k_new,
            v=v_new,
            cache_seqlens=np.array([bt.shape[1] * 16 - 1, 5, 17]),
            block_table=bt,
            session=explicit_session,
        )
    np.testing.assert_array_equal(np.asarray(kc).view(np.uint16), kc0.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(vc).view(np.uint16), vc0.view(np.uint16))
