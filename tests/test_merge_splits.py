"""Split-KV partials merged inside the module (Variant.merge_splits), against
the float64 reference on fresh random inputs.

The merged variant computes each split's partial in f32 and merges them in
the kernel before the epilogue, so the output is rounded to the input dtype
once: conftest's tolerances (which allow two roundings) apply.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CACHE, make_problem
from test_modes import _check

import turbine_fmha
from turbine_fmha.build import aot as tfb
from turbine_fmha.calls.plan import merged_decode_splits
from turbine_fmha.kernels.variants import Variant, online_variant
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def _session(**kw):
    return turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", formulation="online", **kw
    )


@pytest.fixture
def one_cuda_gpu(monkeypatch):
    """Selection tests below make a cuda session on this GPU-less machine:
    IREE's cuda driver, as Session() checks it (the device list it keeps
    per driver), lists one GPU. Nothing opens it: selection reads only the
    manifest."""
    import turbine_fmha.runtime.session as session_mod

    monkeypatch.setitem(session_mod._DRIVER_DEVICES, "cuda", [{"device_id": 1, "path": "", "name": "stand-in"}])


def _problem(rng, dtype, seqlens_k):
    return make_problem(
        rng, dtype=dtype, batch=len(seqlens_k), seqlen_q=1, seqlens_k=seqlens_k, nhead_q=8, nhead_k=2, hdim=64, page=16
    )


CASES = {
    # An empty sequence, and one whose keys all fall in the first split (the
    # other splits of it see nothing and must weigh nothing).
    "plain": dict(dtype="f16", lens=[1500, 0, 37], kw={}),
    # Sinks join the merged denominator once; a window masks whole splits.
    "sinks_window_softcap": dict(
        dtype="bf16",
        lens=[1100, 700, 300],
        kw=dict(mask_type="bottom_right", window_size_left=250, window_size_right=0, logits_soft_cap=20.0, sinks=True),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_splits_match_reference(rng, case):
    c = CASES[case]
    s = _session()
    q, k, v, bt, sk = _problem(rng, c["dtype"], c["lens"])
    kw = dict(c["kw"])
    if kw.pop("sinks", False):
        kw["sinks"] = rng.uniform(-1, 2, q.shape[2]).astype(np.float32)
    out = np.full(q.shape, np.nan, q.dtype)  # poisoned: every element must be written
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=4, out=out, return_lse=True, session=s, **kw)
    assert s.last_variant.merge_splits == 4
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    _check(out, lse, ref, ref_lse, c["dtype"])


def test_merged_splits_at_large_scores(rng):
    """Scores ~1e4-1e5: the splits' maxima differ by far more than f32's exp
    range, so every weight but the top split's is 0 or tiny. f32 inputs: the
    online kernels fold the scale into q in q's dtype, which in f16 alone
    moves an LSE of 1e5 by ~10 (docs/reliability.md)."""
    s = _session()
    q, k, v, bt, sk = _problem(rng, "f32", [1024, 900])
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, scale=3000.0, num_splits=4, return_lse=True, session=s)
    assert s.last_variant.merge_splits == 4
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, scale=3000.0)
    # At these scores the output is as exact as f32 scores let it be, row
    # by row: a score's f32 error is at most (D + 2) eps scale sum_d |q_d k_d|
    # (the dot product and the scale folded into q), and the output moves
    # by at most sum_j p_j |ds_j| |v_j - out|. Where one key dominates that
    # is ~0 (the output is its V exactly); where the top keys nearly tie, a
    # score error of ~1e-3 moves it by ~1e-3 (seeds have hit 7.5e-4 of
    # max |ref|), which conftest's f32 bound of 1e-5 did not allow.
    err = np.abs(out.astype(np.float64) - ref).max(axis=-1)  # [batch, 1, hq]
    assert (err <= _score_rounding_bound(q, k, v, bt, sk, 3000.0) + 1e-5 * np.abs(ref).max()).all()
    # An f32 LSE of 1e5 carries ~0.008 per ulp: the score's products (scale,
    # log2 e, then ln 2 back) and the log round a few ulps; 8 are allowed.
    assert (np.abs(lse - ref_lse) <= 8 * np.finfo(np.float32).eps * np.abs(ref_lse)).all()


def _score_rounding_bound(q, k, v, bt, sk, scale):
    """Per (sequence, query head) of a decode: sum_j p_j ds_j max_d |v_jd - out_d|,
    p and out in float64, ds_j the f32 error bound of key j's score."""
    eps = np.finfo(np.float32).eps
    b_n, _, hq, d = q.shape
    group = hq // k.shape[2]
    bound = np.zeros((b_n, 1, hq))
    for b in range(b_n):
        t = np.arange(int(sk[b]))
        kb = k[bt[b, t // k.shape[1]], t % k.shape[1]].astype(np.float64)  # [keys, hk, d]
        vb = v[bt[b, t // v.shape[1]], t % v.shape[1]].astype(np.float64)
        for h in range(hq):
            qk = q[b, 0, h].astype(np.float64) * kb[:, h // group]  # [keys, d]
            s = scale * qk.sum(-1)
            p = np.exp(s - s.max())
            p /= p.sum()
            out = p @ vb[:, h // group]
            ds = (d + 2) * eps * scale * np.abs(qk).sum(-1)
            bound[b, 0, h] = (p * ds * np.abs(vb[:, h // group] - out).max(-1)).sum()
    return bound


def test_merged_split_with_a_nan_key(rng):
    """A NaN key the row sees, in its last split: the row is NaN as in the
    reference, the other sequence's rows are untouched."""
    s = _session()
    q, k, v, bt, sk = _problem(rng, "f16", [1500, 1200])
    k[bt[0, 90], 3, 1, 5] = np.nan  # key 1443 of sequence 0, KV head 1: split 3 of 4
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=4, return_lse=True, session=s)
    assert s.last_variant.merge_splits == 4
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk)
    assert np.isnan(ref[0, :, 4:]).all() and np.isnan(out[0, :, 4:]).all()
    assert np.isnan(lse[0, 4:]).all()
    _check(out[1:], lse[1:], ref[1:], ref_lse[1:], "f16")
    _check(out[0, :, :4], lse[0, :4], ref[0, :, :4], ref_lse[0, :4], "f16")


def test_auto_split_merges_in_the_module_and_host_merge_remains(rng):
    s = _session(compute_units=8)
    q, k, v, bt, sk = _problem(rng, "f16", [2100, 1600])
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk)
    # 2 sequences x 2 KV heads = 4 items; 8 per unit on 8 units wants 16
    # splits, 2100 keys allow 8 of 256 (plan.MIN_KEYS_PER_MERGED_SPLIT).
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=s)
    assert s.last_variant.merge_splits == 8
    _check(out, lse, ref, ref_lse, "f16")
    # A split count no variant merges: partials merged on the host.
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=3, return_lse=True, session=s)
    assert s.last_variant.merge_splits == 0 and s.last_variant.batch_tile >= 6
    _check(out, lse, ref, ref_lse, "f16")


def test_unsplit_call_never_runs_a_merging_variant(rng, tmp_path_factory):
    """A merging variant shares its problem key with the plain one and has
    the same tile: an unsplit call must not pick it (its q is per sequence,
    its entries per split)."""
    out_dir = CACHE / "merge-select"
    p = Variant("f16", 64, 64, 8, 2, 16, "none").problem
    plain, merged = online_variant(p, 8, 1), online_variant(p, 8, 1, merge_splits=4)
    tfb.build(out_dir, ["host"], [merged, plain])
    s = turbine_fmha.Session("cpu", artifact_dir=out_dir, formulation="online", compute_units=1000)
    assert s.merge_splits_for(p) == (4,)
    q, k, v, bt, sk = _problem(rng, "f16", [700, 300])
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, return_lse=True, session=s)
    assert s.last_variant == plain
    _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk), "f16")
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=4, return_lse=True, session=s)
    assert s.last_variant == merged
    _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk), "f16")


def test_merged_decode_splits():
    merges = (2, 4, 8, 16, 32, 64, 128)
    # H200 (132 units), 8 KV heads, b32 x 4096 keys: 256 items, 8 per unit
    # wants 4 splits.
    assert merged_decode_splits(32 * 8, 132, 4096, merges) == 4
    assert merged_decode_splits(1 * 8, 132, 32768, merges) == 128  # MAX_MERGED_SPLITS
    assert merged_decode_splits(1 * 8, 132, 32768, merges[:-1]) == 64  # the most available
    assert merged_decode_splits(1 * 8, 132, 4096, merges) == 16  # 256 keys per split
    assert merged_decode_splits(4 * 8, 132, 32768, merges) == 32
    assert merged_decode_splits(64 * 8, 132, 4096, merges) == 2
    assert merged_decode_splits(128 * 8, 132, 4096, merges) == 1  # 8 items per unit already
    assert merged_decode_splits(32 * 8, 132, 4096, (8, 16)) == 1  # none available within the target
    assert merged_decode_splits(8, 132, 500, merges) == 1
    assert merged_decode_splits(0, 132, 4096, merges) == 1


def test_merge_splits_field():
    p = Variant("f16", 128, 128, 32, 8, 16, "none").problem
    v = online_variant(p, 128, 1, merge_splits=4)
    assert v.name.endswith("_m16_x4") and Variant.parse(v.name) == v
    for bad in (
        dict(formulation="explicit", merge_splits=2),
        dict(formulation="online", batch_tile=8, seqlen_q_tile=1, merge_splits=3),
        dict(formulation="online", batch_tile=8, seqlen_q_tile=1, merge_splits=1),
    ):
        with pytest.raises(ValueError, match="merge_splits"):
            Variant(**p, **bad)


def test_decode_selection_prefers_one_launch(tmp_path, one_cuda_gpu):
    """A decode takes one launch of a larger tile over several of a smaller
    one (each launch more is host time per call); a prefill still takes the
    least padding."""
    import json

    from turbine_fmha.kernels.signature import KERNEL_ABI

    p = Variant("f16", 128, 128, 32, 8, 16, "none").problem
    kernels = [online_variant(p, t, 1) for t in (8, 64)] + [online_variant(p, 1, q) for q in (128, 4096)]
    kernels += [online_variant(p, t, 1, merge_splits=8) for t in (32, 128)]
    entries = [
        dict(
            variant=k.name,
            target="cuda",
            path=f"cuda/{k.name}.vmfb",
            sha256="0" * 64,
            compiler_version="3.13.0",
            kernel_abi=KERNEL_ABI,
        )
        for k in kernels
    ]
    (tmp_path / "manifest.json").write_text(json.dumps(dict(manifest_version=1, artifacts=entries)))
    s = turbine_fmha.Session("cuda", artifact_dir=tmp_path)
    assert s.select(p, 1, 40).batch_tile == 64  # not 5 launches of 8
    assert s.select(p, 1, 8).batch_tile == 8
    assert s.select(p, 1, 64, merge=8).batch_tile == 128  # not 2 launches of 32
    assert s.select(p, 1, 32, merge=8).batch_tile == 32
    assert s.select(p, 200, 1).seqlen_q_tile == 128  # prefill: 2 x 128 rows, not 4096


def test_causal_prefill_skips_masked_blocks_in_1024_row_chunks(tmp_path, one_cuda_gpu):
    """A long prefill whose mask has a right edge runs in 1024-row chunks,
    each cut at its diagonal (3.60 against 4.12 ms for one 4096-row call on
    the H200); without a right edge one launch covers it; a short one keeps
    the least padding."""
    import json

    from turbine_fmha.kernels.signature import KERNEL_ABI
    from turbine_fmha.runtime.selection import prefill_tile_cost

    p = Variant("f16", 128, 128, 32, 8, 16, "bottom_right").problem
    kernels = [online_variant(p, 1, q) for q in (128, 1024, 4096)]
    entries = [
        dict(
            variant=k.name,
            target="cuda",
            path=f"cuda/{k.name}.vmfb",
            sha256="0" * 64,
            compiler_version="3.13.0",
            kernel_abi=KERNEL_ABI,
        )
        for k in kernels
    ]
    (tmp_path / "manifest.json").write_text(json.dumps(dict(manifest_version=1, artifacts=entries)))
    s = turbine_fmha.Session("cuda", artifact_dir=tmp_path)
    assert s.select(p, 4096, 1, skips_masked=True).seqlen_q_tile == 1024
    assert s.select(p, 4096, 1).seqlen_q_tile == 4096  # every block computed: one launch
    assert s.select(p, 150, 1, skips_masked=True).seqlen_q_tile == 128  # least padding first
    # The model: 4096 rows in four chunks compute 10/16 of the elements.
    assert (
        prefill_tile_cost(4096, 1024) - prefill_tile_cost(4096, 4096)
        == 1024 * (1024 + 2048 + 3072 + 4096) - 4096 * 4096 + 3 * 1_400_000
    )


# Variant.merge_any: one kernel per tile merges any split count dividing it,
# read from q's batch, with each launch's entries split-major.
ANY_CASES = [
    # (batch, splits, tile, lens): tile 32 filled or padded; tile 128 in
    # one launch, then two (each launch's entries reordered on their own).
    (3, 4, 32, [1500, 0, 37]),
    (1, 32, 32, [2000]),
    (5, 16, 128, [900, 1700, 3, 260, 1200]),
    (20, 8, 128, None),
]


@pytest.fixture(scope="module")
def any_count_dir():
    out = CACHE / "merge-any"
    p = Variant("f16", 64, 64, 8, 2, 16, "none").problem
    anyg = Variant("f16", 64, 64, 0, 0, 16, "none").problem  # run-time heads, any group (dynamic padding)
    kernels = [online_variant(p, t, 1, merge_any=True) for t in (32, 128)]
    kernels += [online_variant(anyg, 32, 1, merge_any=True), online_variant(p, 8, 1)]
    kernels.append(online_variant(dict(anyg, dtype="bf16", kv_layout="HND"), 32, 1, merge_any=True))
    # Score terms under a run-time count: sinks, soft-cap and a window (the
    # group padded), and ALiBi (the per-head loop, no padding).
    terms = Variant("bf16", 64, 64, 8, 2, 16, "bottom_right", softcap=True, sinks=True).problem
    alibi = Variant("f16", 64, 64, 8, 2, 16, "none", bias="alibi").problem
    kernels += [online_variant(terms, 32, 1, merge_any=True), online_variant(alibi, 32, 1, merge_any=True)]
    tfb.build(out, ["host"], kernels)
    return out


@pytest.mark.parametrize("batch, splits, tile, lens", ANY_CASES)
def test_any_count_merge_matches_reference(rng, any_count_dir, batch, splits, tile, lens):
    s = turbine_fmha.Session("cpu", artifact_dir=any_count_dir, formulation="online")
    lens = lens or [int(x) for x in rng.integers(0, 1200, batch)]
    q, k, v, bt, sk = _problem(rng, "f16", lens)
    out = np.full(q.shape, np.nan, q.dtype)  # poisoned: every element must be written
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=splits, out=out, return_lse=True, session=s)
    used = s.last_variant
    assert used.merge_any and used.batch_tile == tile and used.nhead_q == 8
    _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk), "f16")


@pytest.mark.parametrize("dtype, kv_layout", [("f16", "NHD"), ("bf16", "HND")])
def test_any_count_merge_any_group(rng, any_count_dir, dtype, kv_layout):
    """The run-time-heads kernel (group padded at run time) under a count
    read at run time: 6/2 heads (group 3) in 4 splits, 2 sequences; also
    over head-major pages."""
    s = turbine_fmha.Session("cpu", artifact_dir=any_count_dir, formulation="online")
    q, k, v, bt, sk = make_problem(
        rng, dtype=dtype, batch=2, seqlen_q=1, seqlens_k=[700, 90], nhead_q=6, nhead_k=2, hdim=64, page=16
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk)
    if kv_layout == "HND":
        k, v = (np.ascontiguousarray(c.transpose(0, 2, 1, 3)) for c in (k, v))
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k, v, bt, sk, num_splits=4, return_lse=True, session=s, kv_layout=kv_layout
    )
    used = s.last_variant
    assert used.merge_any and used.runtime_heads and used.kv_layout == kv_layout
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("feature", ["sinks_window_softcap", "alibi"])
def test_any_count_merge_with_score_terms(rng, any_count_dir, feature):
    """Sinks join the merged denominator once, a window masks whole splits,
    and per-sequence ALiBi slopes follow each entry into its split-major
    slot."""
    s = turbine_fmha.Session("cpu", artifact_dir=any_count_dir, formulation="online")
    if feature == "alibi":
        q, k, v, bt, sk = _problem(rng, "f16", [900, 260])
        kw = dict(alibi_slopes=rng.uniform(0.01, 0.3, (2, 8)).astype(np.float32))
        splits, dtype = 8, "f16"
    else:
        q, k, v, bt, sk = _problem(rng, "bf16", [1100, 700, 300])
        kw = dict(mask_type="bottom_right", window_size_left=250, window_size_right=0, logits_soft_cap=20.0)
        kw["sinks"] = rng.uniform(-1, 2, q.shape[2]).astype(np.float32)
        splits, dtype = 4, "bf16"
    out = np.full(q.shape, np.nan, q.dtype)
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k, v, bt, sk, num_splits=splits, out=out, return_lse=True, session=s, **kw
    )
    used = s.last_variant
    assert used.merge_any and used.batch_tile == 32 and (used.bias == "alibi") == (feature == "alibi")
    _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk, **kw), dtype)


def test_any_count_steps_are_split_major():
    """kernel_steps lays each launch's entries out split-major for a
    merge_any variant (entry j * sequences + b), padding included, and keeps
    plan.split_kv's order for a merged variant of one count."""
    from turbine_fmha.calls.mask import MaskSpec
    from turbine_fmha.calls.plan import KernelCall, kernel_steps, split_kv

    batch, n = 3, 4
    c = KernelCall(
        rows=1,
        q_itemsize=2,
        nhead_q=8,
        block_table=np.arange(batch * 8, dtype=np.int32).reshape(batch, 8),
        page=16,
        seqlen_q=np.ones(batch, np.int32),
        seqlen_k=np.array([100, 50, 128], np.int32),
        kv_shift=np.zeros(batch, np.int32),
        scale=1.0,
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=MaskSpec(),
        alibi_slopes=None,
        bias=None,
        sinks=None,
    )
    split = split_kv(c, n, merged=True)
    p = Variant("f16", 64, 64, 8, 2, 16, "none").problem
    (fixed,) = kernel_steps(online_variant(p, 32, 1, merge_splits=n), split)
    (anyn,) = kernel_steps(online_variant(p, 32, 1, merge_any=True), split)
    names = ("block_table", "seqlen_q", "seqlen_k", "kv_shift")
    for a, b in zip(fixed.args[: len(names)], anyn.args[: len(names)]):
        # fixed: entry b * n + j of 8 sequences' slots; any: entry j * 8 + b.
        assert np.array_equal(b, a.reshape(8, n, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape))
    assert anyn.merge == fixed.merge == n and anyn.place is not None
    with pytest.raises(ValueError, match="cannot merge"):
        kernel_steps(online_variant(p, 32, 1, merge_any=True), split_kv(c, 3, merged=True))


def test_merge_any_field_and_selection(tmp_path, one_cuda_gpu):
    import json

    from turbine_fmha.kernels.signature import KERNEL_ABI

    p = Variant("f16", 128, 128, 32, 8, 16, "none").problem
    v = online_variant(p, 128, 1, merge_any=True)
    assert v.name.endswith("_m16_xn") and Variant.parse(v.name) == v
    assert v.merges(2) and v.merges(128) and not v.merges(3) and not v.merges(0)
    assert not online_variant(p, 128, 1).merges(4) and online_variant(p, 128, 1).merges(0)
    for bad in (
        dict(formulation="explicit", merge_any=True),
        dict(formulation="online", batch_tile=8, seqlen_q_tile=1, merge_any=True, merge_splits=4),
        dict(formulation="online", batch_tile=1, seqlen_q_tile=1, merge_any=True),
    ):
        with pytest.raises(ValueError, match="merge_any"):
            Variant(**p, **bad)
    kernels = [online_variant(p, 8, 1)] + [online_variant(p, t, 1, merge_any=True) for t in (32, 128)]
    kernels.append(online_variant(p, 128, 1, merge_splits=128))
    entries = [
        dict(variant=k.name, target="cuda", path=f"cuda/{k.name}.vmfb", sha256="0" * 64, compiler_version="3.13.0")
        for k in kernels
    ]
    for e in entries:
        e["kernel_abi"] = KERNEL_ABI
    (tmp_path / "manifest.json").write_text(json.dumps(dict(manifest_version=1, artifacts=entries)))
    s = turbine_fmha.Session("cuda", artifact_dir=tmp_path)
    assert s.merge_splits_for(p) == (2, 4, 8, 16, 32, 64, 128)
    assert s.select(p, 1, 16, merge=2).batch_tile == 32  # 16 entries: the smallest tile that holds them
    assert s.select(p, 1, 128, merge=64).batch_tile == 128  # 64 does not divide 32
    assert not s.select(p, 1, 8).merging  # an unsplit decode never runs a merging kernel
    # A kernel of the call's own count before the run-time count at equal cost.
    assert s.select(p, 1, 128, merge=128).merge_splits == 128
    assert s.select(p, 1, 128, merge=32).merge_any
