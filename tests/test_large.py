"""Offsets past 2^31 elements: a K pool of more than 2^31 f16
elements, with the sequences' pages at its very end, read through the
block table. 32-bit element offsets would wrap there. The pool is 64-byte
aligned (PagedKVCache's allocation), so the CPU session reads it in place:
no copy, and only the touched pages become resident."""

from __future__ import annotations

import numpy as np
import pytest
from test_modes import _check

import turbine_fmha
from turbine_fmha.api.cache import aligned_zeros
from turbine_fmha.testing.reference import fmha_fwd_paged_ref


@pytest.mark.heavy
def test_pool_past_2_pow_31_elements(explicit_session, rng):
    page, hk, d, dv = 16, 8, 128, 8
    num_pages = (1 << 31) // (page * hk * d) + 64
    k = aligned_zeros((num_pages, page, hk, d), np.float16)
    v = aligned_zeros((num_pages, page, hk, dv), np.float16)
    assert k.size > 2**31
    used = np.array([[num_pages - 1, 5], [num_pages - 40, num_pages - 2]], np.int32)
    k[used] = rng.standard_normal(used.shape + (page, hk, d)).astype(np.float16)
    v[used] = rng.standard_normal(used.shape + (page, hk, dv)).astype(np.float16)
    sk = np.array([30, 25], np.int32)
    q = rng.standard_normal((2, 3, hk, d)).astype(np.float16)
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k, v, used, sk, mask_type="bottom_right", return_lse=True, session=explicit_session
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, used, sk, mask_type="bottom_right")
    _check(out, lse, ref, ref_lse, "f16")
