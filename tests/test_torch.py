"""torch tensors in, torch tensors out (CPU). With q on the session's own
device the results are made there by torch from DLPack views of the
kernels' buffers (executor.Results): these tests run that path on the CPU, the
same code that keeps CUDA results on the GPU (tests/gpu/test_gpu_interop.py
checks it there)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import make_problem  # noqa: E402
from tolerances import LSE_TOL_F32_SCORES, OUT_TOL  # noqa: E402

import turbine_fmha  # noqa: E402
from turbine_fmha.testing.reference import fmha_fwd_paged_ref  # noqa: E402


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_torch_roundtrip(explicit_session, rng, dtype):
    prob = make_problem(
        rng, dtype=dtype, batch=2, seqlen_q=5, seqlens_k=[40, 9], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    tq, tk, tv = (
        torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if dtype == "bf16" else torch.from_numpy(a)
        for a in prob[:3]
    )
    out, lse = turbine_fmha.fmha_fwd_paged(
        tq,
        tk,
        tv,
        torch.from_numpy(prob[3]),
        torch.from_numpy(prob[4]),
        mask_type="bottom_right",
        window_size_right=0,
        return_lse=True,
        session=explicit_session,
    )
    assert isinstance(out, torch.Tensor) and out.dtype == tq.dtype and out.shape == tq.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    ref, _ = fmha_fwd_paged_ref(*prob, mask_type="bottom_right", window_size_right=0)
    err = np.abs(out.float().numpy() - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL[dtype]


def _t(a):
    return (
        torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype.name == "bfloat16" else torch.from_numpy(a)
    )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_torch_results_group_mode_and_splits(explicit_session, rng, num_splits):
    """Group mode (rows regrouped by torch), skipped sequences
    (min_seqlen_q), sinks and split-KV (merged by combine_splits_torch) on
    the torch path against the reference."""
    lens_q, lens_k = [4, 1, 0, 7], [700, 33, 5, 90]
    batch = len(lens_q)
    q4, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=batch, seqlen_q=max(lens_q), seqlens_k=lens_k, nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    q = np.concatenate([q4[b, :n] for b, n in enumerate(lens_q)])
    seqstart = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    kw = dict(
        seqstart_q=seqstart,
        mask_type="bottom_right",
        window_size_right=0,
        sinks=rng.standard_normal(4).astype(np.float32),
        min_seqlen_q=1,
    )
    out, lse = turbine_fmha.fmha_fwd_paged(
        _t(q), k, v, bt, sk, return_lse=True, num_splits=num_splits, session=explicit_session, **kw
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.shape == (q.shape[0], 4, 64)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **{a: b for a, b in kw.items() if a != "min_seqlen_q"})
    skipped = np.repeat(np.array(lens_q) <= 1, lens_q)  # sequences with seqlen_q <= min_seqlen_q
    ref[skipped] = 0.0
    ref_lse[:, skipped] = -np.inf
    err = np.abs(out.double().numpy() - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL["f16"]
    # LSE: f32 arithmetic over up to 700 keys (split merge included).
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=0, atol=LSE_TOL_F32_SCORES)


def test_torch_results_match_numpy_results(online_session, rng):
    """The torch path and the numpy path run the same kernels on the same
    padded tiles: identical bits without split-KV."""
    q, k, v, bt, sk = make_problem(
        rng, dtype="bf16", batch=3, seqlen_q=9, seqlens_k=[40, 9, 130], nhead_q=8, nhead_k=2, hdim=64, page=16
    )
    kw = dict(
        mask_type="top_left",
        window_size_left=5,
        window_size_right=0,
        num_splits=1,
        return_lse=True,
        session=online_session,
    )
    out_np, lse_np = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, **kw)
    out_t, lse_t = turbine_fmha.fmha_fwd_paged(_t(q), k, v, bt, sk, **kw)
    np.testing.assert_array_equal(out_t.view(torch.int16).numpy(), out_np.view(np.int16))
    np.testing.assert_array_equal(lse_t.numpy(), lse_np)


def test_torch_out_is_written_and_returned(explicit_session, rng):
    """A preallocated torch out on q's device is filled in place (rows of
    skipped sequences left untouched, as for numpy); a torch out with a
    numpy q, or of the wrong shape, is refused before any work."""
    lens_q = [3, 1, 2]
    q4, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=3, seqlens_k=[20, 9, 33], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    q = np.concatenate([q4[b, :n] for b, n in enumerate(lens_q)])
    seqstart = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    out = torch.full((q.shape[0], 4, 64), 7.0, dtype=torch.float16)
    got = turbine_fmha.fmha_fwd_paged(
        _t(q), k, v, bt, sk, seqstart_q=seqstart, min_seqlen_q=1, out=out, session=explicit_session
    )
    assert got is out
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, seqstart_q=seqstart)
    kept = np.repeat(np.array(lens_q) > 1, lens_q)
    assert (out[torch.from_numpy(~kept)] == 7.0).all()  # the skipped sequence's row
    err = np.abs(out.double().numpy()[kept] - ref[kept]).max() / np.abs(ref[kept]).max()
    assert err <= OUT_TOL["f16"]
    with pytest.raises(TypeError, match="torch out needs q"):
        turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, seqstart_q=seqstart, out=out, session=explicit_session)
    with pytest.raises(ValueError, match="out must have shape"):
        turbine_fmha.fmha_fwd_paged(_t(q), k, v, bt, sk, seqstart_q=seqstart, out=out[:-1], session=explicit_session)


def test_kvcache_mode_keeps_torch_caches_torch(explicit_session, rng):
    """fmha_fwd_kvcache views torch caches as pages with torch (no numpy
    round trip; on a GPU they then stay there) and gives the paged result."""
    b, max_sk = 3, 48
    k = rng.standard_normal((4, max_sk, 2, 64)).astype(np.float16)
    v = rng.standard_normal((4, max_sk, 2, 64)).astype(np.float16)
    q = rng.standard_normal((b, 2, 4, 64)).astype(np.float16)
    sk = np.array([48, 5, 30], np.int32)
    idx = np.array([3, 0, 2], np.int32)
    out = turbine_fmha.fmha_fwd_kvcache(_t(q), _t(k), _t(v), sk, cache_batch_idx=idx, session=explicit_session)
    ref = turbine_fmha.fmha_fwd_kvcache(q, k, v, sk, cache_batch_idx=idx, session=explicit_session)
    np.testing.assert_array_equal(out.numpy(), ref)


def test_unaligned_cpu_torch_caches_are_read(explicit_session, rng):
    """The attention reads CPU torch caches that are not 64-byte aligned
    (a view at an offset, torch.from_numpy of an unaligned array): they are
    copied into aligned memory for the call, as such numpy caches are.
    (Writes need aligned memory: test_kv_write refuses them.)"""
    prob = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[40, 9], nhead_q=4, nhead_k=2, hdim=64, page=16
    )

    def unaligned(a):
        t = torch.empty(a.size + 1, dtype=torch.float16)[1:].view(a.shape)
        t.copy_(torch.from_numpy(a))
        assert t.data_ptr() % 64
        return t

    out = turbine_fmha.fmha_fwd_paged(
        torch.from_numpy(prob[0]),
        unaligned(prob[1]),
        unaligned(prob[2]),
        prob[3],
        prob[4],
        causal=True,
        session=explicit_session,
    )
    ref, _ = fmha_fwd_paged_ref(*prob, mask_type="bottom_right", window_size_right=0)
    assert np.abs(out.double().numpy() - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]
