"""A paged KV cache for serving: a page pool with per-sequence page lists.

Sequences are allocated, grow by appending tokens' K/V, fork (the child
shares every page of the parent, reference counted, and copies the shared
last page only when it writes into it), and are freed. `batch` turns a list
of sequences into the block table and seqlen_k that `fmha_fwd_paged` takes.

The pool is zero-initialized, and the cache tracks which pages hold a
non-finite V row, as stored (after the cast to the pool's dtype) and for as
long as the page holds it, freed pages included: while none does, the GPU
kernels without the stale-row guard can serve it (fmha_fwd_paged's
kv_rows_finite).

With a `session`, the pool also lives on that session's device (IREE device
arrays `k_dev`/`v_dev`): appends write only the new rows there, through an
AOT-compiled in-place append kernel (variants.AppendKernel), and `attend`
runs attention on the device pool without copying it. The host arrays `k`/`v`
stay as a write-through mirror; copy-on-write reads the shared rows from
it. The class is thread-safe: every method holds one lock.
"""

from __future__ import annotations

import threading

import numpy as np

from .arrays import _DeviceCache, _dtype_name, _fp8_name, aligned_empty, np_dtype


class CacheFullError(RuntimeError):
    """Not enough free pages for a request; the cache is left unchanged."""


class PagedKVCache:
    """Page pool of `num_pages` pages of `page_block_size` rows.

    k: [num_pages, page_block_size, nhead_k, hdim], v likewise with hdim_v;
    dtype a numpy dtype (or "f16", "bf16", "f32"). Sequence ids are ints
    handed out by `allocate` and `fork`.
    """

    def __init__(self, num_pages: int, page_block_size: int, nhead_k: int, hdim: int, dtype="f16", *,
                 hdim_v: int | None = None, session=None):
        for name, val in (("num_pages", num_pages), ("page_block_size", page_block_size), ("nhead_k", nhead_k), ("hdim", hdim)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        dt = _dtype(dtype)
        self.page_block_size = int(page_block_size)
        # 64-byte aligned: CPU sessions then read the pool in place
        # (Session.import_host) instead of copying it on every call.
        self.k = aligned_zeros((num_pages, page_block_size, nhead_k, hdim), dt)
        self.v = aligned_zeros((num_pages, page_block_size, nhead_k, hdim_v or hdim), dt)
        self._refs = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() gives the lowest id
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._v_bad = np.zeros(num_pages, bool)  # pages holding a non-finite V row
        self.session = session
        self._bits = _fp8_name(dt) is not None
        self.k_dev = self.v_dev = None
        if session is not None:
            import iree.runtime as rt

            from .variants import AppendKernel

            # fp8 pools live on the device as their bytes (int8), like the
            # kernels take them; the append kernel copies bits.
            name = "i8" if self._bits else _dtype_name(dt)
            if name is None:
                raise ValueError(f"device-resident caches take float16, bfloat16, float32 or fp8, got {dt}")
            self._append_fn = session.append_function(
                AppendKernel(name, nhead_k, hdim, hdim_v or hdim, page_block_size))
            device = session.device_of()
            self.k_dev = rt.asdevicearray(device, self._raw(self.k))
            self.v_dev = rt.asdevicearray(device, self._raw(self.v))

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
        """A new sequence with `seq`'s tokens, sharing its pages."""
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
        """Writes tokens' K [n, nhead_k, hdim] and V [n, nhead_k, hdim_v] at
        the end of `seq`. Raises CacheFullError when the free pages do not
        suffice (a shared last page counts one extra: it is copied before it
        is written). Any error leaves the cache exactly as it was: the
        arguments are checked and converted before anything changes, and
        the bookkeeping is committed only after the device write."""
        k_new = self._rows_arg(k_new, "k_new", self.k)
        v_new = self._rows_arg(v_new, "v_new", self.v)
        if v_new.shape[0] != k_new.shape[0]:
            raise ValueError(f"v_new has {v_new.shape[0]} rows but k_new has {k_new.shape[0]}")
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
            taken = self._free[len(self._free) - need:][::-1]  # the pages pop() would give, in order
            shared = pages[-1] if cow else None
            if cow:
                pages[-1] = taken[0]
            pages += taken[int(cow):]
            first = length - fill if cow else length  # first row to write
            pos = np.arange(first, length + n)
            rows_p = np.asarray(pages, np.int64)[pos // page]
            k_rows, v_rows = k_new, v_new
            if cow:  # the shared page's rows, then the new ones
                k_rows = np.concatenate([self.k[shared, :fill], k_new])
                v_rows = np.concatenate([self.v[shared, :fill], v_new])
            if self.k_dev is not None and pos.size:
                slots = np.stack([rows_p, pos % page], axis=1).astype(np.int32)
                self._append_fn(self._raw(np.ascontiguousarray(k_rows)), self._raw(np.ascontiguousarray(v_rows)),
                                slots, self.k_dev, self.v_dev)
            # Commit: nothing below can fail.
            self.k[rows_p, pos % page] = k_rows
            self.v[rows_p, pos % page] = v_rows
            del self._free[len(self._free) - need:]
            if cow:
                self._refs[shared] -= 1
            self._refs[taken] = 1
            self._pages[seq] = pages
            self._lens[seq] = length + n
            # What the pool holds decides whether kernels without the
            # stale-row guard may read it (only V rows matter:
            # plan.stale_rows_finite): a value that became Inf when stored
            # in the pool's dtype counts, and so does whatever a freed page
            # still holds when another sequence reuses it.
            for p in np.unique(rows_p):
                self._v_bad[p] = not np.isfinite(self.v[p].astype(np.float32)).all()

    @property
    def values_finite(self) -> bool:
        """Whether every V row of the pool is finite (fmha_fwd_paged's
        kv_rows_finite): a fact about the stored rows, rows of freed pages
        included."""
        return not self._v_bad.any()

    def _rows_arg(self, x, name: str, pool: np.ndarray) -> np.ndarray:
        a = np.asarray(x)
        if a.ndim != 3 or a.shape[1:] != pool.shape[2:]:
            raise ValueError(f"{name} must have shape [n, {pool.shape[2]}, {pool.shape[3]}], got {a.shape}")
        real = np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)
        if not (real or a.dtype == pool.dtype or a.dtype.name == "bfloat16" or "float8" in a.dtype.name):
            raise TypeError(f"{name} must be a real-valued (float or int) array, got {a.dtype}")
        return a.astype(pool.dtype, copy=False)

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
        from .api import fmha_fwd_paged

        bt, sk = self.batch(seqs)
        if self.session is not None:
            kwargs.setdefault("session", self.session)
            kwargs.setdefault("device", self.session.device)
        if self.k_dev is not None:
            # The device arrays with the pool's own dtype (fp8 pools are
            # int8 there).
            k, v = _DeviceCache(self.k_dev, self.k.dtype), _DeviceCache(self.v_dev, self.v.dtype)
        else:
            k, v = self.k, self.v
        kwargs.setdefault("kv_rows_finite", self.values_finite)
        return fmha_fwd_paged(q, k, v, bt, sk, **kwargs)

    def _raw(self, a: np.ndarray) -> np.ndarray:
        return a.view(np.int8) if self._bits else a

    def gather(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's K and V as contiguous [seqlen, nhead_k, hdim]
        copies (for checking and debugging)."""
        with self._lock:
            pages = np.asarray(self._get(seq), np.int64)
            n = self._lens[seq]
        pos = np.arange(n)
        return self.k[pages[pos // self.page_block_size], pos % self.page_block_size], \
            self.v[pages[pos // self.page_block_size], pos % self.page_block_size]

    def _get(self, seq: int) -> list[int]:
        try:
            return self._pages[seq]
        except KeyError:
            raise KeyError(f"no sequence {seq!r} in this cache") from None


def _dtype(d) -> np.dtype:
    return np_dtype(d) if d in ("f16", "bf16", "f32") else np.dtype(d)


def aligned_zeros(shape, dtype, alignment: int = 64) -> np.ndarray:
    """np.zeros on an `alignment`-byte boundary (see arrays.aligned_empty)."""
    a = aligned_empty(shape, dtype, alignment)
    a[...] = 0
    return a
