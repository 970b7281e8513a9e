"""Kernels of any page size (Variant.page_block_size 0, explicit only): one
artifact serves every page size of its other fields, checked against the
float64 reference on fresh random inputs (pages shuffled, garbage in unused
table slots, NaN in spare pages, poisoned outputs); names, refusals,
selection and the host default set.

Tolerances are conftest's: the kernels are the same contractions with the
page size read from the caches' shapes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import CACHE, make_problem, run_and_check
from test_runtime_heads import _Listing
from tolerances import OUT_TOL

import turbine_fmha
from turbine_fmha.build import aot as tfb
from turbine_fmha.build.default_sets import DEFAULT_HEADS, DEFAULT_PAGES, host_default_set
from turbine_fmha.kernels.variants import Variant, online_variant
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

# Odd sizes too: nothing in the kernel may assume a power of two.
PAGES = (1, 5, 16, 32, 128)


def _built(name: str, variants: list[Variant], **kw) -> turbine_fmha.Session:
    out = CACHE / f"any-page-{name}"
    tfb.build(out, ["host"], variants)
    return turbine_fmha.Session("cpu", artifact_dir=out, **kw)


def test_names_and_refusals():
    v = Variant("f16", 64, 64, 0, 0, 0, "bottom_right")
    assert v.name == "pagedkv_fwd_f16_d64x64_pg0_mbr_lse_explicit"
    assert Variant.parse(v.name) == v and v.runtime_page
    assert not Variant("f16", 64, 64, 0, 0, 16).runtime_page
    with pytest.raises(ValueError, match="page_block_size must be positive, or 0"):
        Variant("f16", 64, 64, 4, 2, -16)
    with pytest.raises(ValueError, match=r"page_block_size must be positive, or 0 .*\(online\)"):
        online_variant(Variant("f16", 64, 64, 4, 2, 0).problem, 8, 1)


@pytest.mark.parametrize("heads", [(8, 2), (0, 0)], ids=["exact-heads", "any-heads"])
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_every_page_size(rng, heads, dtype):
    """Decode, split-KV decode and a causal prefill over pages of 1 to 128
    rows, odd ones included, from one artifact per mask."""
    variants = [Variant(dtype, 64, 64, *heads, 0, m) for m in ("none", "bottom_right")]
    session = _built(f"{dtype}-{heads[0]}", variants)
    for page in PAGES:
        for sq, kw in ((1, {}), (19, dict(mask_type="bottom_right"))):
            p = make_problem(
                rng, dtype=dtype, batch=3, seqlen_q=sq, seqlens_k=[0, 40, 177], nhead_q=8, nhead_k=2, hdim=64, page=page
            )
            run_and_check(session, p, dtype=dtype, **kw)
            assert session.last_variant in variants
        q, k, v, bt, sk = make_problem(
            rng, dtype=dtype, batch=3, seqlen_q=1, seqlens_k=[3, 40, 177], nhead_q=8, nhead_k=2, hdim=64, page=page
        )
        out = np.full((3, 1, 8, 64), np.nan, q.dtype)
        turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=3, out=out, session=session)
        ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk)
        assert np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max() <= OUT_TOL[dtype]


def _hnd(a):
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("layout", ["HND", "vcol", "HND-vcol", "fp8"])
def test_layouts_and_formats(rng, layout):
    """Head-major pages, column-major V (where the page's rows are the last
    axis) and fp8 caches at two page sizes."""
    kv_layout = "HND" if layout.startswith("HND") else "NHD"
    v_layout = "col" if "vcol" in layout else "row"
    kv_dtype = "f8e4m3fn" if layout == "fp8" else ""
    var = Variant("f16", 64, 64, 0, 0, 0, "bottom_right", kv_layout=kv_layout, v_layout=v_layout, kv_dtype=kv_dtype)
    session = _built(layout, [var])
    for page in (8, 32):
        q, k, v, bt, sk = make_problem(
            rng, dtype="f16", batch=2, seqlen_q=7, seqlens_k=[20, 75], nhead_q=6, nhead_k=3, hdim=64, page=page
        )
        if kv_dtype:
            k, v = (np.nan_to_num(x).astype(ml_dtypes.float8_e4m3fn) for x in (k, v))
        ref, _ = fmha_fwd_paged_ref(q, k.astype(np.float32), v.astype(np.float32), bt, sk, mask_type="bottom_right")
        kk = _hnd(k) if kv_layout == "HND" else k
        vv = _hnd(v) if kv_layout == "HND" else v
        if v_layout == "col":  # [pages, heads, dim, rows] whatever the page layout
            vv = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
        out = np.full(q.shape, np.nan, q.dtype)
        turbine_fmha.fmha_fwd_paged(
            q,
            kk,
            vv,
            bt,
            sk,
            mask_type="bottom_right",
            kv_layout=kv_layout,
            v_layout=v_layout,
            out=out,
            session=session,
        )
        assert np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]
        assert session.last_variant == var


@pytest.mark.parametrize("feature", ["alibi", "bias_bh", "softcap", "sinks"])
def test_score_terms(rng, feature):
    """Score terms whose tensors are indexed by gathered key rows (the
    bias), per head (ALiBi) or per row (sinks), over pages of 1 and 5 rows."""
    hq = 6
    kw, fields = {
        "alibi": (dict(alibi_slopes=rng.uniform(0.01, 0.5, hq).astype(np.float32)), dict(bias="alibi")),
        "bias_bh": (
            dict(bias=rng.standard_normal((2, hq, 4, 60)).astype(np.float32)),
            dict(bias="elementwise", bias_shape="bh"),
        ),
        "softcap": (dict(logits_soft_cap=15.0), dict(softcap=True)),
        "sinks": (dict(sinks=rng.uniform(-1, 2, hq).astype(np.float32)), dict(sinks=True)),
    }[feature]
    v = Variant("f16", 64, 64, 0, 0, 0, "bottom_right", **fields)
    session = _built(feature, [v])
    for page in (1, 5):
        p = make_problem(
            rng, dtype="f16", batch=2, seqlen_q=4, seqlens_k=[60, 9], nhead_q=hq, nhead_k=2, hdim=64, page=page
        )
        run_and_check(session, p, dtype="f16", mask_type="bottom_right", **kw)
        assert session.last_variant == v


def test_selection_prefers_the_page_size_then_any():
    """A call runs the variant compiled for its page size where one is
    built (it is faster), else the one of any page size; a built one before
    one compile_missing would compile."""
    exact = Variant("f16", 64, 64, 8, 2, 16, "none")
    anyp = Variant("f16", 64, 64, 8, 2, 0, "none")
    for listing in (_Listing([exact, anyp], "explicit"), _Listing([anyp, exact], "explicit")):
        assert listing.select(exact.problem, 1, 4) == exact
        assert listing.select(dict(exact.problem, page_block_size=32), 1, 4) == anyp
    compiling = _Listing([anyp], "explicit", compile_missing=True)
    assert compiling.select(dict(exact.problem, page_block_size=32), 1, 4) == anyp


def test_host_default_set_serves_every_default_page():
    """The host set compiles page 16 for its size and every other page
    size through kernels of any page: each call the set served when it
    compiled every default page (DEFAULT_PAGES) still finds a kernel, the
    one of its page size at 16."""
    listing = _Listing(host_default_set(), "explicit")
    assert {v.page_block_size for v in host_default_set()} == {16, 0}
    for dtype in ("f16", "bf16", "f32"):
        for page in DEFAULT_PAGES + (256, 7):
            for hq, hk in DEFAULT_HEADS + ((12, 3),):
                for mask in ("none", "top_left", "bottom_right"):
                    for layout in ("NHD", "HND"):
                        p = Variant(dtype, 128, 128, hq, hk, page, mask, kv_layout=layout).problem
                        v = listing.select(p, 3, 2)
                        assert v.page_block_size == (16 if page == 16 else 0), (p, v.name)
                        if layout == "NHD" and (hq, hk) in DEFAULT_HEADS:
                            assert not v.runtime_heads, v.name  # the faster exact heads (docs/benchmarks.md)
