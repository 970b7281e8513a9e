"""Zero-copy imports own their memory.

CPU sessions hand host caches to the kernels without copying them
(Session.import_host). A strided cache view (FlashInfer's `kv[:, 0]`, an
HND permute) is first copied; that copy used to be dropped before the kernel
ran, which then read freed memory: NaN, garbage or a segfault, depending on
where the allocator put the copy. The test makes every such copy its own
anonymous mmap, unmapped the moment it is released, so a use after free is
a certain segfault instead of a rare wrong answer.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import weakref

import numpy as np
from conftest import CACHE
from tolerances import OUT_TOL

import turbine_fmha

_SCRIPT = textwrap.dedent(
    """
    import mmap, sys
    import numpy as np
    import torch
    import turbine_fmha
    import turbine_fmha.core.arrays as arrays
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    def mmap_empty(shape, dtype, alignment=64):
        dtype = np.dtype(dtype)
        n = max(1, int(np.prod(shape)) * dtype.itemsize)
        return np.frombuffer(mmap.mmap(-1, n), np.uint8)[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    arrays.aligned_empty = mmap_empty
    cache = sys.argv[1]
    session = turbine_fmha.Session("cpu", compile_missing=True, cache_dir=cache, artifact_dir=cache + "/none")
    rng = np.random.default_rng(int(sys.argv[2]))
    bt = rng.permutation(12).astype(np.int32).reshape(2, 6)
    sk = np.array([90, 70], np.int32)
    for name in ("f16", "f32", "bf16", "torch_f16_hnd"):
        dt = {"f16": np.float16, "f32": np.float32}.get(name[-3:] if name != "bf16" else "", None)
        if name == "bf16":
            import ml_dtypes
            dt = ml_dtypes.bfloat16
        kv = rng.standard_normal((12, 2, 16, 2, 64)).astype(dt or np.float16)
        q = rng.standard_normal((2, 1, 4, 64)).astype(kv.dtype)
        k, v = kv[:, 0], kv[:, 1]  # FlashInfer's kv_data[:, 0] / [:, 1]
        qa = q
        if name.startswith("torch"):
            hnd = torch.from_numpy(np.ascontiguousarray(kv.transpose(0, 1, 3, 2, 4)))  # [pages, 2, heads, page, dim]
            k, v = hnd[:, 0].permute(0, 2, 1, 3), hnd[:, 1].permute(0, 2, 1, 3)
            qa = torch.from_numpy(q)
        out = turbine_fmha.fmha_fwd_paged(qa, k, v, bt, sk, session=session)
        out = np.asarray(out.float() if name.startswith("torch") else out, np.float64)
        ref, _ = fmha_fwd_paged_ref(q, np.ascontiguousarray(kv[:, 0]), np.ascontiguousarray(kv[:, 1]), bt, sk)
        print(name, np.abs(out - ref).max() / np.abs(ref).max(), flush=True)
    """
)


def test_strided_caches_copied_copies_outlive_the_kernel(rng, tmp_path):
    script = tmp_path / "lifetime.py"
    script.write_text(_SCRIPT)
    seed = int(rng.integers(2**31))
    proc = subprocess.run(
        [sys.executable, str(script), str(CACHE), str(seed)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (-11: SIGSEGV, a kernel read a freed copy)\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    errs = dict(line.split() for line in proc.stdout.splitlines())
    assert set(errs) == {"f16", "f32", "bf16", "torch_f16_hnd"}, proc.stdout
    # One rounding of P and of the output in the cache's dtype (tolerances.py).
    tol = {**OUT_TOL, "torch_f16_hnd": OUT_TOL["f16"]}
    for name, err in errs.items():
        assert float(err) <= tol[name], f"{name}: rel err {err}"


def test_imported_buffer_keeps_its_source_alive(explicit_session):
    """The structural guarantee behind the test above: whoever holds the
    imported buffer holds the array it reads."""
    from turbine_fmha.core.arrays import aligned_empty

    a = aligned_empty((64, 16), np.float32)
    a[...] = 1.5
    gone = weakref.ref(a.base if a.base is not None else a)
    dev = explicit_session.import_host(a)
    assert dev is not None
    del a
    assert gone() is not None, "the imported buffer does not own its memory"
    np.testing.assert_array_equal(dev.to_host(), np.full((64, 16), 1.5, np.float32))
    del dev
    assert gone() is None


def test_torch_results_outlive_the_kernel_buffers(explicit_session, rng):
    """torch results on the session's device are DLPack views of IREE
    buffers: the views, not the call, must own them. Later calls would
    reuse freed buffers and overwrite a result that did not."""
    import gc

    import torch
    from conftest import make_problem

    p = make_problem(rng, dtype="f32", batch=2, seqlen_q=5, seqlens_k=[40, 17], nhead_q=4, nhead_k=2, hdim=64, page=16)
    q = torch.from_numpy(p[0])
    out, lse = turbine_fmha.fmha_fwd_paged(q, *p[1:], session=explicit_session, return_lse=True)
    keep = out.clone(), lse.clone()
    gc.collect()
    for _ in range(5):
        turbine_fmha.fmha_fwd_paged(
            torch.from_numpy(rng.standard_normal(p[0].shape).astype(np.float32)),
            *p[1:],
            session=explicit_session,
            return_lse=True,
        )
    assert torch.equal(out, keep[0]) and torch.equal(lse, keep[1])
