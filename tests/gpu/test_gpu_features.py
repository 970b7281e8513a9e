"""Small random problems per dtype, score term, cache format and split-KV
path on the GPU, against the float64 reference (benchmarks/bench.py
--verify, which benchmarks/probes/h200_bench.sh ran): a decode batch with
an empty and a one-key sequence, and a causal prefill, for fp16 and bf16;
then each score term of the default GPU set (ALiBi, elementwise bias of
each shape, soft-cap, sinks, ALiBi with sinks), column-major V, fp8 KV
caches and fp8 static quantization in fp16; then split-KV merged on the
host, merged in the module, and chosen automatically. numpy inputs (the
session copies them to the GPU and returns numpy)."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import FP8_OUT_TOL, HQ, MASK, check, paged, queries

pytestmark = pytest.mark.gpu

DECODE = (1, [300, 17, 1, 0, 45], {})
PREFILL = (150, [200, 150], MASK)


def run(gpu, q, k, v, bt, sk, dtype="f16", **kw):
    """The call and its reference: (out, lse, ref, ref_lse); the empty
    rows' output checked to be exactly 0."""
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k, v, bt, sk, return_lse=True, session=gpu.session, device=gpu.device, **kw
    )
    assert isinstance(out, np.ndarray) and out.shape[:-1] == q.shape[:-1]
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **{a: x for a, x in kw.items() if a != "num_splits"})
    empty = np.isneginf(ref_lse).transpose(0, 2, 1)  # [b, sq, hq]
    assert (out[empty] == 0).all(), "a row with no visible key is not 0"
    return out, lse, ref, ref_lse


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("case", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_plain(gpu, dtype, case):
    rows, lens, kw = case
    rng = np.random.default_rng(10)
    k, v, bt, sk = paged(rng, lens, dtype=dtype)
    q = queries(rng, rows, dtype=dtype, batch=len(lens))
    out, lse, ref, ref_lse = run(gpu, q, k, v, bt, sk, dtype, **kw)
    check(out, ref, dtype, lse, ref_lse)


def _slopes(rng, b, sq, sks):
    return dict(alibi_slopes=rng.uniform(0.01, 0.5, (b, HQ)).astype(np.float32))


FEATURES = {
    "alibi": _slopes,
    "bias [b,h,sq,sk]": lambda rng, b, sq, sks: dict(
        bias=rng.standard_normal((b, HQ, sq, max(sks))).astype(np.float32)
    ),
    "bias [1,h,sq,sk]": lambda rng, b, sq, sks: dict(
        bias=rng.standard_normal((1, HQ, sq, max(sks))).astype(np.float32)
    ),
    "bias [1,1,sq,sk]": lambda rng, b, sq, sks: dict(bias=rng.standard_normal((1, 1, sq, max(sks))).astype(np.float32)),
    "soft-cap": lambda rng, b, sq, sks: dict(logits_soft_cap=2.0),
    "sinks": lambda rng, b, sq, sks: dict(sinks=rng.uniform(-1, 2, HQ).astype(np.float32)),
    "alibi + sinks": lambda rng, b, sq, sks: dict(
        _slopes(rng, b, sq, sks), sinks=rng.uniform(-1, 2, HQ).astype(np.float32)
    ),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("case", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_score_terms(gpu, feature, case):
    rows, lens, kw = case
    rng = np.random.default_rng(11)
    k, v, bt, sk = paged(rng, lens)
    q = queries(rng, rows, batch=len(lens))
    if feature == "soft-cap":
        q = q * np.float16(4)  # scores past the cap
    kw = dict(kw, **FEATURES[feature](rng, len(lens), rows, lens))
    out, lse, ref, ref_lse = run(gpu, q, k, v, bt, sk, **kw)
    check(out, ref, "f16", lse, ref_lse)


@pytest.mark.parametrize("case", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_column_major_v(gpu, case):
    rows, lens, kw = case
    rng = np.random.default_rng(12)
    k, v, bt, sk = paged(rng, lens)
    q = queries(rng, rows, batch=len(lens))
    v_col = np.ascontiguousarray(v.transpose(0, 2, 3, 1))  # [pages, hk, d, page]
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k, v_col, bt, sk, return_lse=True, v_layout="col", session=gpu.session, device=gpu.device, **kw
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    check(out, ref, "f16", lse, ref_lse)


@pytest.mark.parametrize("case", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_fp8_kv_cache(gpu, case):
    """e4m3fn caches with scales, f16 q (the decode in the online kernels,
    the prefill in the explicit ones)."""
    import ml_dtypes

    rows, lens, kw = case
    rng = np.random.default_rng(13)
    k, v, bt, sk = paged(rng, lens)
    k = (k.astype(np.float32) / 0.05).astype(ml_dtypes.float8_e4m3fn)
    v = (v.astype(np.float32) / 0.08).astype(ml_dtypes.float8_e4m3fn)
    q = queries(rng, rows, batch=len(lens))
    out, lse, ref, ref_lse = run(gpu, q, k, v, bt, sk, k_scale=0.05, v_scale=0.08, **kw)
    check(out, ref, "f16", lse, ref_lse)


@pytest.mark.parametrize("case", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_fp8_static_quantization(gpu, case):
    """q, K and V in e4m3fn with per-tensor scales, fp8 output: the fraction
    of outputs that differ from the reference's fp8 value (FP8_OUT_TOL)."""
    import ml_dtypes

    rows, lens, kw = case
    rng = np.random.default_rng(14)
    k, v, bt, sk = paged(rng, lens, spare=0)
    q = queries(rng, rows, batch=len(lens))
    f8 = ml_dtypes.float8_e4m3fn
    top = float(ml_dtypes.finfo(f8).max)
    scales = [float(np.abs(x.astype(np.float32)).max()) / top for x in (q, k, v)]
    q, k, v = ((x.astype(np.float32) / s).astype(f8) for x, s in zip((q, k, v), scales))
    kw = dict(kw, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2], out_scale=0.01)
    out, lse, ref, ref_lse = run(gpu, q, k, v, bt, sk, **kw)
    differ = float(np.count_nonzero(out.astype(np.float64) != ref) / ref.size)
    assert differ <= FP8_OUT_TOL, f"{differ:.2%} of the fp8 outputs differ from the reference's"


@pytest.mark.parametrize(
    "dtype, lens, kw",
    [
        ("f16", [3000, 17, 0, 1500], dict(num_splits=5)),  # merged on the host
        ("f16", [3000, 17, 0, 1500], dict(num_splits=4)),  # merged in the module
        ("bf16", [3000, 17, 0, 1500], dict(num_splits=4)),
        ("f16", [20000], dict(MASK)),  # split automatically
    ],
    ids=["f16-5-host-merge", "f16-4-module-merge", "bf16-4-module-merge", "f16-auto"],
)
def test_split_kv(gpu, dtype, lens, kw):
    rng = np.random.default_rng(15)
    k, v, bt, sk = paged(rng, lens, dtype=dtype)
    q = queries(rng, 1, dtype=dtype, batch=len(lens))
    out, lse, ref, ref_lse = run(gpu, q, k, v, bt, sk, dtype, **kw)
    check(out, ref, dtype, lse, ref_lse)
