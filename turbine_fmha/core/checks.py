"""Argument checks shared by the validating modules: each error names the
argument it is about."""

from __future__ import annotations

import math
import numbers

import numpy as np

from .arrays import bf16_dtype, is_torch, overlapping, to_numpy, torch_np_dtype

F32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)


def check_int(value, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_float(value, name: str) -> float:
    """A finite float that float32 holds (the kernels' scalars are f32)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite float, got {value!r}")
    if abs(value) > F32_MAX:
        raise ValueError(f"{name} = {value!r} overflows float32 (|{name}| <= {F32_MAX:.4g})")
    return float(value)


def int_array(x, name: str, ndim: int) -> np.ndarray:
    a = to_numpy(x, name)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array (int32), got {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.size and a.max() > _INT64_MAX:
        # Callers compute in int64: such a value would wrap to a negative one
        # (2**64 - 1 to -1).
        idx = [int(i) for i in np.unravel_index(int(np.argmax(a > _INT64_MAX)), a.shape)]
        raise ValueError(f"{name}{idx} = {int(a[tuple(idx)])} is out of range (larger than any int64)")
    return a


def float_array(x, name: str, *, finite: bool = False) -> np.ndarray:
    """x as float32. Values float32 cannot hold are refused by name rather
    than becoming Inf; with finite=True, NaN and Inf are too."""
    a = to_numpy(x, name)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype != bf16_dtype():
        raise TypeError(f"{name} must be a float array, got {a.dtype}")
    wide = a.astype(np.float64, copy=False)
    given = np.isfinite(wide)
    if finite and not given.all():
        idx = tuple(int(i) for i in np.argwhere(~given)[0])
        raise ValueError(f"{name}{list(idx)} = {wide[idx]} must be finite")
    big = given & (np.abs(wide) > F32_MAX)
    if big.any():
        idx = tuple(int(i) for i in np.argwhere(big)[0])
        raise ValueError(f"{name}{list(idx)} = {wide[idx]:.6g} overflows float32")
    return a.astype(np.float32, copy=False)


def check_out(out, q, torch_results, out_shape, dtype, inputs, session):
    """A caller's `out`: q's kind and device, the result's shape and dtype,
    contiguous and writeable, and sharing no memory with `inputs`."""
    if is_torch(out):
        if not is_torch(q) or out.device != q.device:
            raise TypeError("a torch out needs q to be a torch tensor on the same device")
        if tuple(out.shape) != tuple(out_shape) or torch_np_dtype(out.dtype) != dtype:
            raise ValueError(
                f"out must have shape {list(out_shape)} and dtype {dtype}, "
                f"got {list(out.shape)} {torch_np_dtype(out.dtype)}"
            )
        if not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor")
        if not torch_results:
            raise ValueError(f"a torch out needs q on the session's device ({session.torch_device}) and not fp8")
    elif not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array or a torch tensor, got {type(out).__name__}")
    elif out.shape != tuple(out_shape) or out.dtype != dtype:
        raise ValueError(f"out must have shape {list(out_shape)} and dtype {dtype}, got {list(out.shape)} {out.dtype}")
    elif not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a writeable C-contiguous array")
    clash = overlapping(out, inputs)
    if clash:
        raise ValueError(f"out overlaps {clash} in memory; pass a separate output buffer")
