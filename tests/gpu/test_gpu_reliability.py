"""docs/reliability.md's guarantees on the GPU's kernels, against the
float64 reference (the former probes h200_reliability.py,
h200_large_pool.py and h200_deferred_check.py, without their timings):

- scores of ~1e6 and ~1e8 (three identical hot keys), whole and split:
  the output is the mean of their V rows;
- a bias of -1e30 on every key, whole and split; a NaN key under it gives
  exactly the reference's NaN rows;
- a device PagedKVCache whose freed page held +Inf cannot poison the next
  request that reuses it;
- a torch out overlapping the K cache is refused by name;
- a K pool of more than 2^31 elements, the sequences' pages at its end;
- run()'s stale-row check on torch CUDA caches: with NaN in a stale V
  row the first run() runs unguarded, finds the rows non-finite after the
  wait and runs again guarded (exact, into a poisoned out); later runs on
  that cache check first; once the rows are finite, runs are one
  unguarded kernel call again. For a decode, a causal prefill and a mixed
  batch (its decode part alone rerun).
"""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import HK, HQ, MASK, PAGE, D, check, queries, seqstart

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _problem(rng, batch=2, keys=(40, 35), pages=12):
    k = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    q = rng.standard_normal((batch, 1, HQ, D)).astype(np.float16)
    bt = rng.permutation(pages)[: batch * 3].reshape(batch, 3).astype(np.int32)
    return q, k, v, bt, np.array(keys, np.int32)


@pytest.mark.parametrize("c", [1000.0, 9984.0], ids=["1e6", "1e8"])
@pytest.mark.parametrize("splits", [1, 3])
def test_huge_scores(gpu, c, splits):
    rng = np.random.default_rng(12)
    q, k, v, bt, sk = _problem(rng)
    q[...] = 0
    q[..., 0] = c
    for b in range(2):
        for t in (3, 20, 33):
            k[bt[b, t // PAGE], t % PAGE] = 0
            k[bt[b, t // PAGE], t % PAGE, :, 0] = c
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, scale=1.0)
    out = turbine_fmha.fmha_fwd_paged(
        q, k, v, bt, sk, scale=1.0, num_splits=splits, session=gpu.session, device=gpu.device
    )
    check(out, ref, what=gpu.session.last_variant.name)


@pytest.mark.parametrize("splits", [1, 2])
def test_bias_minus_1e30_everywhere(gpu, splits):
    rng = np.random.default_rng(13)
    q, k, v, bt, sk = _problem(rng)
    bias = np.full((1, 1, 1, 48), -1e30, np.float32)
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, bias=bias)
    out = turbine_fmha.fmha_fwd_paged(
        q, k, v, bt, sk, bias=bias, num_splits=splits, session=gpu.session, device=gpu.device
    )
    check(out, ref, what=gpu.session.last_variant.name)


def test_nan_key_under_the_bias(gpu):
    rng = np.random.default_rng(14)
    q, k, v, bt, sk = _problem(rng)
    bias = np.full((1, 1, 1, 48), -1e30, np.float32)
    k[bt[0, 1], 3, 0, 5] = np.nan
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk, bias=bias)
    out = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, bias=bias, session=gpu.session, device=gpu.device)
    assert np.isnan(ref).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))


def test_freed_page_cannot_poison_the_next_request(gpu):
    """A device pool: one request stores +Inf (appends keep the pool's
    dtype) and is freed; the next reuses the page, finite and exact."""
    rng = np.random.default_rng(15)
    cache = turbine_fmha.PagedKVCache(4, PAGE, HK, D, "f16", session=gpu.session)
    a = cache.allocate()
    v_a = rng.standard_normal((6, HK, D)).astype(np.float16)
    v_a[4] = np.inf
    cache.append(a, rng.standard_normal((6, HK, D)).astype(np.float16), v_a)
    cache.free(a)
    b = cache.allocate()
    rows = (rng.standard_normal((3, HK, D)).astype(np.float16) for _ in range(2))
    cache.append(b, *rows)
    q = rng.standard_normal((1, 1, HQ, D)).astype(np.float16)
    out = cache.attend(q, [b])
    kb, vb = cache.gather(b)
    ref, _ = fmha_fwd_paged_ref(q, kb[None], vb[None], np.zeros((1, 1), np.int32), np.array([3], np.int32))
    check(out, ref, what=f"values_finite={cache.values_finite}")


def test_out_overlapping_k_cache_refused(gpu):
    rng = np.random.default_rng(16)
    q, k, v, bt, sk = _problem(rng)
    kt = gpu.tensor(k)
    out = kt.reshape(-1)[: q.size].reshape(q.shape)
    with pytest.raises(ValueError, match="out overlaps k_cache"):
        turbine_fmha.fmha_fwd_paged(
            gpu.tensor(q), kt, gpu.tensor(v), bt, sk, out=out, session=gpu.session, device=gpu.device
        )


def test_k_pool_beyond_2_31_elements(gpu):
    """8/8 heads, K of head dim 128 and V of 8, the used pages at the end
    of a pool of more than 2^31 f16 elements (4 GiB of host memory; the
    session copies the pool to the GPU)."""
    rng = np.random.default_rng(0)
    page, hk, d, dv = 16, 8, 128, 8
    num_pages = (1 << 31) // (page * hk * d) + 64
    k = turbine_fmha.aligned_zeros((num_pages, page, hk, d), np.float16)
    v = turbine_fmha.aligned_zeros((num_pages, page, hk, dv), np.float16)
    used = np.array([[num_pages - 1, 5], [num_pages - 40, num_pages - 2]], np.int32)
    k[used] = rng.standard_normal(used.shape + (page, hk, d)).astype(np.float16)
    v[used] = rng.standard_normal(used.shape + (page, hk, dv)).astype(np.float16)
    sk = np.array([30, 25], np.int32)
    q = rng.standard_normal((2, 3, hk, d)).astype(np.float16)
    out = turbine_fmha.fmha_fwd_paged(
        q, k, v, used, sk, mask_type="bottom_right", session=gpu.session, device=gpu.device
    )
    ref, _ = fmha_fwd_paged_ref(q, k, v, used, sk, mask_type="bottom_right")
    assert k.size > 2**31
    check(out, ref, what=gpu.session.last_variant.name)


# -- run()'s deferred stale-row check ---------------------------------------------

DEFERRED = {
    "decode b8": ([1] * 8, [1000, 517, 33, 2048, 700, 45, 1999, 260], False),
    "causal prefill b2 x 300": ([300, 300], [300, 300], False),
    "mixed: 3 decodes + a 200-row prefill": ([1, 200, 1, 1], [900, 200, 77, 1500], True),
}


@pytest.fixture
def kernel_runs(gpu, monkeypatch):
    """A session of its own whose kernel runs are recorded (the variants,
    in order); in the CPU dry run, with the GPU's deferred check (run()
    defers it only for torch GPU caches). The paged kernels: a prefill
    through contiguous tiles reads no stale row, and checks none."""
    session = gpu.new_session(prefill_tiles=False)
    runs = []
    run_variants = session.run_variants

    def counted(variant, *a, **k):
        runs.append(variant)
        return run_variants(variant, *a, **k)

    monkeypatch.setattr(session, "run_variants", counted)
    deferred = not gpu.dry_run
    if gpu.dry_run:
        try:
            from turbine_fmha.runtime.executor import Executor

            monkeypatch.setattr(Executor, "_defers", staticmethod(lambda v_cache: True))
            deferred = True
        except (ImportError, AttributeError):
            pass
    return session, runs, deferred


@pytest.mark.parametrize("case", list(DEFERRED))
def test_deferred_stale_row_check(gpu, kernel_runs, case):
    session, runs, deferred = kernel_runs
    rows, lens, group = DEFERRED[case]
    rng = np.random.default_rng(27)
    width = max(-(-n // PAGE) for n in lens)
    pages = len(lens) * width + 3
    bt = rng.permutation(pages)[: len(lens) * width].reshape(len(lens), width).astype(np.int32)
    sk = np.array(lens, np.int32)
    k = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D)).astype(np.float16)
    q = queries(rng, sum(rows)) if group else queries(rng, rows[0], batch=len(lens))
    starts = seqstart(rows) if group else None
    # The first sequence with a partial last page: NaN past its keys.
    b = next(i for i, n in enumerate(lens) if n % PAGE)
    nan_page, nan_row = int(bt[b, (lens[b] - 1) // PAGE]), lens[b] % PAGE
    qt, kt, vt = (gpu.tensor(a) for a in (q, k, v))
    kw = dict(seqstart_q=starts) if group else dict(seqlen_q=rows[0])
    attn = turbine_fmha.PagedAttention(session).plan(
        bt, sk, num_pages=pages, page_block_size=PAGE, nhead_q=HQ, nhead_k=HK, hdim=D, dtype="f16", **kw, **MASK
    )
    parts = 2 if group else 1  # a mixed batch runs as its decode part, then its prefill part

    def run(v_host, label):
        runs.clear()
        out = torch.full(qt.shape, float("nan"), dtype=torch.float16, device=gpu.torch_device)
        got, lse = attn.run(qt, kt, vt, out=out, return_lse=True)
        gpu.sync()
        assert got is out, label
        check(got, fmha_fwd_paged_ref(q, k, v_host, bt, sk, seqstart_q=starts, **MASK)[0], what=label)
        return [r.v_guard for r in runs]

    # Finite rows first: whatever run() remembered of this memory before
    # (a freed cache's), it now defers the check.
    run(v, "finite rows")
    v[nan_page, nan_row:] = np.nan
    vt[nan_page, nan_row:] = float("nan")
    first = [False] * parts + [True] if deferred else [True] + [False] * (parts - 1)
    assert run(v, "NaN stale row, first run") == first
    for i in (2, 3):  # checked before the kernels: guarded where it must
        assert run(v, f"NaN stale row, run {i}") == [True] + [False] * (parts - 1)
    v[nan_page, nan_row:] = 0.25
    vt[nan_page, nan_row:] = 0.25
    assert run(v, "rows made finite: checked first") == [False] * parts
    assert run(v, "rows finite: deferred again") == [False] * parts
