"""fp8 KV cache: fp16/bf16 queries over an fp8 paged cache with
per-tensor descales, every fp8 format the targets use, against the float64
reference computed on the dequantized cache (k_scale * K_fp8): the kernel's
only extra error source is its own fp16/bf16 rounding, so the tolerances of
tolerances.py apply unchanged."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import make_problem, run_and_check

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref, fp8_round

FORMATS = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"]


def _fp8_problem(rng, fmt, dtype, **kw):
    q, k, v, bt, sk = make_problem(rng, dtype="f32", **kw)
    f8 = getattr(ml_dtypes, fmt)
    k_scale, v_scale = (float(x) for x in rng.uniform(0.02, 0.3, 2))
    # Quantize like a serving stack would: x_fp8 = x / scale.
    kq = (np.nan_to_num(k) / k_scale).astype(f8)
    vq = (np.nan_to_num(v) / v_scale).astype(f8)
    q = q.astype(np.float16 if dtype == "f16" else ml_dtypes.bfloat16)
    return (q, kq, vq, bt, sk), k_scale, v_scale


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_fp8_kv_cache(explicit_session, online_session, rng, formulation, fmt, dtype):
    session = explicit_session if formulation == "explicit" else online_session
    sq = int(rng.integers(1, 30))
    prob, k_scale, v_scale = _fp8_problem(
        rng,
        fmt,
        dtype,
        batch=3,
        seqlen_q=sq,
        seqlens_k=[int(rng.integers(0, 80)) for _ in range(3)],
        nhead_q=8,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    run_and_check(
        session, prob, dtype=dtype, mask_type="bottom_right", window_size_right=0, k_scale=k_scale, v_scale=v_scale
    )
    assert session.last_variant.kv_dtype == fmt.replace("float8_", "f8").replace("_", "")
    # The online (GPU) kernels take fp8 caches in their decode tiles only;
    # other calls are served by the explicit formulation, which compiles for
    # every GPU target.
    assert session.last_variant.formulation == ("online" if formulation == "online" and sq == 1 else "explicit")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_fp8_kv_online_decode(rng, fmt):
    """A decode over an fp8 cache in the online (GPU) formulation: group
    padded, keys split and merged in the module, against the reference on
    the dequantized cache."""
    from conftest import CACHE

    session = turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", formulation="online", compute_units=8
    )
    prob, k_scale, v_scale = _fp8_problem(
        rng, fmt, "f16", batch=3, seqlen_q=1, seqlens_k=[1500, 0, 700], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    run_and_check(session, prob, dtype="f16", k_scale=k_scale, v_scale=v_scale)
    used = session.last_variant
    # 1500 keys: 4 merged splits of 256 or more (plan.MIN_KEYS_PER_MERGED_SPLIT).
    assert (used.formulation, used.kv_dtype, used.merge_splits) == (
        "online",
        fmt.replace("float8_", "f8").replace("_", ""),
        4,
    )


def test_fp8_errors(rng, tmp_path):
    s = turbine_fmha.Session("cpu", artifact_dir=tmp_path)
    (q, k, v, bt, sk), ks, vs = _fp8_problem(
        rng, "float8_e4m3fn", "f16", batch=2, seqlen_q=2, seqlens_k=[9, 3], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    cases = [
        (dict(q=q.astype(np.float32)), "float16 or bfloat16"),
        (dict(v=v.astype(ml_dtypes.float8_e5m2)), "v_cache dtype"),
        (dict(k_scale=0.0), "k_scale"),
        (dict(v_scale=float("inf")), "v_scale"),
    ]
    for over, word in cases:
        args = dict(q=q, k=k, v=v, k_scale=ks, v_scale=vs)
        args.update(over)
        with pytest.raises((ValueError, TypeError)) as info:
            turbine_fmha.fmha_fwd_paged(
                args["q"], args["k"], args["v"], bt, sk, k_scale=args["k_scale"], v_scale=args["v_scale"], session=s
            )
        assert word in str(info.value), (word, str(info.value))
    q16, k16, v16, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=2, seqlens_k=[9, 3], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    with pytest.raises(ValueError, match="k_scale is for fp8"):
        turbine_fmha.fmha_fwd_paged(q16, k16, v16, bt, sk, k_scale=0.5, session=s)


def test_fp8_decode_is_exact_for_every_byte(explicit_session):
    """The kernels decode fp8 bytes with integer arithmetic (IREE's GPU
    backends reject fp8 element types here): every one of the 256 codes of
    every format must decode to ml_dtypes' value, NaN codes to NaN. One key
    per code, through a one-hot query, so the output row is the decoded V."""
    for fmt in FORMATS:
        f8 = getattr(ml_dtypes, fmt)
        codes = np.arange(256, dtype=np.uint8).view(np.int8).view(f8)
        want = codes.astype(np.float32)
        finite = np.isfinite(want)
        # V holds the codes (head dim 256 = all codes); one key, one query row.
        v = codes.reshape(1, 1, 1, 256)
        k = np.zeros((1, 1, 1, 64), f8)
        q = np.zeros((1, 1, 1, 64), np.float16)
        out = turbine_fmha.fmha_fwd_paged(
            q,
            k,
            np.where(finite, v, np.zeros_like(v)).astype(f8),
            np.zeros((1, 1), np.int32),
            np.ones(1, np.int32),
            session=explicit_session,
        )
        got = out.reshape(256).astype(np.float32)
        np.testing.assert_array_equal(got[finite], want[finite].astype(np.float16).astype(np.float32), err_msg=fmt)


# --- static quantization: fp8 Q/K/V and output (ck_tile kDoFp8StaticQuant) ---


def _fp8_step(x, f8):
    """Spacing of the fp8 grid at |x| (subnormal spacing below the normals)."""
    info = ml_dtypes.finfo(f8)
    e = np.floor(np.log2(np.maximum(np.abs(x), float(info.smallest_normal))))
    return np.exp2(e - info.nmant)


def _squant_problem(rng, fmt, **kw):
    q, k, v, bt, sk = make_problem(rng, dtype="f32", **kw)
    f8 = getattr(ml_dtypes, fmt)
    # Per-tensor scales as a serving stack picks them, amax / fp8 max (with
    # some headroom). Spare pages stay NaN (every format has a NaN code):
    # they must never show.
    top = float(ml_dtypes.finfo(f8).max)
    q_scale, k_scale, v_scale = (float(np.nanmax(np.abs(x)) / top * rng.uniform(1.0, 1.5)) for x in (q, k, v))
    quant = [(x / s).astype(f8) for x, s in ((q, q_scale), (k, k_scale), (v, v_scale))]
    scales = dict(
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        # Outputs |o| <~ 3: out_scale down to 1e-3 drives some of
        # them into saturation; p_scale from a quarter of the
        # format's max (coarser P grid) up to the default.
        out_scale=float(10 ** rng.uniform(-3, -1)),
        p_scale=float(rng.uniform(0.25, 1.0) * ml_dtypes.finfo(f8).max),
    )
    return (*quant, bt, sk), scales


# The kernel computes P = exp(s - max) in f32, the reference in float64.
# Both round p * p_scale to the fp8 grid, so they agree except where
# p * p_scale lies within f32 error of a rounding midpoint. f32 scores of
# |s| <~ 10 from exact fp8 products carry ~1e-6 relative error after exp,
# so 1e-5 is a safe bound. There, P differs by one fp8 step (2^-2
# relative for e5m2). The outputs are sums that cancel, so that can move an
# output by many output steps (seen in CI). The reference is therefore
# evaluated with p_scale scaled by 1 -/+ P_SLACK as well, which rounds
# every such ambiguous P element down/up and leaves the others unchanged
# (the 1e-5 change of the final division is far below an fp8 step).
P_SLACK = 1e-5


def _squant_refs(q, k, v, bt, sk, **kw):
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    alts = [
        fmha_fwd_paged_ref(q, k, v, bt, sk, **dict(kw, p_scale=kw["p_scale"] * (1 + d)))[0] for d in (-P_SLACK, P_SLACK)
    ]
    return ref, ref_lse, np.minimum.reduce([ref, *alts]), np.maximum.reduce([ref, *alts])


def _check_squant(out, lse, refs, f8):
    """Each fp8 output lies within one output step of the range the
    reference spans over the ambiguous P roundings (the kernel's f32 output
    may round the other way at an output midpoint too), and under 1% of
    the outputs differ from the reference's value at all (ambiguous P
    elements are rare, and usually no output is near a midpoint)."""
    ref, ref_lse, lo, hi = refs
    assert out.dtype == f8
    got = out.astype(np.float64)
    assert np.isfinite(got).all(), "non-finite output"
    slack = 1e-9 * np.abs(ref)
    below = got < lo - _fp8_step(lo, f8) - slack
    above = got > hi + _fp8_step(hi, f8) + slack
    assert not (below | above).any(), (
        f"{np.count_nonzero(below | above)} outputs outside the reference's range by more than one fp8 step"
    )
    frac = np.count_nonzero(got != ref) / got.size
    assert frac < 0.01, f"{frac:.2%} of outputs differ from the reference's fp8 value"
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    if (~empty).any():
        # Scores are exact fp8 products summed in f32: LSE to f32 accuracy.
        assert np.abs(lse[~empty] - ref_lse[~empty]).max() <= 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_static_quant(explicit_session, rng, fmt):
    f8 = getattr(ml_dtypes, fmt)
    batch = 3
    (q, k, v, bt, sk), scales = _squant_problem(
        rng,
        fmt,
        batch=batch,
        seqlen_q=int(rng.integers(1, 40)),
        seqlens_k=[int(rng.integers(0, 100)) for _ in range(batch)],
        nhead_q=8,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    kw = dict(mask_type="bottom_right", window_size_right=0, **scales)
    poison = np.full(q.shape[:-1] + (64,), np.nan, f8)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, out=poison, return_lse=True, session=explicit_session, **kw)
    assert out is poison
    _check_squant(out, lse, _squant_refs(q, k, v, bt, sk, **kw), f8)
    assert explicit_session.last_variant.static_quant


def test_fp8_static_quant_features(explicit_session, online_session, rng):
    """Group mode with sinks and a soft-cap, asked of the online (GPU)
    formulation, which hands static quantization to the explicit kernels."""
    fmt = "float8_e4m3fnuz"
    f8 = getattr(ml_dtypes, fmt)
    lens_q = [1, int(rng.integers(2, 30)), 1, int(rng.integers(2, 30))]
    lens_k = [int(rng.integers(lq, 90)) for lq in lens_q]
    (q4, k, v, bt, sk), scales = _squant_problem(
        rng, fmt, batch=4, seqlen_q=max(lens_q), seqlens_k=lens_k, nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    q = np.concatenate([q4[b, :n] for b, n in enumerate(lens_q)])
    seqstart = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    kw = dict(
        seqstart_q=seqstart,
        mask_type="bottom_right",
        window_size_left=20,
        window_size_right=0,
        logits_soft_cap=30.0,
        sinks=rng.uniform(-2, 2, 8).astype(np.float32),
        **scales,
    )
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=online_session, **kw)
    _check_squant(out, lse, _squant_refs(q, k, v, bt, sk, **kw), f8)
    assert online_session.last_variant.formulation == "explicit"


@pytest.mark.parametrize("v_scale", [1.0, 1.0625])
def test_fp8_encode_is_exact_for_every_byte(explicit_session, v_scale):
    """One key, so P = 1 and the output is fp8(V_fp8 * v_scale): with v_scale
    1 every code must come back unchanged (NaN codes as NaN); with 1.0625
    (= 1 + 2^-4) many products fall exactly between two e5m2 values or
    beyond the max, testing ties-to-even and saturation against ml_dtypes."""
    for fmt in FORMATS:
        f8 = getattr(ml_dtypes, fmt)
        codes = np.arange(256, dtype=np.uint8).view(np.int8).view(f8)
        v = codes.reshape(1, 1, 1, 256)
        k = np.zeros((1, 1, 1, 64), f8)
        q = np.zeros((1, 1, 1, 64), f8)
        out = turbine_fmha.fmha_fwd_paged(
            q,
            k,
            v,
            np.zeros((1, 1), np.int32),
            np.ones(1, np.int32),
            v_scale=v_scale,
            p_scale=1.0,
            out_scale=1.0,
            session=explicit_session,
        )
        got = out.reshape(256)
        vals = codes.astype(np.float64)
        want = fp8_round(vals * v_scale, f8)
        nan = np.isnan(vals)
        assert np.isnan(got.astype(np.float64)[nan]).all(), fmt
        np.testing.assert_array_equal(got.astype(np.float64)[~nan], want[~nan], err_msg=fmt)
        if v_scale == 1.0:
            # Bit-exact, except that -0 comes back as +0 (the f32 PV sum
            # starts at +0, and +0 + -0 = +0, as in ck_tile) and e5m2's
            # infinities saturate to +-max (ck_tile's saturates<fp8_t>).
            bits = want.astype(f8).view(np.uint8)
            want_bits = np.where(bits == 0x80, 0, bits)
            np.testing.assert_array_equal(got.view(np.uint8)[~nan], want_bits[~nan], err_msg=fmt)


def test_fp8_static_quant_errors(rng, tmp_path):
    s = turbine_fmha.Session("cpu", artifact_dir=tmp_path)
    (q, k, v, bt, sk), scales = _squant_problem(
        rng, "float8_e4m3fn", batch=2, seqlen_q=2, seqlens_k=[9, 3], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    q16 = q.astype(np.float16)
    cases = [
        (dict(k=k.astype(ml_dtypes.float8_e4m3fnuz)), "k_cache dtype"),
        (dict(v=v.astype(np.float16)), "v_cache dtype"),
        (dict(p_scale=-1.0), "p_scale"),
        (dict(out_scale=float("nan")), "out_scale"),
        (
            dict(
                q=q16,
                k=k.astype(np.float16),
                v=v.astype(np.float16),
                p_scale=None,
                out_scale=None,
                q_scale=0.5,
                k_scale=None,
                v_scale=None,
            ),
            "q_scale is for fp8 q",
        ),
        (
            dict(
                q=q16,
                k=k.astype(np.float16),
                v=v.astype(np.float16),
                p_scale=None,
                out_scale=1.0,
                q_scale=None,
                k_scale=None,
                v_scale=None,
            ),
            "out_scale is for fp8 q",
        ),
    ]
    for over, word in cases:
        args = dict(q=q, k=k, v=v, **scales)
        args.update(over)
        q_, k_, v_ = args.pop("q"), args.pop("k"), args.pop("v")
        with pytest.raises((ValueError, TypeError)) as info:
            turbine_fmha.fmha_fwd_paged(q_, k_, v_, bt, sk, session=s, **args)
        assert word in str(info.value), (word, str(info.value))
