"""Run-time head counts (Variant.group): one artifact serves every model of
its GQA group, or of any group, against the float64 reference on fresh
random inputs; names, refusals and selection.

Tolerances are conftest's (the kernels are the same contractions with the
head counts read from the arguments' shapes).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import CACHE, make_problem, run_and_check
from test_modes import _check
from tolerances import OUT_TOL

import turbine_fmha
from turbine_fmha.build import aot as tfb
from turbine_fmha.build.artifacts import ArtifactError
from turbine_fmha.build.default_sets import ANY_HEADS_HDIMS, gpu_default_set, host_default_set
from turbine_fmha.build.targets import get_target
from turbine_fmha.kernels.variants import Variant, online_variant, runtime_heads
from turbine_fmha.runtime.selection import VariantSelection, problem_key
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

# (nhead_q, nhead_k): groups 1-8, odd counts, MQA.
HEADS = [(8, 2), (12, 3), (6, 6), (10, 2), (7, 1)]


def _built(name: str, variants: list[Variant], **kw) -> turbine_fmha.Session:
    """A session that can run only `variants` (built once into the test
    cache, rebuilt when their source changes)."""
    out = CACHE / f"runtime-heads-{name}"
    tfb.build(out, ["host"], variants)
    return turbine_fmha.Session("cpu", artifact_dir=out, **kw)


def test_names():
    g4 = Variant("f16", 128, 128, 0, 0, 16, "bottom_right", group=4)
    any_group = Variant("f16", 128, 128, 0, 0, 16, "bottom_right")
    static = Variant("f16", 128, 128, 32, 8, 16, "bottom_right")
    assert g4.name == "pagedkv_fwd_f16_d128x128_g4_pg16_mbr_lse_explicit"
    assert any_group.name == "pagedkv_fwd_f16_d128x128_pg16_mbr_lse_explicit"
    assert static.name == "pagedkv_fwd_f16_d128x128_h32x8_pg16_mbr_lse_explicit"
    online = online_variant(g4.problem, 8, 1)
    assert online.name == "pagedkv_fwd_f16_d128x128_g4_pg16_mbr_lse_online_b8_q1_m16"
    for v in (g4, any_group, static, online):
        assert Variant.parse(v.name) == v
    assert (g4.group_size, any_group.group_size, static.group_size) == (4, 0, 4)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(nhead_q=0, nhead_k=8), "nhead_q and nhead_k"),
        (dict(nhead_q=32, nhead_k=0), "nhead_q and nhead_k"),
        (dict(nhead_q=32, nhead_k=8, group=4), "nhead_q and nhead_k"),
        (dict(nhead_q=0, nhead_k=0, group=-1), "static GQA group"),
        (dict(nhead_q=0, nhead_k=0, formulation="online", batch_tile=8, seqlen_q_tile=1), "static GQA group"),
    ],
)
def test_bad_head_fields_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        Variant(**dict(dict(dtype="f16", hdim_q=64, hdim_v=64, page_block_size=16), **fields))


@pytest.mark.parametrize("heads", ["group", "any"])
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_every_head_count(rng, heads, dtype):
    """One artifact for every head configuration (of its group), decode and
    a causal prefill."""
    group = 2 if heads == "group" else 0
    session = _built(
        f"{heads}-{dtype}", [Variant(dtype, 64, 64, 0, 0, 16, m, group=group) for m in ("none", "bottom_right")]
    )
    configs = [(h * 2, h) for h in (1, 3, 5)] if group else HEADS
    for hq, hk in configs:
        for sq, kw in ((1, {}), (19, dict(mask_type="bottom_right"))):
            p = make_problem(
                rng, dtype=dtype, batch=3, seqlen_q=sq, seqlens_k=[0, 40, 77], nhead_q=hq, nhead_k=hk, hdim=64, page=16
            )
            run_and_check(session, p, dtype=dtype, **kw)
            assert session.last_variant.group == group and session.last_variant.runtime_heads


# Score-side features, cache layouts and formats with any head counts:
# call keyword arguments for `hq` query heads (a batch of 3, 5 query rows,
# up to 80 keys), and the variant fields they need.
def _features(rng, hq=12):
    return {
        "alibi": (dict(alibi_slopes=rng.uniform(0.01, 0.5, hq).astype(np.float32)), dict(bias="alibi")),
        "bias_1h": (
            dict(bias=rng.standard_normal((1, hq, 5, 80)).astype(np.float32)),
            dict(bias="elementwise", bias_shape="1h"),
        ),
        "bias_bh": (
            dict(bias=rng.standard_normal((3, hq, 5, 80)).astype(np.float32)),
            dict(bias="elementwise", bias_shape="bh"),
        ),
        "softcap": (dict(logits_soft_cap=15.0), dict(softcap=True)),
        "sinks": (dict(sinks=rng.uniform(-1, 2, hq).astype(np.float32)), dict(sinks=True)),
    }


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("feature", ["alibi", "bias_1h", "bias_bh", "softcap", "sinks"])
def test_features_with_runtime_heads(rng, formulation, feature):
    kw, fields = _features(rng)[feature]
    group = 3 if formulation == "online" else 0
    v = Variant("f16", 64, 64, 0, 0, 16, "bottom_right", group=group, **fields)
    if formulation == "online":
        v = online_variant(v.problem, 1, 16)
    session = _built(f"{formulation}-{feature}", [v], formulation=formulation)
    p = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=5, seqlens_k=[30, 80, 7], nhead_q=12, nhead_k=4, hdim=64, page=16
    )
    run_and_check(session, p, dtype="f16", mask_type="bottom_right", **kw)
    assert session.last_variant == v


def test_online_group_variants(rng):
    """The online (GPU) kernels with run-time head counts: a group-padded
    decode that merges split-KV partials in the module, and prefill tiles;
    any number of KV heads of the group."""
    p = Variant("bf16", 64, 64, 0, 0, 16, group=4).problem
    variants = [
        online_variant(p, 32, 1),
        online_variant(p, 32, 1, merge_splits=4),
        online_variant(dict(p, mask="bottom_right"), 1, 16),
    ]
    session = _built("online-g4", variants, formulation="online")
    for hq, hk in ((4, 1), (12, 3), (32, 8)):
        p1 = make_problem(
            rng, dtype="bf16", batch=3, seqlen_q=1, seqlens_k=[900, 0, 333], nhead_q=hq, nhead_k=hk, hdim=64, page=16
        )
        q, k, v, bt, sk = p1
        out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=4, return_lse=True, session=session)
        assert session.last_variant == variants[1]
        _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk), "bf16")
        p2 = make_problem(
            rng, dtype="bf16", batch=2, seqlen_q=40, seqlens_k=[40, 90], nhead_q=hq, nhead_k=hk, hdim=64, page=16
        )
        run_and_check(session, p2, dtype="bf16", mask_type="bottom_right")
        assert session.last_variant == variants[2]


def test_online_any_group_variants(rng):
    """The online variants for any group: the group is zero-padded at run
    time, to 16 rows for a decode and to the smallest padded group that
    holds it for a prefill."""
    p = Variant("f16", 64, 64, 0, 0, 16).problem
    variants = [online_variant(p, 32, 1), online_variant(p, 32, 1, merge_splits=4)]
    variants += [online_variant(dict(p, mask="bottom_right"), 1, 16, group_rows=gp * 16) for gp in (2, 4, 8)]
    session = _built("online-any", variants, formulation="online")
    for hq, hk, gp in ((4, 4, 2), (12, 4, 4), (10, 2, 8), (28, 4, 8), (16, 1, None)):
        q, k, v, bt, sk = make_problem(
            rng, dtype="f16", batch=3, seqlen_q=1, seqlens_k=[700, 0, 333], nhead_q=hq, nhead_k=hk, hdim=64, page=16
        )
        out = np.full((3, 1, hq, 64), np.nan, np.float16)
        out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=4, out=out, return_lse=True, session=session)
        assert session.last_variant == variants[1]
        _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk), "f16")
        if gp is None:
            continue  # a group of 16 has no prefill variant here
        p2 = make_problem(
            rng, dtype="f16", batch=2, seqlen_q=20, seqlens_k=[20, 70], nhead_q=hq, nhead_k=hk, hdim=64, page=16
        )
        run_and_check(session, p2, dtype="f16", mask_type="bottom_right")
        assert session.last_variant.padded_group == gp


def test_column_major_v_and_fp8_cache(rng):
    vcol = Variant("f16", 64, 64, 0, 0, 16, "bottom_right", v_layout="col")
    fp8 = Variant("f16", 64, 64, 0, 0, 16, "bottom_right", kv_dtype="f8e4m3fn")
    session = _built("layouts", [vcol, fp8])
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 50], nhead_q=9, nhead_k=3, hdim=64, page=16
    )
    out = turbine_fmha.fmha_fwd_paged(
        q,
        k,
        np.ascontiguousarray(v.transpose(0, 2, 3, 1)),
        bt,
        sk,
        v_layout="col",
        mask_type="bottom_right",
        session=session,
    )
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, mask_type="bottom_right")
    assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]
    assert session.last_variant == vcol
    kq, vq = (np.nan_to_num(x).astype(ml_dtypes.float8_e4m3fn) for x in (k, v))
    out = turbine_fmha.fmha_fwd_paged(q, kq, vq, bt, sk, mask_type="bottom_right", session=session)
    # fp8 K and V, read exactly by the reference: the f16 query's bound.
    ref, _ = fmha_fwd_paged_ref(q, kq.astype(np.float32), vq.astype(np.float32), bt, sk, mask_type="bottom_right")
    assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]
    assert session.last_variant == fp8


class _Listing(VariantSelection):
    """What a Session selects from a list of built variants, without
    loading them."""

    def __init__(self, variants, formulation, compile_missing=False):
        self.formulation, self.compile_missing = formulation, compile_missing
        self.target, self.artifact_dir = get_target("host"), "listing"
        self._index = {v.name: {} for v in variants}
        self._by_problem = {}
        for v in variants:
            self._by_problem.setdefault(problem_key(v.problem), []).append(v)


def _call(nq, nk, d=64, dtype="f16", page=16, mask="none"):
    return dict(Variant(dtype, d, d, nq, nk, page, mask).problem)


def test_selection_prefers_the_most_specialized():
    static = Variant("f16", 64, 64, 8, 2, 16)
    g4 = Variant("f16", 64, 64, 0, 0, 16, group=4)
    any_group = Variant("f16", 64, 64, 0, 0, 16)
    s = _Listing([any_group, g4, static], "explicit")
    assert s.select(_call(8, 2), 5, 2) == static
    assert s.select(_call(32, 8), 5, 2) == g4
    assert s.select(_call(14, 2), 5, 2) == any_group
    # A per-group variant never serves another group.
    with pytest.raises(ArtifactError, match="nhead_q=16, nhead_k=2"):
        _Listing([g4], "explicit").select(_call(16, 2), 5, 2)


def test_a_built_variant_is_used_before_compiling_one():
    # compile_missing would compile the per-group variant for the call; a
    # built one for any group serves it at the same cost, without compiling.
    any_group = Variant("f16", 64, 64, 0, 0, 16)
    s = _Listing([any_group], "explicit", compile_missing=True)
    assert s.select(_call(12, 4), 5, 2) == any_group
    # With nothing built, the per-group variant is compiled (one compile
    # serves every model of the group).
    assert _Listing([], "explicit", compile_missing=True).select(_call(12, 4), 5, 2) == Variant(
        **runtime_heads(_call(12, 4))
    )


def test_any_group_online_serves_groups_up_to_its_padding():
    p = Variant("f16", 64, 64, 0, 0, 16, "bottom_right").problem
    pads = {gp: online_variant(p, 1, 128, group_rows=gp * 128) for gp in (4, 8)}
    decode = online_variant(dict(p, mask="none"), 8, 1)
    s = _Listing([decode, *pads.values()], "online")
    assert s.select(_call(12, 4, mask="bottom_right"), 100, 1) == pads[4]
    assert s.select(_call(40, 8, mask="bottom_right"), 100, 1) == pads[8]
    assert s.select(_call(64, 4), 1, 2) == decode  # 16 query heads per KV head
    for too_big in (_call(72, 8, mask="bottom_right"), _call(34, 2)):
        with pytest.raises(ArtifactError):
            s.select(too_big, 1 if too_big["mask"] == "none" else 100, 1)


def test_gpu_sessions_fall_back_to_the_any_heads_variants():
    """A GPU (online) session without an online variant for the call's head
    counts runs the explicit one for any head counts instead of failing."""
    static = online_variant(_call(32, 8), 8, 1)
    any_group = Variant("f16", 64, 64, 0, 0, 16)
    s = _Listing([static, any_group], "online")
    assert s.select(_call(32, 8), 1, 4) == static
    assert s.formulation_for(_call(12, 4), True) == "explicit"
    assert s.select(_call(12, 4), 1, 4) == any_group


def test_gpu_fallback_runs(rng):
    """The same fallback in a session, end to end on the CPU."""
    session = _built(
        "any-f16", [Variant("f16", 64, 64, 0, 0, 16, m) for m in ("none", "bottom_right")], formulation="online"
    )
    p = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=1, seqlens_k=[3, 200, 64], nhead_q=10, nhead_k=5, hdim=64, page=16
    )
    run_and_check(session, p, dtype="f16")
    assert session.last_variant.formulation == "explicit" and session.last_variant.runtime_heads


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("target", ["host", "gpu"])
def test_default_sets_serve_every_head_count(target, kv_layout):
    """Every head configuration of 1-64 query heads, head dims 64/128/256,
    fp16 and bf16, finds a built variant in the default set (no compiling),
    decode and prefill, every mask; over head-major (HND) caches for pages
    of 16 rows."""
    variants = host_default_set() if target == "host" else gpu_default_set()
    s = _Listing(variants, "explicit" if target == "host" else "online")
    pages = (16, 64) if target == "gpu" else (1, 16, 32, 64, 128)
    pages = (16,) if kv_layout == "HND" else pages
    for nq in range(1, 65):
        for nk in (k for k in range(1, nq + 1) if nq % k == 0):
            for d in ANY_HEADS_HDIMS:
                for dtype in ("f16", "bf16"):
                    for page in pages:
                        for mask in ("none", "top_left", "bottom_right"):
                            p = dict(_call(nq, nk, d, dtype, page, mask), kv_layout=kv_layout)
                            for rows in (1, 100):
                                v = s.select(p, rows, 3)
                                assert v.name in s._index and v.kv_layout == kv_layout
