"""The environment variables turbine-fmha reads, each read and checked here.

A variable that is unset or empty means its default. A value that is set
but invalid raises ValueError naming the variable and what it takes,
like an invalid argument; it is never silently replaced by a default.
docs/user-guide.md ("Environment variables") lists them.
"""

from __future__ import annotations

import os
from pathlib import Path

ARTIFACTS = "TURBINE_FMHA_ARTIFACTS"
CACHE = "TURBINE_FMHA_CACHE"
MANIFEST_SHA256 = "TURBINE_FMHA_MANIFEST_SHA256"
CPU_THREADS = "TURBINE_FMHA_CPU_THREADS"
# "1" keeps IREE's stream-ordered CUDA allocations (runtime._shared_config).
CUDA_ASYNC_ALLOCATIONS = "TURBINE_FMHA_CUDA_ASYNC_ALLOCATIONS"
# IREE allocator specs layered over the CUDA device's allocator, comma
# separated ("" for none).
CUDA_ALLOCATORS = "TURBINE_FMHA_CUDA_ALLOCATORS"
MLIR_DIR = "TURBINE_FMHA_MLIR_DIR"
# "1" makes HIP sessions wait on the host around calls given torch tensors
# (torch's stream synchronized before, IREE's fences after), as CUDA
# sessions do, instead of the stream-ordered handoff (runtime/hip_handoff.py).
HIP_HOST_WAIT = "TURBINE_FMHA_HIP_HOST_WAIT"


def text(name: str) -> str | None:
    """The variable's value, or None where it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def path(name: str) -> Path | None:
    value = text(name)
    return None if value is None else Path(value).expanduser()


def directory(name: str) -> Path | None:
    """A path that must be an existing directory."""
    p = path(name)
    if p is not None and not p.is_dir():
        raise ValueError(f"${name} = {os.environ[name]!r} is not a directory")
    return p


def positive_int(name: str) -> int | None:
    value = text(name)
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"${name} must be a positive integer, got {os.environ[name]!r}")
    return n


def switch(name: str) -> bool:
    """ "1" on, "0" (or unset) off."""
    value = text(name)
    if value not in (None, "0", "1"):
        raise ValueError(f"${name} must be 0 or 1, got {os.environ[name]!r}")
    return value == "1"


def comma_list(name: str) -> list[str] | None:
    """A comma-separated list (None where unset); empty items are dropped."""
    value = text(name)
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]
