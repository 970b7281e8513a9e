"""Hugging Face transformers models on these kernels, with a paged KV cache.

    from turbine_fmha.integrations import transformers as fmha_hf

    out = fmha_hf.generate(model, input_ids, attention_mask=mask, max_new_tokens=32, session=session)
    # or, step by step:
    fmha_hf.enable(model)                       # attn_implementation="turbine_fmha"
    cache = fmha_hf.PagedCache(session=session, page_block_size=16)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)

Importing this module registers the attention function "turbine_fmha"
through transformers' `AttentionInterface` (and its mask function through
`AttentionMaskInterface`), so `from_pretrained(..., attn_implementation=
"turbine_fmha")` works too. The model must then run with a `PagedCache`: a
transformers `Cache` whose layers keep K and V in turbine_fmha
`PagedKVCache` page pools (one per layer, one sequence per batch row).
Prefill and decode steps both run the paged kernels, causal with the
bottom-right diagonal, planned once per step and run per layer
(`PagedAttention`).

Cost of a step (the prompt forward or a decode step), whatever the batch:
per layer, one write of the whole batch's new K/V rows
(`PagedKVCache.append_batch`: one append-kernel call for a device pool, one
scatter for a host pool) and one attention run; per step, one plan, made by
the first layer that attends (its block tables built and put on the device
once) and run by every layer, and one read back of the finiteness checks of
every layer's new V rows (which the plan's kv_rows_finite needs; the writes
themselves never wait for the device). Host work that grows with the batch
is the writes' slot mapping (the sequences' page lists, a short loop) and
the plan's tables, once per step.

Pools: in host memory on a CPU session (read in place). On a GPU session,
on its device (`PagedKVCache(session=..., host_mirror=False)`): K/V go
from the model's tensors into the pool by the append kernel and the
attention reads it in place; per step, nothing crosses to the host but
the new V rows' finiteness flags (above).
`PagedCache(device_pool=True)` picks that mode on a CPU session too.

Scope: torch models on the session's device (the CPU, or cuda:N for a
cuda/hip session on GPU N), float32/float16/bfloat16, batches without padding or
left-padded (generate's `attention_mask`; `_hf_masks`); a layer's
`sliding_window` becomes the kernels' left window, its `softcap` their
logit soft-cap and its `s_aux` their attention sinks (gpt-oss: per-layer
weights, which each layer's run brings to the plan the step shares). Right padding
or holes in the mask, a custom 4D mask or a mask function other than
(sliding-window) causal, dropout and non-causal attention raise
NotImplementedError rather than give wrong tokens. Beam search
(`reorder_cache`) and `num_return_sequences` fork sequences in the pools,
sharing their pages; a device pool takes a host mirror at its first fork
(copy-on-write reads the shared rows from it), and from then on each
layer's write also copies its rows to the host, which waits for the device.
"""

from __future__ import annotations

import functools
import itertools
import weakref

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..api.attention import PagedAttention
from ..api.cache import CacheFullError, PagedKVCache, all_values_finite
from ..core.arrays import DeviceCache, np_dtype, numpy_to_torch, to_numpy, torch_np_dtype
from ..runtime.session import Session
from ._hf_masks import NAME, NO_TERMS, left_padding, padding_mask, refuse_unsupported

_DTYPES = {np_dtype(n) for n in ("f16", "bf16", "f32")}
# The tensors a PagedLayer hands to the model carry a weak reference to the
# layer: the model passes them to the attention function unchanged, and
# that is the only path by which the function can find the cache (the
# model's cache object itself is not among its arguments).
_TAG = "_turbine_fmha_layer"


def register() -> None:
    """Registers "turbine_fmha" with transformers (done on import)."""
    AttentionInterface.register(NAME, attention_forward)
    # Flash attention's padding-mask rule (None for a batch without
    # padding, else the 2D mask), checked before any layer runs.
    AttentionMaskInterface.register(NAME, padding_mask)


def enable(model):
    """Switches `model` (and its submodels) to the "turbine_fmha"
    attention; returns it. `model.set_attn_implementation("eager")` (or
    "sdpa") switches back."""
    register()
    model.set_attn_implementation(NAME)
    return model


def generate(
    model,
    input_ids,
    *,
    session: Session | None = None,
    page_block_size: int = 16,
    num_pages: int | None = None,
    device_pool: bool | None = None,
    **generate_kwargs,
):
    """`model.generate(input_ids, **generate_kwargs)` on these kernels with
    a fresh `PagedCache` (see there for the arguments)."""
    enable(model)
    cache = PagedCache(session=session, page_block_size=page_block_size, num_pages=num_pages, device_pool=device_pool)
    return model.generate(input_ids, past_key_values=cache, **generate_kwargs)


class PagedCache(Cache):
    """A transformers `Cache` on turbine_fmha page pools.

    session: the `Session` the kernels run on (default: the shared CPU
    one); the model's tensors must be on its device (`torch_device`).
    page_block_size: rows per page. num_pages: pages of each layer's pool;
    None grows the pools as needed (doubling, by copying the sequences into
    a larger pool), an int fixes them, and running out raises
    CacheFullError. device_pool: keep the pools on the session's device
    (True) or in host memory (False); None: on the device for GPU sessions,
    in host memory for CPU ones.
    """

    def __init__(
        self,
        *,
        session: Session | None = None,
        page_block_size: int = 16,
        num_pages: int | None = None,
        device_pool: bool | None = None,
    ):
        if session is not None and not isinstance(session, Session):
            raise TypeError(f"session must be a turbine_fmha.Session, got {type(session).__name__}")
        if device_pool is not None and not isinstance(device_pool, bool):
            raise TypeError(f"device_pool must be a bool or None, got {type(device_pool).__name__}")
        if device_pool is False and session is not None and session.device != "cpu":
            # Every layer's whole host pool would be copied to the device
            # on every call.
            raise NotImplementedError(
                f"device_pool=False keeps the pools in host memory, which a "
                f"{session.device!r} session cannot read in place: leave device_pool None"
            )
        for name, val in (("page_block_size", page_block_size), ("num_pages", num_pages)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if device_pool is None:
            device_pool = session is not None and session.device != "cpu"
        self.planner = _Planner(session, device_pool)
        super().__init__(
            layer_class_to_replicate=functools.partial(PagedLayer, self.planner, page_block_size, num_pages)
        )


class _Planner:
    """What the layers share: one `PagedAttention` per kind of score terms
    (`_hf_masks.Terms.planned`: sliding window, soft-cap, whether there are
    sinks; every layer of a step has the same tables, so the first layer
    of each kind plans and the others only run, with their own sinks), the
    session and where the pools live,
    the step's padding, and the layers' histories (`version`)."""

    # Transitions remembered (about one per step): past this the table
    # starts over, and a layer then gets a new version (its step plans once
    # more; nothing is wrong, only slower).
    MAX_VERSIONS = 1024

    def __init__(self, session, device_pool: bool):
        self._session, self.device_pool = session, device_pool
        self.attn = self._mask = self._offsets = self._dims = None
        self._termed: dict[tuple, PagedAttention] = {}  # Terms.planned() -> its attention
        self._keys: dict = {}  # Terms.planned() -> the key its plan was made for
        self.layers: list = []  # weak references to the cache's layers
        self._ids = itertools.count()
        self._next: dict = {}

    def version(self, prev, op) -> int:
        """A layer's version after `op` (a tuple of ints and strings) from
        version `prev` (None: a fresh pool).

        Every layer of the model applies the same operations to its own
        pool (the same appends, forks, frees, growth and crops, in the same
        order), and a PagedKVCache hands out pages deterministically, so
        layers with equal versions have equal block tables and lengths. The
        plan is keyed by the version, so that no layer but the one that
        plans reads its tables (building them is Python work proportional
        to the batch's pages). Versions are interned, never hashed: equal
        means the same history, exactly."""
        key = (prev, op)
        v = self._next.get(key)
        if v is None:
            if len(self._next) >= self.MAX_VERSIONS:
                self._next.clear()
            v = self._next[key] = next(self._ids)
        return v

    def fresh(self) -> int:
        """A version no other layer has (after a failed operation)."""
        return next(self._ids)

    def forget(self) -> None:
        """A cache reset: the next pools start new histories."""
        self._next.clear()
        self._keys.clear()

    def attention(self) -> PagedAttention:
        if self.attn is None:  # the shared session is made on first use
            self.attn = PagedAttention(self._session)
        return self.attn

    def offsets(self, mask, batch: int, rows: int):
        """kv_offset of the step's padding mask (None without padding), read
        once per step: every layer gets the same mask tensor (held here)."""
        if mask is None:
            return None
        if mask is not self._mask or self._dims != (batch, rows):
            self._mask = None  # a mask that raised must not pass next time
            self._offsets = left_padding(mask, batch, rows)
            self._mask, self._dims = mask, (batch, rows)
        return self._offsets

    def planned(self, q, layer: PagedLayer, scale, offsets, terms=NO_TERMS) -> PagedAttention:
        """The attention planned for this step's layers of score `terms`,
        planning it if the step's first such layer calls."""
        attn, kind = self.attention(), terms.planned()
        if kind != NO_TERMS.planned():
            attn = self._termed.get(kind) or self._termed.setdefault(kind, PagedAttention(attn.session))
        pool, (kc, vc) = layer.pool, layer.caches
        key = (
            layer.version,
            None if offsets is None else offsets.tobytes(),
            tuple(q.shape),
            q.dtype,
            kc.shape,
            vc.shape,
            scale,
        )
        if key != self._keys.get(kind):
            self._keys.pop(kind, None)  # a plan that raised must not be reused
            bt, sk = pool.batch(layer.seqs)
            finite = self._rows_finite(sk, layer._unattended, offsets)
            # Left padding: row b's keys are its stored rows after the
            # first offsets[b] (_hf_masks).
            attn.plan(
                bt,
                sk if offsets is None else sk - offsets,
                kv_offset=offsets,
                num_pages=kc.shape[0],
                page_block_size=pool.page_block_size,
                nhead_q=q.shape[2],
                nhead_k=kc.shape[2],
                hdim=kc.shape[3],
                hdim_v=vc.shape[3],
                dtype=q.dtype,
                seqlen_q=q.shape[1],
                mask_type="bottom_right",
                window_size_right=0,
                scale=scale,
                **terms.plan_kwargs(),
                kv_rows_finite=finite,
            )
            self._keys[kind] = key
        return attn

    def _rows_finite(self, seqlen_k, new: int, offsets) -> bool:
        """kv_rows_finite for every layer of the step, decided once, by the
        layer that plans (the others may not have written their rows yet).

        The kernels without the stale-row guard differ from the guarded
        ones only where a V row that holds no key is not finite (the tail
        of a last page, the head of a first page with left padding:
        plan.stale_rows). The rows a step writes hold its keys, except left
        padding the step itself writes (a padded prompt): such a step runs
        the guarded kernels, unchecked. In any other step, every row that
        can be stale was written before the step, and is checked here, in
        every layer's pool at once: one read back per step
        (all_values_finite), where reading each append's check cost a device
        sync per sequence per layer."""
        if offsets is not None and (offsets > seqlen_k - new).any():
            return False
        layers = (ref() for ref in self.layers)
        return all_values_finite([la.pool for la in layers if la is not None and la.pool is not None])


class PagedLayer(CacheLayerMixin):
    """One layer's K/V: a `PagedKVCache` holding one sequence per batch
    row. `update` appends the step's rows and returns [num_pages,
    page_block_size, nhead_k, hdim] torch tensors standing for the pools
    (views of host pools; for device pools, stand-ins without memory),
    which only the "turbine_fmha" attention function can read."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False  # a pool's size needs the first batch

    def __init__(self, planner: _Planner, page_block_size: int, num_pages: int | None):
        super().__init__()
        self.planner, self.page_block_size, self.num_pages = planner, page_block_size, num_pages
        self.is_initialized = False
        self.reset()
        planner.layers.append(weakref.ref(self))

    def lazy_initialization(self, key_states, value_states) -> None:
        dtype = torch_np_dtype(key_states.dtype)
        if dtype not in _DTYPES or value_states.dtype != key_states.dtype:
            raise TypeError(
                f"PagedCache keeps float32, float16 or bfloat16 keys and values, got "
                f"{key_states.dtype} and {value_states.dtype}"
            )
        on_device = self.planner.device_pool
        want = self.planner.attention().session.torch_device if on_device else "cpu"
        if str(key_states.device) != want or value_states.device != key_states.device:
            hint = "" if on_device else ": pass session=turbine_fmha.Session('cuda', ...) for a model on the GPU"
            raise NotImplementedError(
                f"PagedCache keeps {'device' if on_device else 'host'} pools of torch "
                f"tensors on {want}, got tensors on {key_states.device}{hint}"
            )
        self.on_device, self.dtype, self.device = on_device, key_states.dtype, key_states.device
        batch, nhead_k, n, hdim = key_states.shape
        pages = self.num_pages or batch * -(-2 * max(n, 1) // self.page_block_size)
        self._set_pool(self._new_pool(pages, nhead_k, hdim, value_states.shape[-1], dtype))
        self.seqs = [self.pool.allocate() for _ in range(batch)]
        self.version = self.planner.version(None, ("init", pages, batch))
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Appends K/V [batch, nhead_k, n, hdim] (the model's layout) to the
        batch's sequences, in one write for the whole batch; returns the
        pools' stand-ins."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != len(self.seqs) or value_states.shape[0] != len(self.seqs):
            raise ValueError(
                f"PagedCache holds {len(self.seqs)} sequences, the model passed "
                f"{key_states.shape[0]} rows of keys and {value_states.shape[0]} of values"
            )
        # [batch, nhead_k, n, hdim] -> [batch, n, nhead_k, hdim]: a view. A
        # device pool takes the torch tensor as it is; for a host pool only
        # bf16 (which numpy reads through its bits) is copied.
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)
        if not self.on_device:
            k, v = to_numpy(k, "key_states"), to_numpy(v, "value_states")
        n = k.shape[1]
        self._changing(lambda: self._append(k, v), ("update", n))
        self._unattended = n
        return self.keys, self.values

    def _changing(self, change, op) -> None:
        """Runs `change` (an operation on the sequences) and advances the
        layer's version by `op` (_Planner.version); a change that raised
        leaves a version no other layer has."""
        try:
            change()
        except BaseException:
            self.version = self.planner.fresh()
            raise
        self.version = self.planner.version(self.version, op)

    def _append(self, k, v) -> None:
        try:
            self.pool.append_batch(self.seqs, k, v)
        except CacheFullError:
            if self.num_pages is not None:
                raise
            # Room for every sequence at the longest one's new length
            # (a shared last page costs one more); doubling keeps the
            # copies amortized.
            longest = max(self.pool.seqlen(s) for s in self.seqs) + k.shape[1]
            need = len(self.seqs) * (-(-longest // self.page_block_size) + 1)
            self._rebuild(pages=max(2 * self.caches[0].shape[0], need))
            self.pool.append_batch(self.seqs, k, v)

    def _new_pool(self, pages: int, nhead_k: int, hdim: int, hdim_v: int, dtype) -> PagedKVCache:
        if not self.on_device:
            return PagedKVCache(pages, self.page_block_size, nhead_k, hdim, dtype, hdim_v=hdim_v)
        return PagedKVCache(
            pages,
            self.page_block_size,
            nhead_k,
            hdim,
            dtype,
            hdim_v=hdim_v,
            session=self.planner.attention().session,
            host_mirror=self._mirror,
        )

    def _rebuild(self, *, pages: int = 0, keep: int | None = None) -> None:
        """Copies the sequences (their first `keep` rows) in order into a
        new pool of at least `pages` pages; the copies become the layer's
        sequences."""
        old, (kc, vc) = self.pool, self.caches
        rows = [old.seqlen(s) if keep is None else min(old.seqlen(s), keep) for s in self.seqs]
        # The copies share no pages, where forks did: each needs its own.
        own = sum(-(-n // self.page_block_size) for n in rows)
        if self.num_pages is not None and own > self.num_pages:
            raise CacheFullError(
                f"the {len(rows)} sequences need {own} pages once copied, the pool has {self.num_pages}"
            )
        pool = self._new_pool(max(pages, own, kc.shape[0]), kc.shape[2], kc.shape[3], vc.shape[3], old.dtype)
        # A device pool without a mirror is read back to the host once (not
        # once per sequence, as gather would). Growth doubles the pool and
        # crop is rare, so these copies are amortized over many steps.
        with old._lock:
            k_all, v_all = (old.k, old.v) if old.k is not None else old._read_device()
        new = [pool.allocate() for _ in self.seqs]
        if rows and min(rows) == max(rows):  # as every update leaves them: one write
            pos = np.arange(rows[0])
            at = old.batch(self.seqs)[0][:, pos // self.page_block_size], pos % self.page_block_size
            pool.append_batch(new, k_all[at], v_all[at])
        else:
            for s, seq, n in zip(self.seqs, new, rows):
                pos = np.arange(n)
                at = np.asarray(old.pages(s), np.int64)[pos // self.page_block_size], pos % self.page_block_size
                pool.append(seq, k_all[at], v_all[at])
        self._set_pool(pool)
        self.seqs = new

    def _set_pool(self, pool: PagedKVCache) -> None:
        self.pool = pool
        if self.on_device:
            # The kernels read the device arrays in place. The model only
            # passes the tagged tensors on, so they need no memory: one
            # element expanded to the pool's shape, never a copy of it.
            self.caches = tuple(DeviceCache(a, pool.dtype) for a in (pool.k_dev, pool.v_dev))
            self.keys, self.values = (
                torch.empty((), dtype=self.dtype, device=self.device).expand(c.shape) for c in self.caches
            )
        else:
            self.caches = (pool.k, pool.v)
            self.keys, self.values = (numpy_to_torch(a) for a in self.caches)
        ref = weakref.ref(self)  # no cycle: the pools are freed with the cache
        setattr(self.keys, _TAG, ref)
        setattr(self.values, _TAG, ref)

    def attend(self, q, scale, offsets=None, terms=NO_TERMS):
        """The attention output [batch, seqlen_q, nhead_q, hdim_v] of q
        [batch, seqlen_q, nhead_q, hdim] over the batch's sequences, less
        each row's first offsets[b] rows (left padding), with the layer's
        score `terms`."""
        out = self.planner.planned(q, self, scale, offsets, terms).run(q, *self.caches, **terms.run_kwargs())
        self._unattended = 0
        return out

    def drop_unattended(self) -> None:
        """Drops the rows appended since the last attention call."""
        if self._unattended:
            keep = self.get_seq_length() - self._unattended
            self._changing(lambda: self._rebuild(keep=keep), ("keep", keep))
            self._unattended = 0

    # -- transformers' Cache protocol ----------------------------------------

    def get_seq_length(self) -> int:
        # Every update appends the same number of rows to every sequence.
        return self.pool.seqlen(self.seqs[0]) if self.is_initialized and self.seqs else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row i continues the old row beam_idx[i]. Forks
        share the old rows' pages; the last page is copied on write."""
        self._select([int(i) for i in beam_idx])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([i for i in range(len(self.seqs)) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        self._select([int(i) for i in indices])

    def _select(self, rows: list[int]) -> None:
        if not self.is_initialized:
            return
        bad = [r for r in rows if not 0 <= r < len(self.seqs)]
        if bad:
            raise IndexError(f"row {bad[0]} selected, the cache holds {len(self.seqs)} sequences")
        self._changing(lambda: self._select_rows(rows), ("select",) + tuple(rows))

    def _select_rows(self, rows: list[int]) -> None:
        if len(set(rows)) == len(rows):  # a reordering or a subset: no fork needed
            for i in set(range(len(self.seqs))) - set(rows):
                self.pool.free(self.seqs[i])
            self.seqs = [self.seqs[r] for r in rows]
            return
        if self.on_device and not self._mirror:
            # Copy-on-write reads the shared rows from the host mirror
            # (PagedKVCache.fork): the pool takes one now, once, and keeps
            # it (each append then also writes the host).
            self._mirror = True
            self._rebuild()
        # Fork first: a row chosen twice, or chosen after another row was
        # freed, must still exist.
        new = [self.pool.fork(self.seqs[r]) for r in rows]
        for s in self.seqs:
            self.pool.free(s)
        self.seqs = new

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove rows of every sequence (the
        transformers convention: 0 or negative)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of rows to drop as a negative int, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        # PagedKVCache cannot shorten a sequence: copy the kept rows.
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        self._changing(lambda: self._rebuild(keep=keep), ("keep", keep))

    def reset(self) -> None:
        if self.is_initialized:
            self.planner.forget()
        self.pool, self.seqs, self.caches, self.keys, self.values, self._unattended = None, [], None, None, None, 0
        self.on_device = self._mirror = self.is_initialized = False
        self.version = None

    def offload(self):
        pass  # the pools stay where they are (host memory or the session's device)

    def prefetch(self):
        pass


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "turbine_fmha" attention function (transformers' signature):
    query [batch, nhead_q, seqlen_q, hdim] against the paged cache that
    `key`/`value` come from; returns ([batch, seqlen_q, nhead_q, hdim_v],
    None) on the query's device, in its dtype."""
    ref = getattr(key, _TAG, None)
    layer = ref() if ref is not None else None
    if layer is None or getattr(value, _TAG, None) is not ref:
        raise ValueError(
            f'attn_implementation="{NAME}" runs on a turbine_fmha PagedCache: pass '
            "past_key_values=PagedCache(...) with use_cache=True (or call "
            "turbine_fmha.integrations.transformers.generate)"
        )
    try:
        terms = refuse_unsupported(module, dropout, kwargs)
        offsets = layer.planner.offsets(attention_mask, len(layer.seqs), layer.get_seq_length())
    except (NotImplementedError, ValueError):
        # These fail alike in every layer (layers that differ, as sliding
        # windows do, are refused by the mask function before any layer
        # runs): dropping the first layer's new rows undoes the step.
        layer.drop_unattended()
        raise
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # [batch, nhead_q, seqlen_q, hdim] -> [batch, seqlen_q, nhead_q, hdim]:
    # the projection's own layout, so usually already contiguous.
    return layer.attend(query.detach().transpose(1, 2), float(scaling), offsets, terms), None


register()
