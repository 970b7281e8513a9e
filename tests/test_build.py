"""AOT build, manifest, content-hash caching, artifact integrity, and
compile-only checks of every ROCm and CUDA variant in the default set."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import numpy as np
import pytest
from conftest import CACHE, make_problem, run_and_check

import turbine_fmha
from turbine_fmha.build import aot as tfb
from turbine_fmha.build.default_sets import (
    DEFAULT_HDIMS,
    DEFAULT_HEADS,
    any_heads_variants,
    check_set,
    default_append_kernels,
    gpu_default_set,
    host_default_set,
    plain_variants,
)
from turbine_fmha.build.isa import isa_problems
from turbine_fmha.kernels.append_kernel import AppendKernel
from turbine_fmha.kernels.variants import (
    GPU_ENTRY_TILES,
    GPU_PREFILL_TILES,
    MERGED_DECODE_TILES,
    Variant,
    online_variant,
)

SMALL = [
    Variant("f16", 64, 64, 4, 2, 16, "bottom_right"),
    Variant("f32", 64, 64, 4, 2, 16, "none"),
]


def test_variant_names_roundtrip():
    for v in host_default_set() + gpu_default_set():
        assert Variant.parse(v.name) == v
    assert len({v.name for v in host_default_set()}) == len(host_default_set())


def test_default_names_unchanged():
    """The default sets keep the names their artifacts were built under.
    (Changed on purpose with the group-padded decode and its 64/128 batch
    tiles: the GPU set's decode names gained _m16; then the decodes that
    merge split-KV partials in the module, _x<n>, were added, and the fp8
    KV caches' online decode variants; then the 128-split merges and the
    1024-row prefill tile.) The variants for any head counts came later,
    under names of their own, then those over head-major (HND) pages, then
    the GPU tiles that run a prefill's rows as entries of 128 rows (16 or
    32 a launch, GPU_ENTRY_TILES); every earlier name is kept. Then the
    host set's pages other than 16 and the GPU sets' explicit page 64 went
    to kernels of any page size (_pg0): the names are checked with those
    pages put back, and each _pg0 name is a page-16 name of the sets with
    _pg0. Then each tile's merged decodes of one split count each (_x<n>,
    MERGED_DECODE_TILES) went to one kernel of any count (_xn), beside
    MERGED_STATIC_TILES: the names are checked with those put back."""
    host, gpu = host_default_set(), gpu_default_set()
    any_count = [v for v in gpu if v.merge_any]
    assert len(any_count) == 44
    gpu = [v for v in gpu if not v.merge_any] + [
        dataclasses.replace(v, merge_any=False, merge_splits=n)
        for v in any_count
        for t, n in MERGED_DECODE_TILES
        if t == v.batch_tile
    ]
    gpu = list({v.name: v for v in gpu}.values())  # the counts kept beside _xn (MERGED_STATIC_TILES) once
    any_page = sorted({v.name for v in host + gpu if v.runtime_page})
    dtypes, pages = ("f16", "bf16", "f32"), (1, 32, 64, 128)
    dropped = plain_variants("explicit", dtypes, [(h, h) for h in DEFAULT_HDIMS], DEFAULT_HEADS, pages)
    dropped += any_heads_variants(dtypes, pages)
    everything = [v for v in gpu + host if not v.runtime_page] + dropped
    assert not {v.name for v in dropped} & {v.name for v in host}
    assert len(any_page) == 90 and all(n.replace("_pg0", "_pg16") in {v.name for v in host} for n in any_page)
    entry_tiles = [v for v in everything if (v.batch_tile, v.seqlen_q_tile) in GPU_ENTRY_TILES]
    variants = [v for v in everything if (v.batch_tile, v.seqlen_q_tile) not in GPU_ENTRY_TILES]
    names = sorted(v.name for v in variants if not v.runtime_heads)
    names += sorted(a.name for gpu in (False, True) for a in default_append_kernels(gpu))
    assert len(names) == 608
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    assert digest == "2012a7407a77daf7021a50894fc0400145f3ba20ffc806d8cc240f6cdfa56609"
    any_heads = sorted({v.name for v in variants if v.runtime_heads and v.kv_layout == "NHD"})
    assert len(any_heads) == 243
    digest = hashlib.sha256("\n".join(any_heads).encode()).hexdigest()
    assert digest == "8df50042d320e7423391d1d2c785bf82309423b83f45de4ea9ff77aa70a9a0aa"
    # Then the same over head-major pages, each name an NHD one with _hnd.
    hnd = sorted({v.name for v in variants if v.kv_layout == "HND"})
    assert len(hnd) == 135 and all(n.replace("_hnd", "") in any_heads for n in hnd)
    # Each entry tile is a prefill tile of the set in all but its batch tile.
    prefill = {v.name for v in variants if (v.batch_tile, v.seqlen_q_tile) == GPU_PREFILL_TILES[0]}
    assert len(entry_tiles) == 160
    assert all(v.name.replace(f"_b{v.batch_tile}_q", "_b1_q") in prefill for v in entry_tiles)


@pytest.mark.parametrize("bad", ["", "pagedkv_fwd_f8_d64x64_h4x2_pg16_nmask_lse_explicit", "foo"])
def test_variant_parse_rejects(bad):
    with pytest.raises(ValueError):
        Variant.parse(bad)


def test_variant_rejects_bad_fields():
    with pytest.raises(ValueError, match="nhead_q"):
        Variant("f16", 64, 64, 6, 4, 16)
    with pytest.raises(ValueError, match="online"):
        Variant("f16", 64, 64, 4, 4, 16, formulation="online")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts")
    results = tfb.build(out, ["host"], SMALL)
    assert all(r.rebuilt for r in results)
    return out


def test_manifest_and_files(built):
    m = json.loads((built / "manifest.json").read_text())
    assert m["compiler_version"] == tfb.compiler_version()
    assert {a["variant"] for a in m["artifacts"]} == {v.name for v in SMALL}
    for a in m["artifacts"]:
        vmfb = built / a["path"]
        assert vmfb.is_file() and a["size"] == vmfb.stat().st_size
        assert a["sha256"] == tfb.sha256_file(vmfb)
        assert f"func.func @{a['variant']}(" in (built / a["mlir"]).read_text()
        assert a["flags"] and a["compile_seconds"] > 0
    assert not list(built.rglob("*.partial"))


def test_unchanged_variants_not_rebuilt(built):
    results = tfb.build(built, ["host"], SMALL)
    assert not any(r.rebuilt for r in results)


def test_a_build_that_compiles_nothing_brings_the_abi_docs_up_to_date(built):
    from turbine_fmha.kernels.abi import abi_docs

    path = built / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps(dict(m, abi=dict(m["abi"], convention="an earlier release's text"))))
    assert not any(r.rebuilt for r in tfb.build(built, ["host"], SMALL))
    assert json.loads(path.read_text())["abi"] == abi_docs()


def test_built_artifacts_run(built, rng):
    s = turbine_fmha.Session("cpu", artifact_dir=built)
    assert set(s.available_variants()) == set(SMALL)
    prob = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=9, seqlens_k=[50, 3], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    run_and_check(s, prob, dtype="f16", mask_type="bottom_right", window_size_right=0)


def _copy(built, tmp_path):
    d = tmp_path / "a"
    shutil.copytree(built, d)
    return d


def _edit_manifest(d, fn):
    p = d / "manifest.json"
    m = json.loads(p.read_text())
    fn(m["artifacts"][0])
    p.write_text(json.dumps(m))
    return m["artifacts"][0]


def _load_first(d, entry_name=None):
    s = turbine_fmha.Session("cpu", artifact_dir=d)
    name = entry_name or json.loads((d / "manifest.json").read_text())["artifacts"][0]["variant"]
    return s._load(Variant.parse(name))


@pytest.mark.parametrize("damage", ["flip_byte", "truncate"])
def test_corrupted_vmfb_refused(built, tmp_path, damage):
    d = _copy(built, tmp_path)
    entry = json.loads((d / "manifest.json").read_text())["artifacts"][0]
    path = d / entry["path"]
    data = bytearray(path.read_bytes())
    if damage == "flip_byte":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 3]
    path.write_bytes(bytes(data))
    with pytest.raises(turbine_fmha.ArtifactError, match="sha256"):
        _load_first(d)


def test_other_compiler_version_refused(built, tmp_path):
    d = _copy(built, tmp_path)
    _edit_manifest(d, lambda a: a.update(compiler_version="3.9.0"))
    with pytest.raises(turbine_fmha.ArtifactError, match="3.9.0"):
        _load_first(d)


def test_manifest_path_escape_refused(built, tmp_path):
    d = _copy(built, tmp_path)
    _edit_manifest(d, lambda a: a.update(path="../../etc/passwd"))
    with pytest.raises(turbine_fmha.ArtifactError, match="escapes"):
        _load_first(d)


def test_unreadable_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(turbine_fmha.ArtifactError, match="manifest"):
        turbine_fmha.Session("cpu", artifact_dir=tmp_path)


def test_compile_error_fails_build(tmp_path, monkeypatch):
    # A template that does not verify must fail the build and leave no vmfb.
    monkeypatch.setattr(tfb, "compile_one", lambda *a: (_ for _ in ()).throw(RuntimeError("error: boom")))
    with pytest.raises(RuntimeError, match="1 of 1 compiles failed"):
        tfb.build(tmp_path, ["host"], SMALL[:1])
    assert not list(tmp_path.rglob("*.vmfb"))


def test_compiles_that_fill_the_cores_run_single_threaded(tmp_path, monkeypatch):
    """A build whose parallel compiles fill the cores runs each compiler
    single threaded (its pass threads would only contend with the other
    compiles); a lone compile, such as a variant built on first use, keeps
    its threads. The artifacts are the same either way."""
    from turbine_fmha.build import compiler

    commands = []
    run = compiler.Compilers.run
    monkeypatch.setattr(compiler.Compilers, "run", lambda self, cmd, cwd: commands.append(cmd) or run(self, cmd, cwd))
    monkeypatch.setattr(tfb.os, "cpu_count", lambda: 2)
    tfb.build(tmp_path / "parallel", ["host"], SMALL, jobs=2)
    assert len(commands) == 2 and all("--mlir-disable-threading" in c for c in commands)
    commands.clear()
    tfb.build(tmp_path / "alone", ["host"], SMALL[:1], jobs=2)
    assert len(commands) == 1 and "--mlir-disable-threading" not in commands[0]
    shas = [
        {a["variant"]: a["sha256"] for a in json.loads((tmp_path / d / "manifest.json").read_text())["artifacts"]}
        for d in ("parallel", "alone")
    ]
    assert shas[1][SMALL[0].name] == shas[0][SMALL[0].name]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("target", ["gfx942", "gfx90a", "gfx950", "cuda"])
def test_gpu_default_set_compiles(target):
    """No GPU here: compile-only. The default GPU set's distinct kernels
    (check_set: every template path, tile family and feature, a few dozen
    of its ~600) and its append kernels compile with no `error:` on
    stderr, and their ISA is what the library ships (isa_problems: matrix
    cores in prefill tiles, no spills or scratch, the tuned CUDA
    configuration). scripts/check_default_sets.py checks the whole set the
    same way (a release check, outside the suite)."""
    out = CACHE / "gpu-default"
    kernels = check_set(gpu_default_set())
    assert 20 <= len(kernels) <= 60
    tfb.build(out, [target], kernels + default_append_kernels(gpu=True))
    m = json.loads((out / "manifest.json").read_text())
    entries = {a["variant"]: a for a in m["artifacts"] if a["target"] == target}
    assert {v.name for v in kernels} <= set(entries)
    problems = {v.name: isa_problems(v, entries[v.name]["isa"], target) for v in kernels}
    assert not any(problems.values()), {n: p for n, p in problems.items() if p}


def test_aarch64_default_set_compiles():
    """No ARM machine here: compile-only. The host set's distinct kernels
    (check_set) and its append kernels compile for the portable aarch64
    target with no `error:`, each artifact holding an AArch64 ELF."""
    out = CACHE / "aarch64-default"
    kernels = check_set(host_default_set()) + default_append_kernels(gpu=False)
    tfb.build(out, ["aarch64"], kernels)
    m = json.loads((out / "manifest.json").read_text())
    entries = {a["variant"]: a for a in m["artifacts"] if a["target"] == "aarch64"}
    assert {k.name for k in kernels} <= set(entries)
    for k in kernels:
        blob = (out / entries[k.name]["path"]).read_bytes()
        assert b"embedded_elf_arm_64" in blob, k.name  # the executable's format, in the vmfb's archive


def test_check_set_covers_every_field_of_the_default_sets():
    """Every value each field takes in a default set is in its check set,
    for the GPU and the host sets."""
    for variants in (gpu_default_set(), host_default_set()):
        kernels = check_set(variants)
        for field in (
            "formulation",
            "dtype",
            "kv_dtype",
            "page_block_size",
            "mask",
            "bias",
            "bias_shape",
            "softcap",
            "sinks",
            "kv_layout",
            "v_layout",
            "v_guard",
            "batch_tile",
            "seqlen_q_tile",
            "merge_splits",
            "group_rows",
            "runtime_heads",
        ):
            assert {getattr(v, field) for v in kernels} == {getattr(v, field) for v in variants}, field
        assert len(kernels) < len(variants) / 4


def test_isa_problems_names_what_is_wrong():
    prefill = Variant("f16", 128, 128, 32, 8, 16, "bottom_right", formulation="online", batch_tile=1, seqlen_q_tile=128)
    good = {"scratch_bytes": 0, "spills": 0, "mfma_count": 12, "kernels": [{"vgpr_spill_count": 0}]}
    assert isa_problems(prefill, good, "gfx942") == []
    assert isa_problems(prefill, dict(good, mfma_count=0, spills=3), "gfx942") == [
        "3 spills",
        "a prefill tile without MFMA",
    ]
    assert isa_problems(prefill, {"attention_config": "default", "mma_count": 0}, "cuda") == [
        "attention configuration 'default', not turbine_fmha's",
        "a prefill tile without mma.sync",
    ]


GPU_FALLBACK = [
    Variant("f16", 256, 256, 32, 8, 16, "bottom_right"),
    Variant("bf16", 128, 128, 32, 8, 16, "none", kv_dtype="f8e5m2fnuz"),
    Variant("bf16", 192, 128, 32, 8, 16, "none"),
    Variant("f16", 128, 128, 32, 8, 1, "bottom_right", "alibi"),
    Variant("f8e5m2", 128, 128, 32, 8, 16, "bottom_right"),
]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("target", ["gfx942", "gfx90a", "gfx950", "cuda"])
def test_gpu_explicit_fallback_compiles(target):
    """Problems the online kernels cannot serve (head dims > 128; per-head
    terms with one-row pages; fp8 caches; fp8 static quantization) run the
    explicit formulation on
    GPUs too: it
    must compile there (no MFMA and some spills: slow, but the kernel the CPU
    tests execute)."""
    out = CACHE / "gpu-fallback"
    tfb.build(out, [target], GPU_FALLBACK)
    m = json.loads((out / "manifest.json").read_text())
    assert {v.name for v in GPU_FALLBACK} <= {a["variant"] for a in m["artifacts"] if a["target"] == target}


def test_stale_manifest_entries_are_ignored(built, tmp_path):
    d = _copy(built, tmp_path)
    _edit_manifest(d, lambda a: a.update(variant="pagedkv_fwd_f16_d256x256_h4x2_pg16_nmask_lse_online_b1_q128"))
    s = turbine_fmha.Session("cpu", artifact_dir=d)
    assert all(v.formulation == "explicit" for v in s.available_variants())


def test_artifacts_of_another_kernel_abi_are_not_loaded(built, tmp_path, rng):
    d = _copy(built, tmp_path)
    _edit_manifest(d, lambda a: a.update(kernel_abi=-1))
    s = turbine_fmha.Session("cpu", artifact_dir=d)
    stale = json.loads((d / "manifest.json").read_text())["artifacts"][0]["variant"]
    assert Variant.parse(stale) not in s.available_variants()


def test_tuning_untiles_the_attention_head_dim():
    """turbine_fmha.tuning edits the workgroup tile of the output head dim
    (in V's and the output's maps, not in Q's) and nothing else."""
    from turbine_fmha.build.tuning import untile_head_dim

    maps = ", ".join(
        f"affine_map<(d0, d1, d2, d3, d4) -> ({r})>"
        for r in ("d0, d1, d3", "d0, d4, d3", "d0, d4, d2", "", "d0, d1, d4", "d0, d1, d2", "d0, d1", "d0, d1")
    )
    text = (
        f"%r = iree_linalg_ext.online_attention <indexing_maps = [{maps}], decomposition_config = "
        "{qk_attrs = {lowering_config = #iree_gpu.lowering_config<{thread = [0, 8]}>}}> "
        "{lowering_config = #iree_gpu.lowering_config<{partial_reduction = [0, 0, 0, 0, 16], workgroup = [1, 64, 32, 0, 0]}>} ins("
    )
    edited = untile_head_dim(text)
    assert edited == text.replace("workgroup = [1, 64, 32, 0, 0]", "workgroup = [1, 64, 0, 0, 0]")
    assert untile_head_dim(edited) is None  # already whole
    assert untile_head_dim("linalg.generic") is None
    # Without a mask operand (static shapes need none) the output map comes
    # one place earlier: it is still found.
    unmasked = text.replace("affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d4)>, ", "", 1)
    assert unmasked != text
    assert untile_head_dim(unmasked) == unmasked.replace(
        "workgroup = [1, 64, 32, 0, 0]", "workgroup = [1, 64, 0, 0, 0]"
    )


def test_tuning_edits_each_attention_executable_of_a_configured_module():
    """tune_configured applies the head-dim edit inside each executable of a
    module stopped at its configurations, leaving other executables and the
    host program alone; None when no executable changes."""
    from turbine_fmha.build.tuning import tune_configured

    maps = ", ".join(
        f"affine_map<(d0, d1, d2, d3, d4) -> ({r})>"
        for r in ("d0, d1, d3", "d0, d4, d3", "d0, d4, d2", "", "d0, d1, d4", "d0, d1, d2", "d0, d1", "d0, d1")
    )

    def attention(name):
        return (
            f"  hal.executable private @{name} {{\n    %r = iree_linalg_ext.online_attention <indexing_maps = [{maps}]> "
            "{lowering_config = #iree_gpu.lowering_config<{workgroup = [1, 64, 32, 0, 0]}>} ins(\n  }\n"
        )

    # A generic's configuration after the first attention executable: an
    # edit that crossed executables would untile it instead of the second's.
    other = "  hal.executable private @gen {\n    {lowering_config = #iree_gpu.lowering_config<{workgroup = [1, 64, 32, 0, 0]}>}\n  }\n"
    host = "  util.func public @main() {\n    stream.cmd.dispatch @att0::@x\n  }\n"
    module = "module {\n" + attention("att0") + other + attention("att1") + host + "}\n"
    tuned = tune_configured(module)
    whole = "workgroup = [1, 64, 0, 0, 0]"
    assert (
        tuned
        == "module {\n"
        + attention("att0").replace("workgroup = [1, 64, 32, 0, 0]", whole)
        + other
        + attention("att1").replace("workgroup = [1, 64, 32, 0, 0]", whole)
        + host
        + "}\n"
    )
    assert tune_configured(tuned) is None
    assert tune_configured("module {\n" + other + host + "}\n") is None


@pytest.mark.gpu_compile
def test_cuda_compile_falls_back_to_iree_configuration(tmp_path, monkeypatch):
    """A CUDA kernel compiles in two halves (compiler._compile_tuned): the
    vmfb's source locations name the variant's own .mlir, never the
    intermediate files, and where the edited configuration does not
    compile the kernel is built with IREE's own and says so."""
    from turbine_fmha.build import compiler, targets, tuning
    from turbine_fmha.kernels.custom_ops import render_variant

    v = online_variant(Variant("f16", 64, 64, 4, 2, 16).problem, 8, 1)
    mlir, cuda = render_variant(v), targets.TARGETS["cuda"]
    _, report, _ = compiler.compile_one(mlir, v.name, tmp_path / "tuned.vmfb", cuda)
    assert report["attention_config"].startswith("tuned")
    blob = (tmp_path / "tuned.vmfb").read_bytes()
    assert f"{v.name}.mlir".encode() in blob
    assert b"configured/" not in blob and b"tuned/" not in blob

    monkeypatch.setattr(tuning, "tune_configured", lambda text: text.replace("workgroup = [", "workgroup = [oops, "))
    _, report, _ = compiler.compile_one(mlir, v.name, tmp_path / "default.vmfb", cuda)
    assert report["attention_config"] == "IREE default (tuned configuration failed to compile)"
    assert (tmp_path / "default.vmfb").stat().st_size > 0


def test_append_kernel_names_roundtrip():
    from turbine_fmha.kernels.variants import parse_kernel

    for a in default_append_kernels(gpu=True) + default_append_kernels(gpu=False):
        assert parse_kernel(a.name) == a == AppendKernel.parse(a.name)
    with pytest.raises(ValueError):
        AppendKernel("f8e4m3fn", 8, 128, 128, 16)


def test_decode_keeps_its_mask_when_only_that_variant_is_built(tmp_path, rng):
    """One-row bottom-right decode may run a mask-free kernel, but only one
    the session has: with just the causal sink variant built, the call
    must use it (examples/demo.py once failed this way)."""
    v = Variant("f16", 64, 64, 4, 2, 16, "bottom_right", sinks=True)
    tfb.build(tmp_path, ["host"], [v])
    s = turbine_fmha.Session("cpu", artifact_dir=tmp_path)
    prob = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[40, 7], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    run_and_check(
        s,
        prob,
        dtype="f16",
        mask_type="bottom_right",
        window_size_right=0,
        sinks=rng.uniform(-1, 1, 4).astype(np.float32),
    )
    assert s.last_variant == v
