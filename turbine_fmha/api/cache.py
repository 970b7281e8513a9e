"""A paged KV cache for serving: a page pool with per-sequence page lists.

Sequences are allocated, grow by appending tokens' K/V (`append`, or
`append_batch` for n tokens to each of many sequences in one write), fork
(the child shares every page of the parent, reference counted, and copies
the shared last page only when it writes into it), and are freed. `batch`
turns a list of sequences into the block table and seqlen_k that
`fmha_fwd_paged` takes.

Appended rows must have the pool's dtype (numpy arrays or torch tensors):
values are never converted, so what is stored is exactly what was given.
The pool is zero-initialized, and the cache tracks which rows hold a
non-finite V value, for as long as they hold it, rows of freed pages
included: while none does, the GPU kernels without the stale-row guard can
serve it (fmha_fwd_paged's kv_rows_finite). Appends do not wait for that
check: it is read back when `values_finite` is next asked (or by
`all_values_finite` for several pools in one transfer).

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

import collections
import contextlib
import dataclasses
import sys
import threading

import numpy as np

from ..calls.options import REQUIRED, Option, documented
from ..core.arrays import (
    DeviceCache,
    aligned_empty,
    check_tensor_devices,
    dtype_name,
    fp8_name,
    is_torch,
    np_dtype,
    to_numpy,
    torch_memory,
    torch_writes_done,
)
from ..core.tracing import untraced_methods
from ..kernels.append_kernel import AppendKernel
from ..kernels.variants import KV_LAYOUTS
from ..runtime.interop import run_append
from .eager import fmha_fwd_paged
from .kv_write import WritableCache, check_rows, kernel_cache, one_head_slots, rows_info

# Appends whose finiteness checks wait, at most, before a pool reads them
# back itself: a pool whose values_finite nobody asks for then costs one
# host read per this many appends, and holds no more of the checks' flags.
MAX_PENDING_CHECKS = 256


class CacheFullError(RuntimeError):
    """Not enough free pages for a request; the cache is left unchanged."""


# append_batch computes its slots on arrays (_unshared_slots) from this many
# sequences; below it the arrays' fixed cost loses to the sequence-by-
# sequence loop (docs/devlog/perf-notes.md, "Performance as called" 26).
ARRAY_SLOTS_MIN_BATCH = 16


@dataclasses.dataclass
class _Slots:
    """Where an append_batch writes: the free pages it takes (in order),
    the sequences whose page lists grow ((index in the batch, new list)),
    the shared pages it copies away from, each written row's page and row,
    and, where shared pages are copied, (source row of each written row in
    the given k/v or -1, the mirror rows the -1 ones come from)."""

    taken: list
    grown: list
    shared: list
    rows_p: np.ndarray
    rows_r: np.ndarray
    copied: tuple | None


@untraced_methods
class PagedKVCache:
    """Page pool of `num_pages` pages of `page_block_size` rows.

        cache = PagedKVCache(1024, 16, nhead_k=8, hdim=128, session=session)
        seq = cache.allocate()
        cache.append(seq, k_prompt, v_prompt)  # [n, nhead_k, hdim] each
        out = cache.attend(q, [seq], causal=True)

    Sequence ids are ints handed out by `allocate` and `fork`. The pool is
    zero-initialized; every method holds one lock (thread-safe).

    Args:
      num_pages: int >= 1. Pages in the pool.
      page_block_size: int >= 1. Rows (tokens) per page.
      nhead_k: int >= 1. KV heads.
      hdim: int >= 1. K's head dim (and V's unless hdim_v).
      dtype: 'f16', 'bf16', 'f32' or a numpy dtype (an ml_dtypes fp8 type
        for an fp8 pool), default 'f16'. Appended rows must have it:
        values are never converted.
      hdim_v: int, keyword-only, default None (hdim). V's head dim.
      session: a turbine_fmha.Session, keyword-only, default None (a pool
        in host memory). The pool then lives on the session's device
        (`k_dev`, `v_dev`, IREE DeviceArrays), appends write only the new
        rows there through the in-place append kernel (which must exist
        for the pool's shape, or be compiled on demand: raises here
        otherwise), and `attend` reads it without copying.
      host_mirror: bool, keyword-only, default True. With a session, keep
        a write-through host copy (`k`, `v`) that copy-on-write reads;
        False keeps no host memory for the pool (`k`, `v` are None, `fork`
        is refused, `gather` reads the device pool back).
      kv_layout: 'NHD' or 'HND', keyword-only, default 'NHD'. The pages:
        k [num_pages, page_block_size, nhead_k, hdim] (v likewise with
        hdim_v), or head-major [num_pages, nhead_k, page_block_size, hdim]
        (FlashInfer's, which the kernels for run-time head counts read
        fastest on GPUs); `attend` passes it on.

    Raises:
      ValueError or TypeError naming the argument.
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
        self._n_bad = 0  # of _v_bad: values_finite without scanning the pool
        # Writes whose finiteness check is not read back yet: (pages, rows,
        # flags), oldest first (_record).
        self._pending: list[tuple] = []
        self.session = session
        self._bits = fp8_name(dt) is not None
        self.k_dev = self.v_dev = None
        self._torch_pools = None  # (k, v): the torch tensors the device pool is, if it is
        if session is not None:
            # fp8 pools live on the device as their bytes (int8), like the
            # kernels take them; the append kernel copies bits.
            name = "i8" if self._bits else dtype_name(dt)
            if name is None:
                raise ValueError(f"device-resident caches take float16, bfloat16, float32 or fp8, got {dt}")
            # HND pools are written as one-head pages (kv_write.one_head_slots).
            heads = 1 if kv_layout == "HND" else nhead_k
            self._append_fn = session.append_function(AppendKernel(name, heads, hdim, hdim_v or hdim, page_block_size))
            if mirror:
                self.k_dev, self.v_dev = (session.device_array(self._raw(z)) for z in (self.k, self.v))
            else:
                raw = np.dtype(np.int8) if self._bits else dt
                self.k_dev, self.v_dev = (session.device_zeros(s, raw) for s in self._shapes)
                # On a GPU those are torch memory: appends of torch rows on
                # that GPU are then torch writes (_torch_write).
                pools = tuple(torch_memory(a) for a in (self.k_dev, self.v_dev))
                self._torch_pools = pools if all(t is not None for t in pools) else None
            self._append_pools = tuple(
                kernel_cache(session, WritableCache(a, s, dt), (num_pages * nhead_k, page_block_size, 1, d))
                if kv_layout == "HND"
                else a
                for a, s, d in zip((self.k_dev, self.v_dev), self._shapes, self._dims)
            )

    # -- sequences -----------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds."""
        return len(self._free)

    def allocate(self) -> int:
        """A new, empty sequence (no pages until its first append).

        Returns:
          The sequence's id (an int).
        """
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            self._pages[sid] = []
            self._lens[sid] = 0
            return sid

    def fork(self, seq: int) -> int:
        """A new sequence with `seq`'s tokens, sharing its pages.

        The pages are reference counted; a shared last page is copied only
        when one of the sequences writes into it. Needs the host mirror
        (copy-on-write reads a shared page's rows from it).

        Args:
          seq: a sequence id of this cache.

        Returns:
          The new sequence's id.

        Raises:
          KeyError: no such sequence. ValueError: no host mirror.
        """
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
        """Drops a sequence: the pages no other sequence holds become free.

        Args:
          seq: a sequence id of this cache (KeyError otherwise).
        """
        with self._lock:
            pages = self._get(seq)
            del self._pages[seq], self._lens[seq]
            for p in reversed(pages):
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)

    def seqlen(self, seq: int) -> int:
        """The tokens a sequence holds.

        Args:
          seq: a sequence id of this cache (KeyError otherwise).
        """
        with self._lock:
            self._get(seq)
            return self._lens[seq]

    def pages(self, seq: int) -> list[int]:
        """A sequence's page ids, in token order.

        Args:
          seq: a sequence id of this cache (KeyError otherwise).
        """
        with self._lock:
            return list(self._get(seq))

    def append(self, seq: int, k_new, v_new) -> None:
        """Writes n tokens' K and V at the end of sequence `seq`.

        Pages are taken from the free list as needed. Any error leaves the
        cache exactly as it was: the arguments are checked before anything
        changes, and the bookkeeping is committed only after the device
        write.

        Args:
          seq: a sequence id of this cache.
          k_new: [n, nhead_k, hdim], of the pool's dtype: numpy, or torch
            in host memory or on the session's GPU.
          v_new: [n, nhead_k, hdim_v], likewise.

        Raises:
          CacheFullError: the free pages do not suffice (a shared last page
            counts one extra: it is copied before it is written).
          KeyError: no such sequence. ValueError or TypeError naming the
            argument.
        """
        self._rows_arg(k_new, "k_new", self._dims[0])
        self._rows_arg(v_new, "v_new", self._dims[1])
        if v_new.shape[0] != k_new.shape[0]:
            raise ValueError(f"v_new has {v_new.shape[0]} rows but k_new has {k_new.shape[0]}")
        if self.k is not None:  # the host pool or mirror is written from host memory
            k_new, v_new = to_numpy(k_new, "k_new"), to_numpy(v_new, "v_new")
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
            bad = _nonfinite_flags(v_rows)
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
            self._record(rows_p, pos % page, bad)

    def append_batch(self, seqs, k_new, v_new) -> None:
        """Writes n tokens at the end of each of sequences `seqs`, in one
        write (one append-kernel call for a device pool).

        The result is that of append(seqs[i], k_new[i], v_new[i]) for each
        i in order (the same pages, taken in that order; shared last pages
        copied on write), but all or nothing: any error leaves the cache
        exactly as it was.

        Args:
          seqs: distinct sequence ids of this cache.
          k_new: [len(seqs), n, nhead_k, hdim], of the pool's dtype, as
            `append` takes it; row i goes to seqs[i].
          v_new: [len(seqs), n, nhead_k, hdim_v], likewise.

        Raises:
          CacheFullError: the free pages do not suffice for the whole batch.
          KeyError: no such sequence. ValueError or TypeError naming the
            argument.
        """
        seqs = list(seqs)
        self._rows_arg(k_new, "k_new", self._dims[0], len(seqs))
        self._rows_arg(v_new, "v_new", self._dims[1], len(seqs))
        if v_new.shape[1] != k_new.shape[1]:
            raise ValueError(f"v_new has {v_new.shape[1]} rows per sequence but k_new has {k_new.shape[1]}")
        if len(set(seqs)) != len(seqs):
            raise ValueError("append_batch takes each sequence once: seqs holds one twice")
        if self.k is not None:  # the host pool or mirror is written from host memory
            k_new, v_new = to_numpy(k_new, "k_new"), to_numpy(v_new, "v_new")
        batch, n = len(seqs), k_new.shape[1]
        with self._lock:
            lists = [self._get(s) for s in seqs]
            if not n or not batch:
                return
            lens = [self._lens[s] for s in seqs]
            plan = (batch >= ARRAY_SLOTS_MIN_BATCH and self._unshared_slots(lists, lens, n)) or self._slots(
                lists, lens, n
            )
            k_rows = k_new.reshape((batch * n,) + tuple(k_new.shape[2:]))
            v_rows = v_new.reshape((batch * n,) + tuple(v_new.shape[2:]))
            if plan.copied is not None:  # forks share pages only with the host mirror: numpy rows
                src, at = plan.copied
                k_rows, v_rows = k_rows[src], v_rows[src]
                k_rows[src == -1], v_rows[src == -1] = self.k[at], self.v[at]
            bad = _nonfinite_flags(v_rows)
            if self.k_dev is not None:
                self._device_write(k_rows, v_rows, plan.rows_p, plan.rows_r)
            # Commit: nothing below can fail.
            if self.k is not None:
                self.k[self._at(plan.rows_p, plan.rows_r)] = k_rows
                self.v[self._at(plan.rows_p, plan.rows_r)] = v_rows
            del self._free[len(self._free) - len(plan.taken) :]
            for p in plan.shared:
                self._refs[p] -= 1
            self._refs[plan.taken] = 1
            for i, pages in plan.grown:
                self._pages[seqs[i]] = pages
            for s, length in zip(seqs, lens):
                self._lens[s] = length + n
            self._record(plan.rows_p, plan.rows_r, bad)

    def _take(self, total: int, batch: int, n: int) -> list[int]:
        """The `total` pages pop() would give, in order (CacheFullError if
        fewer are free); taken from the free list only on commit."""
        if total > len(self._free):
            raise CacheFullError(
                f"the {batch} sequences need {total} free pages for {n} tokens each, {len(self._free)} are free"
            )
        return self._free[len(self._free) - total :][::-1]

    def _unshared_slots(self, lists, lens, n: int) -> _Slots | None:
        """append_batch's slots computed on arrays, for a batch in which no
        partly filled last page is shared (nothing to copy on write) and
        every sequence holds the pages its length needs: a decode step's
        batch. None otherwise (_slots, sequence by sequence). The result is
        _slots': the same pages taken in the same order, the same rows."""
        page, batch = self.page_block_size, len(lists)
        lens_a = np.fromiter(lens, np.int64, batch)
        held = np.fromiter(map(len, lists), np.int64, batch)
        if (held != -(-lens_a // page)).any():
            return None
        partial = lens_a % page != 0
        lasts = np.fromiter((p[-1] for p, f in zip(lists, partial.tolist()) if f), np.int64)
        if (self._refs[lasts] > 1).any():
            return None
        needs = -(-(lens_a + n) // page) - held
        taken = self._take(int(needs.sum()), batch, n)
        # The pages each sequence writes into, in order: its partly filled
        # last page, then its new pages (taken in sequence order).
        counts = partial + needs
        starts = np.cumsum(counts) - counts
        tail = np.empty(int(counts.sum()), np.int64)
        is_last = np.zeros(tail.size, bool)
        is_last[starts[partial]] = True
        tail[is_last] = lasts
        tail[~is_last] = taken
        seq_of = np.repeat(np.arange(batch), n)
        pos = lens_a[seq_of] + np.tile(np.arange(n), batch)
        rows_p = tail[starts[seq_of] + (pos - (lens_a - lens_a % page)[seq_of]) // page]
        at = np.cumsum(needs) - needs
        grown = [(i, lists[i] + taken[at[i] : at[i] + needs[i]]) for i in np.flatnonzero(needs).tolist()]
        return _Slots(taken, grown, (), rows_p, pos % page, None)

    def _slots(self, lists, lens, n: int) -> _Slots:
        """append_batch's slots sequence by sequence, as appends one by one
        would take them: a partly filled last page still shared is copied
        (by each writer but the last holder, which then owns it alone)."""
        page, batch = self.page_block_size, len(lists)
        held: dict[int, int] = {}  # shared page -> its holders left after this batch's copies
        shared = [-1] * batch
        needs = []
        for i, (pages, length) in enumerate(zip(lists, lens)):
            cow = 0
            if length % page:
                last = pages[-1]
                refs = held.get(last, -1)
                if refs < 0:
                    refs = int(self._refs[last])
                if refs > 1:
                    held[last], shared[i], cow = refs - 1, last, 1
            needs.append(-(-(length + n) // page) - len(pages) + cow)
        taken = self._take(sum(needs), batch, n)
        grown, tail = [], []  # tail: the pages written into, sequence by sequence
        first = np.empty(batch, np.int64)  # first row written (a copied page's rows first)
        tail_at = np.empty(batch, np.int64)  # where the sequence's pages start in tail, less its first page
        t = 0
        for i, (pages, length, need) in enumerate(zip(lists, lens, needs)):
            if need:
                got, t = taken[t : t + need], t + need
                pages = pages[:-1] + got if shared[i] >= 0 else pages + got
                grown.append((i, pages))
            f = length - length % page if shared[i] >= 0 else length
            first[i], tail_at[i] = f, len(tail) - f // page
            tail.extend(pages[f // page :])
        lens_a = np.asarray(lens, np.int64)
        count = lens_a + n - first
        seq_of = np.repeat(np.arange(batch), count)
        pos = first[seq_of] + np.arange(int(count.sum())) - (np.cumsum(count) - count)[seq_of]
        rows_p = np.asarray(tail, np.int64)[tail_at[seq_of] + pos // page]
        rows_r = pos % page
        copied = None
        if max(shared) >= 0:
            # Rows of the given k/v, or -1 for a shared page's rows, read
            # from the host mirror at `at`.
            old = pos < lens_a[seq_of]
            src = np.where(old, -1, seq_of * n + pos - lens_a[seq_of])
            copied = (src, self._at(np.asarray(shared, np.int64)[seq_of[old]], rows_r[old]))
        return _Slots(taken, grown, [p for p in shared if p >= 0], rows_p, rows_r, copied)

    def _record(self, pages, rows, bad) -> None:
        """Marks rows (pages[i], rows[i]) as holding a non-finite V value
        where bad[i], once bad is read (lock held).

        Whether kernels without the stale-row guard may read the pool
        depends on every V row it holds (plan.stale_rows_finite), rows of
        freed pages included: a row keeps its mark until it is overwritten.
        The marks of a write are computed where its rows are (on the GPU for
        torch CUDA rows) but read back only when values_finite is next
        needed: reading them at once made every append wait for the device,
        which cost a decode step of a batch B model B syncs per layer.
        Applied oldest first, the pending marks give exactly the marks that
        eager reads would have; until then nothing claims the rows finite
        (values_finite reads them first)."""
        if not len(pages):
            return
        self._pending.append((pages, rows, bad))
        if len(self._pending) >= MAX_PENDING_CHECKS:
            _resolve([self])

    @property
    def values_finite(self) -> bool:
        """Whether every V row of the pool is finite (fmha_fwd_paged's
        kv_rows_finite): a fact about the stored rows, rows of freed pages
        included. Reads back the checks of the appends since it was last
        asked (one transfer)."""
        return all_values_finite([self])

    def _at(self, pages, rows) -> tuple:
        """The index of rows (pages[i], rows[i]) of a pool: [n, nhead_k, dim]."""
        return (pages, slice(None), rows) if self.kv_layout == "HND" else (pages, rows)

    def _device_write(self, k_rows, v_rows, pages, rows) -> None:
        pools = self._torch_pools
        if pools is not None and all(is_torch(x) and x.device == pools[0].device for x in (k_rows, v_rows)):
            self._torch_write(k_rows, v_rows, pages, rows)
            return
        if self.kv_layout == "HND":
            pages, rows = one_head_slots(pages, rows, self._heads)
            k_rows, v_rows = (x.reshape(-1, 1, d) for x, d in zip((k_rows, v_rows), self._dims))
        slots = np.stack([pages, rows], axis=1).astype(np.int32)
        run_append(self.session, self._append_fn, k_rows, v_rows, slots, *self._append_pools)

    def _torch_write(self, k_rows, v_rows, pages, rows) -> None:
        """The rows written by torch into the pool's torch memory, on torch's
        current stream: no IREE call, so nothing waits (the append kernel's
        call waited for torch's stream, then for itself, once per layer of
        a model's step). IREE's readers wait for torch first (the kernels'
        callers, _read_device)."""
        torch = sys.modules["torch"]
        pk, pv = self._torch_pools
        nhd = self.kv_layout == "NHD"
        # NHD pools are written as [pages * page, heads, dim] rows.
        at = np.stack([pages, rows]) if not nhd else pages * self.page_block_size + rows
        at = _device_index(at.astype(np.int64, copy=False), pk.device)
        for pool, x in ((pk, k_rows), (pv, v_rows)):
            if self._bits:
                x = x.view(torch.int8)  # the pool holds fp8 as its bytes
            if nhd:
                pool.view((-1,) + tuple(pool.shape[2:])).index_copy_(0, at, x)
            else:  # HND [pages, heads, page, dim] seen as NHD: the same memory
                pool.transpose(1, 2)[at[0], at[1]] = x

    def _read_device(self) -> tuple:
        """The whole device pool, K and V, copied to host memory as arrays
        of the pool's dtype (lock held)."""
        if self._torch_pools is not None and self._torch_pools[0].is_cuda:
            torch_writes_done(self._torch_pools[0].device)
        return tuple(a.to_host().view(self.dtype) for a in (self.k_dev, self.v_dev))

    def _rows_arg(self, x, name: str, dim: int, batch: int | None = None) -> None:
        """Checks rows [n, nhead_k, dim], or [batch, n, nhead_k, dim]."""
        check_tensor_devices(self.session.device_name if self.session is not None else "cpu", **{name: x})
        info = rows_info(x, name)
        lead = 3 if batch is None else 4
        if (
            info.ndim != lead
            or tuple(info.shape[-2:]) != (self._heads, dim)
            or (batch is not None and info.shape[0] != batch)
        ):
            want = f"[n, {self._heads}, {dim}]" if batch is None else f"[{batch}, n, {self._heads}, {dim}]"
            raise ValueError(f"{name} must have shape {want}, got {list(info.shape)}")
        check_rows(info, name, info.shape, self.dtype)

    # -- batches -------------------------------------------------------------

    def batch(self, seqs) -> tuple[np.ndarray, np.ndarray]:
        """The tables of some of this cache's sequences, for fmha_fwd_paged
        or PagedAttention.plan.

        Args:
          seqs: a sequence of ids of this cache (KeyError otherwise).

        Returns:
          (block_table [len(seqs), max pages] int32, unused slots -1;
          seqlen_k [len(seqs)] int32).
        """
        with self._lock:
            rows = [self._get(s) for s in seqs]
            lens = [self._lens[s] for s in seqs]
        bt = np.full((len(rows), max([len(r) for r in rows] + [1])), -1, np.int32)
        for i, r in enumerate(rows):
            bt[i, : len(r)] = r
        return bt, np.array(lens, np.int32)

    @documented(
        "eager",
        omit=("k_cache", "v_cache", "block_table", "seqlen_k", "kv_layout"),
        extra=(
            Option(
                "seqs",
                "list",
                REQUIRED,
                "arrays",
                frozenset(),
                "a sequence of ids of this cache",
                "The sequences q's rows belong to: q's batch (or group mode's sequences) is len(seqs).",
                positional=True,
            ),
        ),
    )
    def attend(self, q, seqs, **kwargs):
        """fmha_fwd_paged over sequences `seqs` of this cache, on the device
        pool when there is one (read in place), else the host pool.

        The cache gives k_cache, v_cache, block_table, seqlen_k and
        kv_layout; session and device default to the cache's session, and
        kv_rows_finite to `values_finite`. Every other option is
        fmha_fwd_paged's.

        Args: declared in turbine_fmha/calls/options.py.

        Returns:
          What fmha_fwd_paged returns: out, or (out, lse) with return_lse.
        """
        bt, sk = self.batch(seqs)
        if self.session is not None:
            kwargs.setdefault("session", self.session)
            kwargs.setdefault("device", self.session.device)
        if self.k_dev is not None:
            # The device arrays with the pool's own dtype (fp8 pools are
            # int8 there).
            k, v = DeviceCache(self.k_dev, self.dtype), DeviceCache(self.v_dev, self.dtype)
        else:
            k, v = self.k, self.v
        kwargs.setdefault("kv_rows_finite", self.values_finite)
        return fmha_fwd_paged(q, k, v, bt, sk, kv_layout=self.kv_layout, **kwargs)

    def _raw(self, a: np.ndarray) -> np.ndarray:
        return a.view(np.int8) if self._bits else a

    def gather(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """A sequence's K and V, for checking and debugging (without a host
        mirror, the whole device pool is read back).

        Args:
          seq: a sequence id of this cache (KeyError otherwise).

        Returns:
          (K [seqlen, nhead_k, hdim], V [seqlen, nhead_k, hdim_v]):
          contiguous numpy copies of the pool's dtype.
        """
        with self._lock:
            pages = np.asarray(self._get(seq), np.int64)
            n = self._lens[seq]
            k, v = (self.k, self.v) if self.k is not None else self._read_device()
        pos = np.arange(n)
        rows = self._at(pages[pos // self.page_block_size], pos % self.page_block_size)
        return k[rows], v[rows]

    def _get(self, seq: int) -> list[int]:
        try:
            return self._pages[seq]
        except KeyError:
            raise KeyError(f"no sequence {seq!r} in this cache") from None


def all_values_finite(pools) -> bool:
    """Whether every V row of every pool is finite (`values_finite` of
    each), with all their pending checks read back in one transfer (one per
    torch device): what a model with one pool per layer asks once per step."""
    pools = list({id(p): p for p in pools}.values())
    with contextlib.ExitStack() as held:
        for p in sorted(pools, key=id):  # one order for every caller: no deadlock
            held.enter_context(p._lock)
        _resolve(pools)
        return all(p._n_bad == 0 for p in pools)


def _resolve(pools) -> None:
    """Applies the pools' pending checks, oldest first (their locks held)."""
    entries = [(p, e) for p in pools for e in p._pending]
    if not entries:
        return
    flags = _host_flags([e[2] for _, e in entries])  # before anything is dropped: a failed read keeps them pending
    for p in pools:
        p._pending = []
    for (p, (pages, rows, _)), bad in zip(entries, flags):
        at = (pages, rows)
        p._n_bad += int(bad.sum()) - int(p._v_bad[at].sum())  # a write's slots are distinct
        p._v_bad[at] = bad


def _host_flags(flags: list) -> list:
    """The marks of _nonfinite_flags as numpy bool arrays, torch ones
    gathered into one host read per device."""
    out = [f if isinstance(f, np.ndarray) else None for f in flags]
    by_device: dict = {}
    for i, f in enumerate(flags):
        if out[i] is None:
            by_device.setdefault(f.device, []).append(i)
    torch = sys.modules.get("torch")
    for idx in by_device.values():
        parts = [flags[i] for i in idx]
        host = ~np.isfinite(torch.cat(parts).cpu().numpy())
        for i, chunk in zip(idx, np.split(host, np.cumsum([p.shape[0] for p in parts])[:-1])):
            out[i] = chunk
    return out


# The index tensors of recent torch writes, by device and content: every
# layer of a model's step writes the same slots of its own pool (the pools
# share their history), so one upload serves the step, not one per layer.
_INDEX_CACHE: collections.OrderedDict = collections.OrderedDict()
_INDEX_CACHE_SIZE = 8
_INDEX_CACHE_LOCK = threading.Lock()


def _device_index(a: np.ndarray, device):
    """The int64 array `a` as a torch tensor on `device`, uploaded once
    while it is among the recent ones. The tensors are never written."""
    key = (str(device), a.shape, a.tobytes())
    with _INDEX_CACHE_LOCK:
        hit = _INDEX_CACHE.get(key)
        if hit is not None:
            _INDEX_CACHE.move_to_end(key)
            return hit
    t = sys.modules["torch"].from_numpy(a.copy()).to(device)
    with _INDEX_CACHE_LOCK:
        _INDEX_CACHE[key] = t
        while len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
            _INDEX_CACHE.popitem(last=False)
    return t


def _nonfinite_flags(v):
    """Which rows of v [n, heads, dim] hold a non-finite value, not read
    back: a numpy bool array for host rows; for torch rows each row's
    largest magnitude as float32 on their device, non-finite exactly where
    the row is (a max neither overflows nor drops a NaN; _host_flags reads
    it as such): one reduction kernel where isfinite and two alls were four,
    once per layer of a model's step."""
    if is_torch(v):
        torch = sys.modules["torch"]
        t = v.detach()
        if t.element_size() == 1:  # fp8: torch's norms do not take it
            t = t.float()
        return torch.linalg.vector_norm(t, float("inf"), dim=(-2, -1), dtype=torch.float32)
    a = np.asarray(v)
    a = a.reshape(a.shape[0], int(np.prod(a.shape[1:])))
    bits = _EXPONENT_BITS.get(a.dtype)
    if bits is None:
        return ~np.isfinite(a.astype(np.float32)).all(-1)
    # Inf and NaN are the values whose exponent bits are all set: read on
    # the bits, with no float copy of the rows (docs/devlog/perf-notes.md,
    # "Performance as called": a decode step's append_batch).
    return ((a.view(bits[0]) & bits[1]) == bits[1]).any(-1)


# The unsigned view and exponent mask of the float formats _nonfinite_flags
# reads by their bits (others are widened to float32 first).
_EXPONENT_BITS = {
    np.dtype(np.float16): (np.uint16, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7F800000),
    np_dtype("bf16"): (np.uint16, 0x7F80),
}


def _dtype(d) -> np.dtype:
    return np_dtype(d) if d in ("f16", "bf16", "f32") else np.dtype(d)


def aligned_zeros(shape, dtype, alignment: int = 64) -> np.ndarray:
    """np.zeros on an `alignment`-byte boundary: caches a CPU session reads
    and writes in place (reshape_and_cache needs 64 bytes).

    Args:
      shape: the array's shape (an int or a tuple of ints).
      dtype: a numpy dtype (or anything np.dtype takes).
      alignment: int, default 64. The byte boundary its data starts on.

    Returns:
      A C-contiguous numpy array of zeros.
    """
    a = aligned_empty(shape, dtype, alignment)
    a[...] = 0
    return a
