"""Split-KV decode and masked-block skipping (issue 5), against the float64
reference on fresh random inputs.

Split-KV runs each sequence's keys as several runs of pages and merges the
partial outputs by their LSEs; the partial outputs are rounded to the input
dtype once before the f32 merge, one more rounding of the same size as the
output's own, so conftest's tolerances (which allow two) still apply.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem
from test_modes import _check, _gappy_table, _pool

import turbine_fmha
from turbine_fmha.calls.mask import MaskSpec
from turbine_fmha.calls.plan import MASKED_CHUNK_ROWS, KernelCall, decode_splits, kernel_steps, num_splits_heuristic
from turbine_fmha.kernels.variants import MERGE_SPLITS, MMA_ROWS, Variant, online_variant
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def _gappy_problem(rng, dtype, sq, lens, *, max_offset, page=16):
    """Gappy paged problem (8/2 heads, hdim 64): garbage table slots, NaN in
    the spare pages. Returns q, k, v, table, offsets."""
    offsets = [int(rng.integers(0, max_offset)) for _ in lens]
    table, num_pages, spare = _gappy_table(rng, lens, offsets, page)
    k, v = _pool(rng, dtype, num_pages, page, 2, 64, 64)
    k[spare] = np.nan
    v[spare] = np.nan
    q = rng.standard_normal((len(lens), sq, 8, 64)).astype(k.dtype)
    return q, k, v, table, offsets


@pytest.fixture
def sessions(explicit_session, online_session):
    return {"explicit": explicit_session, "online": online_session}


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_decode(sessions, rng, formulation, num_splits):
    lens = [int(rng.integers(0, 200)) for _ in range(5)] + [150]
    prob = make_problem(
        rng, dtype="f16", batch=len(lens), seqlen_q=1, seqlens_k=lens, nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    q, k, v, bt, sk = prob
    kw = dict(mask_type="bottom_right", window_size_right=0, sinks=rng.uniform(-1, 2, 8).astype(np.float32))
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k, v, bt, sk, num_splits=num_splits, return_lse=True, session=sessions[formulation], **kw
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    _check(out, lse, ref, ref_lse, "f16")
    # The partial calls run without sinks (the host merge adds them once),
    # unless the variant merges the splits itself (online, a split count of
    # MERGE_SPLITS): then they are its.
    used = sessions[formulation].last_variant
    assert used.merge_splits == (num_splits if formulation == "online" and num_splits in MERGE_SPLITS else 0)
    assert used.sinks == bool(used.merge_splits)


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("feature", ["alibi", "bias", "window+sink tokens"])
def test_split_kv_features_gappy(sessions, rng, formulation, feature):
    """Split-KV keeps absolute key positions: masks, ALiBi, bias and gappy
    offsets must come out as without splits."""
    b, sq = 3, int(rng.integers(1, 12))
    lens = [int(rng.integers(sq, 120)) for _ in range(b)]
    q, k, v, table, offsets = _gappy_problem(rng, "f32", sq, lens, max_offset=40)
    kw = dict(mask_type="bottom_right", window_size_right=0)
    if feature == "alibi":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (b, 8)).astype(np.float32)
    elif feature == "bias":
        kw["bias"] = rng.standard_normal((1, 8, sq, max(lens))).astype(np.float32)
    else:
        kw.update(window_size_left=int(rng.integers(5, 40)), sink_size=int(rng.integers(1, 6)))
    sk = np.array(lens, np.int32)
    out, lse = turbine_fmha.fmha_fwd_paged(
        q,
        k,
        v,
        table,
        sk,
        kv_offset=np.array(offsets, np.int32),
        num_splits=int(rng.integers(2, 6)),
        return_lse=True,
        session=sessions[formulation],
        **kw,
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, table, sk, kv_offset=offsets, **kw)
    _check(out, lse, ref, ref_lse, "f32")


def test_gappy_kv_with_bias(explicit_session, rng):
    """The kernels index a bias by gathered row; gappy offsets shift those
    per sequence, and the runtime must re-lay the bias out to match."""
    page = 16
    lens, offsets = [40, 20, 33], [5, 19, 0]
    table, num_pages, _ = _gappy_table(rng, lens, offsets, page)
    k, v = _pool(rng, "f32", num_pages, page, 2, 64, 64)
    q = rng.standard_normal((3, 4, 4, 64)).astype(np.float32)
    bias = 3 * rng.standard_normal((1, 4, 4, 40)).astype(np.float32)
    sk = np.array(lens, np.int32)
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k, v, table, sk, kv_offset=np.array(offsets, np.int32), bias=bias, return_lse=True, session=explicit_session
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, table, sk, kv_offset=offsets, bias=bias)
    _check(out, lse, ref, ref_lse, "f32")


def test_auto_split_kv(rng, tmp_path):
    """num_splits=None splits when batch x heads cannot fill the device's
    compute units (here declared as 64) and the sequences are long."""
    from conftest import CACHE

    s = turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", compute_units=64
    )
    q, k, v, bt, sk = make_problem(
        rng, dtype="f32", batch=1, seqlen_q=1, seqlens_k=[1500], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    sinks = rng.uniform(-1, 1, 4).astype(np.float32)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, sinks=sinks, return_lse=True, session=s)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=sinks)
    _check(out, lse, ref, ref_lse, "f32")
    assert not s.last_variant.sinks  # the split path ran (it adds sinks at the merge)
    assert num_splits_heuristic(4, 64, 1500) > 1
    assert num_splits_heuristic(4 * 32, 64, 100_000) == 1  # enough work already
    assert num_splits_heuristic(4, 64, 600) == 1  # too few keys to split
    with pytest.raises(ValueError, match="num_splits"):
        turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, num_splits=0, session=s)


@pytest.mark.parametrize("formulation", ["explicit", "online"])
def test_causal_prefill_with_block_skipping(sessions, rng, formulation):
    """Long causal prefill over a longer cache (chunked prefill), gappy,
    with a sliding window and sink tokens: every chunk of rows sees only
    the pages up to its diagonal."""
    b, sq = 2, int(rng.integers(260, 400))
    lens = [sq + int(rng.integers(0, 100)) for _ in range(b)]
    q, k, v, table, offsets = _gappy_problem(rng, "f16", sq, lens, max_offset=30)
    for kw in (
        dict(mask_type="bottom_right", window_size_right=0),
        dict(mask_type="top_left", window_size_left=64, window_size_right=3, sink_size=4),
    ):
        out, lse = turbine_fmha.fmha_fwd_paged(
            q,
            k,
            v,
            table,
            np.array(lens, np.int32),
            kv_offset=np.array(offsets, np.int32),
            return_lse=True,
            session=sessions[formulation],
            **kw,
        )
        ref, ref_lse = fmha_fwd_paged_ref(q, k, v, table, lens, kv_offset=offsets, **kw)
        _check(out, lse, ref, ref_lse, "f16")


def test_causal_chunks_skip_masked_pages():
    """The plan itself: causal chunks of MASKED_CHUNK_ROWS rows get block
    tables cut at their diagonal, so the masked upper triangle is never
    computed."""
    v = Variant("f16", 64, 64, 4, 2, 16, "bottom_right")
    sq = sk = 512
    c = KernelCall(
        rows=sq,
        q_itemsize=2,
        nhead_q=4,
        block_table=np.arange(32, dtype=np.int32)[None],
        page=16,
        seqlen_q=np.array([sq], np.int32),
        seqlen_k=np.array([sk], np.int32),
        kv_shift=np.zeros(1, np.int32),
        scale=1.0,
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=MaskSpec("bottom_right", -1, 0),
        alibi_slopes=None,
        bias=None,
        sinks=None,
    )
    widths = [st.args[0].shape[1] for st in kernel_steps(v, c)]
    step = MASKED_CHUNK_ROWS // 16
    assert widths == [step * (i + 1) for i in range(sq // MASKED_CHUNK_ROWS)]
    c.mask = MaskSpec("bottom_right", -1, -1)  # no right edge: nothing to skip
    assert [st.args[0].shape[1] for st in kernel_steps(v, c)] == [32]


def test_online_decode_pads_the_group_and_splits(rng):
    """A decode in the GPU formulation runs with its GQA group zero-padded
    to the matrix-core rows (Variant.group_rows) and its keys split so that
    the (sequence, KV head) items fill the device
    (plan.merged_decode_splits): against the reference, with sinks and NaN
    in spare pages."""
    from conftest import CACHE

    s = turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", formulation="online", compute_units=8
    )
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[1500, 700], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    sinks = rng.uniform(-1, 1, 4).astype(np.float32)
    out, lse = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, sinks=sinks, return_lse=True, session=s)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=sinks)
    _check(out, lse, ref, ref_lse, "f16")
    used = s.last_variant
    assert used.group_rows == MMA_ROWS and used.padded_group == MMA_ROWS
    # 2 (sequences) x 2 (KV heads) items on 8 units: split, 1500 keys allow
    # 4 splits of 256 keys (plan.MIN_KEYS_PER_MERGED_SPLIT), merged in the
    # module with the sinks.
    assert used.merge_splits == 4 and used.sinks


def test_decode_splits():
    # H200 (132 units), 8 KV heads: b32 x 4096 keys has an item per unit
    # already (the merge would cost more than the splits save).
    assert decode_splits(32 * 8, 132, 4096, 32, 128) == 1
    assert decode_splits(8 * 8, 132, 4096, 8, 128) == 8  # 64 items: 8 splits of 512 keys
    assert decode_splits(1 * 8, 132, 32768, 1, 128) == 64  # at most MAX_SPLITS
    assert decode_splits(4 * 8, 132, 32768, 4, 128) == 32  # batch x splits fits the largest tile
    assert decode_splits(8, 132, 600, 1, 128) == 1  # splits keep 512 keys
    assert decode_splits(256 * 8, 132, 4096, 256, 128) == 1  # enough items already
    assert decode_splits(8, 132, 32768, 1, 32) == 32  # one launch of the largest tile
    assert decode_splits(0, 132, 4096, 0, 128) == 1


def test_group_padding_rule():
    gqa = Variant("f16", 128, 128, 32, 8, 16, "none").problem
    assert online_variant(gqa, 32, 1).group_rows == MMA_ROWS  # decode: 4 rows per KV head
    assert online_variant(gqa, 1, 128).group_rows == 0  # prefill: 512 rows already
    alibi = Variant("f16", 128, 128, 32, 8, 16, "none", bias="alibi").problem
    assert online_variant(alibi, 8, 1).group_rows == 0  # per-head terms loop over query heads
    assert online_variant(Variant("f16", 128, 128, 32, 32, 16, "none").problem, 8, 1).group_rows == MMA_ROWS
    for bad in (
        dict(formulation="explicit"),
        dict(formulation="online", batch_tile=8, seqlen_q_tile=1, bias="alibi"),
        dict(formulation="online", batch_tile=8, seqlen_q_tile=1, nhead_k=1),
        dict(formulation="online", batch_tile=8, seqlen_q_tile=3),
    ):
        fields = dict(dtype="f16", hdim_q=64, hdim_v=64, nhead_q=32, nhead_k=8, page_block_size=16) | bad
        with pytest.raises(ValueError, match="group_rows"):
            Variant(**fields, group_rows=16)
