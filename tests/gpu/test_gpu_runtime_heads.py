"""Head counts and head dims no variant was built for, on the GPU, against
the float64 reference (benchmarks/probes/h200_runtime_heads.py's
verification, without its timings): the online kernels reading head
counts at run time for any GQA group serve 28/4, 12/2, 16/16 and 8/1 over
NHD and head-major (HND) caches, also with NaN in the value rows past each
sequence's keys (the guarded kernels); the explicit kernels for any head
counts serve head dim 64 (no online kernel built for it) at pages of 16
and of any size (48). A decode batch with short and long sequences and a
causal prefill of 150 rows each."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import MASK, check, paged, queries

pytestmark = pytest.mark.gpu

CALLS = {"decode": (1, [5, 300, 77], {}), "prefill": (150, [150, 170, 400], MASK)}


def _call(gpu, heads, d, page, kind, kv_layout="NHD", stale_nan=False):
    (hq, hk), (rows, lens, kw) = heads, CALLS[kind]
    rng = np.random.default_rng(hq * 100 + hk)
    k, v, bt, sk = paged(rng, lens, hk=hk, d=d, page=page)
    if stale_nan:  # NaN in the value rows of each sequence's last page past its keys
        for b, n in enumerate(lens):
            if n % page:
                v[bt[b, (n - 1) // page], n % page :] = np.nan
    q = queries(rng, rows, hq=hq, d=d, batch=len(lens))
    kc, vc = (k, v) if kv_layout == "NHD" else (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, kc, vc, bt, sk, return_lse=True, kv_layout=kv_layout, session=gpu.session, device=gpu.device, **kw
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **kw)
    check(out, ref, "f16", lse, ref_lse, what=gpu.session.last_variant.name)
    return gpu.session.last_variant


@pytest.mark.parametrize("kind", list(CALLS))
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", [(28, 4), (12, 2), (16, 16), (8, 1)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_any_group_online(gpu, heads, kv_layout, kind):
    variant = _call(gpu, heads, 128, 16, kind, kv_layout)
    assert variant.formulation == "online" and variant.runtime_heads, variant.name


@pytest.mark.parametrize("kind", list(CALLS))
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_any_group_stale_nan(gpu, kv_layout, kind):
    variant = _call(gpu, (28, 4), 128, 16, kind, kv_layout, stale_nan=True)
    assert variant.v_guard, variant.name


@pytest.mark.parametrize("kind", list(CALLS))
@pytest.mark.parametrize("page", [16, 48])
@pytest.mark.parametrize("heads", [(32, 8), (12, 2)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_explicit_fallback(gpu, heads, page, kind):
    variant = _call(gpu, heads, 64, page, kind)
    assert variant.formulation == "explicit", variant.name
