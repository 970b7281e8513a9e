"""Prefill through contiguous tiles (kernels.tiles_kernel, calls/tiles.py)
on the GPU, against the float64 reference: ragged varlen batches (rows
that are not whole tiles, chunked prefill over cached keys, one-row
sequences), causal and mask-free, fp16 and bf16, numpy and torch inputs;
and the same call with the tiles off (the paged kernels) as a second
opinion. The CPU dry run asks for the tiles explicitly (the CPU default
is off)."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.kernels.tiles_kernel import TilesKernel
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import HK, HQ, MASK, PAGE, D, check, paged, queries, seqstart

pytestmark = pytest.mark.gpu

# (rows, keys) per sequence (the longest past calls/tiles.MIN_ROWS): a
# long causal prefill, a chunk over 2000
# cached keys, a two-row sequence, rows just past a tile. (A one-row
# sequence would make a mixed batch, whose decodes the tiles leave to
# the decode kernels: it runs the paged kernels.)
RAGGED = ([1000, 300, 2, 129], [1000, 2300, 700, 129])
SMALL = ([600, 40, 2, 129], [600, 500, 90, 129])


@pytest.fixture(scope="module")
def tiles(gpu):
    return gpu.new_session(prefill_tiles=True)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("mask", [MASK, {}], ids=["causal", "none"])
@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
def test_ragged_prefill(gpu, tiles, dtype, mask, as_torch):
    rows, keys = SMALL if gpu.dry_run else RAGGED
    rng = np.random.default_rng(40)
    k, v, bt, sk = paged(rng, keys, dtype=dtype)
    q = queries(rng, sum(rows), dtype=dtype)
    kw = dict(seqstart_q=seqstart(rows), **mask)
    if as_torch and not gpu.dry_run:  # torch takes no ml_dtypes bfloat16: through f32
        import torch

        tdt = torch.float16 if dtype == "f16" else torch.bfloat16
        args = tuple(gpu.tensor(a.astype(np.float32)).to(tdt) for a in (q, k, v))
    else:
        args = (q, k, v)
    out, lse = turbine_fmha.fmha_fwd_paged(*args, bt, sk, return_lse=True, session=tiles, **kw)
    assert isinstance(tiles.last_variant, TilesKernel), tiles.last_variant
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    check(out, ref, dtype, lse, ref_lse)
    paged_session = gpu.new_session(prefill_tiles=False)
    out_p = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, session=paged_session, **kw)
    assert not isinstance(paged_session.last_variant, TilesKernel)
    check(out_p, ref, dtype)


def test_gpu_sessions_run_tiles_by_default(gpu):
    gpu.skip_on_cpu("the CPU default is the paged kernels")
    assert gpu.session.prefill_tiles is True


@pytest.mark.parametrize("mask", [MASK, {}], ids=["causal", "none"])
def test_row_groups_past_the_partials_budget(gpu, tiles, monkeypatch, mask):
    """A call whose partials pass calls/tiles.MAX_PARTIAL_BYTES (lowered
    here) runs as several tile calls of consecutive rows, together equal
    to the float64 reference."""
    from turbine_fmha.calls import tiles as tiling

    rows, keys = SMALL if gpu.dry_run else RAGGED
    rng = np.random.default_rng(41)
    k, v, bt, sk = paged(rng, keys)
    q = queries(rng, sum(rows))
    kw = dict(seqstart_q=seqstart(rows), **mask)
    monkeypatch.setattr(tiling, "MAX_PARTIAL_BYTES", 12 * tiling.entry_bytes(HQ, 128, D))
    shape = dict(dtype="f16", nhead_q=HQ, nhead_k=HK, hdim=D, page_block_size=PAGE, num_pages=k.shape[0])
    plan = turbine_fmha.PagedAttention(tiles).plan(bt, sk, **shape, **kw)
    assert plan._plan.plan.tiles is not None and len(plan._plan.plan.tiles) >= 2
    out, lse = plan.run(q, k, v, return_lse=True)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    check(out, ref, "f16", lse, ref_lse)
