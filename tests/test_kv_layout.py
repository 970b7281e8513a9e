"""Head-major (HND) caches, [num_pages, nhead_k, page_block_size, hdim]
(FlashInfer's kv_layout="HND"): every formulation and head-count kind
against the float64 reference computed on the same pages in NHD order, so
that the reference's own layout handling is not what is tested; group
mode and split-KV; names, refusals, the stale-row check, and a round trip
through reshape_and_cache.

Tolerances are conftest's: the kernels compute the same contractions, only
the gathers' addressing differs.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from conftest import CACHE, make_problem
from test_modes import _check, _group_problem
from test_runtime_heads import _features
from tolerances import LSE_TOL, OUT_TOL

import turbine_fmha
from turbine_fmha.api.cache import aligned_zeros
from turbine_fmha.build import aot as tfb
from turbine_fmha.kernels.append_kernel import AppendKernel
from turbine_fmha.kernels.variants import Variant, online_variant
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def _built(name: str, variants: list[Variant], **kw) -> turbine_fmha.Session:
    out = CACHE / f"kv-layout-{name}"
    tfb.build(out, ["host"], variants)
    return turbine_fmha.Session("cpu", artifact_dir=out, **kw)


def hnd(cache: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(cache.transpose(0, 2, 1, 3))


def check_hnd(session, problem, *, dtype, v_col=False, **kw):
    """Runs `problem` (NHD caches) over HND copies of its caches (V column-
    major with v_col) into a poisoned `out`, against the reference on the
    NHD caches."""
    q, k, v, bt, sk = problem
    vk = np.ascontiguousarray(v.transpose(0, 2, 3, 1)) if v_col else hnd(v)
    out = np.full(q.shape[:-1] + (v.shape[-1],), np.nan, q.dtype)
    kw_run = dict(kw, v_layout="col") if v_col else kw
    got, lse = turbine_fmha.fmha_fwd_paged(
        q, hnd(k), vk, bt, sk, kv_layout="HND", out=out, return_lse=True, session=session, **kw_run
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **{n: x for n, x in kw.items() if n != "num_splits"})
    assert got is out
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got.astype(np.float64) - ref).max() / scale
    assert np.isfinite(got.astype(np.float64)).all() and err <= OUT_TOL[dtype], err
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~seen)
    if seen.any():
        assert np.abs(lse[seen] - ref_lse[seen]).max() <= LSE_TOL[dtype]
    return got


def test_names():
    v = Variant("f16", 128, 128, 0, 0, 16, "bottom_right", kv_layout="HND")
    assert v.name == "pagedkv_fwd_f16_d128x128_pg16_hnd_mbr_lse_explicit"
    col = online_variant(Variant("f16", 64, 64, 8, 2, 16, v_layout="col", kv_layout="HND").problem, 8, 1)
    assert col.name == "pagedkv_fwd_f16_d64x64_h8x2_pg16_hnd_vcol_nmask_lse_online_b8_q1_m16"
    for x in (v, col):
        assert Variant.parse(x.name) == x
    with pytest.raises(ValueError, match="kv_layout"):
        Variant("f16", 64, 64, 8, 2, 16, kv_layout="hnd")


def test_reference_reads_hnd(rng):
    q, k, v, bt, sk = make_problem(
        rng, dtype="f32", batch=2, seqlen_q=3, seqlens_k=[20, 33], nhead_q=4, nhead_k=2, hdim=16, page=8
    )
    want = fmha_fwd_paged_ref(q, k, v, bt, sk, mask_type="bottom_right")
    got = fmha_fwd_paged_ref(q, hnd(k), hnd(v), bt, sk, mask_type="bottom_right", kv_layout="HND")
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


# (nhead_q, nhead_k) served by one run-time-head variant, and the static ones.
HEADS = [(8, 2), (12, 3), (7, 1), (6, 6)]


@pytest.mark.parametrize("heads", ["static", "any"])
@pytest.mark.parametrize("formulation", ["explicit", "online"])
def test_hnd_matches_reference(rng, formulation, heads):
    """Decode and a causal prefill with gappy KV, garbage table slots and
    NaN spare pages; static head counts, or any head counts from one
    variant."""
    configs = HEADS if heads == "any" else HEADS[:1]
    hq, hk = (0, 0) if heads == "any" else HEADS[0]
    plain = [Variant("f16", 64, 64, hq, hk, 16, m, kv_layout="HND") for m in ("none", "bottom_right")]
    if formulation == "online":
        rows = dict(group_rows=16) if heads == "any" else {}
        plain = [
            online_variant(plain[0].problem, 8, 1, **rows),
            online_variant(plain[1].problem, 1, 16, **(dict(group_rows=128) if heads == "any" else {})),
        ]
    session = _built(f"{formulation}-{heads}", plain, formulation=formulation)
    for nq, nk in configs:
        for sq, kw in ((1, {}), (21, dict(mask_type="bottom_right"))):
            # Gappy KV: sequence b's keys start at table position offset[b].
            offset = np.array([0, 5, 16], np.int32)
            *p, sk = make_problem(
                rng, dtype="f16", batch=3, seqlen_q=sq, seqlens_k=[0, 45, 93], nhead_q=nq, nhead_k=nk, hdim=64, page=16
            )
            check_hnd(session, (*p, sk - offset), dtype="f16", kv_offset=offset, **kw)
            assert session.last_variant.kv_layout == "HND"


@pytest.mark.parametrize("formulation", ["explicit", "online"])
def test_group_mode_and_split_kv_over_hnd(rng, formulation, explicit_session, online_session):
    """Group mode (a mixed batch of decodes and prefills, regrouped by the
    runtime) and split-KV merged on the host, over HND caches (compiled on
    demand: the default sessions' path)."""
    session = explicit_session if formulation == "explicit" else online_session
    q, k, v, bt, sk, seqstart = _group_problem(rng, "f16", [1, 37, 0, 1, 12], [40, 90, 17, 0, 33])
    kw = dict(mask_type="bottom_right", window_size_right=0)
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, hnd(k), hnd(v), bt, sk, seqstart_q=seqstart, kv_layout="HND", return_lse=True, session=session, **kw
    )
    _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk, seqstart_q=seqstart, **kw), "f16")
    p = make_problem(rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[700, 90], nhead_q=8, nhead_k=2, hdim=64, page=16)
    check_hnd(session, p, dtype="f16", num_splits=3)


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("feature", ["alibi", "bias_1h", "softcap", "sinks"])
def test_features_over_hnd(rng, formulation, feature):
    """Score-side features, ALiBi and the per-head bias through the online
    kernels' per-head loop, which slices a head out of the HND gathers."""
    kw, fields = _features(rng, hq=8)[feature]
    v = Variant("f16", 64, 64, 0, 0, 16, "bottom_right", group=4, kv_layout="HND", **fields)
    if formulation == "online":
        v = online_variant(v.problem, 1, 16)
    session = _built(f"{formulation}-{feature}", [v], formulation=formulation)
    p = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=5, seqlens_k=[30, 80, 7], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    check_hnd(session, p, dtype="f16", mask_type="bottom_right", **kw)
    assert session.last_variant == v


@pytest.mark.parametrize("formulation", ["explicit", "online"])
def test_column_major_v_and_fp8_over_hnd(rng, formulation):
    """HND keys with a column-major V cache, and an fp8 (e4m3) HND cache."""
    col = Variant("f16", 64, 64, 8, 2, 16, kv_layout="HND", v_layout="col")
    f8 = Variant("f16", 64, 64, 8, 2, 16, kv_layout="HND", kv_dtype="f8e4m3fn")
    if formulation == "online":
        col, f8 = online_variant(col.problem, 8, 1), online_variant(f8.problem, 8, 1)
    session = _built(f"{formulation}-col-fp8", [col, f8], formulation=formulation)
    p = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=1, seqlens_k=[30, 80, 7], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    check_hnd(session, p, dtype="f16", v_col=True)
    assert session.last_variant == col
    q, k, v, bt, sk = p
    f8k, f8v = (np.nan_to_num(x).astype(ml_dtypes.float8_e4m3fn) for x in (k, v))
    check_hnd(session, (q, f8k, f8v, bt, sk), dtype="f16", k_scale=0.5, v_scale=2.0)
    assert session.last_variant == f8


def test_merged_decode_and_stale_rows_over_hnd(rng):
    """An online decode merging split-KV partials in the module, and the
    stale-row check reading HND rows: a NaN value row past a sequence's
    last key makes the runtime pick the guarded variant (checking the NHD
    rows of the same indices would miss it and run the unguarded one)."""
    p = Variant("f16", 64, 64, 0, 0, 16, kv_layout="HND").problem
    merged = online_variant(p, 8, 1, group_rows=16, merge_splits=4)
    guarded = online_variant(p, 8, 1, group_rows=16)
    session = _built(
        "online-merged",
        [merged, dataclasses.replace(merged, v_guard=False), guarded, dataclasses.replace(guarded, v_guard=False)],
        formulation="online",
    )
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[300, 77], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    check_hnd(session, (q, k, v, bt, sk), dtype="f16", num_splits=4)
    assert session.last_variant.merge_splits == 4 and not session.last_variant.v_guard
    # Sequence 1's last page holds keys 64-76: row 13 on is stale. Head 1,
    # row 14 of that page is NaN; the NHD rows [page, 14] would be head 14's
    # (out of range there), [page, 1] a real key's.
    v[bt[1, 4], 14, 1, :] = np.nan
    check_hnd(session, (q, k, v, bt, sk), dtype="f16")
    assert session.last_variant.v_guard


def test_hnd_caches_written_by_reshape_and_cache(rng):
    """reshape_and_cache(kv_layout="HND") then attention over the same caches."""
    session = _built(
        "append-hnd",
        [Variant("f16", 64, 64, 0, 0, 16, "bottom_right", kv_layout="HND"), AppendKernel("f16", 1, 64, 64, 16)],
    )
    num_pages, hk, hq = 12, 2, 6
    kc, vc = (aligned_zeros((num_pages, hk, 16, 64), np.float16) for _ in range(2))
    kc[...] = vc[...] = np.nan  # rows never written must never be read
    tokens = [37, 20]
    bt = np.array([[3, 7, 1], [9, 4, 11]], np.int32)
    slots = np.concatenate([bt[b, t // 16] * 16 + t % 16 for b, n in enumerate(tokens) for t in [np.arange(n)]])
    k_new = rng.standard_normal((sum(tokens), hk, 64)).astype(np.float16)
    v_new = rng.standard_normal((sum(tokens), hk, 64)).astype(np.float16)
    turbine_fmha.reshape_and_cache(k_new, v_new, kc, vc, slots, kv_layout="HND", session=session)
    q = rng.standard_normal((2, 4, hq, 64)).astype(np.float16)
    sk = np.array(tokens, np.int32)
    out = turbine_fmha.fmha_fwd_paged(q, kc, vc, bt, sk, kv_layout="HND", mask_type="bottom_right", session=session)
    k_nhd = np.zeros((num_pages, 16, hk, 64), np.float16)
    v_nhd = k_nhd.copy()
    k_nhd.reshape(-1, hk, 64)[slots], v_nhd.reshape(-1, hk, 64)[slots] = k_new, v_new
    ref, _ = fmha_fwd_paged_ref(q, k_nhd, v_nhd, bt, sk, mask_type="bottom_right")
    assert np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]


def test_planned_hnd(rng):
    """PagedAttention.plan(kv_layout="HND"), and the torch op's result shapes."""
    session = _built(
        "explicit-any", [Variant("f16", 64, 64, 0, 0, 16, m, kv_layout="HND") for m in ("none", "bottom_right")]
    )
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=1, seqlens_k=[5, 40, 77], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    attn = turbine_fmha.PagedAttention(session).plan(
        bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, kv_layout="HND"
    )
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk)
    got = attn.run(q, hnd(k), hnd(v))
    assert np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]
    with pytest.raises(ValueError, match="k_cache"):
        attn.run(q, k, v)  # NHD caches of a plan for HND ones
    torch = pytest.importorskip("torch")
    from turbine_fmha.api.torch_ops import result_shapes

    tq, tk, tv = (torch.from_numpy(a) for a in (q, hnd(k), hnd(v)))
    assert result_shapes(tq, tk, tv, kv_layout="HND") == ((3, 1, 4, 64), (3, 4, 1))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_layout="hnd"), "kv_layout"),
        (dict(kv_layout="HND", v_nhd=True), "v_cache"),
        (dict(kv_layout="HND", k_hdim=32), "k_cache head dim"),
    ],
)
def test_bad_layouts_refused(trap, rng, kw, match):
    """Refused before any kernel is selected or run (test_validation's trap)."""
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[5, 40], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    kw = dict(kw)
    kc, vc = hnd(k), (v if kw.pop("v_nhd", False) else hnd(v))
    if kw.pop("k_hdim", None):
        kc = kc[..., :32]
    with pytest.raises(ValueError, match=match):
        turbine_fmha.fmha_fwd_paged(q, kc, vc, bt, sk, session=trap, **kw)
