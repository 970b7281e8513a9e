"""Prefill through contiguous tiles (kernels.tiles_kernel, calls/tiles.py,
mlir/prefill_tiles.mlir.jinja): the kernel against the float64 reference
on ragged batches, its plan's region, its clamps, and the planner and
executor running it through the public API.

The GPU targets run it by default; on the CPU it runs only where a
session asks for it (Session(prefill_tiles=True)), as here."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CACHE, make_problem, run_and_check
from tolerances import LSE_TOL, OUT_TOL

import turbine_fmha
from turbine_fmha.calls.tiles import MIN_ROWS, Sequence, classes_needed, tiles_plan
from turbine_fmha.kernels.tiles_kernel import TilesKernel
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HQ, HK, D, PG = 4, 2, 32, 16
# A small tile keeps the kernel-level cases fast; the planner's own is
# kernels.tiles_kernel.TILE_ROWS.
T = 32
CAUSAL = dict(mask_type="bottom_right", window_size_right=0)


@pytest.fixture(scope="module")
def tiles_session():
    return turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", prefill_tiles=True
    )


def _paged(rng, spec, spare=3):
    """Caches, per-sequence pages and a varlen q for [(rows, keys)]: pages
    shuffled, spare pages NaN, and every row past a sequence's keys in its
    last page NaN in V and +Inf in K, so that any read of one shows."""
    used = [-(-k // PG) for _, k in spec]
    npages = sum(used) + spare
    kc = rng.standard_normal((npages, PG, HK, D)).astype(np.float16)
    vc = rng.standard_normal((npages, PG, HK, D)).astype(np.float16)
    perm = rng.permutation(npages)
    seqs, q0, i = [], 0, 0
    for (rows, keys), n in zip(spec, used):
        pages = perm[i : i + n]
        i += n
        kc[pages[-1], keys - (n - 1) * PG :] = np.inf
        vc[pages[-1], keys - (n - 1) * PG :] = np.nan
        seqs.append(Sequence(q0, rows, keys, pages))
        q0 += rows
    kc[perm[i:]] = np.nan
    vc[perm[i:]] = np.nan
    q = rng.standard_normal((q0, HQ, D)).astype(np.float16)
    return q, kc, vc, seqs


def _reference(q, kc, vc, seqs, mask):
    width = max(len(s.pages) for s in seqs)
    table = np.zeros((len(seqs), width), np.int32)
    for b, s in enumerate(seqs):
        table[b, : len(s.pages)] = s.pages
    seqstart = np.cumsum([0] + [s.rows for s in seqs])
    seqlen_k = np.array([s.keys for s in seqs], np.int32)
    causal = {} if mask == "none" else dict(window_size_right=0)
    return fmha_fwd_paged_ref(q, kc, vc, table, seqlen_k, seqstart_q=seqstart, mask_type=mask, **causal)


def _check(out, lse, ref, ref_lse):
    assert np.isfinite(out.astype(np.float64)).all()
    err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL["f16"], err
    assert np.abs(lse - ref_lse).max() <= LSE_TOL["f16"]


# (mask, [(rows, keys)]): ragged, chunked (cached keys first), rows that
# are not whole tiles, a sequence of one row; chunks whose digits leave
# classes empty (filled by splitting a longer chunk); one tile (no class
# but the masked one); mask-free keys that end mid-block and on a block.
CASES = [
    ("bottom_right", [(40, 40), (7, 100), (70, 200), (1, 33)]),
    ("bottom_right", [(64, 64 + 8 * T), (5, 5)]),
    ("bottom_right", [(20, 20)]),
    ("top_left", [(50, 90), (32, 32), (3, 64)]),
    ("none", [(33, 33), (5, 77), (64, 64), (20, 2 * T)]),
]


@pytest.mark.parametrize("mask, spec", CASES, ids=[f"{m}-{len(s)}x{max(k for _, k in s)}" for m, s in CASES])
def test_kernel_matches_the_reference(tiles_session, rng, mask, spec):
    q, kc, vc, seqs = _paged(rng, spec)
    nc = classes_needed(seqs, mask, T)
    plan = tiles_plan(seqs, q.shape[0], mask, PG, T, nc, HK, 1 / np.sqrt(D))
    # No class is empty: a dispatch over no entry faults IREE's CUDA device.
    assert all(a.shape[0] for a in plan.args[4:-3:2]), [a.shape[0] for a in plan.args[4:-3:2]]
    kernel = TilesKernel("f16", HQ, HK, D, PG, T, nc)
    (out, lse) = tiles_session.run_variants(kernel, [[q, kc, vc, *plan.args]])[0]
    _check(out, lse, *_reference(q, kc, vc, seqs, mask))


def test_classes_the_digits_leave_empty_take_split_chunks():
    """Two tiles see a prefix of 8 blocks (one chunk of class 3), one of
    them a block more (class 0): one tile's chunk is split for classes 2
    and 1 (4 blocks, then 2 and 2); with one such tile, no chunk can be
    spared, and classes 0-2 get dummy entries (7 blocks of 9 wasted)."""
    for rows, sizes, waste in ((2 * T, [1, 2, 1, 1, 2], 0.0), (T, [1, 1, 1, 1, 1], 7 / 9)):
        seqs = [Sequence(0, rows, 8 * T + rows, np.arange((8 * T + rows) // PG))]
        plan = tiles_plan(seqs, rows, "bottom_right", PG, T, 4, HK, 1.0)
        assert [a.shape[0] for a in plan.args[4:-3:2]] == sizes
        assert plan.waste == pytest.approx(waste)


def test_the_region_holds_each_key_once(rng):
    """Each sequence's keys are laid out once, whatever the chunks that
    read them: the region is the keys' blocks, no alignment gaps, then
    padded to whole chunks of the longest class (64 tiles here)."""
    spec = [(512, 8704), (512, 8704), (300, 1000), (129, 129)]
    seqs = [Sequence(0, r, k, np.arange(-(-k // PG))) for r, k in spec]
    plan = tiles_plan(seqs, 2000, "bottom_right", PG, 128, 7, HK, 1.0)
    keys = sum(-(-k // 128) * 128 for _, k in spec)
    assert plan.args[0].shape[0] * PG == -(-keys // (64 * 128)) * 64 * 128
    assert (plan.args[1][keys // PG :] == 0).all()


def test_no_argument_reads_outside_its_tensor(tiles_session, rng):
    """Ids out of range (pages, tiles, chunks, parts, rows) are clamped:
    the call completes with finite output."""
    q, kc, vc, seqs = _paged(rng, [(40, 40 + 4 * T)], spare=0)
    nc = classes_needed(seqs, "bottom_right", T)
    plan = tiles_plan(seqs, q.shape[0], "bottom_right", PG, T, nc, HK, 1 / np.sqrt(D))
    args = [a.copy() for a in plan.args]
    kc[...] = 0.5
    vc[...] = 1.0
    huge = np.iinfo(np.int32)
    args[0][:] = [huge.max, -7, 10**6][: args[0].size] + [0] * max(0, args[0].size - 3)
    args[2][0, 0], args[3][0] = huge.max, huge.min
    for a in args[4:-3]:
        a[...] = huge.max if a.size % 2 else -5
    args[-2][...] = 1000
    kernel = TilesKernel("f16", HQ, HK, D, PG, T, nc)
    (out, _) = tiles_session.run_variants(kernel, [[q, kc, vc, *args]])[0]
    assert np.isfinite(out.astype(np.float32)).all()


@pytest.mark.parametrize(
    "mask",
    [CAUSAL, dict(mask_type="top_left", window_size_right=0), dict(mask_type="bottom_right"), {}],
    ids=["causal", "top_left", "no_right_edge", "none"],
)
def test_the_planner_runs_prefill_in_tiles(tiles_session, rng, mask):
    """A prefill through the public API: one tile-kernel call, results as
    the reference's (batch mode: the LSE rearranged to [B, HQ, S])."""
    problem = make_problem(
        rng,
        dtype="f16",
        batch=2,
        seqlen_q=MIN_ROWS + 3,
        seqlens_k=[MIN_ROWS + 3, MIN_ROWS + 300],
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        page=PG,
    )
    run_and_check(tiles_session, problem, dtype="f16", **mask)
    assert isinstance(tiles_session.last_variant, TilesKernel)


def test_varlen_prefill_in_tiles_writes_out(tiles_session, rng):
    """Group mode with a given out: the rows land in it."""
    lens, keys = [MIN_ROWS, 2, 150], [MIN_ROWS, 2 + 4 * PG, 150]
    q, kc, vc, table, seqlen_k = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=1, seqlens_k=keys, nhead_q=HQ, nhead_k=HK, hdim=D, page=PG
    )
    q = rng.standard_normal((sum(lens), HQ, D)).astype(np.float16)
    seqstart = np.cumsum([0] + lens)
    out = np.full_like(q, np.nan)
    kw = dict(seqstart_q=seqstart, **CAUSAL)
    got, lse = turbine_fmha.fmha_fwd_paged(
        q, kc, vc, table, seqlen_k, out=out, return_lse=True, session=tiles_session, **kw
    )
    assert got is out and isinstance(tiles_session.last_variant, TilesKernel)
    _check(out, lse, *fmha_fwd_paged_ref(q, kc, vc, table, seqlen_k, **kw))


def test_mixed_batch_prefills_in_tiles_decodes_paged(tiles_session, rng):
    """Continuous batching: the one-row sequences run the decode kernels,
    the prefills one tile call, each writing its own rows of out and LSE."""
    lens, keys = [1, MIN_ROWS, 1, 70], [50, MIN_ROWS, 300, 80]
    q, kc, vc, table, seqlen_k = make_problem(
        rng, dtype="f16", batch=4, seqlen_q=1, seqlens_k=keys, nhead_q=HQ, nhead_k=HK, hdim=D, page=PG
    )
    q = rng.standard_normal((sum(lens), HQ, D)).astype(np.float16)
    kw = dict(seqstart_q=np.cumsum([0] + lens), **CAUSAL)
    attn = turbine_fmha.PagedAttention(tiles_session)
    plan = attn.plan(
        table, seqlen_k, dtype="f16", nhead_q=HQ, nhead_k=HK, hdim=D, page_block_size=PG, num_pages=kc.shape[0], **kw
    )
    assert plan._plan.plan.mixed and plan._plan.plan.tiles is not None
    out, lse = plan.run(q, kc, vc, return_lse=True)
    _check(out, lse, *fmha_fwd_paged_ref(q, kc, vc, table, seqlen_k, **kw))


@pytest.mark.parametrize(
    "kw",
    [dict(CAUSAL, window_size_left=8), dict(logits_soft_cap=5.0), dict(kv_layout="HND")],
    ids=["window", "softcap", "hnd"],
)
def test_what_the_tiles_do_not_serve_runs_as_before(tiles_session, rng, kw):
    hnd = kw.get("kv_layout") == "HND"
    q, kc, vc, table, seqlen_k = make_problem(
        rng,
        dtype="f16",
        batch=1,
        seqlen_q=MIN_ROWS,
        seqlens_k=[MIN_ROWS],
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        page=PG,
    )
    if hnd:
        kc, vc = (np.ascontiguousarray(c.transpose(0, 2, 1, 3)) for c in (kc, vc))
    run_and_check(tiles_session, (q, kc, vc, table, seqlen_k), dtype="f16", **kw)
    assert not isinstance(tiles_session.last_variant, TilesKernel)


def test_sessions_choose_tiles_on_gpus_only():
    assert turbine_fmha.Session("cpu", artifact_dir=CACHE / "none").prefill_tiles is False
    with pytest.raises(TypeError, match="prefill_tiles"):
        turbine_fmha.Session("cpu", artifact_dir=CACHE / "none", prefill_tiles="yes")


def test_prefills_below_the_threshold_run_paged(tiles_session, rng):
    """Under MIN_ROWS rows (measured: 8 sequences of 256 ran slower in
    tiles) the paged kernels serve the call."""
    problem = make_problem(
        rng,
        dtype="f16",
        batch=2,
        seqlen_q=MIN_ROWS - 1,
        seqlens_k=[MIN_ROWS - 1] * 2,
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        page=PG,
    )
    run_and_check(tiles_session, problem, dtype="f16", **CAUSAL)
    assert not isinstance(tiles_session.last_variant, TilesKernel)


@pytest.mark.parametrize("offset", [2 * PG, 5], ids=["whole_pages", "mid_page"])
def test_gappy_kv_in_tiles(tiles_session, rng, offset):
    """kv_offset of whole pages: the tiles read from that table column on;
    mid-page offsets run the paged kernels. Both as the reference."""
    keys = MIN_ROWS + 40
    q, kc, vc, table, seqlen_k = make_problem(
        rng,
        dtype="f16",
        batch=1,
        seqlen_q=MIN_ROWS,
        seqlens_k=[keys + offset],
        nhead_q=HQ,
        nhead_k=HK,
        hdim=D,
        page=PG,
    )
    seqlen_k = np.array([keys], np.int32)
    run_and_check(tiles_session, (q, kc, vc, table, seqlen_k), dtype="f16", kv_offset=np.array([offset]), **CAUSAL)
    assert isinstance(tiles_session.last_variant, TilesKernel) == (offset % PG == 0)


MASKS = {"bottom_right": CAUSAL, "top_left": dict(mask_type="top_left", window_size_right=0), "none": {}}


@pytest.mark.parametrize("mask", list(MASKS))
def test_calls_past_the_partials_budget_run_in_row_groups(tiles_session, rng, monkeypatch, mask):
    """The entries' f32 partials grow with the rows times the classes: past
    MAX_PARTIAL_BYTES a call runs as several tile calls of consecutive q
    rows (a sequence cut between its tiles), each within the budget, and
    together they give every row and its LSE."""
    from turbine_fmha.calls import tiles

    lens, keys = [MIN_ROWS + 100, 300], [MIN_ROWS + 164, 300]
    _, kc, vc, table, seqlen_k = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=keys, nhead_q=HQ, nhead_k=HK, hdim=D, page=PG
    )
    q = rng.standard_normal((sum(lens), HQ, D)).astype(np.float16)
    kw = dict(seqstart_q=np.cumsum([0] + lens), **MASKS[mask])
    shape = dict(dtype="f16", nhead_q=HQ, nhead_k=HK, hdim=D, page_block_size=PG, num_pages=kc.shape[0])
    budget = 10 * tiles.entry_bytes(HQ, 128, D)  # fewer entries than the call's
    monkeypatch.setattr(tiles, "MAX_PARTIAL_BYTES", budget)
    plan = turbine_fmha.PagedAttention(tiles_session).plan(table, seqlen_k, **shape, **kw)
    calls = plan._plan.plan.tiles
    assert calls is not None and len(calls) >= 2
    assert [c.start for c in calls] == [0] + [c.stop for c in calls[:-1]] and calls[-1].stop == sum(lens)
    assert all(c.plan.partial_bytes(HQ, D) <= budget for c in calls)
    out = np.full_like(q, np.nan)
    got, lse = plan.run(q, kc, vc, out=out, return_lse=True)
    assert got is out and isinstance(tiles_session.last_variant, TilesKernel)
    _check(out, lse, *fmha_fwd_paged_ref(q, kc, vc, table, seqlen_k, **kw))


def test_a_tile_past_the_partials_budget_runs_paged(tiles_session, rng, monkeypatch):
    """Where one tile's entries alone pass the budget, the paged kernels
    serve the call."""
    from turbine_fmha.calls import tiles

    problem = make_problem(
        rng, dtype="f16", batch=1, seqlen_q=MIN_ROWS, seqlens_k=[MIN_ROWS], nhead_q=HQ, nhead_k=HK, hdim=D, page=PG
    )
    seqs = [Sequence(0, MIN_ROWS, MIN_ROWS, np.arange(MIN_ROWS // PG))]
    plan = tiles_plan(seqs, MIN_ROWS, "bottom_right", PG, 128, 2, HK, 1.0)
    assert plan.entries == 4 + 4  # 4 last blocks; chunks: the digits of 1, 2 and 3
    monkeypatch.setattr(tiles, "MAX_PARTIAL_BYTES", tiles.entry_bytes(HQ, 128, D))
    run_and_check(tiles_session, problem, dtype="f16", **CAUSAL)
    assert not isinstance(tiles_session.last_variant, TilesKernel)


def test_row_groups_cut_between_tiles():
    """Each group's sequences are the rows [r0, r1) of the call's, as
    bottom-right sequences of the keys their last row sees; top-left ones
    become bottom-right; mask-free rows keep every key."""
    from turbine_fmha.calls.tiles import row_groups

    pages = np.arange(40)
    seqs = [Sequence(0, 600, 640, pages), Sequence(600, 200, 200, pages)]
    mask, groups = row_groups(seqs, "bottom_right", 128, 4)
    assert mask == "bottom_right"
    # The first's rows sit at keys 40..639: tiles 0..4, entries 1, 2, 2, 3, 2;
    # the second's tiles 0..1, entries 1, 2: 13 in groups of at most 4.
    assert [(a, b) for a, b, _ in groups] == [(0, 216), (216, 344), (344, 472), (472, 600), (600, 800)]
    rows_keys = [[(x.q_start, x.rows, x.keys) for x in sub] for _, _, sub in groups]
    assert rows_keys[0] == [(0, 216, 256)] and rows_keys[3] == [(0, 128, 640)] and rows_keys[4] == [(0, 200, 200)]
    mask, groups = row_groups([Sequence(0, 300, 500, pages)], "top_left", 128, 3)
    assert mask == "bottom_right" and [g[2][0].keys for g in groups] == [256, 300]
    mask, groups = row_groups([Sequence(0, 300, 500, pages)], "none", 128, 3)
    assert mask == "none" and [(g[2][0].rows, g[2][0].keys) for g in groups] == [(128, 500), (128, 500), (44, 500)]
    assert row_groups(seqs, "bottom_right", 128, 2) is None  # tile 3 alone has 3 entries


@pytest.mark.parametrize("target", ["host", "cuda"])
def test_a_tiles_call_is_one_submission(tmp_path, target):
    """Every check before the first dispatch: an assert after one splits the
    call into two stream.cmd.execute, and the second one's allocations then
    wait on the host for the first (IREE's CUDA queue_alloca)."""
    import subprocess

    from turbine_fmha.build.compiler import iree_compile_path
    from turbine_fmha.build.targets import get_target
    from turbine_fmha.kernels.custom_ops import render_tiles

    k = TilesKernel("f16", HQ, HK, D, PG, T, 3)
    src = tmp_path / "tiles.mlir"
    src.write_text(render_tiles(k))
    cmd = [iree_compile_path(), str(src), *get_target(target).flags, "--compile-to=stream"]
    stream = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    entry = stream[stream.index(f"util.func public @{k.name}(") :]
    assert entry.count("stream.cmd.execute") == 1


def test_an_empty_class_is_refused_before_any_work(tiles_session, rng):
    """A class without entries would be a dispatch over nothing, which
    faults IREE's CUDA device: the kernel refuses it by name first."""
    q, kc, vc, seqs = _paged(rng, [(64, 64 + 8 * T), (5, 5)])
    nc = classes_needed(seqs, "bottom_right", T)
    plan = tiles_plan(seqs, q.shape[0], "bottom_right", PG, T, nc, HK, 1 / np.sqrt(D))
    args = list(plan.args)
    args[6], args[7] = args[6][:0], args[7][:0]  # class 1's tiles and chunks (after 4 arguments and class 0's)
    kernel = TilesKernel("f16", HQ, HK, D, PG, T, nc)
    with pytest.raises(Exception, match="class 1 has no entry"):
        tiles_session.run_variants(kernel, [[q, kc, vc, *args]])


def test_a_wave_of_split_chunks_fills_the_empty_classes(tiles_session, rng):
    """Chunked prefills whose prefixes leave classes 1 and 2 empty: one
    split chunk fills them for a GPU wave of one entry, as many as the
    wave holds (here 3) for a wider one, since a class of fewer entries
    than a wave lasts as long as one entry's reduction. Both plans give
    the reference's output."""
    spec = [(2 * T, 8 * T + 2 * T)] * 4
    q, kc, vc, seqs = _paged(rng, spec)
    nc = classes_needed(seqs, "bottom_right", T)
    kernel = TilesKernel("f16", HQ, HK, D, PG, T, nc)
    ref = _reference(q, kc, vc, seqs, "bottom_right")
    sizes = {}
    for wave in (1, 3):
        plan = tiles_plan(seqs, q.shape[0], "bottom_right", PG, T, nc, HK, 1 / np.sqrt(D), wave)
        sizes[wave] = [a.shape[0] for a in plan.args[4:-3:2]]
        (out, lse) = tiles_session.run_variants(kernel, [[q, kc, vc, *plan.args]])[0]
        _check(out, lse, *ref)
    # 8 tiles: prefixes of 8 and 9 blocks (class 3, class 0), last blocks.
    assert sizes[1] == [4, 2, 1, 7, 8]
    assert sizes[3] == [4, 6, 3, 5, 8]
