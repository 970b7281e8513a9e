"""Device interop for a Session: host memory and torch tensors in and out
of IREE buffers without copies where the driver allows (DLPack), and the
lifetime rule that goes with it: an imported buffer owns a reference to
its source."""

from __future__ import annotations

import sys

import numpy as np

from ..build.targets import DEFAULT_BINDING_ALIGNMENT
from ..core.arrays import (
    DeviceCache,
    fp8_name,
    is_device_array,
    is_torch,
    kernel_host_array,
    np_torch_dtype,
    to_numpy,
    torch_writes_done,
)
from ..core.devices import torch_device_of

# Host caches a plan keeps imported (two per layer of a large model).
MAX_KEPT_IMPORTS = 512


class DeviceInterop:
    """Mixed into Session: needs `target`, `device`, `ordinal`, `device_of()`."""

    def import_host(self, array, alignment: int = DEFAULT_BINDING_ALIGNMENT):
        """A DeviceArray over a C-contiguous numpy array's own memory (no
        copy) on a CPU session, or None where that is not possible (GPU
        sessions, dtypes without an IREE element type, memory less aligned
        than `alignment`, what the kernels that read it assume:
        Session.binding_alignment). The result holds a reference to
        `array`; the array must stay unchanged while calls use it."""
        # Kernels handed less aligned memory than they assume crash (aligned
        # vector loads): such arrays are copied instead.
        if self.target.driver != "local-task" or not array.flags.c_contiguous or array.ctypes.data % alignment:
            return None
        import iree.runtime as rt

        et = {
            np.dtype(np.float16): rt.HalElementType.FLOAT_16,
            np.dtype(np.float32): rt.HalElementType.FLOAT_32,
            np.dtype(np.int8): rt.HalElementType.SINT_8,
        }.get(array.dtype)
        if et is None and array.dtype.name == "bfloat16":
            et = rt.HalElementType.BFLOAT_16
        if et is None:
            return None
        device = self.device_of()
        try:
            buf = device.allocator.import_host_allocation(
                array, rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE, rt.BufferUsage.DEFAULT
            )
        except Exception:  # e.g. an alignment the allocator refuses: copy instead
            return None
        imported = rt.DeviceArray(device, rt.HalBufferView(buf, list(array.shape), et))
        # The buffer is the array's memory: the DeviceArray owns a reference
        # to it, so the memory lives as long as anything can reach the buffer
        # (a caller dropping its copy early once made kernels read freed
        # memory).
        imported._host_keepalive = array
        return imported

    def device_array(self, array: np.ndarray):
        """A DeviceArray on this session's device holding a copy of
        `array`, for memory that outlives calls (KV caches and pools). It is
        allocated past the pool that recycles the calls' results and
        transients (runtime.DEFAULT_CUDA_ALLOCATORS), which counts every
        live buffer it hands out against its capacity: long-lived ones would
        use it up, and each call's buffers would then be a synchronous
        cuMemAlloc and a device-synchronizing cuMemFree, so that every call
        waits for the device (docs/devlog/perf-notes.md, "The host side of
        a GPU call: queued calls and the call-buffer pool")."""
        import iree.runtime as rt

        # IREE's caching allocator routes exportable buffers to the device
        # allocator underneath it.
        usage = rt.BufferUsage.DEFAULT | rt.BufferUsage.SHARING_EXPORT
        return rt.asdevicearray(self.device_of(), array, allowed_usage=usage)

    def device_zeros(self, shape: tuple, dtype: np.dtype):
        """device_array(np.zeros(shape, dtype)), made on the device where
        torch can: a GPU session's zeros are torch memory (one memset)
        imported through DLPack, not host zeros copied over (copying a
        Hugging Face model's new pools took most of its prompt forward:
        docs/devlog/perf-notes.md, "Performance as called", item "The
        prompt forward: pools made on the device"). Like device_array's,
        the memory is outside the pool that recycles the calls' buffers."""
        torch = sys.modules.get("torch")
        if self.target.driver == "local-task" or torch is None:
            return self.device_array(np.zeros(shape, dtype))
        zeros = torch.zeros(shape, dtype=np_torch_dtype(dtype), device=self.torch_device)
        torch_writes_done(self.torch_device)  # the memset, before IREE reads or writes the memory
        return self.import_torch(zeros)

    def kernel_cache(self, c, as_bytes: bool, kept: dict | None = None, alignment: int = DEFAULT_BINDING_ALIGNMENT):
        """A cache (an arrays.cache_array) as a kernel argument: device
        arrays as they are; host caches read in place on CPU sessions (a
        strided one, or one less aligned than `alignment`, what the kernel
        assumes, is copied, aligned, per call). `as_bytes`: the kernel takes
        the cache as i8 (fp8). `kept`: a plan's imports of host caches read
        in place, by memory and layout, so that the next layer's run() of
        the same arrays imports nothing; it holds the arrays (like a plan's
        bound torch caches)."""
        if isinstance(c, DeviceCache):
            return c.array
        # Keyed by the caller's array as it is (the lookup is most of a
        # layer's run() on a small decode, so it reads the pointer once).
        key = (c.ctypes.data, c.shape, c.strides, c.dtype.str, as_bytes, alignment)
        hit = None if kept is None else kept.get(key)
        if hit is not None:
            return hit
        a = kernel_host_array(c, alignment)
        in_place = a is c
        if as_bytes:
            a = a.view(np.int8)
        imported = self.import_host(a, alignment)
        if imported is None:
            return a
        if in_place and kept is not None:
            if len(kept) >= MAX_KEPT_IMPORTS:
                kept.clear()
            kept[key] = imported  # holds `a` (import_host)
        return imported

    @property
    def torch_device(self) -> str:
        """The torch device whose memory this session's device reads: "cpu",
        or "cuda:N" for a cuda/hip session on GPU N (core/devices.py)."""
        return torch_device_of(self.device, self.ordinal)

    def to_torch(self, *arrays):
        """torch tensors on this session's device with the DeviceArrays'
        contents, never through the host: DLPack views of the IREE buffers
        (which they keep alive) where the driver exports them, else
        device-to-device copies into new tensors (device_copy_to_torch).
        Returns one tensor per array."""
        import torch

        if getattr(self, "_exports", True):
            # DLPack device type codes: kDLCPU, kDLCUDA, kDLROCM.
            code = {"local-task": 1, "cuda": 2, "hip": 10}[self.target.driver]
            index = 0 if code == 1 else torch.device(self.torch_device).index
            try:
                return tuple(
                    torch.from_dlpack(self.device_of().create_dlpack_capsule(a._buffer_view, code, index))
                    for a in arrays
                )
            except RuntimeError:
                # IREE's CUDA driver exports only plain device allocations,
                # not the stream-ordered ones that hold function results
                # (it raises "buffer type is not supported for export").
                # Remembered, so later calls go straight to copies.
                self._exports = False
        return self.device_copy_to_torch(*arrays)

    def import_torch(self, tensor):
        """A DeviceArray over a torch tensor on this session's GPU, zero
        copy (DLPack). The tensor must stay alive while calls use it, and
        torch's pending writes to it must be finished first (IREE runs on
        its own stream)."""
        import iree.runtime as rt

        t = tensor if tensor.is_contiguous() else tensor.contiguous()
        device = self.device_of()
        array = rt.DeviceArray(device, device.from_dlpack_capsule(_capsule(t)))
        array._torch_keepalive = t
        return array

    def device_copy_to_torch(self, *arrays):
        """New torch tensors on this session's device holding copies of
        DeviceArrays, made by IREE queue copies into the tensors' memory
        (imported through DLPack), waited for once before returning.
        Verified on CUDA (tests/gpu/test_gpu_interop.py); the CPU driver
        never needs it (it exports) and refuses queue copies into imported
        torch memory."""
        import torch

        out = [torch.empty(tuple(a.shape), dtype=np_torch_dtype(a.dtype), device=self.torch_device) for a in arrays]
        if out and out[0].is_cuda:
            torch.cuda.synchronize(out[0].device)  # the allocations are stream-ordered too
        device = self.device_of()
        done = device.create_semaphore(0)
        for i, (a, t) in enumerate(zip(arrays, out), 1):
            dst = device.from_dlpack_capsule(_capsule(t))
            device.queue_copy(a._buffer_view.get_buffer(), dst.get_buffer(), [(done, i - 1)], [(done, i)])
        if out:
            done.wait(len(out))
        return tuple(out)


def _capsule(t):
    """A DLPack capsule of a torch tensor. The legacy exporter skips the
    stream handshake of `__dlpack__`, a host cost paid on every call
    (docs/devlog/perf-notes.md, "The host side of a call: plan/run"):
    callers synchronize torch's stream themselves before IREE reads."""
    from torch.utils.dlpack import to_dlpack

    return to_dlpack(t)


def kernel_input(session, x):
    """An input of the append kernel as it takes it: host arrays as numpy
    (fp8 as their bytes), torch tensors on the session's GPU imported."""
    if is_device_array(x):
        return x
    if is_torch(x) and x.device.type != "cpu":
        t = x.detach()
        return session.import_torch(t.view(sys.modules["torch"].int8) if "float8" in str(t.dtype) else t)
    a = np.ascontiguousarray(to_numpy(x, "x"))
    return a.view(np.int8) if fp8_name(a.dtype) else a


def run_append(session, fn, *arrays):
    """Calls the loaded append kernel `fn` on its arguments (numpy, torch,
    DeviceArrays): the caches among them are written in place."""
    args = [kernel_input(session, a) for a in arrays]
    torch = sys.modules.get("torch")
    if session.device != "cpu" and torch is not None:
        torch_writes_done(session.torch_device)
    return fn(*args)
