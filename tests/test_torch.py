"""torch tensors in, torch tensors out (CPU)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import turbine_fmha  # noqa: E402
from conftest import OUT_TOL, make_problem  # noqa: E402
from turbine_fmha.reference import fmha_fwd_paged_ref  # noqa: E402


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_torch_roundtrip(explicit_session, rng, dtype):
    prob = make_problem(rng, dtype=dtype, batch=2, seqlen_q=5, seqlens_k=[40, 9],
                        nhead_q=4, nhead_k=2, hdim=64, page=16)
    tq, tk, tv = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if dtype == "bf16" else torch.from_numpy(a) for a in prob[:3])
    out, lse = turbine_fmha.fmha_fwd_paged(tq, tk, tv, torch.from_numpy(prob[3]), torch.from_numpy(prob[4]),
                                          mask_type="bottom_right", window_size_right=0,
                                          return_lse=True, session=explicit_session)
    assert isinstance(out, torch.Tensor) and out.dtype == tq.dtype and out.shape == tq.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    ref, _ = fmha_fwd_paged_ref(*prob, mask_type="bottom_right", window_size_right=0)
    err = np.abs(out.float().numpy() - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL[dtype]
