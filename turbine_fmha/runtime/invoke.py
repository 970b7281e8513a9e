"""Calling a loaded artifact: one VM context and timeline per thread, the
arguments handed to the VM directly, and the wait done here rather than
inside IREE's synchronous wrapper (polling on GPUs)."""

from __future__ import annotations

import threading
import time

# How long a GPU call's thread polls for completion before it sleeps in the
# wait: long enough to cover a decode kernel; a call that runs longer makes
# a late wake-up cost little next to the kernel, and the core is given back
# (docs/devlog/perf-notes.md, "Round 2: how the kernel is called").
SPIN_SECONDS = 0.002


class Loaded:
    """One verified, loaded artifact. The VM module is shared; each thread
    gets its own VM context (IREE contexts are not safe for concurrent
    invocation) and its own timeline semaphore, so calls from several
    threads run concurrently."""

    def __init__(self, variant, vm_module, config, spin: bool):
        self.variant = variant
        self.vm_module = vm_module
        self.config = config
        self.spin = spin
        self._tls = threading.local()

    @property
    def function(self):
        fn = getattr(self._tls, "fn", None)
        if fn is None:
            import iree.runtime as rt

            ctx = rt.SystemContext(config=self.config)
            ctx.add_vm_module(self.vm_module)
            fn = ctx.modules[self.vm_module.name][self.variant.name]
            t = self._tls
            t.ctx, t.fn = ctx, fn
            # Artifacts built by turbine-fmha take a wait and a signal fence
            # (targets.EXECUTION_MODEL); artifacts from older builds are
            # synchronous functions, still called as such.
            t.fenced = fn.vm_function.reflection.get("iree.abi.model") == "coarse-fences"
            t.timeline, t.value = (self.config.device.create_semaphore(0), 0) if t.fenced else (None, 0)
        return fn

    @property
    def fenced(self) -> bool:
        """Whether the entry point takes a wait and a signal fence."""
        _ = self.function
        return self._tls.fenced

    def next_value(self):
        """(the thread's timeline, its next value), taken: a wait imported
        onto the timeline (hip_handoff) holds that value."""
        t = self._tls
        t.value += 1
        return t.timeline, t.value

    def __call__(self, *args):
        """All results of the entry point on `args` (see invoke)."""
        return self.invoke(list(args))

    def invoke(self, args: list, n_results: int | None = None) -> tuple:
        """The entry point on `args`, returning its first `n_results`
        results (all by default) as DeviceArrays once the device work is
        done."""
        call = self.enqueue(args)
        call.wait()
        return call.results(n_results)

    def enqueue(self, args: list, after=None, own_timeline: bool = False, handoff=None) -> _Call:
        """Queues the entry point on `args` and returns at once (for
        artifacts built before EXECUTION_MODEL, after the work). Device
        arrays go straight to the VM (FunctionInvoker's packing and wrapping
        is Python work on every call: docs/devlog/perf-notes.md, "Round 2:
        how the kernel is called"); host arrays are copied in, as
        FunctionInvoker would. `after`: a _Call whose work must finish
        first (default: none, the inputs are ready). Name it only for a real
        dependency: the call's allocations then wait for it on the host
        (IREE's queue_alloca with a pooled allocator), so this enqueue
        returns only once `after` is done. `own_timeline`: signal a new
        semaphore rather than the thread's timeline, whose values must be
        signaled in order: calls queued together without naming each other
        may finish in any order (a CPU's workers run them at once).
        `handoff`: a hip_handoff.Handoff, whose fence of torch's work the
        call waits on and which exports the call's signal before it is
        queued."""
        import iree.runtime as rt

        fn, device, t = self.function, self.config.device, self._tls
        arg_list = rt.VmVariantList(len(args) + 2)
        for a in args:
            if not isinstance(a, rt.DeviceArray):
                a = rt.asdevicearray(device, a)
            arg_list.push_ref(a._buffer_view.ref)
        call = _Call(self, rt.VmVariantList(4))
        if t.fenced:
            if handoff is not None:
                wait = handoff.wait_fence(self)
            else:
                wait = after.done if after is not None and after.done is not None else rt.HalFence(1)
            arg_list.push_ref(wait.ref)
            if own_timeline:
                call.timeline, call.value = device.create_semaphore(0), 1
            else:
                t.value += 1
                call.timeline, call.value = t.timeline, t.value
            call.done = rt.HalFence.create_at(call.timeline, call.value)
            arg_list.push_ref(call.done.ref)
        try:
            if handoff is not None:
                handoff.export(call)
            fn._vm_context.invoke(fn.vm_function, arg_list, call.ret_list)
        except Exception:
            if handoff is not None:
                handoff.not_queued(call)
            self._reset(call.timeline)
            raise
        return call

    def _reset(self, failed=None) -> None:
        """A new timeline for this thread if it uses `failed` (default: its
        own): a failed timeline stays failed."""
        t = self._tls
        if getattr(t, "fenced", False) and (failed is None or failed is t.timeline):
            t.timeline, t.value = self.config.device.create_semaphore(0), 0


class _Call:
    """One queued call of a Loaded: its results and its signal fence."""

    def __init__(self, loaded: Loaded, ret_list):
        self.loaded, self.ret_list = loaded, ret_list
        self.done, self.timeline, self.value = None, None, 0

    def wait(self) -> None:
        """Returns once the call's device work is done. On a GPU the thread
        first polls for up to SPIN_SECONDS: a thread that sleeps in the wait
        wakes late and cold, which slows every host step after it, a large
        share of a decode call (docs/devlog/perf-notes.md, "Round 2: how the
        kernel is called"). CPU kernels run on this machine's cores, so
        the host never spins there."""
        if self.done is None:
            return
        if self.loaded.spin:
            deadline = time.perf_counter() + SPIN_SECONDS
            while self.timeline.query() < self.value and time.perf_counter() < deadline:
                pass
        try:
            self.done.wait()  # raises if the device work failed
        except Exception:
            self.loaded._reset(self.timeline)
            raise

    def failed(self) -> Exception | None:
        """The call's failure if IREE knows of it already, else None; never
        waits. A failed timeline is replaced, as wait() does."""
        if self.done is None:
            return None
        try:
            self.timeline.query()
        except Exception as e:
            self.loaded._reset(self.timeline)
            return e
        return None

    def results(self, n: int | None = None) -> tuple:
        """The first n results (all by default) as DeviceArrays; valid once
        wait() has returned (or, handed back by a hip_handoff, on torch's
        stream, after the stream waits for the call)."""
        import iree.runtime as rt

        device = self.loaded.config.device
        n = len(self.ret_list) if n is None else n
        return tuple(rt.DeviceArray(device, self.ret_list.get_as_object(i, rt.HalBufferView)) for i in range(n))


def wait_all(calls) -> Exception | None:
    """Waits for every call; returns the first failure (None if none). On
    a GPU the wait first watches a HostFlag that the device sets after the
    calls, then waits on the calls themselves (which raises a failure, and
    costs nothing once the flag is set)."""
    fenced = [c for c in calls if c.done is not None]
    flag = _flag_for(fenced)
    if flag is not None and flag.wait(fenced):
        return None
    first = None
    for c in calls:
        try:
            c.wait()
        except Exception as e:
            first = first or e
    if flag is not None:
        flag.settle()
    return first


def _flag_for(fenced) -> HostFlag | None:
    """The HostFlag for waiting on GPU calls `fenced`, or None. Only calls
    on one timeline get it: IREE 3.13's CUDA queue crashed the process (its
    worker thread in cuStreamWaitEvent) when the flag's copy waited on
    several semaphores, as a run's calls after its first signal their own
    (docs/reliability.md "A segfault in the GPU wait")."""
    if len({id(c.timeline) for c in fenced}) != 1 or not fenced[0].loaded.spin:
        return None
    return _flag(fenced[0].loaded.config.device)


class HostFlag:
    """Calls' completion seen in host memory. After a thread's calls on one
    timeline, a 4-byte device-to-host copy queued to wait on it sets an int in
    pinned host memory, which the thread reads until it changes: IREE's own
    completion path (its completion thread's event synchronize, then the
    semaphore's signal on the host) reached a waiting thread well after the
    device had finished (docs/devlog/perf-notes.md). The copy runs only if
    every call succeeded (it waits on their fences), so a set flag means
    they all did. One per thread and device, reset before each use."""

    def __init__(self, device):
        import iree.runtime as rt
        import numpy as np

        self.device = device
        self.buffer = device.allocator.allocate_buffer(
            memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.TRANSFER | rt.BufferUsage.MAPPING),
            allocation_size=4,
        )
        self._mapping = self.buffer.map()
        self.value = self._mapping.asarray([1], np.dtype(np.int32))
        self._one = rt.asdevicearray(device, np.ones(1, np.int32))
        self._timeline, self._count = device.create_semaphore(0), 0

    def wait(self, calls) -> bool:
        """Whether the device finished `calls`, seen within SPIN_SECONDS
        (else the caller waits on the calls themselves, as it must for a
        call that failed: the copy then never runs)."""
        self.value[0] = 0
        # The latest value of each timeline: one wait per semaphore.
        latest = {}
        for c in calls:
            if id(c.timeline) not in latest or c.value > latest[id(c.timeline)][1]:
                latest[id(c.timeline)] = (c.timeline, c.value)
        waits = list(latest.values())
        try:
            self.device.queue_copy(
                self._one._buffer_view.get_buffer(), self.buffer, waits, [(self._timeline, self._count + 1)]
            )
        except Exception:
            # The calls' own fences still tell (and raise what failed);
            # _count stays at a value the timeline reached, so settle()
            # cannot wait on a signal that was never queued.
            return False
        self._count += 1
        deadline = time.perf_counter() + SPIN_SECONDS
        while self.value[0] != 1:
            if time.perf_counter() > deadline:
                return False
        return True

    def settle(self) -> None:
        """Waits for the last copy (or its failure): a copy still in flight
        would set the flag during the next wait."""
        import iree.runtime as rt

        try:
            rt.HalFence.create_at(self._timeline, self._count).wait()
        except Exception:
            self._timeline = self.device.create_semaphore(0)
            self._count = 0


_FLAGS = threading.local()


def _flag(device) -> HostFlag:
    flags = getattr(_FLAGS, "by_device", None)
    if flags is None:
        flags = _FLAGS.by_device = {}
    flag = flags.get(id(device))
    if flag is None or flag.device is not device:
        flag = flags[id(device)] = HostFlag(device)
    return flag


class _HostView:
    """Owns a DeviceArray for the numpy view of its memory: the array that
    DeviceArray.to_host() maps does not keep the buffer alive, so a result
    viewed after its DeviceArray died was memory the next call reused."""

    def __init__(self, array):
        host = array.to_host()
        self.array, self.host, self.dtype = array, host, host.dtype
        self.__array_interface__ = host.__array_interface__


def host_array(array):
    """The host memory of a host-visible DeviceArray (a call's result on a
    CPU session) as a numpy array that keeps the DeviceArray alive; a
    device-only one is copied (to_host)."""
    import numpy as np

    view = _HostView(array)
    return np.asarray(view).view(view.dtype)
