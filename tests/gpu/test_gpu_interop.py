"""fmha_fwd_paged and PagedAttention with torch CUDA tensors, against the
float64 reference (the former probe h200_torch_interop.py's checks,
without its timings): host numpy caches on a GPU session; torch CUDA q
and caches read in place (DLPack), results made on the GPU; one plan run
over several layers' caches, and caches of another shape refused; NaN in
the stale rows (K only: the unguarded kernel; K and V: the guarded one);
NaN in q and in a visible key (exactly the reference's NaN rows); fp8
torch caches; a long single decode split and merged, with its LSE; a
varlen batch of prefills and decodes; a non-paged cache with
cache_batch_idx into a torch out; a CUDA tensor refused by a CPU session.

Decode batches are 32 x 4096 keys (1024 in the CPU dry run), GQA 32/8,
head dim 128, pages of 16; two sequences of each are checked against the
reference."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import HK, HQ, MASK, PAGE, D, check, host, queries, seqstart

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _pool(rng, pages):
    k = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    return k, v


@pytest.fixture(scope="module")
def decode(gpu):
    """A decode batch of 32 with 5 stale rows at each sequence's end: host
    arrays, the same on the device, the reference of two sequences."""
    rng = np.random.default_rng(0)
    b, keys = 32, 1024 if gpu.dry_run else 4096
    pages = b * keys // PAGE
    k, v = _pool(rng, pages + 1)
    bt = rng.permutation(pages + 1)[:pages].reshape(b, -1).astype(np.int32)
    sl = np.full(b, keys - 5, np.int32)
    q = queries(rng, 1, batch=b)
    sample = [0, b - 1]
    ref, _ = fmha_fwd_paged_ref(q[sample], k, v, bt[sample], sl[sample])
    qt, kt, vt = (gpu.tensor(x) for x in (q, k, v))
    return dict(q=q, k=k, v=v, bt=bt, sl=sl, qt=qt, kt=kt, vt=vt, sample=sample, ref=ref)


def test_decode_host_caches(gpu, decode):
    d = decode
    out = turbine_fmha.fmha_fwd_paged(d["q"], d["k"], d["v"], d["bt"], d["sl"], session=gpu.session, device=gpu.device)
    assert isinstance(out, np.ndarray)
    check(out[d["sample"]], d["ref"])


def test_decode_torch_caches_in_place(gpu, decode):
    d = decode
    out = turbine_fmha.fmha_fwd_paged(
        d["qt"], d["kt"], d["vt"], d["bt"], d["sl"], session=gpu.session, device=gpu.device
    )
    assert isinstance(out, torch.Tensor) and str(out.device) == gpu.torch_device
    check(out[d["sample"]], d["ref"])


def test_plan_once_run_layers(gpu, decode):
    """Planned once, run over three layers' caches twice (the second pass
    reuses what each run bound); then a shorter k_cache and a v_cache
    resized in place (the same tensor, bound before) are refused."""
    d = decode
    rng = np.random.default_rng(1)
    pages = d["kt"].shape[0]
    attn = turbine_fmha.PagedAttention(gpu.session).plan(
        d["bt"], d["sl"], num_pages=pages, page_block_size=PAGE, nhead_q=HQ, nhead_k=HK, hdim=D, dtype="f16"
    )
    layers = [(d["kt"], d["vt"])] + [tuple(gpu.tensor(x) for x in _pool(rng, pages)) for _ in (1, 2)]
    s = d["sample"]
    refs = [fmha_fwd_paged_ref(d["q"][s], host(kk), host(vv), d["bt"][s], d["sl"][s])[0] for kk, vv in layers]
    for _ in range(2):
        for (kk, vv), ref in zip(layers, refs):
            check(attn.run(d["qt"], kk, vv)[s], ref)
    with pytest.raises(ValueError):
        attn.run(d["qt"], layers[1][0][:-1], layers[1][1])
    resized = layers[2][1]
    resized.resize_(pages - 1, PAGE, HK, D)
    with pytest.raises(ValueError):
        attn.run(d["qt"], layers[2][0], resized)


def test_nan_stale_rows(gpu, decode):
    """NaN in the rows past sequence 3's keys: in K only the score mask
    removes it and the unguarded kernel runs; in V as well the guarded one
    must. Both outputs finite and right."""
    d = decode
    page = int(d["bt"][3, -1])
    k_nan, v_nan = d["kt"].clone(), d["vt"].clone()
    k_nan[page, PAGE - 5 :] = float("nan")
    v_nan[page, PAGE - 5 :] = float("nan")
    for vv, guarded in ((d["vt"], False), (v_nan, True)):
        out = turbine_fmha.fmha_fwd_paged(d["qt"], k_nan, vv, d["bt"], d["sl"], session=gpu.session, device=gpu.device)
        assert not torch.isnan(out).any().item()
        assert gpu.session.last_variant.v_guard == guarded, gpu.session.last_variant.name
        check(out[d["sample"]], d["ref"])


def test_nan_propagates_as_the_reference(gpu, decode):
    """The guarded kernel with NaN where the reference propagates it too (a
    q row; a visible key's K): the NaN outputs are exactly the
    reference's, and stale NaN rows add none."""
    d = decode
    qn, kn, vn = d["q"].copy(), d["k"].copy(), d["v"].copy()
    page = int(d["bt"][3, -1])
    kn[page, PAGE - 5 :] = np.nan
    vn[page, PAGE - 5 :] = np.nan
    qn[5, 0, 7, 0] = np.nan
    kn[int(d["bt"][9, 2]), 3, 1, 0] = np.nan  # key 35 of sequence 9, KV head 1 (query heads 4-7)
    out = turbine_fmha.fmha_fwd_paged(
        gpu.tensor(qn), gpu.tensor(kn), gpu.tensor(vn), d["bt"], d["sl"], session=gpu.session, device=gpu.device
    )
    assert gpu.session.last_variant.v_guard
    rows = [3, 5, 9]
    ref, _ = fmha_fwd_paged_ref(qn[rows], kn, vn, d["bt"][rows], d["sl"][rows])
    got = torch.isnan(out).cpu().numpy()
    np.testing.assert_array_equal(got[rows], np.isnan(ref))
    assert np.isnan(ref).any()
    assert not got[[i for i in range(len(d["sl"])) if i not in rows]].any()


def test_fp8_torch_caches(gpu, decode):
    """e4m3fn torch caches, imported as their bytes, f16 q."""
    import ml_dtypes

    d = decode
    k8, v8 = d["kt"].to(torch.float8_e4m3fn), d["vt"].to(torch.float8_e4m3fn)
    out = turbine_fmha.fmha_fwd_paged(
        d["qt"], k8, v8, d["bt"], d["sl"], k_scale=0.5, v_scale=2.0, session=gpu.session, device=gpu.device
    )
    k8h, v8h = (t.cpu().view(torch.int8).numpy().view(ml_dtypes.float8_e4m3fn) for t in (k8, v8))
    s = d["sample"]
    ref, _ = fmha_fwd_paged_ref(d["q"][s], k8h, v8h, d["bt"][s], d["sl"][s], k_scale=0.5, v_scale=2.0)
    check(out[s], ref)


@pytest.mark.parametrize("splits", [1, None], ids=["unsplit", "auto-split"])
def test_long_single_decode(gpu, splits):
    """One sequence of 32k keys (8k in the dry run), whole and split (the
    splits merged on the device), with its LSE."""
    rng = np.random.default_rng(2)
    keys = 8192 if gpu.dry_run else 32768
    k, v = _pool(rng, keys // PAGE)
    bt = rng.permutation(keys // PAGE)[None].astype(np.int32)
    sl = np.array([keys], np.int32)
    q = queries(rng, 1, batch=1)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sl)
    out, lse = turbine_fmha.fmha_fwd_paged(
        gpu.tensor(q),
        gpu.tensor(k),
        gpu.tensor(v),
        bt,
        sl,
        num_splits=splits,
        return_lse=True,
        session=gpu.session,
        device=gpu.device,
    )
    assert str(out.device) == gpu.torch_device
    check(out, ref, "f16", lse, ref_lse)


def test_varlen_prefills_and_decodes(gpu):
    """Two prefills and two decodes in one group-mode call, causal."""
    rng = np.random.default_rng(3)
    lens_q, lens_k = [300, 1, 77, 1], [300, 2000, 500, 17]
    need = [-(-n // PAGE) for n in lens_k]
    k, v = _pool(rng, sum(need))
    perm = rng.permutation(sum(need)).astype(np.int32)
    bt = np.full((4, max(need)), -1, np.int32)
    at = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[at : at + n]
        at += n
    sl = np.array(lens_k, np.int32)
    q = queries(rng, sum(lens_q))
    kw = dict(seqstart_q=seqstart(lens_q), **MASK)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sl, **kw)
    out, lse = turbine_fmha.fmha_fwd_paged(
        gpu.tensor(q),
        gpu.tensor(k),
        gpu.tensor(v),
        bt,
        sl,
        return_lse=True,
        session=gpu.session,
        device=gpu.device,
        **kw,
    )
    check(out, ref, "f16", lse, ref_lse)


def test_non_paged_cache_into_out(gpu, decode):
    """fmha_fwd_kvcache over [batch, keys, hk, d] caches picked by
    cache_batch_idx, into a preallocated torch out (returned as is)."""
    d = decode
    rows = 1024 if gpu.dry_run else 4096
    kc = d["kt"][: 8 * rows // PAGE].reshape(8, rows, HK, D)
    vc = d["vt"][: 8 * rows // PAGE].reshape(8, rows, HK, D)
    idx = np.array([5, 0, 7, 2], np.int32)
    sl = np.array([rows, 100, rows // 2 + 1, 1], np.int32)
    q = d["q"][:4].copy()
    out = torch.empty((4, 1, HQ, D), dtype=torch.float16, device=gpu.torch_device)
    got = turbine_fmha.fmha_fwd_kvcache(
        gpu.tensor(q), kc, vc, sl, cache_batch_idx=idx, out=out, session=gpu.session, device=gpu.device
    )
    assert got is out
    k4, v4 = host(kc).astype(np.float16), host(vc).astype(np.float16)
    per = rows // 128
    bt = (idx[:, None] * per + np.arange(per)[None, :]).astype(np.int32)  # pages of 128 rows
    ref, _ = fmha_fwd_paged_ref(q, k4.reshape(-1, 128, HK, D), v4.reshape(-1, 128, HK, D), bt, sl)
    check(out, ref)


def test_cuda_tensor_refused_by_a_cpu_session(gpu, decode):
    gpu.skip_on_cpu("a CUDA tensor needs a GPU")
    d = decode
    cpu = turbine_fmha.Session("cpu", artifact_dir=gpu.build / "none")
    with pytest.raises(ValueError, match="q"):
        turbine_fmha.fmha_fwd_paged(d["qt"], d["k"], d["v"], d["bt"], d["sl"], session=cpu)
