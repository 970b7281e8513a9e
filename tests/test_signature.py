"""The kernel signature declaration (turbine_fmha.signature) and what is
derived from it: the CustomOp signature, select(), example arguments, the
templates' type aliases, the call order, the kernel name and KERNEL_ABI;
and the templates as package data."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from turbine_fmha.build.default_sets import default_append_kernels, gpu_default_set, host_default_set
from turbine_fmha.kernels import custom_ops as kernels
from turbine_fmha.kernels import signature, variants
from turbine_fmha.kernels.append_kernel import AppendKernel
from turbine_fmha.kernels.variants import Variant

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "mlir"

ALL = list(dict.fromkeys(gpu_default_set() + host_default_set()))


def test_kernel_abi_is_derived():
    assert isinstance(signature.KERNEL_ABI, int) and 0 < signature.KERNEL_ABI < 1 << 48


def test_kernel_abi_is_the_same_in_every_process():
    code = "from turbine_fmha.kernels import signature; print(signature.KERNEL_ABI)"
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert int(out.stdout) == signature.KERNEL_ABI


def test_custom_op_signature():
    assert kernels.PagedKVFwdExplicit.signature == (
        "turbine_fmha_pagedkv_fwd_explicit(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seqlen_q, Tensor seqlen_k, Tensor kv_shift, Tensor fparams, Tensor iparams, "
        "Tensor? alibi_slopes, Tensor? bias, Tensor? sinks, str mask, int softcap, str kv_layout, str v_layout, "
        "str kv_dtype, int v_guard, int group_rows, int merge_splits, int runtime_heads, int group, int runtime_page) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    )
    assert kernels.PagedKVAppend.signature == (
        "turbine_fmha_pagedkv_append(Tensor k_new, Tensor v_new, Tensor slots, Tensor k_cache, "
        "Tensor v_cache) -> (Tensor, Tensor)"
    )


def test_call_order():
    fixed = ("q", "k_cache", "v_cache", "block_table", "seqlen_q", "seqlen_k", "kv_shift", "fparams", "iparams")
    assert signature.KERNEL_ARGS == fixed + ("alibi_slopes", "bias", "sinks")
    assert signature.OPTIONAL_ARGS == {"alibi_slopes", "bias", "sinks"}
    v = Variant("f16", 64, 64, 4, 2, 16, bias="alibi", sinks=True)
    assert signature.call_args(v) == fixed + ("alibi_slopes", "sinks")
    v = Variant("f16", 64, 64, 4, 2, 16, bias="elementwise", bias_shape="1h")
    assert signature.call_args(v) == fixed + ("bias",)


def _expected_readback(v: Variant) -> Variant:
    # The kernels return the LSE whatever `lse` says, and with a static batch
    # tile of 1 a per-sequence bias axis is indistinguishable from a
    # broadcast one (same MLIR types).
    v = dataclasses.replace(v, lse=True)
    if v.batch_tile == 1 and v.bias_shape[:1] == "b":
        v = dataclasses.replace(v, bias_shape="1" + v.bias_shape[1])
    return v


@pytest.mark.parametrize("v", ALL, ids=str)
def test_example_args_read_back_as_the_variant(v):
    args = kernels.example_args(v)
    n = len(signature.FWD.args)
    assert len(args) == n + len(signature.FWD.attrs)
    tensors, attrs = args[:n], dict(zip((a.name for a in signature.FWD.attrs), args[n:]))
    assert [a.name for a, t in zip(signature.FWD.args, tensors) if t is not None] == list(signature.call_args(v))
    assert kernels.variant_of(v.formulation, tensors, attrs) == _expected_readback(v)


def test_static_dims_follow_the_formulation():
    ex = Variant("f16", 128, 64, 32, 8, 16, "bottom_right", bias="elementwise", bias_shape="b1")
    on = Variant("f16", 128, 64, 32, 8, 16, "bottom_right", formulation="online", batch_tile=8, seqlen_q_tile=1)
    h = signature.mlir_header(signature.FWD, list(signature.FWD.args[:11]), signature.fwd_types(ex))
    assert "!q_t = tensor<?x?x32x128xf16>" in h["aliases"]
    assert "!bias_t = tensor<?x1x?x?xf32>" in h["aliases"]
    assert "!v_cache_t = tensor<?x16x8x64xf16>" in h["aliases"]
    assert "!out_t = tensor<?x?x32x64xf16>" in h["aliases"]
    assert h["results"] == "!out_t, !lse_t, !row_max_t, !row_sum_t"
    h = signature.mlir_header(signature.FWD, list(signature.FWD.args[:9]), signature.fwd_types(on))
    assert "!q_t = tensor<8x1x32x128xf16>" in h["aliases"]
    assert "!block_table_t = tensor<8x?xi32>" in h["aliases"]
    assert "!lse_t = tensor<8x32x1xf32>" in h["aliases"]
    assert h["params"].startswith("%q: !q_t, %k_cache: !k_cache_t, %v_cache: !v_cache_t")


def test_rendered_kernels_are_named_by_the_variant():
    for v in (
        Variant("f16", 64, 64, 4, 2, 16, "bottom_right", sinks=True),
        Variant("bf16", 64, 64, 4, 2, 16, "none", formulation="online", batch_tile=2, seqlen_q_tile=4),
        AppendKernel("i8", 2, 64, 64, 16),
    ):
        text = kernels.render_variant(v)
        assert f"func.func @{v.name}(" in text
        assert f"util.func private @{v.name}_impl(" in text


# Ops that only rebind a name: x & x, x | x, max(x, x), c ? v : v, s + 0.
_IDENTITY = [
    re.compile(r"arith\.(andi|ori|maximumf|minimumf) (%[\w#.]+), \2 :"),
    re.compile(r"arith\.select %[\w#.]+, (%[\w#.]+), \1 :"),
]


@pytest.mark.parametrize(
    "v",
    [
        Variant("f16", 64, 64, 4, 2, 16, "none", v_layout="col"),
        Variant("f16", 64, 64, 4, 2, 16, "top_left", bias="alibi", sinks=True),
        Variant("bf16", 64, 64, 4, 2, 16, "bottom_right", softcap=True, kv_dtype="f8e4m3fn"),
        Variant("f8e4m3fn", 64, 64, 4, 2, 16, "none"),
        Variant("f32", 64, 64, 4, 4, 16, "none", bias="elementwise", bias_shape="bh"),
        Variant(
            "f16",
            64,
            64,
            4,
            2,
            16,
            "none",
            bias="elementwise",
            bias_shape="11",
            formulation="online",
            batch_tile=2,
            seqlen_q_tile=4,
        ),
        Variant(
            "f16", 64, 64, 4, 2, 16, "bottom_right", bias="alibi", formulation="online", batch_tile=2, seqlen_q_tile=4
        ),
    ],
    ids=str,
)
def test_no_identity_ops(v):
    text = kernels.render_variant(v)
    for pattern in _IDENTITY:
        assert not pattern.search(text), pattern.search(text).group(0)


def test_templates_add_no_zero():
    for path in TEMPLATES.rglob("*.jinja"):
        assert not re.search(r"arith\.addf[^\n]*%zero", path.read_text()), path.name


def test_templates_are_package_data():
    """Every file under mlir/ is package data of the package that
    pyproject.toml maps onto its directory."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"]["turbine_fmha.mlir"] == "mlir"
    files = [p.relative_to(TEMPLATES) for p in TEMPLATES.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert files
    for f in files:
        package = ".".join(("turbine_fmha.mlir",) + f.parent.parts)
        assert package in conf["packages"], f
        assert any(fnmatch.fnmatch(f.name, p) for p in conf["package-data"][package]), f
    assert kernels.mlir_dir() == TEMPLATES or kernels.mlir_dir().is_dir()


def test_every_package_is_listed():
    """pyproject.toml lists the packages (the mapped templates package
    rules out setuptools' `find`): every directory of Python under
    turbine_fmha/ must be one of them, or the wheel leaves it out."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "turbine_fmha").rglob("*.py")}
    assert found <= set(conf["packages"]), sorted(found - set(conf["packages"]))


def test_template_dir_override(tmp_path, monkeypatch):
    shutil.copytree(TEMPLATES, tmp_path, dirs_exist_ok=True)
    append = tmp_path / "pagedkv_append.mlir.jinja"
    append.write_text("// overridden\n" + append.read_text())
    monkeypatch.setenv("TURBINE_FMHA_MLIR_DIR", str(tmp_path))
    assert kernels.mlir_dir() == tmp_path
    a = AppendKernel("f16", 2, 64, 64, 16)
    text = kernels.PackageJinjaLoader().render(
        "pagedkv_append",
        func_name="f",
        dt="f16",
        sig=signature.mlir_header(signature.APPEND, list(signature.APPEND.args), signature.append_types(a)),
    )
    assert text.startswith("// overridden")


def test_variant_names_unchanged():
    """The name codec writes exactly the names artifacts already carry."""
    assert (
        Variant(
            "f16",
            128,
            128,
            32,
            8,
            16,
            "bottom_right",
            bias="elementwise",
            bias_shape="1h",
            formulation="online",
            batch_tile=1,
            seqlen_q_tile=128,
        ).name
        == "pagedkv_fwd_f16_d128x128_h32x8_pg16_mbr_bias1h_lse_online_b1_q128"
    )
    assert (
        Variant(
            "bf16", 64, 64, 8, 8, 1, v_layout="col", kv_dtype="f8e4m3fnuz", softcap=True, sinks=True, lse=False
        ).name
        == "pagedkv_fwd_bf16_d64x64_h8x8_pg1_vcol_kvf8e4m3fnuz_nmask_softcap_sink_nlse_explicit"
    )
    assert (
        Variant("f16", 128, 128, 32, 8, 64, formulation="online", batch_tile=8, seqlen_q_tile=1, v_guard=False).name
        == "pagedkv_fwd_f16_d128x128_h32x8_pg64_nmask_lse_online_b8_q1_nvguard"
    )
    assert AppendKernel("i8", 8, 128, 64, 16).name == "pagedkv_append_i8_h8_d128x64_pg16"


def test_every_default_name_roundtrips():
    appends = default_append_kernels(gpu=True) + default_append_kernels(gpu=False)
    for v in ALL:
        assert Variant.parse(v.name) == v and variants.parse_kernel(v.name) == v
    for a in appends:
        assert AppendKernel.parse(a.name) == a and variants.parse_kernel(a.name) == a
