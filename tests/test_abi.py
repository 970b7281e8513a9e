"""The artifacts' ABI (kernels/abi.py): every declared name documented,
each manifest entry's description equal to its kernel's and to the
function's own reflection, and artifacts called through `iree-run-module`
with nothing but the manifest: a host of another language, told only
what the ABI says (argument order, shapes, dtypes, what the packed
scalars and the static tiles mean), gets the float64 reference's
results."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CACHE
from tolerances import LSE_TOL, OUT_TOL

from turbine_fmha.build import aot
from turbine_fmha.kernels import abi
from turbine_fmha.kernels.signature import APPEND, APPEND_ROTARY, FWD, tiles_declaration
from turbine_fmha.kernels.tiles_kernel import TILES_CLASSES
from turbine_fmha.kernels.variants import parse_kernel
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

DECODE = "pagedkv_fwd_f16_d64x64_g2_pg16_nmask_lse_explicit"
PREFILL = "pagedkv_fwd_f16_d64x64_g2_pg16_mbr_lse_explicit"
STATIC = "pagedkv_fwd_f16_d32x32_h4x2_pg16_nmask_lse_online_b8_q1_nvguard_m16"
# Any page size: the host picks one (PG "?" in the ABI).
ANY_PAGE = "pagedkv_fwd_f16_d64x64_g2_pg0_mbr_lse_explicit"
OTHERS = [
    "pagedkv_fwd_f16_d64x64_g2_pg16_nmask_biasb1_lse_explicit",
    "pagedkv_append_bf16_h1_d16x8_pg4_ropei",
    "pagedkv_append_bf16_h1_d16x8_pg4",
]
DTYPES = {"f16": np.float16, "bf16": None, "f32": np.float32, "i32": np.int32, "i8": np.int8}


def test_every_declared_name_has_a_meaning():
    tiles = [tiles_declaration(c) for c in TILES_CLASSES]
    for decl in (FWD, APPEND, APPEND_ROTARY, *tiles):
        meanings = abi.MEANINGS[abi.family(decl)]
        for t in decl.args + decl.results:
            assert t.name in meanings, (decl.name, t.name)
            for layout in [d for _, d in t.layouts] or [t.dims]:
                for d in layout:
                    assert isinstance(d, int) or d in abi.SYMBOLS, (t.name, d)
    assert [n for n, _ in abi.FPARAMS] == ["scale_s", "logits_soft_cap", "scale_o", "scale_p"]


def test_every_kind_of_kernel_is_described():
    """`turbine-fmha inspect --abi` of a tile kernel, whose fparams is not
    the attention's and which has no mask attribute."""
    for name in (STATIC, "pagedkv_append_f16_h8_d128x128_pg16", "prefill_tiles_f16_h32x8_d128_pg16_t128_c3"):
        described = abi.describe(parse_kernel(name))
        assert described["function"] == name
        assert all(t["meaning"] for t in described["args"] + described["results"])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The kernels, built for the host into a directory of their own (a
    copy of the suite's cache entries, so nothing compiles twice)."""
    d = tmp_path_factory.mktemp("abi")
    kernels = [parse_kernel(n) for n in (DECODE, PREFILL, STATIC, ANY_PAGE, *OTHERS)]
    aot.build(CACHE, ["host"], kernels)
    cache = json.loads((CACHE / "manifest.json").read_text())
    keep = [a for a in cache["artifacts"] if a["target"] == "host" and a["variant"] in {k.name for k in kernels}]
    for a in keep:
        (d / a["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CACHE / a["path"], d / a["path"])
    (d / "manifest.json").write_text(json.dumps(dict(cache, artifacts=keep)))
    return d


def test_entries_carry_their_kernels_abi(built):
    m = json.loads((built / "manifest.json").read_text())
    assert m["abi"] == abi.abi_docs()
    for a in m["artifacts"]:
        assert a["abi"] == abi.abi(parse_kernel(a["variant"]))


def _declared(decl: str) -> tuple[list, list]:
    """The argument and result types of IREE's reflection of a function."""
    ins, outs = re.fullmatch(r"async func @\w+\((.*)\) -> \((.*)\)", decl).groups()
    parse = lambda part: [
        (m.group(1).split("x")[:-1], m.group(1).split("x")[-1]) for m in re.finditer(r"tensor<([^>]*)>", part)
    ]
    return parse(ins), parse(outs)


def test_abi_matches_the_functions_reflection(built):
    import iree.runtime as rt

    m = json.loads((built / "manifest.json").read_text())
    instance = rt.VmInstance()
    for a in m["artifacts"]:
        module = rt.VmModule.mmap(instance, str(built / a["path"]))
        fn = module.lookup_function(a["abi"]["function"])
        assert fn is not None and fn.reflection["iree.abi.model"] == "coarse-fences"
        ins, outs = _declared(fn.reflection["iree.abi.declaration"])
        for declared, described in ((ins, a["abi"]["args"]), (outs, a["abi"]["results"])):
            assert [(dims, dt) for dims, dt in declared] == [
                ([str(s) for s in t["shape"]], t["dtype"]) for t in described
            ], a["variant"]


def _run_module(directory: Path, name: str, inputs: dict, tmp: Path) -> list[np.ndarray]:
    """Calls artifact `name` with iree-run-module, reading nothing but the
    manifest: the argument order, static sizes and dtypes come from its
    ABI."""
    r, n = _invoke(directory, name, inputs, tmp)
    assert r.returncode == 0, r.stderr
    return [np.load(tmp / f"out{i}.npy") for i in range(n)]


def _invoke(directory: Path, name: str, inputs: dict, tmp: Path, check_shapes: bool = True):
    """iree-run-module's completed process for that call, and the result count."""
    m = json.loads((directory / "manifest.json").read_text())
    (entry,) = [a for a in m["artifacts"] if a["variant"] == name]
    cmd = [
        str(Path(sys.executable).with_name("iree-run-module")),
        f"--module={directory / entry['path']}",
        "--device=local-task",
        f"--function={entry['abi']['function']}",
    ]
    for i, arg in enumerate(entry["abi"]["args"]):
        a = inputs[arg["name"]]
        assert a.dtype == DTYPES[arg["dtype"]]
        assert not check_shapes or all(s == "?" or s == n for s, n in zip(arg["shape"], a.shape))
        np.save(tmp / f"in{i}.npy", np.ascontiguousarray(a))
        cmd.append(f"--input=@{tmp / f'in{i}.npy'}")
    cmd += [f"--output=@{tmp / f'out{i}.npy'}" for i in range(len(entry["abi"]["results"]))]
    # A subprocess: a call that reads out of bounds must fail this test, not end the suite.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300), len(entry["abi"]["results"])


def _scalars(docs: dict, d: int, causal: bool) -> dict:
    """fparams and iparams by the names the manifest gives them."""
    unbounded = docs["unbounded"]
    f = {"scale_s": 1 / math.sqrt(d), "logits_soft_cap": 0.0, "scale_o": 1.0, "scale_p": 1.0}
    i = {"q_start": 0, "window_left": unbounded, "window_right": 0 if causal else unbounded, "sink_size": 0}
    return dict(
        fparams=np.array([f[p["name"]] for p in docs["fparams"]], np.float32),
        iparams=np.array([i[p["name"]] for p in docs["iparams"]], np.int32),
    )


@pytest.mark.parametrize(
    "name, rows, causal", [(DECODE, 1, False), (PREFILL, 40, True), (STATIC, 1, False), (ANY_PAGE, 40, True)]
)
def test_a_call_through_iree_run_module_from_the_manifest_alone(built, rng, tmp_path, name, rows, causal):
    m = json.loads((built / "manifest.json").read_text())
    (entry,) = [a for a in m["artifacts"] if a["variant"] == name]
    sizes = entry["abi"]["sizes"]
    hq, hk = (sizes["HQ"], sizes["HK"]) if sizes["HQ"] != "?" else (4, 2)
    d, dv = sizes["D"], sizes["DV"]
    page = sizes["PG"] if sizes["PG"] != "?" else 12
    seqs, seqlen_k = 3, np.array([37, 5, 64 if causal else 20], np.int32)
    seqlen_k = np.maximum(seqlen_k, rows) if causal else seqlen_k
    batch = sizes["B"] if sizes["B"] != "?" else seqs  # static tiles: pad the batch (ABI "pad_to_tiles")
    width, pages = 6, 24
    k = rng.standard_normal((pages, page, hk, d)).astype(np.float16)
    v = rng.standard_normal((pages, page, hk, dv)).astype(np.float16)
    table = np.zeros((batch, width), np.int32)  # padding entries read page 0, with no keys
    used = -(-seqlen_k // page)
    perm = rng.permutation(pages)
    for b in range(seqs):
        table[b, : used[b]] = perm[b * width : b * width + used[b]]
        table[b, used[b] :] = table[b, 0]  # unused slots: a page the sequence owns (finite_stale_rows)
    q = rng.standard_normal((batch, rows, hq, d)).astype(np.float16)
    pad = lambda a: np.concatenate([a, np.zeros(batch - seqs, np.int32)])
    inputs = dict(
        q=q,
        k_cache=k,
        v_cache=v,
        block_table=table,
        seqlen_q=pad(np.full(seqs, rows, np.int32)),
        seqlen_k=pad(seqlen_k),
        kv_shift=np.zeros(batch, np.int32),
        **_scalars(m["abi"], d, causal),
    )
    out, lse, *_ = _run_module(built, name, inputs, tmp_path)
    mask = dict(mask_type="bottom_right", window_size_right=0) if causal else {}
    ref, ref_lse = fmha_fwd_paged_ref(q[:seqs], k, v, table[:seqs], seqlen_k, **mask)
    err = np.abs(out[:seqs].astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL["f16"], err
    np.testing.assert_allclose(lse[:seqs], ref_lse, atol=LSE_TOL["f16"])


def _decode_inputs(m: dict, rng) -> dict:
    """A consistent call of DECODE (4/2 heads, d 64, page 16): 3 sequences."""
    k = rng.standard_normal((8, 16, 2, 64)).astype(np.float16)
    return dict(
        q=rng.standard_normal((3, 1, 4, 64)).astype(np.float16),
        k_cache=k,
        v_cache=k.copy(),
        block_table=rng.integers(0, 8, (3, 2)).astype(np.int32),
        seqlen_q=np.ones(3, np.int32),
        seqlen_k=np.full(3, 20, np.int32),
        kv_shift=np.zeros(3, np.int32),
        **_scalars(m["abi"], 64, False),
    )


@pytest.mark.parametrize(
    "arg, change, words",
    [
        ("v_cache", lambda a: a[:1], "v_cache dim 0 differs from k_cache dim 0 (NP)"),
        ("v_cache", lambda a: np.concatenate([a] * 100), "v_cache dim 0 differs from k_cache dim 0 (NP)"),
        ("q", lambda a: np.repeat(a, 300, 0), "block_table dim 0 differs from q dim 0 (B)"),
        ("seqlen_k", lambda a: a[:1], "seqlen_k dim 0 differs from q dim 0 (B)"),
        ("kv_shift", lambda a: a[:2], "kv_shift dim 0 differs from q dim 0 (B)"),
        ("k_cache", lambda a: a[:0], "differs from k_cache dim 0"),
        ("q", lambda a: a[:, :, :3], "q's heads must be 2 per head of k_cache"),
    ],
)
def test_an_artifact_refuses_sizes_that_disagree(built, rng, tmp_path, arg, change, words):
    """Sizes one symbol declares, passed unequal to an artifact (here
    through iree-run-module, from the manifest alone), fail the call with
    the kernel's message naming them, before any dispatch reads them: a
    v_cache of fewer pages than k_cache read past its end, and a batch past
    the table's rows read past the table."""
    m = json.loads((built / "manifest.json").read_text())
    inputs = _decode_inputs(m, rng)
    inputs[arg] = change(inputs[arg])
    r, _ = _invoke(built, DECODE, inputs, tmp_path, check_shapes=False)
    assert r.returncode != 0 and words in r.stderr, (r.returncode, r.stderr[-2000:])
    assert r.returncode > 0  # a failed call, not a signal


def test_inspect_abi_prints_it(built, capsys):
    from turbine_fmha.cli.main import main

    assert main(["inspect", "--abi", STATIC, "--artifacts", str(built), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described == abi.describe(parse_kernel(STATIC))
    assert "every V row the kernel reads is finite" in " ".join(described["preconditions"])
    assert main(["inspect", "--abi", STATIC, "--artifacts", str(built)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{STATIC}(\n  q ") and "iparams[0] q_start" in text
