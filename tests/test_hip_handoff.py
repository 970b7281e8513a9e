"""The stream-ordered handoff of HIP sessions (runtime/hip_handoff.py):
calls given torch tensors order themselves after torch's work, and torch's
later work after them, on the device, with no host wait.

No AMD GPU exists here, and torch is CPU-only. The HIP runtime is a
recording stand-in library (hipEventCreateWithFlags / Record /
StreamWaitEvent / Destroy), IREE's HIP driver a stand-in that records the
device parameters and opens CPU devices, the semaphores' import_timepoint
and export_timepoint are recorded (the CPU driver implements neither), and
torch's streams are stand-in objects with a pointer. The kernels are real:
a CPU kernel runs on the device the stand-in driver opened, and a call
that waits on torch's imported work does not run until the test completes
that work. What this cannot show is how IREE's HIP driver and a ROCm GPU
behave: that has never run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import threading
import time
import types

import numpy as np
import pytest
from conftest import CACHE, make_problem

import turbine_fmha
import turbine_fmha.runtime.session as session_mod
from turbine_fmha.core import env
from turbine_fmha.runtime import hip_handoff, invoke
from turbine_fmha.runtime.executor import Results

torch = pytest.importorskip("torch")
rt = pytest.importorskip("iree.runtime")

SHAPE = dict(dtype="f16", batch=3, seqlen_q=1, seqlens_k=[17, 40, 5], nhead_q=4, nhead_k=2, hdim=64, page=16)
DEFAULT, SIDE = 0x5000, 0x7000  # torch's default stream of the GPU, and another one
WATCHDOG_SECONDS = 30


def _value(x) -> int:
    """The integer a ctypes argument carries (c_void_p(0).value is None)."""
    return (x.value if isinstance(x, ctypes.c_void_p) else x) or 0


class FakeHip:
    """libamdhip64 as the handoff calls it, recording each call in `log`.
    `live`: events created here or exported by IREE that nobody has
    destroyed; `iree`: events handed to IREE by an import (IREE destroys
    those itself)."""

    def __init__(self, log):
        self.log, self.ids = log, itertools.count(0x100)
        self.live, self.iree = set(), set()

    def new_event(self) -> int:
        e = next(self.ids)
        self.live.add(e)
        return e

    # The functions, as ctypes would call them.
    def hipEventCreateWithFlags(self, event, flags):
        event.value = self.new_event()
        self.log.append(("create", event.value))
        return 0

    def hipEventRecord(self, event, stream):
        self.log.append(("record", _value(event), _value(stream)))
        return 0

    def hipStreamWaitEvent(self, stream, event, flags):
        assert _value(event) in self.live, "a stream waits on a destroyed event"
        self.log.append(("stream waits", _value(stream), _value(event)))
        return 0

    def hipEventDestroy(self, event):
        e = _value(event)
        assert e in self.live and e not in self.iree, f"event {e:#x} destroyed twice, or IREE's"
        self.live.discard(e)
        self.log.append(("destroy", e))
        return 0

    def ours(self) -> set:
        """The events still alive that are ours to destroy."""
        return self.live - self.iree


class FakeStream:
    def __init__(self, ptr, log):
        self.cuda_stream, self.log = ptr, log

    def synchronize(self):
        self.log.append(("host waits for torch", self.cuda_stream))


class FakeGpuDriver:
    """IREE's HIP (or CUDA) driver on a one-GPU machine: records how each
    device is created and opens a CPU device."""

    def __init__(self, log):
        self.log = log

    def query_available_devices(self):
        return [{"device_id": 1, "path": "GPU-0", "name": "stand-in"}]

    def create_device(self, info, params=None, allocators=None):
        self.log.append(("create_device", info["device_id"], params))
        return rt.get_driver("local-task").create_default_device()

    def create_device_by_uri(self, uri, allocators=None):
        self.log.append(("create_device_by_uri", uri))
        return rt.get_driver("local-task").create_default_device()


class Rig:
    """A session whose device is the stand-in HIP driver's, a planned call
    on it, and everything recorded in one log."""

    def __init__(self, monkeypatch, rng, driver="hip", torch_started=False, current=SIDE, auto_torch=True):
        self.log = []
        self.hip = FakeHip(self.log)
        self.current, self.auto_torch, self.imports, self.exported = current, auto_torch, [], []
        mp = monkeypatch
        mp.setattr(hip_handoff, "_RUNTIME", hip_handoff.HipRuntime(self.hip))
        mp.setattr(hip_handoff, "_PENDING", [])
        mp.setattr(hip_handoff, "_THREAD", types.SimpleNamespace())
        mp.setattr(hip_handoff, "_DEVICE_STREAMS", {})
        mp.setattr(session_mod, "_CONFIGS", {})
        mp.setattr(session_mod, "_MODULES", {})
        mp.setattr(session_mod, "_DRIVER_DEVICES", {})
        mp.setattr(rt, "get_driver", self._get_driver(driver))
        mp.setattr(torch.cuda, "is_initialized", lambda: torch_started)
        mp.setattr(torch.cuda, "default_stream", lambda device=None: FakeStream(DEFAULT, self.log))
        mp.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(self.current, self.log))
        # Plain functions: the semaphore arrives as their first argument.
        self.import_timepoint = lambda semaphore, *a: self._import(semaphore, *a)
        mp.setattr(rt.HalSemaphore, "import_timepoint", self.import_timepoint)
        mp.setattr(rt.HalSemaphore, "export_timepoint", lambda semaphore, *a: self._export(semaphore, *a))
        submit = rt.VmContext.invoke
        mp.setattr(rt.VmContext, "invoke", lambda ctx, *a: (self.log.append(("submit",)), submit(ctx, *a))[1])
        wait_all = invoke.wait_all
        mp.setattr(
            session_mod, "wait_all", lambda calls: (self.log.append(("host waits for IREE",)), wait_all(calls))[1]
        )

        s = turbine_fmha.Session("cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none")
        # The CPU session's kernels, on a device of IREE's `driver` (the
        # stand-in's), as a session of that device would run them.
        s.target, s.device = dataclasses.replace(s.target, driver=driver), {"hip": "hip", "cuda": "cuda"}[driver]
        mp.setattr(s, "to_torch", lambda *arrays: arrays)  # DLPack needs a GPU torch
        self.session = s
        q, k, v, bt, sk = make_problem(rng, **SHAPE)
        attn = turbine_fmha.PagedAttention(s).plan(
            bt, sk, num_pages=k.shape[0], page_block_size=16, nhead_q=4, nhead_k=2, hdim=64, dtype="f16"
        )
        plan = attn._plan
        self.variant = plan.variant(0, plan._rows_finite(0, v))
        st = plan.device_steps(0, self.variant, Results(s))[0]
        device = s.device_of()
        # Every argument already a device array: Results.run then imports
        # nothing through torch (a CPU torch here).
        self.args = [
            a if isinstance(a, rt.DeviceArray) else rt.asdevicearray(device, np.ascontiguousarray(a))
            for a in (st.q(q), k, v, *st.args)
        ]
        self.loaded = s._load(self.variant)
        (self.want,) = s.run_variants(self.variant, [self.args])  # waited for on the host
        self.log.clear()
        # A call that waited on the host for torch's imported work would
        # wait forever (the test completes that work after the call
        # returns): past this, the work fails instead, and so does the test.
        self.watchdog = threading.Timer(WATCHDOG_SECONDS, self.release)
        self.watchdog.daemon = True
        self.watchdog.start()

    def _get_driver(self, kind):
        real, driver = rt.get_driver, FakeGpuDriver(self.log)
        return lambda name: driver if name == kind else real(name)

    def _import(self, semaphore, value, timepoint):
        assert timepoint.type == hip_handoff.HIP_EVENT and timepoint.compatibility & hip_handoff.DEVICE_WAIT
        self.hip.iree.add(timepoint.hip_event)
        self.log.append(("import", value, timepoint.hip_event))
        self.imports.append((semaphore, value))
        if self.auto_torch:
            self.torch_finishes()

    def _export(self, semaphore, value, kind, flags, out):
        assert kind == hip_handoff.HIP_EVENT
        out.hip_event = self.hip.new_event()  # IREE's event, handed over
        self.log.append(("export", value, out.hip_event))
        self.exported.append((semaphore, value))

    def release(self):
        """The test is over: calls still waiting on torch's imported work
        (a test that failed before completing it) fail instead, so that no
        queued work outlives the test and blocks the device's teardown."""
        self.watchdog.cancel()
        for semaphore, _ in self.imports:
            semaphore.fail("the test ended before torch's work was done")
        self.imports.clear()

    def torch_finishes(self):
        """torch's work up to each imported event is done: the imported
        values are reached, in order, as IREE's HIP semaphores reach them
        on the device."""
        for semaphore, value in self.imports:
            semaphore.wait(value - 1)
            semaphore.signal(value)
        self.imports.clear()

    def run(self, calls=1, while_queued=None):
        """Results.run, as an executor runs a call with torch results on
        the session's GPU: [(out, lse)] per call. `while_queued()` runs
        once the calls are queued (the executor's deferred checks)."""
        results = Results(self.session, types.SimpleNamespace(device=torch.device("cuda", 0)))
        results.while_queued = while_queued
        return results.run(self.variant, [self.args] * calls)

    def timeline(self):
        return self.loaded._tls.timeline, self.loaded._tls.value

    def check(self, results):
        """Compares calls' results, once done (wait_done), with the waited
        run's."""
        for out, lse in results:
            np.testing.assert_array_equal(invoke.host_array(out), self.want[0])
            np.testing.assert_array_equal(invoke.host_array(lse), self.want[1])

    def wait_done(self):
        """The test's own host wait for every call queued so far (each
        exported signal, and the thread's timeline)."""
        for semaphore, value in [self.timeline(), *self.exported]:
            semaphore.wait(value)

    def kinds(self):
        return [e[0] for e in self.log]


@pytest.fixture
def make_rig(monkeypatch, rng):
    """make_rig(**options): a Rig, released after the test."""
    rigs = []
    yield lambda **kw: rigs.append(Rig(monkeypatch, rng, **kw)) or rigs[-1]
    for rig in rigs:
        rig.release()


@pytest.fixture
def no_switch(monkeypatch):
    monkeypatch.delenv(env.HIP_HOST_WAIT, raising=False)


def test_calls_wait_for_torch_and_torch_for_them_on_the_device(make_rig, no_switch):
    """Two consecutive calls on another stream than the device's: each
    imports an event of torch's current stream before it is queued (its
    kernel waits on it), exports its signal before the submit and has
    torch's stream wait on that event after it; no host wait on either
    side, and the kernel runs only once torch's imported work is done."""
    rig = make_rig(auto_torch=False)
    first = rig.run()
    semaphore, value = rig.timeline()
    second = rig.run()
    e1, x1, e2, x2 = (e for kind, *rest in rig.log for e in rest[-1:] if kind in ("create", "export"))
    base = value - 1  # the first import's value on the thread's timeline
    assert rig.log == [
        ("create", e1),
        ("record", e1, SIDE),
        ("import", base, e1),
        ("export", base + 1, x1),
        ("submit",),
        ("stream waits", SIDE, x1),
        ("create", e2),
        ("record", e2, SIDE),
        ("import", base + 2, e2),
        ("export", base + 3, x2),
        ("submit",),
        ("stream waits", SIDE, x2),
    ]
    # Queued and handed back, not run: torch's work they wait for is not done.
    time.sleep(0.05)
    assert semaphore.query() == base - 1
    rig.torch_finishes()
    rig.wait_done()
    rig.check(first + second)


def test_results_come_back_in_flight_and_right(make_rig, no_switch):
    """A multi-call run (a chunked prefill's shape): one import for the
    run, every call exported and waited on by torch, the results right."""
    rig = make_rig()
    results = rig.run(calls=3)
    assert rig.kinds().count("import") == 1 and rig.kinds().count("export") == 3
    assert rig.kinds().count("stream waits") == 3 and "host waits for IREE" not in rig.kinds()
    assert rig.kinds().index("export") < rig.kinds().index("submit")
    assert all(isinstance(a, rt.DeviceArray) for r in results for a in r)  # not read back to the host
    rig.wait_done()
    rig.check(results)


def test_the_device_runs_on_torchs_default_stream(make_rig, no_switch):
    """With torch started on the GPU, the IREE device is created on torch's
    default stream of that GPU (hip_external_stream, the pointer as IREE's
    HIP driver parses it); calls on that stream need no event at all, and
    calls on another stream use events on the same device."""
    rig = make_rig(torch_started=True, current=DEFAULT)
    # The device was created before the log was cleared: read its record.
    assert hip_handoff.device_stream(rig.session.device_of()) == DEFAULT
    results = rig.run()
    assert rig.log == [("submit",)]
    rig.wait_done()
    rig.check(results)
    rig.log.clear()
    rig.current = SIDE
    results = rig.run()
    assert [k for k in rig.kinds() if k != "destroy"] == [
        "create",
        "record",
        "import",
        "export",
        "submit",
        "stream waits",
    ]
    rig.wait_done()
    rig.check(results)


def test_device_parameters(monkeypatch, no_switch):
    """What the stand-in driver is asked for: torch started, the device
    on torch's default stream (not the current one); torch not started, or
    the switch on, the device as before (create_device_by_uri)."""
    log, real = [], rt.get_driver
    for started, switch, default, want in (
        (True, None, DEFAULT, [("create_device", 1, {"hip_external_stream": str(DEFAULT)})]),
        (False, None, DEFAULT, [("create_device_by_uri", "hip")]),
        (True, "1", DEFAULT, [("create_device_by_uri", "hip")]),
        # A null default stream (0) is no stream to IREE: events order it.
        (True, None, 0, [("create_device_by_uri", "hip")]),
    ):
        log.clear()
        if switch:
            monkeypatch.setenv(env.HIP_HOST_WAIT, switch)
        else:
            monkeypatch.delenv(env.HIP_HOST_WAIT, raising=False)
        monkeypatch.setattr(session_mod, "_CONFIGS", {})
        monkeypatch.setattr(session_mod, "_DRIVER_DEVICES", {})
        monkeypatch.setattr(hip_handoff, "_DEVICE_STREAMS", {})
        driver = FakeGpuDriver(log)
        monkeypatch.setattr(rt, "get_driver", lambda name, d=driver: d if name == "hip" else real(name))
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda s=started: s)
        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None, d=default: FakeStream(d, log))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(SIDE, log))
        device = session_mod._shared_config("hip", 0, "hip:0").device
        assert log == want
        assert hip_handoff.device_stream(device) == (DEFAULT if want[0][0] == "create_device" else None)


def test_the_switch_restores_host_waits(make_rig, monkeypatch, no_switch):
    """TURBINE_FMHA_HIP_HOST_WAIT=1: torch's stream is synchronized before
    the call and IREE's fences waited for after it, as on CUDA; no event,
    import or export. Read per call: unset, the handoff is back."""
    rig = make_rig()
    monkeypatch.setenv(env.HIP_HOST_WAIT, "1")
    results = rig.run()
    assert rig.log == [("host waits for torch", SIDE), ("submit",), ("host waits for IREE",)]
    rig.check(results)
    rig.log.clear()
    monkeypatch.setenv(env.HIP_HOST_WAIT, "0")
    rig.run()
    assert "import" in rig.kinds() and "host waits for IREE" not in rig.kinds()
    rig.wait_done()


def test_an_invalid_switch_is_refused_at_the_session(monkeypatch):
    monkeypatch.setenv(env.HIP_HOST_WAIT, "yes")
    with pytest.raises(ValueError, match=r"^\$TURBINE_FMHA_HIP_HOST_WAIT must be 0 or 1, got 'yes'"):
        turbine_fmha.Session("hip")


def test_events_do_not_leak(make_rig, no_switch):
    """Over many calls the exported events are destroyed once their
    timelines pass them (at the next call's start), the imported ones are
    left to IREE, and none is destroyed twice (FakeHip asserts it)."""
    rig = make_rig()
    for _ in range(40):
        rig.run(calls=2)
        assert len(rig.hip.ours()) <= 6  # this run's and the last one's, at most, in flight
    rig.wait_done()
    hip_handoff.collect()
    assert rig.hip.ours() == set() and hip_handoff.pending_events() == 0
    assert rig.kinds().count("destroy") == rig.kinds().count("export") == 80


def test_a_device_failure_is_raised_by_the_threads_next_call(make_rig, no_switch):
    """A call handed back in flight that then fails on the device: the
    thread's next call raises it before queueing anything, and the one
    after runs on a new timeline."""
    rig = make_rig(auto_torch=False)
    rig.run()
    semaphore, _ = rig.timeline()
    semaphore.fail("device fault")
    rig.imports.clear()  # torch's event: never to be reached on the failed timeline
    rig.exported.clear()  # nor the call's signal
    rig.log.clear()
    with pytest.raises(RuntimeError, match="an earlier call on this thread failed on the device.*device fault"):
        rig.run()
    assert not {"create", "import", "export", "submit"} & set(rig.kinds())
    assert rig.timeline()[0] is not semaphore
    rig.auto_torch = True
    results = rig.run()
    rig.wait_done()
    rig.check(results)


def test_a_failure_known_when_queued_is_raised_by_its_own_call(make_rig, no_switch):
    """A failure IREE already knows of once the run is queued is raised by
    that run (a query, no wait), once: not again by the next call."""
    rig = make_rig(auto_torch=False)
    failed = []

    def fail():
        semaphore, _ = rig.timeline()
        semaphore.fail("device fault")
        failed.append(semaphore)
        rig.imports.clear()
        rig.exported.clear()

    with pytest.raises(RuntimeError, match="device fault") as raised:
        rig.run(while_queued=fail)
    assert "earlier call" not in str(raised.value) and "host waits for IREE" not in rig.kinds()
    assert rig.timeline()[0] is not failed[0]
    rig.auto_torch = True
    results = rig.run()
    rig.wait_done()
    rig.check(results)
    hip_handoff.collect()
    assert rig.hip.ours() == set()


def test_a_refused_import_fails_the_call_cleanly(make_rig, monkeypatch, no_switch):
    """IREE refusing the import: the call raises, the event (still ours)
    is destroyed, nothing is queued, and the next call works."""
    rig = make_rig()

    def refuse(semaphore, value, timepoint):
        raise RuntimeError("importing timepoint: INVALID_ARGUMENT")

    monkeypatch.setattr(rt.HalSemaphore, "import_timepoint", refuse)
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        rig.run()
    assert "submit" not in rig.kinds() and rig.hip.ours() == set()
    monkeypatch.setattr(rt.HalSemaphore, "import_timepoint", rig.import_timepoint)
    results = rig.run()
    rig.wait_done()
    rig.check(results)


def test_the_cuda_path_is_untouched(make_rig, monkeypatch, no_switch):
    """A CUDA session: torch's stream synchronized on the host before the
    call, the call waited for on the host after, no HIP library loaded, no
    import or export."""
    rig = make_rig(driver="cuda")

    def no_library():
        raise AssertionError("the HIP library was loaded for a CUDA session")

    monkeypatch.setattr(hip_handoff, "_RUNTIME", None)
    monkeypatch.setattr(hip_handoff, "load_library", no_library)
    results = rig.run()
    assert rig.log == [("host waits for torch", SIDE), ("submit",), ("host waits for IREE",)]
    rig.check(results)


def test_the_installed_binding_takes_the_handoffs_arguments(monkeypatch):
    """The real IREE 3.13 binding, on a CPU semaphore: the import and the
    export get past the binding's argument checks with what the handoff
    passes, to the CPU driver's refusal (it implements neither), not a
    TypeError. The other tests replace both methods."""
    hip = FakeHip([])
    handoff = hip_handoff.Handoff(torch.device("cuda", 0), SIDE, False, hip_handoff.HipRuntime(hip))
    semaphore = rt.get_driver("local-task").create_default_device().create_semaphore(0)
    loaded = types.SimpleNamespace(next_value=lambda: (semaphore, 1), _reset=lambda failed: None)
    with pytest.raises(NotImplementedError, match="timepoint import is not yet implemented"):
        handoff.wait_fence(loaded)
    assert hip.ours() == set()  # not imported: destroyed
    call = types.SimpleNamespace(timeline=semaphore, value=2, done=object())
    with pytest.raises(NotImplementedError, match="timepoint export is not yet implemented"):
        handoff.export(call)
