"""Stream-ordered handoff between torch and IREE on ROCm (HIP sessions).

A HIP session's calls given torch tensors on its GPU are ordered against
torch on the device, with no host wait on either side:

- where IREE's device runs on the stream torch is using (the device was
  created on torch's default stream of that GPU, `create_device`), stream
  order alone puts each call after torch's work and torch's later work
  after it;
- otherwise a HIP event recorded on torch's current stream is imported
  into the thread's timeline semaphore and the calls wait on it; each
  call's signal is exported as a HIP event before the call is queued, and
  torch's current stream waits on it (hipStreamWaitEvent). Exported events
  are ours to destroy, once their timelines have passed them; IREE owns
  (and destroys) the events it imports.

Written from iree-turbine's runtime/device.py (`_create_hip_device`,
`_HipSemaphoreInterop`, `Device.setup_iree_action` /
`finalize_iree_action`) and IREE's HIP driver (hal/drivers/hip/
event_semaphore.c, hip_device.c). Tested on the CPU against a stand-in
HIP runtime and driver only: it has never run on an AMD GPU.
`$TURBINE_FMHA_HIP_HOST_WAIT=1` turns it off: calls then wait on the host
as CUDA sessions' do. CUDA sessions never come here: IREE 3.13's CUDA
driver cannot export or import its timepoints (docs/repro/
cuda_event_handoff.py).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

from ..core import env
from ..core.arrays import torch_writes_done

# IREE's enum values as the binding takes them (ints): IREE's HIP semaphores
# import only HIP_EVENT timepoints that can be waited on by the device.
HIP_EVENT = 3  # iree_hal_external_timepoint_type_t
DEVICE_WAIT = 2  # iree_hal_semaphore_compatibility_t
# hipEventCreateWithFlags: these events order streams and time nothing.
HIP_EVENT_DISABLE_TIMING = 0x2
# The device parameter IREE's HIP driver reads for the stream it dispatches
# on (iree_hal_hip_device_params_t.external_stream), a decimal pointer.
EXTERNAL_STREAM = "hip_external_stream"


class HipRuntime:
    """The four HIP runtime calls the handoff makes, on `library`
    (libamdhip64 through ctypes, or a stand-in with the same functions)."""

    def __init__(self, library):
        self.library = library

    def _check(self, name: str, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"{name} failed (hipError_t {code})")

    def record(self, stream: int) -> int:
        """A new event, recorded on `stream`."""
        event = ctypes.c_void_p(0)
        self._check("hipEventCreateWithFlags", self.library.hipEventCreateWithFlags(event, HIP_EVENT_DISABLE_TIMING))
        try:
            self._check("hipEventRecord", self.library.hipEventRecord(event, ctypes.c_void_p(stream)))
        except Exception:
            self.destroy(event.value)
            raise
        return event.value

    def wait(self, stream: int, event: int) -> None:
        """Work queued on `stream` from now on waits for `event`."""
        self._check(
            "hipStreamWaitEvent", self.library.hipStreamWaitEvent(ctypes.c_void_p(stream), ctypes.c_void_p(event), 0)
        )

    def destroy(self, event: int) -> None:
        self._check("hipEventDestroy", self.library.hipEventDestroy(ctypes.c_void_p(event)))


# The names IREE's HIP driver looks for (hal/drivers/hip/dynamic_symbols.c),
# then the versioned ones ROCm installs.
LIBRARY_NAMES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")


def load_library():
    """libamdhip64 with the handoff's functions declared, or None where it
    cannot be loaded."""
    names = ("amdhip64.dll",) if sys.platform == "win32" else LIBRARY_NAMES
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        void_p, uint = ctypes.c_void_p, ctypes.c_uint
        for fn, args in (
            ("hipEventCreateWithFlags", [ctypes.POINTER(void_p), uint]),
            ("hipEventRecord", [void_p, void_p]),
            ("hipStreamWaitEvent", [void_p, void_p, uint]),
            ("hipEventDestroy", [void_p]),
        ):
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, ctypes.c_int
        return lib
    return None


_RUNTIME_LOCK = threading.Lock()
# The loaded HipRuntime; False once loading failed (not tried again).
_RUNTIME: HipRuntime | bool | None = None


def runtime() -> HipRuntime | None:
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            lib = load_library()
            _RUNTIME = HipRuntime(lib) if lib is not None else False
        return _RUNTIME or None


# -- the device on torch's stream ---------------------------------------------

# IREE devices created on a torch stream: id(device) -> (device, stream).
_DEVICE_STREAMS: dict[int, tuple] = {}


def device_params(ordinal: int) -> dict | None:
    """The parameters to create GPU `ordinal`'s IREE HIP device with: on
    torch's default stream of that GPU, where torch has started on the GPU
    already (a session that never sees torch does not start it). The
    default stream, not the current one: the device is the process's, for
    every session and thread, and outlives any `torch.cuda.stream(...)`
    block its first call runs in; torch's default stream lives as long as
    the process. None: a device on IREE's own stream (the switch is on, or
    torch has not started)."""
    if env.switch(env.HIP_HOST_WAIT):
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    stream = int(torch.cuda.default_stream(f"cuda:{ordinal}").cuda_stream)
    # torch on ROCm commonly reports its default stream as the null stream
    # (0), which IREE's driver cannot tell from "no external stream": its
    # device would run on a stream of its own while device_stream() claimed
    # torch's, and calls would go unordered. Events order that case.
    if not stream:
        return None
    return {EXTERNAL_STREAM: str(stream)}


def create_device(hal_driver, info: dict, ordinal: int):
    """GPU `ordinal`'s IREE HIP device on torch's stream (device_params),
    from `info`, its entry in the driver's query_available_devices(); None
    where it is not to be, or cannot be, made that way: the caller then
    creates it as usual, and the calls order themselves through events."""
    params = device_params(ordinal)
    if params is None:
        return None
    try:
        device = hal_driver.create_device(info, params=params)
    except (RuntimeError, ValueError) as e:
        logging.getLogger(__name__).debug("HIP device on torch's stream refused (%s); events instead", e)
        return None
    _DEVICE_STREAMS[id(device)] = (device, int(params[EXTERNAL_STREAM]))
    return device


def device_stream(device) -> int | None:
    """The torch stream IREE's `device` dispatches on, if it was created on one."""
    hit = _DEVICE_STREAMS.get(id(device))
    return hit[1] if hit is not None and hit[0] is device else None


# -- exported events and the failures found later -----------------------------

_PENDING_LOCK = threading.Lock()
# Exported events torch's stream waits on: (event, semaphore, value), each
# destroyed once its semaphore has reached the value (or failed).
_PENDING: list[tuple] = []
# Per thread: (Loaded, semaphore, value) of calls handed back without a
# wait, until their values are seen reached (or their failure raised).
_THREAD = threading.local()


def collect() -> None:
    """Destroys the exported events whose timelines have passed them: the
    device has recorded and completed them, so torch's waits on them are
    satisfied and IREE records them no more. A failed timeline records
    nothing more either."""
    with _PENDING_LOCK:
        if not _PENDING:
            return
        hip, keep = runtime(), []
        for event, semaphore, value in _PENDING:
            try:
                passed = semaphore.query() >= value
            except Exception:
                passed = True
            if not passed:
                keep.append((event, semaphore, value))
                continue
            try:
                hip.destroy(event)
            except RuntimeError as e:
                # Dropped all the same: a second try could only destroy it
                # twice.
                logging.getLogger(__name__).warning("turbine-fmha: %s", e)
        _PENDING[:] = keep


def pending_events() -> int:
    """How many exported events wait to be destroyed (collect)."""
    with _PENDING_LOCK:
        return len(_PENDING)


def _earlier_failure() -> Exception | None:
    """The device failure of this thread's earlier calls that were handed
    back without a wait, if one has happened; forgets the calls seen done.
    The failed timeline is replaced (a failed semaphore stays failed)."""
    earlier = getattr(_THREAD, "calls", None)
    if not earlier:
        return None
    keep, failure = [], None
    for loaded, semaphore, value in earlier:
        try:
            if semaphore.query() < value:
                keep.append((loaded, semaphore, value))
        except Exception as e:
            loaded._reset(semaphore)
            failure = failure or e
    earlier[:] = keep
    return failure


class Handoff:
    """One run's handoff (Session.run_variants): the calls' wait fence
    (torch's work so far), each call's exported signal, and torch's stream
    waiting on them once they are queued."""

    def __init__(self, torch_device, stream: int, same_stream: bool, hip: HipRuntime | None):
        self.torch_device, self.stream, self.same_stream, self.hip = torch_device, stream, same_stream, hip
        self.fence = None
        self.exports: list[tuple] = []  # (call, event)

    def wait_fence(self, loaded):
        """The fence the run's calls wait on. On torch's own stream: none,
        stream order is the wait. Otherwise an event of torch's current
        stream imported into the thread's timeline, once per run: the
        run's calls are independent, so they all wait on the one import."""
        import iree.runtime as rt

        if self.same_stream:
            return rt.HalFence(1)
        if self.fence is None:
            event = self.hip.record(self.stream)
            timepoint = rt.HalExternalTimepoint()
            timepoint.compatibility = DEVICE_WAIT
            timepoint.hip_event = event  # the binding sets the type (HIP_EVENT) with it
            semaphore, value = loaded.next_value()
            try:
                semaphore.import_timepoint(value, timepoint)
            except Exception:
                # Not imported: the event is still ours, and the value was
                # never reached.
                self.hip.destroy(event)
                loaded._reset(semaphore)
                raise
            self.fence = rt.HalFence.create_at(semaphore, value)
        return self.fence

    def export(self, call) -> None:
        """Exports `call`'s signal as a HIP event, before the call is
        queued: IREE's HIP queue_execute then returns only once the event
        is recorded (iree_hal_hip_semaphore_for_exported_timepoints), so
        torch may wait on it as soon as the call is queued."""
        if self.same_stream or call.done is None:
            return
        import iree.runtime as rt

        timepoint = rt.HalExternalTimepoint()
        call.timeline.export_timepoint(call.value, HIP_EVENT, 0, timepoint)
        self.exports.append((call, timepoint.hip_event))

    def not_queued(self, call) -> None:
        """`call`'s invocation raised: torch will not wait on its event,
        which is destroyed once its timeline passes it, if ever (part of
        the invocation may have been queued, and may still record it)."""
        for i, (c, event) in enumerate(self.exports):
            if c is call:
                del self.exports[i]
                with _PENDING_LOCK:
                    _PENDING.append((event, call.timeline, call.value))
                return

    def finish(self, calls) -> Exception | None:
        """After the run's calls are queued (and its host work done):
        torch's current stream waits for each, and the calls are handed
        back in flight. Returns a failure IREE already knows of (never
        waiting for one); a later one is raised by this thread's next
        handoff (begin)."""
        exports, self.exports = self.exports, []
        with _PENDING_LOCK:
            _PENDING.extend((event, call.timeline, call.value) for call, event in exports)
        try:
            for _, event in exports:
                self.hip.wait(self.stream, event)
        except Exception as e:
            # torch's stream cannot wait for the calls: the host does, so
            # torch's later work still comes after them.
            from .invoke import wait_all

            return wait_all(calls) or e
        earlier = getattr(_THREAD, "calls", None)
        if earlier is None:
            earlier = _THREAD.calls = []
        failure = None
        for c in calls:
            f = c.failed()
            if f is not None:
                failure = failure or f
            elif c.done is not None:  # checked by the thread's next handoff (begin)
                earlier.append((c.loaded, c.timeline, c.value))
        return failure

    def waited(self) -> None:
        """The host waited for the run's calls instead (a call could not be
        queued): their exported events are done with once their timelines
        pass them, which they have."""
        exports, self.exports = self.exports, []
        with _PENDING_LOCK:
            _PENDING.extend((event, call.timeline, call.value) for call, event in exports)
        collect()

    def host_wait(self) -> None:
        """This run waits on the host instead (results read on the host, or
        a synchronous entry point, which takes no wait fence): torch's
        writes first, as on CUDA. Returns None, the run's handoff then."""
        torch_writes_done(self.torch_device)


def begin(session, torch_device) -> Handoff | None:
    """The handoff of a run of `session` whose torch results live on
    `torch_device`, or None where the host waits instead: not a HIP
    session, $TURBINE_FMHA_HIP_HOST_WAIT=1, or no HIP runtime library to
    make events with when torch's current stream is not the device's.
    Raises, before anything is queued, a device failure of this thread's
    earlier calls handed back in flight."""
    if session.target.driver != "hip" or env.switch(env.HIP_HOST_WAIT):
        return None
    import torch

    stream = int(torch.cuda.current_stream(torch_device).cuda_stream)
    same = device_stream(session.device_of()) == stream
    hip = None if same else runtime()
    if not same and hip is None:
        return None
    collect()
    failure = _earlier_failure()
    if failure is not None:
        raise RuntimeError(f"an earlier call on this thread failed on the device: {failure}") from failure
    return Handoff(torch_device, stream, same, hip)
