"""Shared fixtures: CPU sessions that compile missing variants into a
content-hashed cache, and a generator of paged problems with poisoned
outputs and garbage in unused block-table slots."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.core.arrays import np_dtype
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

CACHE = Path(os.environ.get("TURBINE_FMHA_TEST_CACHE", Path(__file__).resolve().parent.parent / "build" / "test-cache"))
# The host kernels the suite's sessions compile on demand into CACHE, built
# together before the first test, in parallel: one by one, as tests meet
# them, they were most of a fresh suite's time. A kernel missing from the
# list is still compiled when a test needs it; a stale name is skipped.
# TURBINE_FMHA_RECORD_KERNELS=1 rewrites the list from CACHE at the end of
# a run (do it on a fresh cache, with the whole suite).
KERNELS = Path(__file__).resolve().parent / "kernels.txt"


def pytest_sessionstart(session):
    from turbine_fmha.build import aot
    from turbine_fmha.kernels.variants import parse_kernel

    kernels = []
    for name in KERNELS.read_text().split():
        try:
            kernels.append(parse_kernel(name))
        except ValueError:
            print(f"tests/kernels.txt: skipping {name} (no longer a kernel name)")
    t0 = time.perf_counter()
    results = aot.build(CACHE, ["host"], kernels, jobs=os.cpu_count())
    compiled = sum(r.rebuilt for r in results)
    if compiled:
        print(
            f"\nprebuilt {len(results)} host kernels into {CACHE} ({compiled} compiled) in "
            f"{time.perf_counter() - t0:.0f} s"
        )


def pytest_sessionfinish(session):
    if os.environ.get("TURBINE_FMHA_RECORD_KERNELS") == "1":
        import json

        m = json.loads((CACHE / "manifest.json").read_text())
        names = sorted({a["variant"] for a in m["artifacts"] if a["target"] == "host"})
        KERNELS.write_text("\n".join(names) + "\n")


class _TrapSession(turbine_fmha.Session):
    """A session whose kernels must never be reached: validation tests
    pass it to show that a bad call is refused before any kernel is chosen
    or run."""

    def run_variants(self, *a, **k):  # pragma: no cover - reaching it fails the test
        raise AssertionError("kernel ran on invalid input")

    run_variant = run_variants

    def select(self, *a, **k):
        raise AssertionError("variant selected for invalid input")


@pytest.fixture(scope="module")
def trap(tmp_path_factory):
    return _TrapSession("cpu", artifact_dir=tmp_path_factory.mktemp("empty"))


@pytest.fixture(scope="session")
def explicit_session():
    return turbine_fmha.Session("cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none")


@pytest.fixture(scope="session")
def online_session():
    return turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", formulation="online"
    )


@pytest.fixture
def allocations(monkeypatch):
    """The shapes of the arrays the runtime allocates for a call's results
    (executor.Results.empty), recorded while the test runs."""
    from turbine_fmha.runtime.executor import Results as _Results

    made = []
    empty = _Results.empty
    monkeypatch.setattr(
        _Results, "empty", lambda self, shape, dtype, **kw: made.append(tuple(shape)) or empty(self, shape, dtype, **kw)
    )
    return made


@pytest.fixture
def rng(request):
    # Fresh inputs every run; the seed is printed so a failure can be replayed.
    seed = int(os.environ.get("TURBINE_FMHA_SEED", secrets.randbits(32)))
    print(f"TURBINE_FMHA_SEED={seed}")
    return np.random.default_rng(seed)


def make_problem(
    rng, *, dtype, batch, seqlen_q, seqlens_k, nhead_q, nhead_k, hdim, page, hdim_v=None, spare_pages=3, extra_slots=2
):
    """Random paged problem: pages shuffled across sequences, unused table
    slots full of garbage (negative and out-of-range ids), spare pages in the
    pool full of NaN so that any read of them would show."""
    hdim_v = hdim_v or hdim
    dt = np_dtype(dtype)
    used = [-(-s // page) for s in seqlens_k]
    num_pages = sum(used) + spare_pages
    k_cache = rng.standard_normal((num_pages, page, nhead_k, hdim)).astype(dt)
    v_cache = rng.standard_normal((num_pages, page, nhead_k, hdim_v)).astype(dt)
    perm = rng.permutation(num_pages)
    width = max(used + [1]) + extra_slots
    garbage = np.array([-1, -7, num_pages, num_pages + 1000, 2**31 - 1], np.int64)
    block_table = rng.choice(garbage, size=(batch, width)).astype(np.int32)
    i = 0
    for b, n in enumerate(used):
        block_table[b, :n] = perm[i : i + n]
        i += n
    spare = perm[i:]
    k_cache[spare] = np.nan
    v_cache[spare] = np.nan
    q = rng.standard_normal((batch, seqlen_q, nhead_q, hdim)).astype(dt)
    return q, k_cache, v_cache, block_table, np.array(seqlens_k, np.int32)


# Output error bound: max |out - ref| / max |ref|. Inputs are exact in the
# input dtype, the kernels accumulate in f32, and the unnormalized
# probabilities P and the output are rounded to the input dtype once each:
# f16 (11-bit mantissa) 2 x 2^-11 ~ 1e-3 worst case, bound 5e-3; bf16 (8-bit)
# 2 x 2^-8 ~ 8e-3, bound 2e-2; f32 only summation-order rounding, bound 1e-5.
OUT_TOL = {"f16": 5e-3, "bf16": 2e-2, "f32": 1e-5}
# LSE absolute bound: the online (GPU) formulation folds scale*log2(e) into Q
# in the input dtype, so scores carry one input-dtype rounding (|s| <~ 5 here):
# f16 5 x 2^-11 ~ 2.5e-3, bf16 5 x 2^-8 ~ 2e-2. f32 and the explicit
# formulation's f32 scores are far tighter.
LSE_TOL = {"f16": 5e-3, "bf16": 3e-2, "f32": 1e-4}


def run_and_check(session, problem, *, dtype, **kw):
    q, k_cache, v_cache, block_table, seqlen_k = problem
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k_cache, v_cache, block_table, seqlen_k, return_lse=True, session=session, **kw
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k_cache, v_cache, block_table, seqlen_k, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == np.float32
    out64 = out.astype(np.float64)
    assert np.isfinite(out64).all(), "non-finite output"
    denom = max(np.abs(ref).max(), 1e-30)
    err = np.abs(out64 - ref).max() / denom if ref.size else 0.0
    assert err <= OUT_TOL[dtype], f"output rel err {err:.3e} > {OUT_TOL[dtype]}"
    # Rows with no visible key: output exactly 0 and LSE exactly -inf.
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert not np.isnan(lse).any()
    finite = ~empty
    if finite.any():
        lerr = np.abs(lse[finite] - ref_lse[finite]).max()
        assert lerr <= LSE_TOL[dtype], f"lse abs err {lerr:.3e} > {LSE_TOL[dtype]}"
    empty_rows = np.transpose(empty, (0, 2, 1))  # [b, sq, hq]
    assert (out64[empty_rows] == 0).all()
    return out, lse
