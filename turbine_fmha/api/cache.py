"""A paged KV cache for serving: a page pool with per-sequence page lists.

Sequences are allocated, grow by appending tokens' K/V, fork (the child
shares every page of the parent, reference counted, and copies the shared
last page only when it writes into it), and are freed. `batch` turns a list
of sequences into the block table and seqlen_k that `fmha_fwd_paged` takes.

Appended rows must have the pool's dtype (numpy arrays or torch tensors):
values are never converted, so what is stored is exactly what was given.
The pool is zero-initialized, and the cache tracks which rows hold a
non-finite V value, for as long as they hold it, rows of freed pages
included: while none does, the GPU kernels without the stale-row guard can
serve it (fmha_fwd_paged's kv_rows_finite).

With a `session`, the pool lives on that session's device (IREE device
arrays `k_dev`/`v_dev`): appends write only the new rows there, through an
AOT-compiled in-place append kernel (variants.AppendKernel, the kernel of
kv_write.reshape_and_cache), and `attend` runs attention on the device
pool without copying it. The host arrays `k`/`v` are a write-through mirror
(`host_mirror`, on by default): copy-on-write reads the shared rows from
it. Without it (host_mirror=False) a device pool takes no host memory, and
`fork` is refused. The class is thread-safe: every method holds one lock.
"""

from __future__ import annotations

import threading

import numpy as np

from ..core.arrays import (
    _check_tensor_devices,
    _DeviceCache,
    _dtype_name,
    _fp8_name,
    _to_numpy,
    aligned_empty,
    np_dtype,
    ops_for,
)
from ..core.tracing import untraced_methods
from ..kernels.append_kernel import AppendKernel
from ..kernels.variants import KV_LAYOUTS
from ..runtime.interop import run_append
from .eager import fmha_fwd_paged
from .kv_write import _Cache, check_rows, kernel_cache, one_head_slots, rows_info


class CacheFullError(RuntimeError):
    """Not enough free pages for a request; the cache is left unchanged."""


@untraced_methods
class PagedKVCache:
    """Page pool of `num_pages` pages of `page_block_size` rows.

    k: [num_pages, page_block_size, nhead_k, hdim], v likewise with hdim_v;
    with kv_layout="HND" (FlashInfer's head-major pages, which the kernels
    for run-time head counts read fastest on GPUs) [num_pages, nhead_k,
    page_block_size, hdim]. dtype a numpy dtype (or "f16", "bf16", "f32").
    Sequence ids are ints handed out by `allocate` and `fork`.
    host_mirror=False (with a session) keeps no host copy of the device
    pool: `k`/`v` are then None.
    """

    def __init__(
        self,
        num_pages: int,
        page_block_size: int,
        nhead_k: int,
        hdim: int,
        dtype="f16",
        *,
        hdim_v: int | None = None,
        session=None,
        host_mirror: bool = True,
        kv_layout: str = "NHD",
    ):
        for name, val in (
            ("num_pages", num_pages),
            ("page_block_size", page_block_size),
            ("nhead_k", nhead_k),
            ("hdim", hdim),
        ):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if not isinstance(host_mirror, bool):
            raise TypeError(f"host_mirror must be a bool, got {type(host_mirror).__name__}")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        dt = _dtype(dtype)
        self.dtype = dt
        self.page_block_size = int(page_block_size)
        self.kv_layout = kv_layout
        self._heads = int(nhead_k)
        self._dims = (int(hdim), int(hdim_v or hdim))
        page_dims = (nhead_k, page_block_size) if kv_layout == "HND" else (page_block_size, nhead_k)
        self._shapes = tuple((num_pages, *page_dims, d) for d in self._dims)
        mirror = session is None or host_mirror
        # 64-byte aligned: CPU sessions then read the pool in place
        # (Session.import_host) instead of copying it on every call.
        self.k = aligned_zeros(self._shapes[0], dt) if mirror else None
        self.v = aligned_zeros(self._shapes[1], dt) if mirror else None
        self._refs = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() gives the lowest id
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._v_bad = np.zeros((num_pages, page_block_size), bool)  # rows holding a non-finite V value
        self.session = session
        self._bits = _fp8_name(dt) is not None
        self.k_dev = self.v_dev = None
        if session is not None:
            # fp8 pools live on the device as their bytes (int8), like the
            # kernels take them; the append kernel copies bits.
            name = "i8" if self._bits else _dtype_name(dt)
            if name is None:
                raise ValueError(f"device-resident caches take float16, bfloat16, float32 or fp8, got {dt}")
            # HND pools are written as one-head pages (kv_write.one_head_slots).
            heads = 1 if kv_layout == "HND" else nhead_k
            self._append_fn = session.append_function(AppendKernel(name, heads, hdim, hdim_v or hdim, page_block_size))
            zeros = (self.k, self.v) if mirror else (np.zeros(s, dt) for s in self._shapes)
            self.k_dev, self.v_dev = (session.device_array(self._raw(z)) for z in zeros)
            self._append_pools = tuple(
                kernel_cache(session, _Cache(a, s, dt), (num_pages * nhead_k, page_block_size, 1, d))
                if kv_layout == "HND"
                else a
                for a, s, d in zip((self.k_dev, self.v_dev), self._shapes, self._dims)
            )

    # -- sequences -----------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A new, empty sequence (no pages until its first append)."""
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            self._pages[sid] = []
            self._lens[sid] = 0
            return sid

    def fork(self, seq: int) -> int:
        """A new sequence with `seq`'s tokens, sharing its pages. Needs the
        host mirror (copy-on-write reads a shared page's rows from it)."""
        if self.k is None:
            raise ValueError(
                "fork needs the host mirror, which copy-on-write reads shared rows from: "
                "create the cache with host_mirror=True"
            )
        with self._lock:
            pages = self._get(seq)
            sid = self._next_id
            self._next_id += 1
            self._pages[sid] = list(pages)
            self._lens[sid] = self._lens[seq]
            self._refs[pages] += 1
            return sid

    def free(self, seq: int) -> None:
        """Drops the sequence; pages no other sequence holds become free."""
        with self._lock:
            pages = self._get(seq)
            del self._pages[seq], self._lens[seq]
            for p in reversed(pages):
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)

    def seqlen(self, seq: int) -> int:
        with self._lock:
            self._get(seq)
            return self._lens[seq]

    def pages(self, seq: int) -> list[int]:
        with self._lock:
            return list(self._get(seq))

    def append(self, seq: int, k_new, v_new) -> None:
        """Writes tokens' K [n, nhead_k, hdim] and V [n, nhead_k, hdim_v],
        of the pool's dtype (numpy, or torch in host memory or on the
        session's GPU), at the end of `seq`. Raises CacheFullError when the
        free pages do not suffice (a shared last page counts one extra: it
        is copied before it is written). Any error leaves the cache exactly
        as it was: the arguments are checked before anything changes, and
        the bookkeeping is committed only after the device write."""
        self._rows_arg(k_new, "k_new", self._dims[0])
        self._rows_arg(v_new, "v_new", self._dims[1])
        if v_new.shape[0] != k_new.shape[0]:
            raise ValueError(f"v_new has {v_new.shape[0]} rows but k_new has {k_new.shape[0]}")
        if self.k is not None:  # the host pool or mirror is written from host memory
            k_new, v_new = _to_numpy(k_new, "k_new"), _to_numpy(v_new, "v_new")
        n = k_new.shape[0]
        page = self.page_block_size
        with self._lock:
            pages = list(self._get(seq))
            length = self._lens[seq]
            fill = length % page  # rows used in the last page (0: full or none)
            cow = fill > 0 and n > 0 and self._refs[pages[-1]] > 1
            need = -(-(length + n) // page) - len(pages) + int(cow)
            if need > len(self._free):
                raise CacheFullError(
                    f"sequence {seq} needs {need} free pages for {n} tokens, {len(self._free)} are free"
                )
            taken = self._free[len(self._free) - need :][::-1]  # the pages pop() would give, in order
            shared = pages[-1] if cow else None
            if cow:
                pages[-1] = taken[0]
            pages += taken[int(cow) :]
            first = length - fill if cow else length  # first row to write
            pos = np.arange(first, length + n)
            rows_p = np.asarray(pages, np.int64)[pos // page]
            k_rows, v_rows = k_new, v_new
            if cow:  # the shared page's rows, then the new ones
                shared_rows = self._at(np.full(fill, shared), np.arange(fill))
                k_rows = np.concatenate([self.k[shared_rows], k_new])
                v_rows = np.concatenate([self.v[shared_rows], v_new])
            bad = _nonfinite_rows(v_rows)
            if self.k_dev is not None and pos.size:
                self._device_write(k_rows, v_rows, rows_p, pos % page)
            # Commit: nothing below can fail.
            if self.k is not None:
                self.k[self._at(rows_p, pos % page)] = k_rows
                self.v[self._at(rows_p, pos % page)] = v_rows
            del self._free[len(self._free) - need :]
            if cow:
                self._refs[shared] -= 1
            self._refs[taken] = 1
            self._pages[seq] = pages
            self._lens[seq] = length + n
            # Whether kernels without the stale-row guard may read the pool
            # depends on every V row it holds (plan.stale_rows_finite),
            # rows of freed pages included: a row keeps its mark until it
            # is overwritten.
            self._v_bad[rows_p, pos % page] = bad

    @property
    def values_finite(self) -> bool:
        """Whether every V row of the pool is finite (fmha_fwd_paged's
        kv_rows_finite): a fact about the stored rows, rows of freed pages
        included."""
        return not self._v_bad.any()

    def _at(self, pages, rows) -> tuple:
        """The index of rows (pages[i], rows[i]) of a pool: [n, nhead_k, dim]."""
        return (pages, slice(None), rows) if self.kv_layout == "HND" else (pages, rows)

    def _device_write(self, k_rows, v_rows, pages, rows) -> None:
        if self.kv_layout == "HND":
            pages, rows = one_head_slots(pages, rows, self._heads)
            k_rows, v_rows = (x.reshape(-1, 1, d) for x, d in zip((k_rows, v_rows), self._dims))
        slots = np.stack([pages, rows], axis=1).astype(np.int32)
        run_append(self.session, self._append_fn, k_rows, v_rows, slots, *self._append_pools)

    def _rows_arg(self, x, name: str, dim: int) -> None:
        _check_tensor_devices(self.session.device if self.session is not None else "cpu", **{name: x})
        info = rows_info(x, name)
        if info.ndim != 3 or tuple(info.shape[1:]) != (self._heads, dim):
            raise ValueError(f"{name} must have shape [n, {self._heads}, {dim}], got {list(info.shape)}")
        check_rows(info, name, info.shape, self.dtype)

    # -- batches -------------------------------------------------------------

    def batch(self, seqs) -> tuple[np.ndarray, np.ndarray]:
        """(block_table [len(seqs), max pages] int32, seqlen_k [len(seqs)]
        int32) for fmha_fwd_paged; unused slots hold -1."""
        with self._lock:
            rows = [self._get(s) for s in seqs]
            lens = [self._lens[s] for s in seqs]
        bt = np.full((len(rows), max([len(r) for r in rows] + [1])), -1, np.int32)
        for i, r in enumerate(rows):
            bt[i, : len(r)] = r
        return bt, np.array(lens, np.int32)

    def attend(self, q, seqs, **kwargs):
        """fmha_fwd_paged over sequences `seqs` of this cache (q as there:
        [len(seqs), seqlen_q, nhead_q, hdim], or group mode with
        seqstart_q), on the device pool when there is one."""
        bt, sk = self.batch(seqs)
        if self.session is not None:
            kwargs.setdefault("session", self.session)
            kwargs.setdefault("device", self.session.device)
        if self.k_dev is not None:
            # The device arrays with the pool's own dtype (fp8 pools are
            # int8 there).
            k, v = _DeviceCache(self.k_dev, self.dtype), _DeviceCache(self.v_dev, self.dtype)
        else:
            k, v = self.k, self.v
        kwargs.setdefault("kv_rows_finite", self.values_finite)
        return fmha_fwd_paged(q, k, v, bt, sk, kv_layout=self.kv_layout, **kwargs)

    def _raw(self, a: np.ndarray) -> np.ndarray:
        return a.view(np.int8) if self._bits else a

    def gather(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's K and V as contiguous [seqlen, nhead_k, hdim]
        copies (for checking and debugging; without a host mirror, the
        whole device pool is read back)."""
        with self._lock:
            pages = np.asarray(self._get(seq), np.int64)
            n = self._lens[seq]
            k, v = (
                (self.k, self.v)
                if self.k is not None
                else (a.to_host().view(self.dtype) for a in (self.k_dev, self.v_dev))
            )
        pos = np.arange(n)
        rows = self._at(pages[pos // self.page_block_size], pos % self.page_block_size)
        return k[rows], v[rows]

    def _get(self, seq: int) -> list[int]:
        try:
            return self._pages[seq]
        except KeyError:
            raise KeyError(f"no sequence {seq!r} in this cache") from None


def _nonfinite_rows(v) -> np.ndarray:
    """Which rows of v [n, heads, dim] (numpy or torch) hold a non-finite
    value, as a host bool array."""
    ops = ops_for(v)
    bad = ops.any(~ops.isfinite(ops.f32(v)), (1, 2))
    return bad.cpu().numpy() if hasattr(bad, "cpu") else np.asarray(bad)


def _dtype(d) -> np.dtype:
    return np_dtype(d) if d in ("f16", "bf16", "f32") else np.dtype(d)


def aligned_zeros(shape, dtype, alignment: int = 64) -> np.ndarray:
    """np.zeros on an `alignment`-byte boundary (see arrays.aligned_empty)."""
    a = aligned_empty(shape, dtype, alignment)
    a[...] = 0
    return a
