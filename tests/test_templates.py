"""The kernel templates (mlir/): their rendered MLIR held byte for byte,
and the score terms kept out of the skeletons.

DIGESTS is the sha256 (first 16 hex digits) of kernels.render_variant for a
representative subset: both formulations, every score term and bias
shape, every mask, the layouts, fp8 caches and static quantization, run-
time heads, group padding, split-KV merges (of one count and of any), no
V guard, and the append kernels. It was recorded before the score terms
became hooks, when the full sets (host, GPU, append, the tests'
variants and a covering sweep, 3,266 kernels) rendered byte-identical
too. A template change that alters one of these kernels must change its
digest here, on purpose.

The skeletons (every template outside mlir/terms/) call the score terms
through hooks (mlir/hooks.mlir.jinja) and test no feature: no `if` of
theirs, statement or inline, names a score term.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from jinja2 import Environment, nodes

from turbine_fmha.kernels import custom_ops as kernels
from turbine_fmha.kernels import signature
from turbine_fmha.kernels.variants import Variant, parse_kernel

ROOT = Path(__file__).resolve().parent.parent
MLIR = ROOT / "mlir"
TERMS = MLIR / "terms"

DIGESTS = {
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_explicit": "99ba845dc5c59512",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_mtl_softcap_lse_explicit": "251db7b5ab34a284",
    "pagedkv_fwd_f32_d64x64_h8x2_pg16_mbr_alibi_lse_explicit": "4b69c5224d20b3e6",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_alibi_sink_lse_explicit": "99bd8a4a38254574",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mtl_bias11_lse_explicit": "c45a8315fb0ab5c2",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_mbr_biasb1_lse_explicit": "881fcd935a743519",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_bias1h_lse_explicit": "931580ca1f25d47b",
    "pagedkv_fwd_f32_d64x64_h4x4_pg16_nmask_biasbh_sink_lse_explicit": "15ac5727245264b4",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_softcap_sink_lse_explicit": "cf8efe36e79c6a6a",
    "pagedkv_fwd_f16_d32x16_h2x1_pg1_mbr_alibi_lse_explicit": "315cf87b8a447aa6",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_vcol_nmask_lse_explicit": "3b81e42bc35dfcf9",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_kvf8e4m3fn_mbr_lse_explicit": "a1061414c3ff9f76",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_hnd_vcol_kvf8e5m2_nmask_lse_explicit": "4521213489e450b8",
    "pagedkv_fwd_f8e4m3fn_d64x64_h8x2_pg16_mbr_lse_explicit": "5b71dc4b5ea775d5",
    "pagedkv_fwd_f8e5m2fnuz_d64x64_h8x2_pg16_nmask_sink_lse_explicit": "4304e73545a5630c",
    "pagedkv_fwd_f16_d64x64_g4_pg16_mbr_bias1h_lse_explicit": "1a0187707210950e",
    "pagedkv_fwd_bf16_d128x128_pg16_hnd_mtl_lse_explicit": "3a69947f6ddbfad9",
    "pagedkv_fwd_f16_d64x64_pg16_hnd_kvf8e4m3fnuz_nmask_alibi_lse_explicit": "954a3037f777ca31",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b8_q1_m16": "3db9bf86cf7c7a55",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b1_q128": "e0345a4326aaf1df",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_lse_online_b1_q16_nvguard": "e99e19dc92c36ffa",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b128_q1_m16_x4": "6cb35299b880f526",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_kvf8e4m3fn_nmask_lse_online_b8_q1_m16": "9a6e7873c59f3ecb",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_hnd_vcol_nmask_lse_online_b8_q1_m16": "be440d71ed772d0c",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mtl_softcap_sink_lse_online_b1_q16": "01787aee737c8fec",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_alibi_lse_online_b1_q16": "94e2b1664314e84d",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_hnd_nmask_alibi_sink_lse_online_b8_q1": "4a7ab0c5f7a74c5c",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_bias11_lse_online_b8_q1_m16": "d781c2a47e74e0c0",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_biasb1_lse_online_b8_q1_m16": "444593062f0e5635",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_biasb1_lse_online_b1_q16": "3e153e8abe64ad80",
    "pagedkv_fwd_f32_d64x64_h8x2_pg16_mbr_bias1h_lse_online_b1_q16": "5e526dcf530b737e",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_biasbh_lse_online_b8_q1_nvguard": "9f86181965b85181",
    "pagedkv_fwd_f16_d64x64_g4_pg16_nmask_lse_online_b32_q1_m16_x4": "2a917a607a6e71af",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b128_q1_m16_xn": "e7a2770b6dbee261",
    "pagedkv_fwd_bf16_d64x64_pg16_hnd_nmask_lse_online_b32_q1_nvguard_m16_xn": "47bf8608e27b6be8",
    "pagedkv_fwd_f16_d64x64_pg16_nmask_lse_online_b8_q1_m16": "20698655909c4c47",
    "pagedkv_fwd_bf16_d64x64_pg16_hnd_mbr_lse_online_b1_q16_m64": "f509cc4104a1ff1e",
    "pagedkv_fwd_f16_d64x64_g2_pg16_mbr_alibi_lse_online_b1_q16": "4d5bb64814119977",
    "pagedkv_append_f16_h2_d64x64_pg16": "860a90f1aa2bf0a5",
    "pagedkv_append_i8_h2_d64x64_pg16": "a49c32325961fb9b",
    "pagedkv_append_f32_h1_d16x8_pg4_ropei": "ab8747911ed1ea42",
    "pagedkv_append_bf16_h2_d64x64_pg16_ropeh": "9c8832f9fc136204",
}


@pytest.mark.parametrize("name", DIGESTS)
def test_rendered_mlir_is_unchanged(name):
    text = kernels.render_variant(parse_kernel(name))
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == DIGESTS[name]


def test_digests_cover_every_term_and_shape():
    variants = [parse_kernel(n) for n in DIGESTS if n.startswith("pagedkv_fwd_")]
    for formulation in ("explicit", "online"):
        vs = [v for v in variants if v.formulation == formulation]
        assert {t for v in vs for t in signature.score_terms(v)} >= {"softcap", "alibi", "elementwise", "sinks"}
        assert {v.bias_shape for v in vs} == {"", "11", "b1", "1h", "bh"}
        assert {v.mask for v in vs} == {"none", "top_left", "bottom_right"}
    assert any(v.static_quant for v in variants) and any(v.kv_dtype for v in variants)
    assert {t.stem.split(".")[0] for t in TERMS.glob("*.mlir.jinja")} == {
        t for v in variants for t in signature.score_terms(v)
    }


# Names a skeleton's conditions must not mention: the terms (their files)
# and the feature flags the templates once took.
_FEATURES = {
    "alibi",
    "bias",
    "bias_shape",
    "softcap",
    "sinks",
    "sink",
    "static_quant",
    "qf8",
    "elementwise",
    "per_head_terms",
}


def _conditions(source: str):
    """The test of every if / elif and inline if (x if c else y) of a
    template."""
    for node in Environment().parse(source).find_all((nodes.If, nodes.CondExpr)):
        yield node.test


def _mentions(test: nodes.Node) -> set[str]:
    """The names, attributes and strings in a condition, lowercased."""
    names = set()
    for n in (test, *test.find_all(nodes.Node)):
        if isinstance(n, nodes.Name):
            names.add(n.name)
        elif isinstance(n, nodes.Getattr):
            names.add(n.attr)
        elif isinstance(n, nodes.Const) and isinstance(n.value, str):
            names.add(n.value)
    return {n.lower() for n in names}


@pytest.mark.parametrize("path", sorted(p.relative_to(MLIR).as_posix() for p in MLIR.glob("*.mlir.jinja")))
def test_skeletons_test_no_score_term(path):
    source = (MLIR / path).read_text()
    features = _FEATURES | {t.name.split(".")[0] for t in TERMS.glob("*.mlir.jinja")}
    for test in _conditions(source):
        assert not _mentions(test) & features, f"{path}: a condition tests {sorted(_mentions(test) & features)}"
    for flag in ("ALIBI", "BIAS_SHAPE", "SOFTCAP", "SINKS", "QF8"):
        assert flag not in source, f"{path} reads {flag}"


def test_the_condition_check_sees_conditions():
    src = "{% if ALIBI %}a{% elif x.bias %}b{% endif %}{{ 1 if SINKS else 2 }}{% set y = 'c' if 'softcap' in T %}"
    assert [sorted(_mentions(t) & _FEATURES) for t in _conditions(src)] == [["alibi"], ["bias"], ["sinks"], ["softcap"]]


def test_every_term_file_is_a_term():
    """score_terms names only files under mlir/terms/, and each term's
    tensors are declared `when` it."""
    v = Variant("f8e4m3fn", 64, 64, 8, 2, 16, softcap=True, sinks=True)
    names = (
        signature.score_terms(v)
        + signature.score_terms(Variant("f16", 64, 64, 8, 2, 16, bias="alibi"))
        + signature.score_terms(Variant("f16", 64, 64, 8, 2, 16, bias="elementwise", bias_shape="11"))
    )
    assert all((TERMS / f"{t}.mlir.jinja").is_file() for t in names)
    assert {a.when for a in signature.FWD.args if a.when} <= set(names)
