"""How the runtime calls a loaded artifact (runtime.Loaded.invoke).

Artifacts are built async-external (targets.EXECUTION_MODEL): the entry
point takes a wait and a signal fence and the runtime waits itself.
Directories built before that hold synchronous entry points, which must
keep working, and a call that fails must not leave the thread's timeline
failed for the calls after it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import make_problem
from tolerances import OUT_TOL

import turbine_fmha
from turbine_fmha.runtime.executor import Results
from turbine_fmha.runtime.invoke import Loaded
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

SHAPE = dict(dtype="f16", batch=3, seqlen_q=1, seqlens_k=[17, 40, 5], nhead_q=4, nhead_k=2, hdim=64, page=16)


def _planned(session, rng):
    q, k, v, bt, sk = make_problem(rng, **SHAPE)
    attn = turbine_fmha.PagedAttention(session).plan(
        bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, dtype="f16"
    )
    ref, _ = fmha_fwd_paged_ref(q, k, v, bt, sk)
    return attn, (q, k, v), ref


def _args(attn, q, k, v):
    plan = attn._plan
    variant = plan.variant(0, plan._rows_finite(0, v))
    st = plan.device_steps(0, variant, Results(attn.session))[0]
    return variant, [st.q(q), k, v, *st.args]


def test_built_artifacts_are_fenced(explicit_session, rng):
    attn, (q, k, v), ref = _planned(explicit_session, rng)
    out = attn.run(q, k, v)
    loaded = explicit_session._load(explicit_session.last_variant)
    assert loaded._tls.fenced, "the runtime's own builds should take fences"
    assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()


def test_synchronous_artifact_still_runs(explicit_session, rng, tmp_path):
    """An artifact compiled without the execution-model flag (as before it
    existed) is called without fences and gives the same bits."""
    from turbine_fmha.build import compiler, targets
    from turbine_fmha.kernels.custom_ops import render_variant

    attn, (q, k, v), ref = _planned(explicit_session, rng)
    variant, args = _args(attn, q, k, v)
    fenced = explicit_session._load(variant).invoke(args, 2)[0].to_host()
    host = targets.TARGETS["host"]
    sync = dataclasses.replace(host, flags=tuple(f for f in host.flags if f != targets.EXECUTION_MODEL))
    path = tmp_path / "sync.vmfb"
    compiler.compile_one(render_variant(variant), variant.name, path, sync)
    import iree.runtime as rt

    config = explicit_session._iree_config()
    loaded = Loaded(variant, rt.VmModule.copy_buffer(config.vm_instance, Path(path).read_bytes()), config, spin=False)
    out = loaded.invoke(args, 2)[0].to_host()
    assert not loaded._tls.fenced
    np.testing.assert_array_equal(out, fenced)


def test_failed_call_leaves_the_next_one_working(explicit_session, rng):
    """A call the VM refuses consumes a timeline value without signalling
    it; the thread's next calls must still complete and agree."""
    attn, (q, k, v), ref = _planned(explicit_session, rng)
    variant, args = _args(attn, q, k, v)
    loaded = explicit_session._load(variant)
    good = loaded.invoke(args, 2)[0].to_host()
    with pytest.raises(Exception):  # noqa: B017 - whatever IREE's VM raises
        loaded.invoke(args[:-1], 2)  # an argument short: the VM refuses the call
    np.testing.assert_array_equal(loaded.invoke(args, 2)[0].to_host(), good)
    np.testing.assert_array_equal(attn.run(q, k, v), good)


def test_spin_only_on_gpus(explicit_session, rng):
    """CPU kernels run on this machine's cores: a polling host thread would
    take one from them."""
    attn, (q, k, v), _ = _planned(explicit_session, rng)
    attn.run(q, k, v)
    assert explicit_session._load(explicit_session.last_variant).spin is False


def test_queued_calls_are_waited_for_when_a_later_one_fails(explicit_session, rng, monkeypatch):
    """Session.run_variants queues a plan's calls without waits; if one
    cannot be queued, the ones before it are still reading their arguments
    (host memory imported in place among them): they must be waited for
    before the error reaches the caller, and the thread's next calls work."""
    attn, (q, k, v), ref = _planned(explicit_session, rng)
    variant, args = _args(attn, q, k, v)
    loaded = explicit_session._load(variant)
    good = loaded.invoke(args, 2)[0].to_host()
    waited = []
    wait = turbine_fmha.runtime.invoke._Call.wait
    monkeypatch.setattr(turbine_fmha.runtime.invoke._Call, "wait", lambda self: (wait(self), waited.append(self)))
    with pytest.raises(Exception):  # noqa: B017 - whatever IREE's VM raises
        explicit_session.run_variants(variant, [args, args, args[:-1]])  # the third is refused by the VM
    assert len(waited) == 2
    monkeypatch.undo()
    got = explicit_session.run_variants(variant, [args, args])
    for out, _ in got:
        np.testing.assert_array_equal(out, good)


def test_gpu_wait_through_the_host_flag(explicit_session, rng, monkeypatch):
    """The GPU wait (a HostFlag set by a copy queued after the calls, read
    in host memory) on the CPU driver, which runs the same queue
    operations: the results are the waited ones; a wait that outlasts its
    spin falls back to the calls' own fences and settles the copy, so a
    late copy cannot set the flag during the next wait."""
    import turbine_fmha.runtime.invoke as invoke

    prob = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[40, 9], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    want = turbine_fmha.fmha_fwd_paged(*prob, session=explicit_session)
    variant = explicit_session.last_variant
    loaded = explicit_session._load(variant)
    monkeypatch.setattr(loaded, "spin", True)
    monkeypatch.setattr(invoke, "SPIN_SECONDS", 5.0)  # the CPU driver's copy takes milliseconds
    for _ in range(3):
        np.testing.assert_array_equal(turbine_fmha.fmha_fwd_paged(*prob, session=explicit_session), want)
    flag = invoke._flag(loaded.config.device)
    assert flag.value[0] == 1 and flag._count >= 3
    monkeypatch.setattr(invoke, "SPIN_SECONDS", 0.0)  # every wait falls back
    for _ in range(3):
        np.testing.assert_array_equal(turbine_fmha.fmha_fwd_paged(*prob, session=explicit_session), want)
    assert flag._timeline.query() == flag._count  # settled: no copy left in flight


def test_gpu_flag_copy_waits_on_one_semaphore(explicit_session, rng, monkeypatch):
    """The HostFlag's copy waits on a single semaphore: on IREE 3.13's
    CUDA driver a copy that waited on the several semaphores of a
    multi-call run crashed the process (docs/reliability.md "A segfault in
    the GPU wait"). A run of several calls (each after the first on its
    own timeline) waits on the calls' fences instead, and still returns
    every call's results; a single call keeps the flag."""
    import turbine_fmha.runtime.invoke as invoke

    attn, (q, k, v), _ = _planned(explicit_session, rng)
    variant, args = _args(attn, q, k, v)
    loaded = explicit_session._load(variant)
    good = loaded.invoke(args, 2)[0].to_host()
    monkeypatch.setattr(loaded, "spin", True)
    monkeypatch.setattr(invoke, "SPIN_SECONDS", 5.0)  # the CPU driver's copy takes milliseconds
    flag = invoke._flag(loaded.config.device)
    copies = _Recording(flag.device)
    monkeypatch.setattr(flag, "device", copies)
    monkeypatch.setattr(invoke, "_flag", lambda device: flag)
    for out, _ in explicit_session.run_variants(variant, [args, args, args]):
        np.testing.assert_array_equal(out, good)
    assert copies.waits == []
    ((out, _),) = explicit_session.run_variants(variant, [args])
    np.testing.assert_array_equal(out, good)
    assert [len(w) for w in copies.waits] == [1]


class _Recording:
    """The device, recording the wait lists of its queue copies."""

    def __init__(self, device):
        self._device, self.waits = device, []

    def queue_copy(self, src, dst, waits, signals):
        self.waits.append(list(waits))
        return self._device.queue_copy(src, dst, waits, signals)

    def __getattr__(self, name):
        return getattr(self._device, name)


def test_gpu_wait_survives_a_failing_flag_copy(explicit_session, rng, monkeypatch):
    """A flag copy the device refuses (a driver that lacks the transfer, a
    lost device) is not the calls' failure: the wait falls back to their
    fences and returns their results, and settle() does not wait on a
    signal that was never queued (it would hang)."""
    import turbine_fmha.runtime.invoke as invoke

    prob = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=1, seqlens_k=[33, 17], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    want = turbine_fmha.fmha_fwd_paged(*prob, session=explicit_session)
    loaded = explicit_session._load(explicit_session.last_variant)
    monkeypatch.setattr(loaded, "spin", True)
    flag = invoke._flag(loaded.config.device)
    before = flag._count
    refusing = _Refusing(flag.device)
    monkeypatch.setattr(flag, "device", refusing)
    monkeypatch.setattr(invoke, "_flag", lambda device: flag)  # _flag would replace a flag of another device
    for _ in range(2):
        np.testing.assert_array_equal(turbine_fmha.fmha_fwd_paged(*prob, session=explicit_session), want)
    assert refusing.refused == 2  # the flag path was taken, and refused
    assert flag._count == before and flag._timeline.query() == flag._count


class _Refusing:
    """The device, except that queue_copy raises."""

    def __init__(self, device):
        self._device, self.refused = device, 0

    def queue_copy(self, *_args):
        self.refused += 1
        raise RuntimeError("queue_copy refused")

    def __getattr__(self, name):
        return getattr(self._device, name)
