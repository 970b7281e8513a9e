"""The kernel templates (mlir/): their rendered MLIR held byte for byte,
and the score terms kept out of the skeletons.

DIGESTS is the sha256 (first 16 hex digits) of kernels.render_variant for a
representative subset: both formulations, every score term and bias
shape, every mask, the layouts, fp8 caches and static quantization, run-
time heads, group padding, split-KV merges (of one count and of any), no
V guard, and the append kernels. It was recorded before the score terms
became hooks (issue 26), when the full sets (host, GPU, append, the tests'
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
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_explicit": "89879af3ff5d96a8",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_mtl_softcap_lse_explicit": "bc3e82ccafab91c5",
    "pagedkv_fwd_f32_d64x64_h8x2_pg16_mbr_alibi_lse_explicit": "7eb982bd621b496e",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_alibi_sink_lse_explicit": "7c8834d79f18b368",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mtl_bias11_lse_explicit": "600b013c0ba44f50",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_mbr_biasb1_lse_explicit": "6f1ef9a61a3a028f",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_bias1h_lse_explicit": "972ac9b5da37164f",
    "pagedkv_fwd_f32_d64x64_h4x4_pg16_nmask_biasbh_sink_lse_explicit": "6924b7d487814316",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_softcap_sink_lse_explicit": "9efec29cda934211",
    "pagedkv_fwd_f16_d32x16_h2x1_pg1_mbr_alibi_lse_explicit": "af17c61fa74b9019",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_vcol_nmask_lse_explicit": "a8c9a17f387982ec",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_kvf8e4m3fn_mbr_lse_explicit": "99183e9a4e2eaa49",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_hnd_vcol_kvf8e5m2_nmask_lse_explicit": "1b808e6ef599777d",
    "pagedkv_fwd_f8e4m3fn_d64x64_h8x2_pg16_mbr_lse_explicit": "b0f303c1a9b5e54a",
    "pagedkv_fwd_f8e5m2fnuz_d64x64_h8x2_pg16_nmask_sink_lse_explicit": "e60f7d359112076f",
    "pagedkv_fwd_f16_d64x64_g4_pg16_mbr_bias1h_lse_explicit": "b575ad67820105d1",
    "pagedkv_fwd_bf16_d128x128_pg16_hnd_mtl_lse_explicit": "f3caedf1992ca29b",
    "pagedkv_fwd_f16_d64x64_pg16_hnd_kvf8e4m3fnuz_nmask_alibi_lse_explicit": "ba96e99f2296e734",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b8_q1_m16": "16c01ede94060cd5",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b1_q128": "f597da7dc86f0bbd",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_lse_online_b1_q16_nvguard": "6de073c14f25bdae",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b128_q1_m16_x4": "b43be31fae3b9eba",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_kvf8e4m3fn_nmask_lse_online_b8_q1_m16": "a00b240d7be181b4",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_hnd_vcol_nmask_lse_online_b8_q1_m16": "44deb9e61f4dfae5",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mtl_softcap_sink_lse_online_b1_q16": "91fb443116c234a4",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_alibi_lse_online_b1_q16": "147a52e8bcf5394c",
    "pagedkv_fwd_bf16_d64x64_h8x2_pg16_hnd_nmask_alibi_sink_lse_online_b8_q1": "99fa4b094a7c34b7",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_bias11_lse_online_b8_q1_m16": "a8fb87a91211f4cb",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_biasb1_lse_online_b8_q1_m16": "59b07e8ee0109a90",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_mbr_biasb1_lse_online_b1_q16": "2b363c253fc07cf8",
    "pagedkv_fwd_f32_d64x64_h8x2_pg16_mbr_bias1h_lse_online_b1_q16": "95f733666b31829d",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_biasbh_lse_online_b8_q1_nvguard": "b7a5b063d978f736",
    "pagedkv_fwd_f16_d64x64_g4_pg16_nmask_lse_online_b32_q1_m16_x4": "53d1964b5804aca3",
    "pagedkv_fwd_f16_d64x64_h8x2_pg16_nmask_lse_online_b128_q1_m16_xn": "74821d0bd141794e",
    "pagedkv_fwd_bf16_d64x64_pg16_hnd_nmask_lse_online_b32_q1_nvguard_m16_xn": "3c7aaf9ee85a1f4e",
    "pagedkv_fwd_f16_d64x64_pg16_nmask_lse_online_b8_q1_m16": "50b31a27fe43f464",
    "pagedkv_fwd_bf16_d64x64_pg16_hnd_mbr_lse_online_b1_q16_m64": "c94a877915eebbcb",
    "pagedkv_fwd_f16_d64x64_g2_pg16_mbr_alibi_lse_online_b1_q16": "a481de97d9b1fe9d",
    "pagedkv_append_f16_h2_d64x64_pg16": "0351c2ecd10c0d60",
    "pagedkv_append_i8_h2_d64x64_pg16": "71be6b0466fdc4cd",
    "pagedkv_append_f32_h1_d16x8_pg4_ropei": "15c904e6822ad8f4",
    "pagedkv_append_bf16_h2_d64x64_pg16_ropeh": "aaf952a002fc9616",
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
