"""PagedAttention: plan once per batch step, run per layer.

Every run is checked against the float64 reference on fresh random caches
(one pair per "layer", the same tables), with garbage in unused table
slots and NaN in spare pages (conftest.make_problem).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import _TrapSession, make_problem
from tolerances import LSE_TOL, OUT_TOL

import turbine_fmha
from turbine_fmha.api.cache import aligned_zeros
from turbine_fmha.runtime.executor import Results
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


def _check(out, lse, ref, ref_lse, dtype):
    err = np.abs(out.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= OUT_TOL[dtype], f"output rel err {err:.3e}"
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    if fin.any():
        assert np.abs(lse[fin] - ref_lse[fin]).max() <= LSE_TOL[dtype]


def _layers(rng, n, k, v):
    """n more (k, v) pairs shaped like k, v, spare pages NaN like make_problem's."""
    out = []
    for _ in range(n):
        k2 = rng.standard_normal(k.shape).astype(k.dtype)
        v2 = rng.standard_normal(v.shape).astype(v.dtype)
        k2[np.isnan(k).any(axis=(1, 2, 3))] = np.nan
        v2[np.isnan(v).any(axis=(1, 2, 3))] = np.nan
        out.append((k2, v2))
    return out


CASES = {
    "decode": dict(seqlen_q=1, kw=dict(mask_type="bottom_right", window_size_right=0)),
    "prefill_causal": dict(seqlen_q=37, kw=dict(mask_type="bottom_right", window_size_right=0)),
    "decode_split_alibi": dict(
        seqlen_q=1, kw=dict(num_splits=2, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    ),
    "window_sinks": dict(
        seqlen_q=5,
        kw=dict(
            mask_type="top_left",
            window_size_left=3,
            window_size_right=0,
            sink_size=2,
            sinks=np.array([0.5, -1.0, 0.0, 2.0], np.float32),
        ),
    ),
}


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_once_run_many_layers(explicit_session, online_session, rng, formulation, case):
    session = explicit_session if formulation == "explicit" else online_session
    c = CASES[case]
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=3,
        seqlen_q=c["seqlen_q"],
        seqlens_k=[40, 17, 70],
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=k.shape[0],
        page_block_size=16,
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        dtype="f16",
        seqlen_q=c["seqlen_q"],
        **c["kw"],
    )
    for kl, vl in [(k, v)] + _layers(rng, 2, k, v):
        ql = rng.standard_normal(q.shape).astype(np.float16)
        out, lse = attn.run(ql, kl, vl, return_lse=True)
        kw = {n: x for n, x in c["kw"].items() if n != "num_splits"}
        ref, ref_lse = fmha_fwd_paged_ref(ql, kl, vl, bt, sk, **kw)
        _check(out, lse, ref, ref_lse, "f16")
        # The one-shot API is a plan and a run: the same bits.
        one = turbine_fmha.fmha_fwd_paged(ql, kl, vl, bt, sk, session=session, **c["kw"])
        np.testing.assert_array_equal(out, one)


SINKS_CASES = {
    "decode": dict(seqlen_q=1),
    "decode_split": dict(seqlen_q=1, num_splits=2),
    "prefill": dict(seqlen_q=37),
    "group_mixed": dict(seqstart_q=[0, 3, 4, 4, 10]),  # prefills and decodes: two parts
}


def _rel(out, ref):
    return np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("formulation", ["explicit", "online"])
@pytest.mark.parametrize("case", sorted(SINKS_CASES))
def test_each_run_brings_its_own_sinks(explicit_session, online_session, rng, monkeypatch, formulation, case):
    """Sinks are weights of each layer (gpt-oss): a plan made with one
    layer's serves every layer, each run with its own (numpy or torch),
    and a run without sinks takes the plan's. Each run's sinks move the
    output by far more than the tolerance, so a run given the plan's
    sinks instead would fail."""
    session = explicit_session if formulation == "explicit" else online_session
    c = dict(SINKS_CASES[case])
    starts = c.pop("seqstart_q", None)
    batch = 4 if starts else 3
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=batch,
        seqlen_q=c.pop("seqlen_q", 1),
        seqlens_k=[40, 17, 70, 23][:batch],
        nhead_q=8,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    mask = dict(mask_type="bottom_right", window_size_right=0)
    if starts:
        starts = np.array(starts, np.int32)
        q = rng.standard_normal((int(starts[-1]), 8, 64)).astype(np.float16)
        mask["seqstart_q"] = starts
    planned = rng.uniform(-2, 0, 8).astype(np.float32)
    plan_kw = dict(
        num_pages=k.shape[0],
        page_block_size=16,
        nhead_q=8,
        nhead_k=2,
        hdim=64,
        dtype="f16",
        seqlen_q=q.shape[1] if q.ndim == 4 else 1,
        sinks=planned,
        **mask,
        **c,
    )
    attn = turbine_fmha.PagedAttention(session).plan(bt, sk, **plan_kw)
    torch = pytest.importorskip("torch")
    layers = [rng.uniform(1, 3, 8).astype(np.float32) for _ in range(2)]
    for sinks in layers + [torch.from_numpy(rng.uniform(1, 3, 8).astype(np.float32)), None]:
        out, lse = attn.run(q, k, v, return_lse=True, sinks=sinks)
        own = planned if sinks is None else np.asarray(sinks)
        ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=own, **mask)
        _check(out, lse, ref, ref_lse, "f16")
        if sinks is not None:
            assert _rel(fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=planned, **mask)[0], ref) > 4 * OUT_TOL["f16"]
    # The next step's plan (a new one) finds the layers' sinks on the
    # device already (Session.sinks_uploads): nothing uploads them again.
    uploads = []
    real = Results.upload
    monkeypatch.setattr(Results, "upload", lambda self, arrays: uploads.extend(arrays) or real(self, arrays))
    again = turbine_fmha.PagedAttention(session).plan(bt, sk, **plan_kw)
    out, lse = again.run(q, k, v, return_lse=True, sinks=layers[0])
    _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=layers[0], **mask), "f16")
    assert uploads, "the new plan's tables were not seen uploading"
    assert not [a for a in uploads if a.shape == (8,) and np.array_equal(a, layers[0])]


def test_one_shot_calls_differing_in_sinks_share_a_plan(explicit_session, rng):
    """The one-shot API keys its kept plans (plan_cache) by the sinks'
    layout, not their values: layers with their own sinks share a plan,
    and each call still gets its own sinks."""
    explicit_session.plans.clear()
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=1, seqlens_k=[40, 17, 70], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    mask = dict(mask_type="bottom_right", window_size_right=0)
    for _ in range(3):
        sinks = rng.uniform(-1, 3, 8).astype(np.float32)
        out, lse = turbine_fmha.fmha_fwd_paged(
            q, k, v, bt, sk, sinks=sinks, return_lse=True, session=explicit_session, **mask
        )
        _check(out, lse, *fmha_fwd_paged_ref(q, k, v, bt, sk, sinks=sinks, **mask), "f16")
    assert len(explicit_session.plans._plans) == 1


def _sinks_plan(trap, rng, sinks):
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    attn = turbine_fmha.PagedAttention(trap).plan(
        bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, dtype="f16", sinks=sinks
    )
    return attn, (q, k, v)


RUN_SINKS_BAD = {
    "plan_without_sinks": (None, np.zeros(4, np.float32), ValueError, "plan made without sinks"),
    "shape": (
        np.zeros(4, np.float32),
        np.zeros(3, np.float32),
        ValueError,
        r"sinks must have shape \[nhead_q\] = \[4\]",
    ),
    "not_finite": (
        np.zeros(4, np.float32),
        np.float32([0, 1, np.nan, 2]),
        ValueError,
        r"sinks\[2\] = nan must be finite",
    ),
    "integers": (np.zeros(4, np.float32), np.arange(4), TypeError, "sinks must be a float array"),
    "meta_tensor": (np.zeros(4, np.float32), "meta", ValueError, "sinks is a torch tensor on meta"),
}


@pytest.mark.parametrize("case", sorted(RUN_SINKS_BAD))
def test_run_refuses_bad_sinks_before_anything_runs(rng, tmp_path, case):
    planned, sinks, exc, words = RUN_SINKS_BAD[case]
    attn, (q, k, v) = _sinks_plan(_TrapSession("cpu", artifact_dir=tmp_path), rng, planned)
    if isinstance(sinks, str):
        sinks = pytest.importorskip("torch").zeros(4, device=sinks)
    out = np.full(q.shape, np.nan, np.float16)
    with pytest.raises(exc, match=words):
        attn.run(q, k, v, out=out, sinks=sinks)
    assert np.isnan(out).all()


def test_group_mode_plan(explicit_session, rng):
    lens_q = [3, 1, 0, 6]
    seqstart = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    _, k, v, bt, sk = make_problem(
        rng, dtype="bf16", batch=4, seqlen_q=1, seqlens_k=[20, 33, 5, 16], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    attn = turbine_fmha.PagedAttention(explicit_session).plan(
        bt,
        sk,
        seqstart_q=seqstart,
        num_pages=k.shape[0],
        page_block_size=16,
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        dtype=k.dtype,
        mask_type="bottom_right",
        window_size_right=0,
    )
    for kl, vl in [(k, v)] + _layers(rng, 1, k, v):
        q = rng.standard_normal((int(seqstart[-1]), 4, 64)).astype(k.dtype)
        out, lse = attn.run(q, kl, vl, return_lse=True)
        ref, ref_lse = fmha_fwd_paged_ref(
            q, kl, vl, bt, sk, seqstart_q=seqstart, mask_type="bottom_right", window_size_right=0
        )
        _check(out, lse, ref, ref_lse, "bf16")


@pytest.fixture
def planned(rng, tmp_path):
    trap = _TrapSession("cpu", artifact_dir=tmp_path)
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    attn = turbine_fmha.PagedAttention(trap).plan(
        bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, dtype="f16", seqlen_q=3
    )
    return attn, (q, k, v)


RUN_BAD = {
    "k_cache_pages": (lambda q, k, v: (q, k[:-1], v), ValueError, "k_cache must have shape"),
    "v_cache_dtype": (lambda q, k, v: (q, k, v.astype(np.float32)), ValueError, "v_cache must have shape"),
    "q_rows": (lambda q, k, v: (q[:, :2], k, v), ValueError, "q must have shape"),
    "q_dtype": (lambda q, k, v: (q.astype(np.float32), k, v), ValueError, "q must have shape"),
}


@pytest.mark.parametrize("case", sorted(RUN_BAD))
def test_run_with_arrays_unlike_the_plan(planned, case):
    attn, arrays = planned
    mutate, exc, words = RUN_BAD[case]
    with pytest.raises(exc, match=words):
        attn.run(*mutate(*arrays))


def test_run_with_a_tensor_on_another_device(planned):
    torch = pytest.importorskip("torch")
    attn, (q, k, v) = planned
    with pytest.raises(ValueError, match="k_cache is a torch tensor on meta"):
        attn.run(q, torch.from_numpy(k).to("meta"), v)


PLAN_BAD = {
    "page_out_of_range": (lambda bt, sk: (np.where(bt == bt[0, 0], 10**6, bt), sk), "block_table[0, 0]"),
    "seqlen_k_capacity": (lambda bt, sk: (bt, np.array([20, 10**6], np.int32)), "seqlen_k[1]"),
    "seqlen_k_rows": (lambda bt, sk: (bt, sk[:1]), "seqlen_k has 1 entries"),
    "block_table_float": (lambda bt, sk: (bt.astype(np.float32), sk), "block_table must be an integer array"),
}


@pytest.mark.parametrize("case", sorted(PLAN_BAD))
def test_plan_refuses_bad_tables_before_anything_runs(rng, tmp_path, case):
    trap = _TrapSession("cpu", artifact_dir=tmp_path)
    _, k, _, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    mutate, words = PLAN_BAD[case]
    with pytest.raises((ValueError, TypeError), match=words.replace("[", r"\[")):
        turbine_fmha.PagedAttention(trap).plan(
            *mutate(bt, sk), num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, dtype="f16"
        )


def test_run_before_plan(explicit_session, rng):
    with pytest.raises(RuntimeError, match="before plan"):
        turbine_fmha.PagedAttention(explicit_session).run(
            *make_problem(rng, dtype="f16", batch=1, seqlen_q=1, seqlens_k=[3], nhead_q=4, nhead_k=2, hdim=64, page=16)[
                :3
            ]
        )


def test_run_neither_copies_nor_allocates_for_the_cache(explicit_session, rng):
    """A 256 MB pool per cache, read in place: run() allocates on the host
    nothing near the cache's size, and both caches reach the kernel as
    imports of their own memory (no IREE upload)."""
    pages, page, hk, d = 4096, 16, 2, 512
    k = aligned_zeros((pages, page, hk, d), np.float16)
    v = aligned_zeros((pages, page, hk, d), np.float16)
    bt = np.array([[7, 4000, 123]], np.int32)
    sk = np.array([40], np.int32)
    for p in bt[0]:
        k[p] = rng.standard_normal((page, hk, d)).astype(np.float16)
        v[p] = rng.standard_normal((page, hk, d)).astype(np.float16)
    q = rng.standard_normal((1, 1, 4, d)).astype(np.float16)
    attn = turbine_fmha.PagedAttention(explicit_session).plan(
        bt, sk, num_pages=pages, page_block_size=page, nhead_q=4, nhead_k=hk, hdim=d, dtype="f16"
    )
    imported = []
    real = explicit_session.import_host

    def spy(a, *alignment):
        r = real(a, *alignment)
        imported.append((a.nbytes, r is not None and r._host_keepalive is a))
        return r

    explicit_session.import_host = spy
    try:
        attn.run(q, k, v)  # loads the kernel and imports the caches
        tracemalloc.start()
        out = attn.run(q, k, v)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        del explicit_session.import_host
    # Imported by the first run, reused by the next (Session.kernel_cache).
    assert imported == [(k.nbytes, True), (v.nbytes, True)]
    assert peak < 4 << 20, f"run() allocated {peak / 2**20:.1f} MB on the host"
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk)
    assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()


def test_a_kernel_built_on_first_use_keeps_the_plans_cache_imports(tmp_path, rng):
    """The first run() of a kernel not built yet builds it, and its host
    caches are imported once, by that run, whatever alignment the new
    artifact records: the next run imports nothing."""
    s = turbine_fmha.Session("cpu", compile_missing=True, cache_dir=tmp_path, artifact_dir=tmp_path / "none")
    pages, page, hk, d = 8, 16, 1, 32
    k = aligned_zeros((pages, page, hk, d), np.float16)
    v = aligned_zeros((pages, page, hk, d), np.float16)
    k[...] = rng.standard_normal(k.shape)
    v[...] = rng.standard_normal(v.shape)
    bt, sk = np.array([[3, 5]], np.int32), np.array([20], np.int32)
    q = rng.standard_normal((1, 1, 2, d)).astype(np.float16)
    attn = turbine_fmha.PagedAttention(s).plan(
        bt, sk, num_pages=pages, page_block_size=page, nhead_q=2, nhead_k=hk, hdim=d, dtype="f16"
    )
    imported = []
    real = s.import_host
    s.import_host = lambda a, *alignment: imported.append(a.nbytes) or real(a, *alignment)
    for _ in range(3):
        out = attn.run(q, k, v)
    assert imported == [k.nbytes, v.nbytes]
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk)
    assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()


def test_run_reads_each_layers_cache_as_it_is_now(explicit_session, rng):
    """A plan keeps its imports of host caches (Session.kernel_cache): runs
    over several layers' caches must each read their own, and a cache
    written in place between runs (a step's appends) must be read as it is
    now, aligned (imported) or not (copied per call)."""
    shape = dict(dtype="f16", batch=2, seqlen_q=1, seqlens_k=[40, 17], nhead_q=4, nhead_k=2, hdim=64, page=16)
    q, k, v, bt, sk = make_problem(rng, **shape)
    layers = [(q, _aligned_copy(k), _aligned_copy(v))]
    layers.append((q, _aligned_copy(k * 2), _aligned_copy(v * 3)))
    layers.append((q, _at_offset(k + 1, 2), v))  # less aligned than any kernel assumes: copied per call
    attn = turbine_fmha.PagedAttention(explicit_session).plan(
        bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, dtype="f16"
    )
    used = np.concatenate([bt[b, : -(-n // 16)] for b, n in enumerate(sk)])
    for _ in range(2):
        for q, k, v in layers:
            out = attn.run(q, k, v)
            ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk)
            assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()
        for _, k, v in layers:  # new values in the used pages, in place
            k[used] = rng.standard_normal(k[used].shape).astype(np.float16)
            v[used] = rng.standard_normal(v[used].shape).astype(np.float16)


def test_numpy_caches_at_malloc_alignment_are_read_in_place(explicit_session, rng, monkeypatch):
    """CPU artifacts assume 16-byte aligned arguments
    (build.targets.CPU_BINDING_ALIGNMENT, recorded per manifest entry), the
    alignment numpy's own allocations have: a numpy cache 16 but not 64
    bytes aligned is read in place, where at IREE's default of 64 it was
    copied, aligned, on every call (as called on the CPU, that copy cost
    as much as a decode's attention). An entry without the field (built
    before) assumes 64, and the same caches are then copied. Each output
    against the float64 reference."""
    shape = dict(dtype="f16", batch=2, seqlen_q=1, seqlens_k=[40, 17], nhead_q=4, nhead_k=2, hdim=64, page=16)
    q, k, v, bt, sk = make_problem(rng, **shape)
    k, v = _at_offset(k, 16), _at_offset(v, 16)
    attn = turbine_fmha.PagedAttention(explicit_session).plan(
        bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, dtype="f16"
    )
    imported = []
    real = explicit_session.import_host

    def spy(a, *alignment):
        r = real(a, *alignment)
        imported.append(r is not None and r._host_keepalive is a and a.base is not None and a.base is k.base)
        return r

    monkeypatch.setattr(explicit_session, "import_host", spy, raising=False)
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk)
    out = attn.run(q, k, v)
    assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()
    variant = explicit_session.last_variant
    assert explicit_session.binding_alignment(variant) == 16
    assert imported and imported[0]  # k itself, not a copy
    monkeypatch.delitem(explicit_session._index[variant.name], "binding_alignment")
    imported.clear()
    out = attn.run(q, k, v)
    assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()
    assert imported and not any(imported)  # copies


def _at_offset(a, offset: int):
    """A copy of `a` whose memory starts `offset` bytes past a 64-byte
    boundary."""
    raw = np.empty(a.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == offset
    return out


def _aligned_copy(a):
    out = aligned_zeros(a.shape, a.dtype)
    out[...] = a
    return out


JOINED = {
    # (formulation, batch, rows): calls along the rows (the explicit
    # kernels' 64-row chunks of a causal mask; online 128-row tiles, the
    # last one padded) or along the batch (online tiles of one sequence);
    # or one call whose tile pads the batch (a decode), cut to it.
    "explicit_rows": ("explicit", 2, 150),
    "online_rows_padded": ("online", 1, 200),
    "online_batch": ("online", 3, 128),
    "online_one_padded_tile": ("online", 3, 1),
}


@pytest.mark.parametrize("arrays", ["numpy", "torch"])
@pytest.mark.parametrize("case", sorted(JOINED))
def test_calls_tiling_the_outputs_are_joined(explicit_session, online_session, rng, allocations, case, arrays):
    """A call run as several kernel calls that tile its outputs along one
    axis gets each output as one concatenation of their results (cut to
    their rows): nothing is allocated, filled and placed per call (on a
    GPU each was a host launch), and a given `out` is filled in place.
    One call with a padded tile returns its results cut to the batch:
    contiguous views, no copy. Checked against the float64 reference,
    LSE included."""
    import torch

    formulation, batch, rows = JOINED[case]
    session = explicit_session if formulation == "explicit" else online_session
    q, k, v, bt, sk = make_problem(
        rng,
        dtype="f16",
        batch=batch,
        seqlen_q=rows,
        seqlens_k=[rows + 10 * i for i in range(batch)],
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        page=16,
    )
    kw = dict(mask_type="bottom_right", window_size_right=0)
    attn = turbine_fmha.PagedAttention(session).plan(
        bt,
        sk,
        num_pages=k.shape[0],
        page_block_size=16,
        nhead_q=4,
        nhead_k=2,
        hdim=64,
        dtype="f16",
        seqlen_q=rows,
        **kw,
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    if arrays == "torch":
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    out, lse = attn.run(q, k, v, return_lse=True)
    steps = next(iter(attn._plan._steps.values()))
    one = case == "online_one_padded_tile"
    assert (len(steps) == 1 and steps[0].tile[0] > batch) if one else len(steps) > 1, [st.tile for st in steps]
    assert not allocations, f"{len(steps)} calls, allocated {allocations}"
    assert isinstance(out, type(q)) and isinstance(lse, type(q))
    if one:
        assert out.shape == q.shape and (out.is_contiguous() if arrays == "torch" else out.flags.c_contiguous)
    _check(np.asarray(out), np.asarray(lse), ref, ref_lse, "f16")

    poison = np.full(q.shape, np.nan, np.float16)
    given = torch.from_numpy(poison.copy()) if arrays == "torch" else poison.copy()
    got = attn.run(q, k, v, out=given)
    assert got is given
    _check(np.asarray(given), np.asarray(lse), ref, ref_lse, "f16")
