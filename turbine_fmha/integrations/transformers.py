"""Hugging Face transformers models on these kernels, with a paged KV cache.

    from turbine_fmha.integrations import transformers as fmha_hf

    out = fmha_hf.generate(model, input_ids, max_new_tokens=32, session=session)
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

Scope: CPU torch models on a CPU `Session`, float32/float16/bfloat16,
batches whose rows have equal lengths. A padding mask (left padding), a
custom 4D mask, sliding windows, soft-capping, attention sinks, dropout
and non-causal attention raise NotImplementedError rather than give
wrong tokens. Beam search (`reorder_cache`) and `num_return_sequences`
fork sequences in the pools, sharing their pages.
"""

from __future__ import annotations

import functools
import weakref

from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ..arrays import _numpy_to_torch, _to_numpy, _torch_np_dtype, np_dtype
from ..attention import PagedAttention
from ..cache import CacheFullError, PagedKVCache
from ..runtime import Session

NAME = "turbine_fmha"
_DTYPES = {np_dtype(n) for n in ("f16", "bf16", "f32")}
# The tensors a PagedLayer hands to the model carry a weak reference to the
# layer: the model passes them to the attention function unchanged, and
# that is the only path by which the function can find the cache (the
# model's cache object itself is not among its arguments).
_TAG = "_turbine_fmha_layer"


def register() -> None:
    """Registers "turbine_fmha" with transformers (done on import)."""
    AttentionInterface.register(NAME, attention_forward)
    # The padding-mask rule of flash attention: None for a plain causal
    # batch, the 2D mask when some row is padded (then refused below).
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def enable(model):
    """Switches `model` (and its submodels) to the "turbine_fmha"
    attention; returns it. `model.set_attn_implementation("eager")` (or
    "sdpa") switches back."""
    register()
    model.set_attn_implementation(NAME)
    return model


def generate(model, input_ids, *, session: Session | None = None, page_block_size: int = 16,
             num_pages: int | None = None, **generate_kwargs):
    """`model.generate(input_ids, **generate_kwargs)` on these kernels with
    a fresh `PagedCache` (see there for the arguments)."""
    enable(model)
    cache = PagedCache(session=session, page_block_size=page_block_size, num_pages=num_pages)
    return model.generate(input_ids, past_key_values=cache, **generate_kwargs)


class PagedCache(Cache):
    """A transformers `Cache` on turbine_fmha page pools.

    session: the CPU `Session` the kernels run on (default: the shared
    one). page_block_size: rows per page. num_pages: pages of each layer's
    pool; None grows the pools as needed (doubling, by copying the
    sequences into a larger pool), an int fixes them, and running out
    raises CacheFullError.
    """

    def __init__(self, *, session: Session | None = None, page_block_size: int = 16, num_pages: int | None = None):
        if session is not None and not isinstance(session, Session):
            raise TypeError(f"session must be a turbine_fmha.Session, got {type(session).__name__}")
        if session is not None and session.device != "cpu":
            # The pools live in host memory: a GPU session would copy every
            # layer's whole pool to the device on every call.
            raise NotImplementedError(f"PagedCache runs CPU torch models on a CPU session, got a "
                                      f"{session.device!r} session")
        for name, val in (("page_block_size", page_block_size), ("num_pages", num_pages)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.planner = _Planner(session)
        super().__init__(layer_class_to_replicate=functools.partial(
            PagedLayer, self.planner, page_block_size, num_pages))


class _Planner:
    """One `PagedAttention` for the whole model: every layer of a step has
    the same tables, so the first layer plans and the others only run."""

    def __init__(self, session):
        self.session = session
        self.attn = None
        self.key = None

    def planned(self, q, pool: PagedKVCache, seqs, scale) -> PagedAttention:
        if self.attn is None:
            self.attn = PagedAttention(self.session)
        bt, sk = pool.batch(seqs)
        finite = pool.values_finite
        key = (bt.shape, bt.tobytes(), sk.tobytes(), tuple(q.shape), q.dtype, pool.k.shape, pool.v.shape,
               scale, finite)
        if key != self.key:
            self.key = None  # a plan that raised must not be reused
            self.attn.plan(bt, sk, num_pages=pool.k.shape[0], page_block_size=pool.page_block_size,
                           nhead_q=q.shape[2], nhead_k=pool.k.shape[2], hdim=pool.k.shape[3],
                           hdim_v=pool.v.shape[3], dtype=q.dtype, seqlen_q=q.shape[1],
                           mask_type="bottom_right", window_size_left=-1, window_size_right=0,
                           scale=scale, kv_rows_finite=finite)
            self.key = key
        return self.attn


class PagedLayer(CacheLayerMixin):
    """One layer's K/V: a `PagedKVCache` holding one sequence per batch
    row. `update` appends the step's rows and returns the pools (as
    [num_pages, page_block_size, nhead_k, hdim] torch views of them),
    which only the "turbine_fmha" attention function can read."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False  # a pool's size needs the first batch

    def __init__(self, planner: _Planner, page_block_size: int, num_pages: int | None):
        super().__init__()
        self.planner, self.page_block_size, self.num_pages = planner, page_block_size, num_pages
        self.pool: PagedKVCache | None = None
        self.seqs: list[int] = []

    def lazy_initialization(self, key_states, value_states) -> None:
        dtype = _torch_np_dtype(key_states.dtype)
        if dtype not in _DTYPES or value_states.dtype != key_states.dtype:
            raise TypeError(f"PagedCache keeps float32, float16 or bfloat16 keys and values, got "
                            f"{key_states.dtype} and {value_states.dtype}")
        if key_states.device.type != "cpu":
            raise NotImplementedError(f"PagedCache runs CPU torch models, got tensors on {key_states.device}")
        batch, nhead_k, n, hdim = key_states.shape
        pages = self.num_pages or batch * -(-2 * max(n, 1) // self.page_block_size)
        self._set_pool(PagedKVCache(pages, self.page_block_size, nhead_k, hdim, dtype, hdim_v=value_states.shape[-1]))
        self.seqs = [self.pool.allocate() for _ in range(batch)]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Appends K/V [batch, nhead_k, n, hdim] (the model's layout) to the
        batch's sequences; returns the pools."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != len(self.seqs) or value_states.shape[0] != len(self.seqs):
            raise ValueError(f"PagedCache holds {len(self.seqs)} sequences, the model passed "
                             f"{key_states.shape[0]} rows of keys and {value_states.shape[0]} of values")
        for b in range(len(self.seqs)):
            # [nhead_k, n, hdim] -> [n, nhead_k, hdim]: a view; only bf16
            # (which numpy reads through its bits) is copied on the way.
            k = _to_numpy(key_states[b].transpose(0, 1), "key_states")
            v = _to_numpy(value_states[b].transpose(0, 1), "value_states")
            self._append(b, k, v)
        return self.keys, self.values

    def _append(self, row: int, k, v) -> None:
        try:
            self.pool.append(self.seqs[row], k, v)
        except CacheFullError:
            if self.num_pages is not None:
                raise
            # Room for every sequence at the longest one's new length
            # (a shared last page costs one more); doubling keeps the
            # copies amortized.
            longest = max(self.pool.seqlen(s) for s in self.seqs) + k.shape[0]
            need = len(self.seqs) * (-(-longest // self.page_block_size) + 1)
            self._rebuild(pages=max(2 * self.pool.k.shape[0], need))
            self.pool.append(self.seqs[row], k, v)

    def _rebuild(self, *, pages: int = 0, keep: int | None = None) -> None:
        """Copies the sequences (their first `keep` rows) in order into a
        new pool of at least `pages` pages; the copies become the layer's
        sequences."""
        old = self.pool
        rows = [old.seqlen(s) if keep is None else min(old.seqlen(s), keep) for s in self.seqs]
        # The copies share no pages, where forks did: each needs its own.
        own = sum(-(-n // self.page_block_size) for n in rows)
        if self.num_pages is not None and own > self.num_pages:
            raise CacheFullError(f"the {len(rows)} sequences need {own} pages once copied, the pool has "
                                 f"{self.num_pages}")
        pool = PagedKVCache(max(pages, own, old.k.shape[0]), self.page_block_size, old.k.shape[2],
                            old.k.shape[3], old.k.dtype, hdim_v=old.v.shape[3])
        new = []
        for s, n in zip(self.seqs, rows):
            k, v = old.gather(s)
            new.append(pool.allocate())
            pool.append(new[-1], k[:n], v[:n])
        self._set_pool(pool)
        self.seqs = new

    def _set_pool(self, pool: PagedKVCache) -> None:
        self.pool = pool
        self.keys, self.values = (_numpy_to_torch(a) for a in (pool.k, pool.v))
        ref = weakref.ref(self)  # no cycle: the pools are freed with the cache
        setattr(self.keys, _TAG, ref)
        setattr(self.values, _TAG, ref)

    def attend(self, q, scale):
        """The attention output [batch, seqlen_q, nhead_q, hdim_v] of q
        [batch, seqlen_q, nhead_q, hdim] over the batch's sequences."""
        attn = self.planner.planned(q, self.pool, self.seqs, scale)
        return attn.run(q, self.pool.k, self.pool.v)

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
        self._rebuild(keep=max(self.get_seq_length() + tokens_to_remove, 0))

    def reset(self) -> None:
        self.pool, self.seqs, self.keys, self.values = None, [], None, None
        self.is_initialized = False

    def offload(self):
        pass  # the pools are in host memory already

    def prefetch(self):
        pass


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "turbine_fmha" attention function (transformers' signature):
    query [batch, nhead_q, seqlen_q, hdim] against the paged cache that
    `key`/`value` come from; returns ([batch, seqlen_q, nhead_q, hdim_v],
    None)."""
    ref = getattr(key, _TAG, None)
    layer = ref() if ref is not None else None
    if layer is None or getattr(value, _TAG, None) is not ref:
        raise ValueError(
            f'attn_implementation="{NAME}" runs on a turbine_fmha PagedCache: pass '
            "past_key_values=PagedCache(...) with use_cache=True (or call "
            "turbine_fmha.integrations.transformers.generate)")
    _refuse_unsupported(module, attention_mask, dropout, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # [batch, nhead_q, seqlen_q, hdim] -> [batch, seqlen_q, nhead_q, hdim]:
    # the projection's own layout, so usually already contiguous.
    return layer.attend(query.detach().transpose(1, 2), float(scaling)), None


def _refuse_unsupported(module, attention_mask, dropout, kwargs) -> None:
    """Raises NotImplementedError for whatever would make these kernels
    compute something else than the model asks for."""
    if attention_mask is not None:
        raise NotImplementedError(
            f"{NAME} attention takes causal batches of equal-length rows only: got an attention mask with "
            "padding (or a custom mask); pad-free batches (or one sequence per call) are supported")
    if dropout:
        raise NotImplementedError(f"{NAME} attention is inference only: got dropout={dropout}")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{NAME} attention is causal only")
    for name in ("sliding_window", "softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{NAME} attention does not support {name} yet")


register()
