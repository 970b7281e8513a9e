"""Plans of one-shot calls, kept for the calls after them with equal inputs.

A model calls attention once per layer per step with the same tables; a
caller of `fmha_fwd_paged` (or `flash_attn_with_kvcache`) rather than
`PagedAttention` would otherwise validate, plan and upload the tables once
per layer. A plan is found again by a digest of the call's arguments:
the tables' and score arrays' bytes, every scalar, and the kind, shape,
dtype, strides and device of q, the caches and the sinks (whose values no
plan depends on; the sinks are checked by each run). Equal digests mean
validation saw equal inputs.
"""

from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np

from ..core.arrays import is_device_array, is_torch

# Plans a session keeps: a step's distinct calls (decode, prefill chunks,
# a few layouts), not a history.
PLAN_CACHE_SIZE = 8
# Arguments keyed by their layout only: no plan depends on their values
# (the sinks: every run brings its own, as each layer has its own).
LAYOUT_ONLY = frozenset({"q", "k_cache", "v_cache", "sinks"})
_SCALARS = (type(None), bool, int, float, str, np.generic)


class _Undigestable(Exception):
    """An argument of a kind the key cannot capture exactly."""


def call_key(arguments: dict) -> bytes | None:
    """A digest of a call's arguments (name -> value), or None if one of
    them is of a kind it cannot digest exactly (the call is then planned
    and validated as usual, and its plan not kept)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        for name, value in arguments.items():
            h.update(name.encode() + b"=")
            _feed(h, value, name in LAYOUT_ONLY)
    except _Undigestable:
        return None
    return h.digest()


def _feed(h, x, layout_only: bool) -> None:
    if isinstance(x, _SCALARS):
        h.update(f"{type(x).__qualname__}:{x!r};".encode())
    elif isinstance(x, (tuple, list)):
        h.update(f"{type(x).__qualname__}[".encode())
        for item in x:
            _feed(h, item, layout_only)
        h.update(b"]")
    elif isinstance(x, np.ndarray):
        # dtype.name too: the fp8 formats all have the str '|V1'.
        h.update(f"ndarray{x.dtype.name}{x.dtype.str}{x.shape}{x.strides};".encode())
        if not layout_only:
            h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    elif is_torch(x):
        import torch

        h.update(f"tensor{x.dtype}{tuple(x.shape)}{x.stride()}{x.device};".encode())
        if not layout_only:  # as bytes: numpy has no bf16/fp8
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    elif is_device_array(x) and layout_only:
        h.update(f"DeviceArray{x.dtype}{tuple(x.shape)};".encode())
    else:
        raise _Undigestable


class PlanCache:
    """A small LRU of plans by call key; safe across threads (a race builds
    a plan twice, and either copy serves)."""

    def __init__(self, size: int = PLAN_CACHE_SIZE):
        self.size = size
        self._plans: collections.OrderedDict[bytes, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes | None, make):
        """The plan kept under `key`, else make()'s (kept unless key is None)."""
        if key is None:
            return make()
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = make()
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
