"""A prefill run as row entries: each 128-row chunk of
each sequence a sequence of its own, so that a tile of several entries
runs the chunks of many sequences in one launch. The online formulation
on the CPU, against the float64 reference on fresh random inputs with
NaN in spare pages and garbage in unused table slots: causal (bottom
right, with a left window and sink tokens), no mask, group mode with
decodes beside prefills, gappy KV, torch tensors and out=; and the calls
that must not run as entries (ALiBi, bias, top-left masks) still right."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CACHE, make_problem, run_and_check
from tolerances import LSE_TOL, OUT_TOL

import turbine_fmha
from turbine_fmha.build import aot
from turbine_fmha.calls.mask import MaskSpec
from turbine_fmha.calls.plan import KernelCall, kernel_steps, row_entries
from turbine_fmha.kernels.variants import ENTRY_ROWS, Variant, online_variant
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

BASE = Variant("f16", 64, 64, 4, 2, 16, "bottom_right")
# The entry tiles (b1 and b4 of 128 rows) without a mask and bottom-right;
# a decode tile for group mode's decodes.
TILES = [online_variant(dict(BASE.problem, mask=m), bt, ENTRY_ROWS) for m in ("none", "bottom_right") for bt in (1, 4)]
TILES += [online_variant(dict(BASE.problem, mask="none"), 8, 1)]


@pytest.fixture(scope="module")
def entries_session():
    out = CACHE / "row-entries"
    aot.build(out, ["host"], TILES)
    return turbine_fmha.Session("cpu", artifact_dir=out, formulation="online")


CASES = {
    # name: (fmha_fwd_paged's mask arguments, seqlen_k per sequence, seqlen_q)
    "causal": (dict(mask_type="bottom_right", window_size_right=0), [600, 300, 450], 200),
    "no_mask": ({}, [300, 200, 280], 150),
    "window_and_sinks": (
        dict(mask_type="bottom_right", window_size_left=50, window_size_right=0, sink_size=4),
        [400, 256, 300],
        180,
    ),
    "window": (dict(mask_type="bottom_right", window_size_left=100, window_size_right=0), [600, 300, 450], 200),
    # New rows over cached keys, as a chunked prefill has them.
    "chunked_prefill": (dict(mask_type="bottom_right", window_size_right=0), [700, 650, 690, 610], 128),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_entries_match_the_reference(entries_session, rng, case):
    kw, lens_k, rows = CASES[case]
    p = make_problem(
        rng, dtype="f16", batch=len(lens_k), seqlen_q=rows, seqlens_k=lens_k, nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    run_and_check(entries_session, p, dtype="f16", **kw)
    assert entries_session.last_variant.batch_tile == 4, entries_session.last_variant.name


def test_group_mode_gappy_torch_and_out(entries_session, rng):
    """Group mode (prefills of several lengths beside decodes), gappy KV,
    torch tensors and a NaN-poisoned out=: rows are regrouped through the
    entries and every row is written."""
    import torch

    lens_q, lens_k = [150, 1, 260, 1, 40], [300, 90, 500, 33, 200]
    offsets = np.array([3, 0, 17, 5, 0], np.int32)
    q4, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=5,
        seqlen_q=max(lens_q),
        seqlens_k=[n + 20 for n in lens_k],
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    sk = np.array(lens_k, np.int32)
    q = np.concatenate([q4[b, :n] for b, n in enumerate(lens_q)])
    starts = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    kw = dict(seqstart_q=starts, kv_offset=offsets, mask_type="bottom_right", window_size_right=0)
    out = torch.full((q.shape[0], 4, 64), float("nan"), dtype=torch.float16)
    got, lse = turbine_fmha.fmha_fwd_paged(
        torch.from_numpy(q),
        torch.from_numpy(k),
        torch.from_numpy(v),
        bt,
        sk,
        out=out,
        return_lse=True,
        session=entries_session,
        **kw,
    )
    assert got is out
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    err = np.abs(out.double().numpy() - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL["f16"], err
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), ~finite)
    assert np.abs(lse.numpy()[finite] - ref_lse[finite]).max() <= LSE_TOL["f16"]


@pytest.mark.parametrize("refused", ["top_left", "alibi", "right_window"])
def test_calls_entries_cannot_serve_run_as_they_are(refused):
    """A top-left mask, ALiBi and a right window side depend on a row's
    absolute position in ways an entry cannot keep: row_entries refuses
    them (the plan then runs the call as it is)."""
    c = KernelCall(
        rows=300,
        q_itemsize=2,
        nhead_q=4,
        block_table=np.zeros((2, 40), np.int32),
        page=16,
        seqlen_q=np.array([300, 200], np.int32),
        seqlen_k=np.array([600, 600], np.int32),
        kv_shift=np.zeros(2, np.int32),
        scale=1.0,
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=MaskSpec.from_args("bottom_right", -1, 0),
        alibi_slopes=None,
        bias=None,
        sinks=None,
    )
    assert row_entries(c) is not None
    if refused == "alibi":
        c.alibi_slopes = np.ones((2, 4), np.float32)
    else:
        c.mask = MaskSpec.from_args(
            "top_left" if refused == "top_left" else "bottom_right", -1, 0 if refused == "top_left" else 5
        )
    assert row_entries(c) is None


def test_entry_tables():
    """Entry c * batch + b is chunk c of sequence b: its rows, and the keys
    up to its last row's diagonal."""
    c = KernelCall(
        rows=300,
        q_itemsize=2,
        nhead_q=4,
        block_table=np.arange(80, dtype=np.int32).reshape(2, 40),
        page=16,
        seqlen_q=np.array([300, 200], np.int32),
        seqlen_k=np.array([600, 500], np.int32),
        kv_shift=np.array([0, 7], np.int32),
        scale=1.0,
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=MaskSpec.from_args("bottom_right", -1, 0),
        alibi_slopes=None,
        bias=None,
        sinks=None,
    )
    e = row_entries(c)
    assert e.rows == ENTRY_ROWS and e.batch == 6
    np.testing.assert_array_equal(e.seqlen_q, [128, 128, 128, 72, 44, 0])
    # Sequence 0 (shift 300): its chunks end at rows 127, 255, 299 -> keys 428, 556, 600.
    # Sequence 1 (shift 300): rows 127, 199 -> keys 428, 500; its third chunk is empty.
    np.testing.assert_array_equal(e.seqlen_k, [428, 428, 556, 500, 600, 0])
    np.testing.assert_array_equal(e.kv_shift, [0, 7, 0, 7, 0, 7])
    np.testing.assert_array_equal(e.block_table[1], c.block_table[1])


def _plan(session, bt, sk, num_pages, rows, **kw):
    """The f16 4/2 x 64, page-16 plan of the problems below."""
    return turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=num_pages,
        page_block_size=16,
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        dtype="f16",
        seqlen_q=rows,
        **kw,
    )


def test_windowed_entries_read_their_own_windows(entries_session, rng):
    """Under a sliding window each entry's table starts at the first page
    its own rows see, not the sequence's first row's: a launch reads its
    widest entry's keys, about the window plus the entry's rows, however
    long the prompt. Against the float64 reference with NaN in the spare
    pages, so a table cut wrong reads them and fails."""
    window, rows = 100, 1024
    p = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=rows, seqlens_k=[rows, rows], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    kw = dict(mask_type="bottom_right", window_size_left=window, window_size_right=0)
    attn = _plan(entries_session, p[3], p[4], p[1].shape[0], rows, **kw)
    plan = attn._plan.parts[0]
    assert plan.entries == rows // ENTRY_ROWS
    variant = attn._plan.variant(0, False)
    # An entry's keys: its 128 rows and the window before its first, each
    # end rounded out to a page.
    most = -(-(ENTRY_ROWS + window) // 16) + 1
    widths = [st.width for st in kernel_steps(variant, plan.call)]
    assert max(widths) <= most, (widths, most)
    out, lse = attn.run(*p[:3], return_lse=True)
    ref, ref_lse = fmha_fwd_paged_ref(*p, **kw)
    assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()
    assert np.abs(lse - ref_lse).max() <= LSE_TOL["f16"]


@pytest.mark.parametrize("arrays", ["numpy", "torch"])
@pytest.mark.parametrize("rows", [256, 200], ids=["whole_chunks", "last_chunk_padded"])
def test_entries_results_are_rearranged_once(entries_session, rng, allocations, arrays, rows):
    """A call run as row entries gets its outputs by rearranging the
    entries' results once (into `out` if given): no output or LSE buffer
    is allocated and placed into first (only the padded q is made). The
    LSE is contiguous, as every returned array. Against the float64
    reference, LSE included."""
    import torch

    lens_k = [600, 300, 450]
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=rows, seqlens_k=lens_k, nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    kw = dict(mask_type="bottom_right", window_size_right=0)
    attn = _plan(entries_session, bt, sk, k.shape[0], rows, **kw)
    assert attn._plan.parts[0].entries
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    if arrays == "torch":
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    out, lse = attn.run(q, k, v, return_lse=True)
    assert allocations == [(3, -(-rows // ENTRY_ROWS) * ENTRY_ROWS, 4, 64)], allocations  # the padded q alone
    for a in (out, lse):
        assert isinstance(a, type(q)) and (a.is_contiguous() if arrays == "torch" else a.flags.c_contiguous)

    def check(o, lse_):
        o64 = np.asarray(o).astype(np.float64)
        assert np.abs(o64 - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()
        assert np.abs(np.asarray(lse_) - ref_lse).max() <= LSE_TOL["f16"]

    check(out, lse)
    given = np.full(q.shape, np.nan, np.float16)
    given = torch.from_numpy(given) if arrays == "torch" else given
    assert attn.run(q, k, v, out=given) is given
    check(given, lse)
    np.testing.assert_array_equal(np.asarray(attn.run(q, k, v)), np.asarray(out))  # without the LSE: the same output
