"""Split-KV decode and masked-block skipping, against the float64
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
from turbine_fmha.calls.plan import (
    MASKED_CHUNK_ROWS,
    KernelCall,
    decode_splits,
    kernel_steps,
    num_splits_heuristic,
    window_cut,
    window_keys,
)
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
    c = _call(np.arange(32)[None], [sq], [sk], [0], MaskSpec("bottom_right", -1, 0))
    widths = [st.args[0].shape[1] for st in kernel_steps(v, c)]
    step = MASKED_CHUNK_ROWS // 16
    assert widths == [step * (i + 1) for i in range(sq // MASKED_CHUNK_ROWS)]
    c.mask = MaskSpec("bottom_right", -1, -1)  # no right edge: nothing to skip
    assert [st.args[0].shape[1] for st in kernel_steps(v, c)] == [32]


def _call(block_table, seqlen_q, seqlen_k, kv_shift, mask, rows=None):
    """A KernelCall of 4 query heads over pages of 16, for plan-level tests;
    with mask None, a zero bias (bottom-right masks set after)."""
    batch = block_table.shape[0]
    return KernelCall(
        rows=rows or int(max(seqlen_q)),
        q_itemsize=2,
        nhead_q=4,
        block_table=np.asarray(block_table, np.int32),
        page=16,
        seqlen_q=np.array(seqlen_q, np.int32),
        seqlen_k=np.array(seqlen_k, np.int32),
        kv_shift=np.array(kv_shift, np.int32),
        scale=1.0,
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=mask,
        alibi_slopes=None,
        bias=np.zeros((batch, 4, rows or int(max(seqlen_q)), block_table.shape[1] * 16), np.float32)
        if mask is None
        else None,
        sinks=None,
    )


def test_window_chunks_skip_pages_before_the_window():
    """The plan: with a sliding window (a left mask edge, no sink tokens),
    each chunk's table also starts at the first page its first row can see,
    its kv_shift moved back by as many rows (keys keep their positions):
    the pages before the window are never read. Sink tokens keep them."""
    v = Variant("f16", 64, 64, 4, 2, 16, "bottom_right")
    sq = sk = 512
    left = 100
    c = _call(np.arange(32)[None], [sq], [sk], [0], MaskSpec("bottom_right", left, 0))
    steps = kernel_steps(v, c)
    assert len(steps) == sq // MASKED_CHUNK_ROWS
    for st in steps:
        table, shift = st.args[0], st.args[3]
        first, last = max(0, st.s - left) // 16, -(-st.e // 16)
        assert table.tolist() == [list(range(first, last))]
        assert shift.tolist() == [-16 * first]
        assert st.width == last - first <= -(-(left + MASKED_CHUNK_ROWS) // 16) + 1
    # A window with no right edge is chunked and cut the same way.
    c.mask = MaskSpec("top_left", left, -1)
    assert [st.args[0][0, 0] for st in kernel_steps(v, c)] == [max(0, s - left) // 16 for s in range(0, sq, 64)]
    c.mask = MaskSpec("bottom_right", left, 0, sink=4)
    assert all(st.args[0][0, 0] == 0 and st.args[3][0] == 0 for st in kernel_steps(v, c))


def test_window_cut_reads_each_sequence_window(rng):
    """window_cut: a ragged batch of windowed decodes (gappy, one sequence
    without keys) reads each sequence's window only, its table row starting
    at the window's first page and padded with that page, its kv_shift
    moved back to keep key positions; the table is as wide as the widest
    window. Without a left edge, with sink tokens or with a bias it is the
    call unchanged."""
    page, left = 16, 256
    lens, shifts = np.array([4000, 100, 2050, 0]), np.array([0, 3, 21, 0])
    width = int(-(-(lens + shifts).max() // page)) + 2
    bt = rng.permutation(4 * width).reshape(4, width)
    c = _call(bt, [1] * 4, lens, shifts, MaskSpec("bottom_right", left, 0))
    cut = window_cut(c)
    firsts = []
    for b in range(4):
        first = max(0, lens[b] - 1 - left + shifts[b]) // page if lens[b] else 0
        last = max(1, -(-(lens[b] + shifts[b]) // page))
        row = cut.block_table[b]
        assert row[: last - first].tolist() == bt[b, first:last].tolist()
        assert (row[last - first :] == bt[b, first]).all()
        assert cut.kv_shift[b] == shifts[b] - page * first
        firsts.append((first, last))
    assert firsts[0][0] > 200 and firsts[2][0] > 100
    assert cut.block_table.shape[1] == max(e - f for f, e in firsts) <= -(-(left + 1) // page) + 1
    for mask in (MaskSpec("bottom_right", -1, 0), MaskSpec("bottom_right", left, 0, sink=2)):
        plain = _call(bt, [1] * 4, lens, shifts, mask)
        assert window_cut(plain) is plain
    biased = _call(bt, [1] * 4, lens, shifts, None)
    biased.mask = MaskSpec("bottom_right", left, 0)
    assert window_cut(biased) is biased


def test_window_keys_turn_a_windowed_decode_into_its_window(rng):
    """window_keys: a decode row under a bottom-right window sees the last
    left + 1 keys of each sequence, so the call becomes one over just
    those, as gappy keys (kv_shift moved on by the keys dropped, keys
    shorter than the window kept whole); window_cut then starts each table
    row at the window's first page. Prefill rows, top-left masks, sink
    tokens, ALiBi and a bias leave the call as it is."""
    left = 100
    lens, shifts = np.array([3000, 40, 101, 0]), np.array([0, 7, 15, 0])
    bt = rng.permutation(4 * 200).reshape(4, 200)
    c = _call(bt, [1] * 4, lens, shifts, MaskSpec("bottom_right", left, 0))
    w = window_keys(c)
    assert w.seqlen_k.tolist() == [101, 40, 101, 0]
    assert w.kv_shift.tolist() == [2899, 7, 15, 0]
    cut = window_cut(w)
    assert cut.block_table[0, :7].tolist() == bt[0, 181:188].tolist()  # rows 2899..2999
    assert cut.kv_shift[0] == 2899 - 181 * 16
    for other in (
        _call(bt, [5] * 4, lens, shifts, MaskSpec("bottom_right", left, 0), rows=5),
        _call(bt, [1] * 4, lens, shifts, MaskSpec("top_left", left, 0)),
        _call(bt, [1] * 4, lens, shifts, MaskSpec("bottom_right", left, 0, sink=4)),
        _call(bt, [1] * 4, lens, shifts, MaskSpec("bottom_right", -1, 0)),
    ):
        assert window_keys(other) is other
    alibi = _call(bt, [1] * 4, lens, shifts, MaskSpec("bottom_right", left, 0))
    alibi.alibi_slopes = np.ones((4, 4), np.float32)
    assert window_keys(alibi) is alibi


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("feature", ["plain", "alibi", "bias", "splits"])
def test_sliding_window_past_many_pages(sessions, rng, formulation, feature):
    """A sliding window that has left many pages behind (gappy KV, garbage
    in unused table slots, NaN in the spare pages), as a prefill over a
    longer cache and as a ragged batch of decodes, with ALiBi (absolute
    positions), a bias (its columns cut with the table) or split-KV (the
    window split, not the sequence): as the reference computes it over
    every key. The tolerances are conftest's (split-KV's extra rounding
    fits them: see the module docstring)."""
    for sq, extra in ((int(rng.integers(70, 140)), (200, 400)), (1, (20, 700))):
        lens = [sq + int(rng.integers(*extra)) for _ in range(3)]
        q, k, v, table, offsets = _gappy_problem(rng, "f32", sq, lens, max_offset=40)
        kw = dict(mask_type="bottom_right", window_size_left=int(rng.integers(20, 90)), window_size_right=0)
        if feature == "alibi":
            kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (3, 8)).astype(np.float32)
        elif feature == "bias":
            kw["bias"] = rng.standard_normal((3, 8, sq, max(lens))).astype(np.float32)
        elif feature == "splits" and sq == 1:
            kw["num_splits"] = 3
        sk = np.array(lens, np.int32)
        out, lse = turbine_fmha.fmha_fwd_paged(
            q,
            k,
            v,
            table,
            sk,
            kv_offset=np.array(offsets, np.int32),
            return_lse=True,
            session=sessions[formulation],
            **kw,
        )
        kw.pop("num_splits", None)
        ref, ref_lse = fmha_fwd_paged_ref(q, k, v, table, sk, kv_offset=offsets, **kw)
        _check(out, lse, ref, ref_lse, "f32")
        # A windowed decode runs the mask-free decode kernels over its
        # window's keys (plan.window_keys), save with ALiBi or a bias.
        unmasked = sq == 1 and feature in ("plain", "splits")
        assert (sessions[formulation].last_variant.mask == "none") == unmasked


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
