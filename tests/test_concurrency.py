"""One session, many threads: concurrent calls give exactly the
results of the same calls made one after another, and the async entry point
returns futures of the same results. Each thread runs its own VM context
(runtime.Loaded), so the calls really overlap."""

from __future__ import annotations

import threading

import numpy as np
from conftest import make_problem

import turbine_fmha


def _problems(rng, n):
    probs = []
    for i in range(n):
        b = int(rng.integers(1, 4))
        sq = int(rng.choice([1, int(rng.integers(2, 40))]))
        probs.append(
            (
                make_problem(
                    rng,
                    dtype="f16",
                    batch=b,
                    seqlen_q=sq,
                    seqlens_k=[int(rng.integers(0, 120)) for _ in range(b)],
                    nhead_q=8,
                    nhead_k=2,
                    hdim=64,
                    page=16,
                ),
                dict(mask_type="bottom_right", window_size_right=0) if i % 2 else {},
            )
        )
    return probs


def _call(session, prob, kw):
    return turbine_fmha.fmha_fwd_paged(*prob, return_lse=True, session=session, **kw)


def test_threads_match_serial_calls(explicit_session, rng):
    probs = _problems(rng, 16)
    serial = [_call(explicit_session, p, kw) for p, kw in probs]
    n_threads, rounds = 8, 4
    results: dict = {}
    errors = []
    start = threading.Barrier(n_threads)

    def worker(t):
        try:
            start.wait()
            for r in range(rounds):
                i = (t * rounds + r) % len(probs)
                results[(t, r)] = (i, _call(explicit_session, *probs[i]))
        except Exception as e:  # surfaced below with the thread's id
            errors.append((t, e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(results) == n_threads * rounds
    for i, (out, lse) in results.values():
        np.testing.assert_array_equal(out, serial[i][0])
        np.testing.assert_array_equal(lse, serial[i][1])


def test_async_futures(explicit_session, rng):
    probs = _problems(rng, 6)
    futures = [
        turbine_fmha.fmha_fwd_paged_async(*p, return_lse=True, session=explicit_session, **kw) for p, kw in probs
    ]
    for (p, kw), fut in zip(probs, futures):
        out, lse = fut.result(timeout=300)
        want_out, want_lse = _call(explicit_session, p, kw)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
    # Errors come back through the future.
    q, k, v, bt, sk = probs[0][0]
    bad = turbine_fmha.fmha_fwd_paged_async(q, k, v, bt, sk, mask_type="diagonal", session=explicit_session)
    try:
        bad.result(timeout=60)
    except ValueError as e:
        assert "mask_type" in str(e)
    else:
        raise AssertionError("invalid mask_type was accepted")


def test_sessions_share_device_and_modules(rng):
    """Two sessions on one device share the IREE device and each loaded
    module (runtime._CONFIGS / _MODULES), and still compute the same."""
    from conftest import CACHE

    from turbine_fmha.runtime import session as runtime

    kw = dict(compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none")
    a, b = turbine_fmha.Session("cpu", **kw), turbine_fmha.Session("cpu", **kw)
    prob, _ = _problems(rng, 1)[0]
    out_a = turbine_fmha.fmha_fwd_paged(*prob, session=a)
    out_b = turbine_fmha.fmha_fwd_paged(*prob, session=b)
    np.testing.assert_array_equal(out_a, out_b)
    assert a.device_of() is b.device_of()
    va, vb = a._load(a.last_variant), b._load(b.last_variant)
    assert va.vm_module is vb.vm_module
    assert len({id(m) for m in runtime._MODULES.values()}) == len(runtime._MODULES)
