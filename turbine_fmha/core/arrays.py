"""The kinds of arrays the API takes, and where a call's results live.

numpy arrays (bf16 and fp8 through ml_dtypes), torch tensors, and IREE
DeviceArrays, seen through one shape/dtype view for validation, and moved
between devices only where the call says so: torch GPU tensors are
imported through DLPack, never copied through the host. torch is optional;
it is imported only when a torch tensor is passed.
"""

from __future__ import annotations

import sys

import numpy as np

from .devices import device_name, parse_device, torch_device_of


def bf16_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a variant dtype name (f16, bf16, f32): the one
    table between the two; torch names its dtypes as numpy and ml_dtypes
    do (`np_torch_dtype`)."""
    if name == "bf16":
        return bf16_dtype()
    return np.dtype({"f16": np.float16, "f32": np.float32}[name])


def dtype_name(dt: np.dtype) -> str | None:
    return next((n for n in ("f16", "bf16", "f32") if dt == np_dtype(n)), None)


_FP8_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def fp8_name(dt: np.dtype) -> str | None:
    """ml_dtypes fp8 dtype -> variant dtype name (f8e4m3fn, ...), or None."""
    import ml_dtypes

    for name in _FP8_NAMES:
        if dt == np.dtype(getattr(ml_dtypes, name)):
            return "f8" + name.split("_", 1)[1].replace("_", "")
    return None


def fp8_max(dt: np.dtype) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(dt).max)


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
    """np.empty whose data starts on an `alignment`-byte boundary (numpy
    gives 16): CPU kernels assume 64-byte aligned bindings, so only such
    arrays can be handed to them without a copy (Session.import_host). The
    result is a view that keeps its backing buffer alive."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + n].view(dtype).reshape(shape)


def kernel_host_array(a: np.ndarray, alignment: int) -> np.ndarray:
    """`a` itself when a CPU kernel that assumes `alignment`-byte aligned
    arguments can read it in place (C-contiguous, so aligned), else a
    64-byte aligned C-contiguous copy."""
    if a.flags.c_contiguous and a.ctypes.data % alignment == 0:
        return a
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def is_torch(x) -> bool:
    # torch is never imported here: if it is not loaded, x is no tensor.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x, name: str):
    if is_torch(x):
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16 or "float8" in str(t.dtype):
            # numpy has no such dtype: through the bits, into ml_dtypes'.
            bits = {1: torch.int8, 2: torch.int16}[t.element_size()]
            return t.contiguous().view(bits).numpy().view(torch_np_dtype(t.dtype))
        return t.numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")


class DeviceCache:
    """An IREE DeviceArray cache seen through numpy's shape/dtype/ndim, for
    validation; `.array` goes to the kernels as is (no host copy)."""

    def __init__(self, array, dtype=None):
        self.array = array
        self.shape = tuple(int(d) for d in array.shape)
        self.ndim = len(self.shape)
        # dtype: what the bytes hold where the array says less (PagedKVCache
        # keeps fp8 pools as int8 on the device).
        self.dtype = np.dtype(dtype if dtype is not None else array.dtype)


def torch_memory(array):
    """The torch tensor whose memory an IREE DeviceArray is (imported
    through DLPack: Session.import_torch), or None."""
    return getattr(array, "_torch_keepalive", None)


def torch_gpu_memory(array) -> bool:
    """Whether an IREE DeviceArray is torch GPU memory, which torch writes
    on its own stream: IREE must wait for those writes (torch_writes_done)
    before it reads."""
    t = torch_memory(array)
    return t is not None and t.is_cuda


class TensorInfo:
    """shape / ndim / dtype (numpy's) of a torch tensor, for validation
    without copying its data off its device."""

    def __init__(self, tensor):
        self.shape = tuple(int(d) for d in tensor.shape)
        self.ndim = len(self.shape)
        self.dtype = torch_np_dtype(tensor.dtype)


def np_torch_dtype(dtype):
    """The torch dtype of a numpy (or ml_dtypes) dtype: torch names its
    dtypes as numpy and ml_dtypes do."""
    import torch

    return getattr(torch, np.dtype(dtype).name)


def torch_np_dtype(dtype):
    name = str(dtype).split(".")[-1]
    if name == "bfloat16":
        return bf16_dtype()
    if "float8" in name:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


class TorchDeviceCache(DeviceCache):
    """A torch CUDA/HIP tensor cache, imported into the session's device
    zero-copy through DLPack when the call runs (`bind`)."""

    def __init__(self, tensor):
        info = TensorInfo(tensor)
        self.shape, self.ndim, self.dtype = info.shape, info.ndim, info.dtype
        self.source = tensor  # as given: a plan recognises it by identity
        self.tensor = tensor.detach()
        self.array = None

    def bind(self, session):
        import torch

        t = self.tensor
        if "float8" in str(t.dtype):
            t = t.view(torch.int8)  # the kernels take fp8 caches as their bytes
        # Callers synchronize torch's stream once before the kernels run
        # (IREE runs on its own stream).
        self.array = session.import_torch(t)


def is_device_array(x) -> bool:
    t = type(x)
    return t.__name__ == "DeviceArray" and t.__module__.startswith("iree.runtime")


def cache_array(x, name: str):
    if isinstance(x, DeviceCache):
        return x
    if is_device_array(x):
        return DeviceCache(x)
    if is_torch(x) and x.device.type == "cuda":
        return TorchDeviceCache(x)
    return to_numpy(x, name)


def check_tensor_devices(device, **arrays) -> None:
    """torch tensors must be in host memory or, for a cuda/hip session, on
    its GPU (Session.torch_device; `device` is the session's name, "cuda"
    meaning cuda:0): anything else is refused by name rather than silently
    copied across devices."""
    kind, ordinal = parse_device(device)
    gpu = None if kind == "cpu" else torch_device_of(kind, ordinal)
    for name, x in arrays.items():
        if not is_torch(x):
            continue
        d = x.device
        if d.type == "cpu" or (gpu is not None and d.type == "cuda" and f"cuda:{d.index or 0}" == gpu):
            continue
        where = "host memory" if gpu is None else f"host memory or {gpu}"
        raise ValueError(
            f"{name} is a torch tensor on {d}, but the session runs on {device_name(kind, ordinal)!r}: pass it in {where}"
        )


def torch_writes_done(device=None) -> None:
    """Waits for the work torch queued on its current stream of `device`
    (default: the current device): IREE runs on a stream of its own, so
    what torch wrote there (q, the caches, the tables) must be done before
    IREE reads it. Work on other streams is the caller's to order, as for
    any torch operation; a whole-device synchronize would also wait for
    those streams, and for IREE's own."""
    import torch

    torch.cuda.current_stream(device).synchronize()


def numpy_to_torch(a: np.ndarray):
    """A CPU torch tensor over a numpy array's memory (bf16 and fp8 too)."""
    import torch

    if a.dtype == bf16_dtype():
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if fp8_name(a.dtype):
        return torch.from_numpy(a.view(np.int8)).view(np_torch_dtype(a.dtype))
    return torch.from_numpy(a)


def from_numpy(a: np.ndarray, like):
    return numpy_to_torch(a).to(like.device)


def overlapping(out, arrays: dict) -> str | None:
    """The name of the first array whose memory overlaps `out`'s."""
    lo, hi = byte_range(out)
    dev = array_device(out)
    for name, a in arrays.items():
        if a is None or not (is_torch(a) or isinstance(a, np.ndarray)) or array_device(a) != dev:
            continue
        a_lo, a_hi = byte_range(a)
        if a_lo < hi and lo < a_hi and a_hi > a_lo:
            if isinstance(a, np.ndarray) and isinstance(out, np.ndarray):
                try:
                    if not np.shares_memory(a, out, max_work=10**6):
                        continue
                except _TooHardError:
                    pass
            return name
    return None


def byte_range(a) -> tuple[int, int]:
    if isinstance(a, np.ndarray):
        return _byte_bounds(a) if a.size else (0, 0)
    if a.numel() == 0:
        return (0, 0)
    lo = hi = a.data_ptr()
    for n, st in zip(a.shape, a.stride()):
        span = (n - 1) * st * a.element_size()
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return lo, hi + a.element_size()


# numpy 2 moved these; numpy 1.24 (the oldest this package takes) has them at the top.
_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds
_TooHardError = getattr(np, "exceptions", np).TooHardError


def array_device(a) -> str:
    return str(a.device) if is_torch(a) else "cpu"


class _NumpyOps:
    """The few array operations the runtime writes once for numpy and
    torch (ops_for): numpy's."""

    where, exp, log = staticmethod(np.where), staticmethod(np.exp), staticmethod(np.log)
    isfinite, isnan = staticmethod(np.isfinite), staticmethod(np.isnan)
    einsum, logaddexp = staticmethod(np.einsum), staticmethod(np.logaddexp)

    @staticmethod
    def f32(a):
        return np.asarray(a).astype(np.float32, copy=False)

    @staticmethod
    def amax(a, axis):
        return a.max(axis=axis)

    @staticmethod
    def sum(a, axis):
        return a.sum(axis=axis)

    @staticmethod
    def any(a, axis):
        return a.any(axis=axis)

    @staticmethod
    def concat(pieces, axis, out=None):
        return np.concatenate(pieces, axis=axis, out=out)

    @staticmethod
    def sum_f32(a):
        """The float32 sum of all of `a` (bf16 and fp8 ones included)."""
        return np.asarray(a).astype(np.float32, copy=False).sum(dtype=np.float32)

    @staticmethod
    def like(a, ref):
        """`a` (host data) as an array beside `ref`."""
        return np.asarray(a)

    @staticmethod
    def quiet():
        return np.errstate(all="ignore")


class _TorchOps:
    """torch's side of _NumpyOps, on the tensors' own device."""

    def __init__(self):
        import torch

        self.t = torch
        self.where, self.exp, self.log, self.isfinite, self.isnan = (
            torch.where,
            torch.exp,
            torch.log,
            torch.isfinite,
            torch.isnan,
        )
        self.einsum, self.logaddexp = torch.einsum, torch.logaddexp

    def f32(self, a):
        return a.float()

    def amax(self, a, axis):
        return self.t.amax(a, dim=axis)

    def sum(self, a, axis):
        return a.sum(dim=axis)

    def concat(self, pieces, axis, out=None):
        return self.t.cat(pieces, dim=axis) if out is None else self.t.cat(pieces, dim=axis, out=out)

    def any(self, a, axis):
        return a.any(dim=axis)

    def sum_f32(self, a):
        # One reduction kernel for the common caches; fp8 ones convert first.
        if a.dtype not in (self.t.float16, self.t.bfloat16, self.t.float32):
            a = a.float()
        return a.sum(dtype=self.t.float32)

    def like(self, a, ref):
        return self.t.as_tensor(a, device=ref.device)

    @staticmethod
    def quiet():
        import contextlib

        return contextlib.nullcontext()


_NUMPY_OPS = _NumpyOps()


_TORCH_OPS: list = []  # made on first use: torch is imported only for torch arrays


def ops_for(x):
    """The array operations for x's kind (numpy or torch)."""
    if not is_torch(x):
        return _NUMPY_OPS
    if not _TORCH_OPS:
        _TORCH_OPS.append(_TorchOps())
    return _TORCH_OPS[0]
