"""The public attention inside exported programs (`iree.turbine.aot.export`,
torch.export): while a module is exported, `fmha_fwd_paged` emits the
kernel itself (the kernels' CustomOp, lowered into the program by
iree-turbine) instead of the eager call or the opaque torch op that
torch.compile gets. The exported program then holds the paged gather and
the attention with the rest of the model: one compiled program, one
invoke per step, any IREE host.

What is decided here, at export time, from the declared shapes alone:
the variant (dtype, head counts, head dims, page size, page layout, mask,
score terms), and the scalars the kernel takes (scale, soft-cap, window
sides). Batch, page count and table width stay dynamic where the export
declares them so. The kernel is the explicit formulation, which every
target compiles, or under export_options(formulation="online") the GPUs'
online kernel for a decode of a static batch, in the runtime's batch tile
(docs/user-guide.md, "Inside exported programs"). fmha_fwd_kvcache and
reshape_and_cache are here too.

Checks that need values (the tables' contents) or run-time sizes cannot
run on traced tensors. The program checks them itself: a guard
(signature.GUARD_PAGED, GUARD_WRITE) runs first and fails the invocation
where sizes disagree, and values outside the caches are cut or skipped,
never clamped onto another sequence's pages (docs/user-guide.md, "Inside
exported programs"). Imports torch and iree-turbine: only an export
reaches it.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..calls.mask import MaskSpec
from ..calls.plan import FULL_LAUNCH_ROWS, PREFILL_LAUNCH_ELEMENTS
from ..core.checks import check_float
from ..kernels import custom_ops
from ..kernels.signature import fwd_attrs
from ..kernels.turbine_compat import ensure_mlir_isinstance
from ..kernels.variants import (
    GPU_PREFILL_TILES,
    MERGE_SPLITS,
    Variant,
    decode_batch_tile,
    online_unsupported,
    online_variant,
)
from .conventions import conventions

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Here, at import (which an export's tracing runs as plain Python), not in
# the traced call: dynamo cannot trace the op's registration, and
# iree-turbine lowers the op after tracing, with the bindings patched.
ensure_mlir_isinstance()
_FWD_EXPLICIT = custom_ops.torch_op(custom_ops.PagedKVFwdExplicit)
_FWD_ONLINE = custom_ops.torch_op(custom_ops.PagedKVFwdOnline)
_GUARD_PAGED = custom_ops.torch_op(custom_ops.GuardPaged)
_GUARD_WRITE = custom_ops.torch_op(custom_ops.GuardWrite)
_I32_MAX = 2**31 - 1

FORMULATIONS = ("explicit", "online")
# A plain dict, not a ContextVar: dynamo, which traces the calls while
# exporting, reads a module's dict but cannot call ContextVar.get.
_OPTIONS = {"formulation": "explicit", "num_splits": None}


@contextlib.contextmanager
def export_options(*, formulation: str = "explicit", num_splits: int | None = None):
    """The kernels that attention calls put into programs exported inside
    this block. "explicit" (the default) compiles for every target and
    takes dynamic shapes. "online" is the GPUs' faster formulation with
    static tiles: for a decode (seqlen_q 1) of a static batch, the batch
    tile the runtime would pick (the smallest of 8, 32, 64, 128 that holds
    the batch, in launches of 128 beyond), the batch padded to it in the
    program; the stale-row guard unless the call says kv_rows_finite=True.
    Other calls under "online" raise NotImplementedError naming what
    needs the explicit one. `num_splits` (online decodes only): the keys
    of each sequence in that many splits over its table's columns, merged
    inside the kernel (the runtime's merged split-KV decode variants; one
    of MERGE_SPLITS), for long keys over few sequences: the keys are not
    known when exporting, so the caller picks it for the lengths it
    serves."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    if num_splits is not None:
        if formulation != "online":
            raise ValueError("num_splits needs formulation='online' (the explicit kernel does not split)")
        if isinstance(num_splits, bool) or num_splits not in MERGE_SPLITS:
            raise ValueError(f"num_splits must be one of {MERGE_SPLITS} or None, got {num_splits!r}")
    before = dict(_OPTIONS)
    _OPTIONS.update(formulation=formulation, num_splits=num_splits)
    try:
        yield
    finally:
        _OPTIONS.update(before)


# Arguments the exported attention does not take yet, each with the value
# that means "not used".
_UNSUPPORTED = {
    "seqstart_q": None,
    "kv_offset": None,
    "min_seqlen_q": 0,
    "alibi_slopes": None,
    "bias": None,
    "q_scale": None,
    "k_scale": None,
    "v_scale": None,
    "p_scale": None,
    "out_scale": None,
    "num_splits": None,
    "out": None,
}


def call_paged(
    q,
    k_cache,
    v_cache,
    block_table,
    seqlen_k,
    *,
    scale=None,
    softmax_scale=None,
    causal=False,
    window_size=None,
    mask_type="none",
    window_size_left=-1,
    window_size_right=-1,
    sink_size=0,
    logits_soft_cap=0.0,
    sinks=None,
    kv_layout="NHD",
    v_layout="row",
    return_lse=False,
    kv_rows_finite=None,
    device=None,
    session=None,
    **others,
):
    """fmha_fwd_paged while exporting (the public function routes here).
    `kv_rows_finite`, `device` and `session` have no meaning in an
    exported program (it runs where it is compiled for, and the explicit
    kernels keep their stale-row guard) and are ignored."""
    for name, value in others.items():
        if name not in _UNSUPPORTED:
            raise TypeError(f"fmha_fwd_paged() got an unexpected keyword argument {name!r}")
        default = _UNSUPPORTED[name]
        if not (value is None if default is None else isinstance(value, type(default)) and value == default):
            raise NotImplementedError(
                f"{name} is not supported inside an exported program yet (batch mode with masks, scale, "
                "logits_soft_cap and sinks is; docs/user-guide.md, 'Inside exported programs')"
            )
    terms = conventions(
        scale=scale,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        mask_type=mask_type,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
    )
    mask = MaskSpec.from_args(terms["mask_type"], terms["window_size_left"], terms["window_size_right"], sink_size)
    _check(q, k_cache, v_cache, block_table, seqlen_k, sinks, kv_layout, v_layout)
    hdim = q.shape[3]
    softmax = math.sqrt(1.0 / hdim) if terms["scale"] is None else check_float(terms["scale"], "scale")
    cap = check_float(logits_soft_cap, "logits_soft_cap")
    if cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0, got {cap}")
    heads = 2 if kv_layout == "NHD" else 1
    variant = Variant(
        dtype=custom_ops.torch_dtype_name(q.dtype),
        hdim_q=hdim,
        hdim_v=v_cache.shape[2 if v_layout == "col" else 3],
        nhead_q=q.shape[2],
        nhead_k=k_cache.shape[heads],
        page_block_size=k_cache.shape[1 if kv_layout == "NHD" else 2],
        mask=mask.type,
        softcap=bool(cap),
        sinks=sinks is not None,
        kv_layout=kv_layout,
        v_layout=v_layout,
        formulation="explicit",
    )
    block_table, seqlen_k = _guarded(q, k_cache, v_cache, block_table, seqlen_k, kv_layout)
    left, right = mask.kernel_sides
    scalars = (
        torch.tensor([softmax, cap, 1.0, 1.0], dtype=torch.float32),
        torch.tensor([0, left, right, mask.sink], dtype=torch.int32),
        None,
        None,
        None if sinks is None else sinks.to(torch.float32),
    )
    if _OPTIONS["formulation"] == "online":
        batch, rows = q.shape[:2]
        if not isinstance(batch, int) or not isinstance(rows, int):
            raise NotImplementedError(
                "export_options(formulation='online') takes a static batch and static query rows (a decode, "
                "seqlen_q 1, or a prefill bucket); export this call with the explicit formulation (the "
                "default), or declare its batch and rows static"
            )
        online = _online_decode if rows == 1 else _online_prefill
        out, lse = online(variant, mask, q, k_cache, v_cache, block_table, seqlen_k, scalars, kv_rows_finite)
    else:
        out, lse, _, _ = _FWD_EXPLICIT(
            q,
            k_cache,
            v_cache,
            block_table,
            torch.full_like(seqlen_k, q.shape[1]),  # batch mode: every sequence has all q's rows
            seqlen_k,
            torch.zeros_like(seqlen_k),  # kv_shift: no gappy KV
            *scalars,
            *fwd_attrs(variant).values(),
        )
    return (out, lse) if return_lse else out


def _guarded(q, k_cache, v_cache, block_table, seqlen_k, kv_layout):
    """The table and lengths the kernels get: int32, after the program's
    run-time guard (signature.GUARD_PAGED), which fails the invocation
    where the sizes disagree and cuts each sequence's seqlen_k at its first
    used slot outside k_cache's pages. The casts come first and read one
    tensor each: an id or length beyond int32 must not wrap into range."""
    if block_table.dtype != torch.int32:
        block_table = torch.where(torch.logical_and(block_table >= 0, block_table <= _I32_MAX), block_table, -1)
        block_table = block_table.to(torch.int32)
    if seqlen_k.dtype != torch.int32:
        seqlen_k = seqlen_k.clamp(-1, _I32_MAX).to(torch.int32)
    page_axis = 1 if kv_layout == "NHD" else 2
    return block_table, _GUARD_PAGED(q, k_cache, v_cache, block_table, seqlen_k, page_axis)


def _online_decode(variant, mask, q, k_cache, v_cache, block_table, seqlen_k, scalars, kv_rows_finite):
    """The online decode of a static batch: launches of the runtime's batch
    tile, each padded to it with sequences of no keys that read the first
    sequence's pages (finite, as the guard-free kernels require of every
    page they read; docs/abi.md, finite_stale_rows). With num_splits n
    (export_options), each sequence is n entries over runs of its table's
    columns, as plan.split_kv makes them: entry b * n + j keeps absolute
    key positions (kv_shift -j * columns * page), the table padded with
    each row's first page (plan.split_kv's runs, one column longer); the
    merged variant folds a sequence's n entries into its one result."""
    batch = q.shape[0]
    problem = variant.problem
    if not mask.decode_needs_mask(alibi=False):
        # As the runtime does (attention._Plan._key): the last row sees
        # every key, and the GPU sets' decode tiles are the mask-free ones.
        problem = dict(problem, mask="none")
    why = online_unsupported(problem, decode=True)
    if why:
        raise NotImplementedError(f"export_options(formulation='online'): {why}")
    splits = _OPTIONS["num_splits"] or 1
    merged = {"merge_splits": splits} if splits > 1 else {}
    tile = decode_batch_tile(batch * splits, splits if splits > 1 else 0)  # in entries
    kernel = online_variant(
        problem, tile, 1, v_guard=not (kv_rows_finite is True and variant.v_layout == "row"), **merged
    )
    table, shift = block_table, torch.zeros_like(seqlen_k)
    if splits > 1:
        width = block_table.shape[1]
        # One column more than the width needs: a run of one column is a
        # size torch.export specializes (it guards per != 1 and refuses a
        # width Dim that allows it). The extra column holds no keys.
        per = (width + splits - 1) // splits + 1
        # Columns past the width read column 0 (an index, not a cat of an
        # expand, whose symbolic size torch.export would guard too).
        cols = torch.arange(per * splits)
        table = block_table[:, torch.where(cols < width, cols, 0)].reshape(batch * splits, per)
        shift = (torch.arange(splits, dtype=torch.int32) * (-per * k_cache.shape[1])).repeat(batch)
    # Per entry: one query row, its sequence's keys.
    entry_rows = torch.ones(batch * splits, dtype=torch.int32)
    entry_keys = seqlen_k.repeat_interleave(splits) if splits > 1 else seqlen_k
    seqs = tile // splits  # sequences a launch holds
    zeros = lambda k, part: torch.zeros((k, *part.shape[1:]), dtype=part.dtype)
    first_row = lambda k, part: part[:1].expand(k, *part.shape[1:])

    def padded(t, start, n, size, fill):
        part = t[start : start + n]
        return part if n == size else torch.cat([part, fill(size - n, part)])

    outs, lses = [], []
    for start in range(0, batch, seqs):
        n = min(seqs, batch - start)
        e0, ne = start * splits, n * splits
        # Padding entries: no rows and no keys (seqlen 0), over the first
        # sequence's first page.
        out, lse, _, _ = _FWD_ONLINE(
            padded(q, start, n, seqs, zeros),
            k_cache,
            v_cache,
            padded(table, e0, ne, tile, first_row),
            padded(entry_rows, e0, ne, tile, zeros),
            padded(entry_keys, e0, ne, tile, zeros),
            padded(shift, e0, ne, tile, zeros),
            *scalars,
            *fwd_attrs(kernel).values(),
        )
        outs.append(out[:n])
        lses.append(lse[:n])
    return torch.cat(outs) if len(outs) > 1 else outs[0], torch.cat(lses) if len(lses) > 1 else lses[0]


def _prefill_tile(batch: int, rows: int) -> int:
    """The query rows of the one-sequence prefill tile (GPU_PREFILL_TILES)
    for `rows` rows of `batch` sequences: the least modelled time, as the
    runtime's plan.modelled_cost counts it (a launch of fewer than
    FULL_LAUNCH_ROWS rows at a lower rate, a cost per launch). The chunks
    of a program read the whole table (it is not cut at their diagonal:
    the keys are not known when exporting), so each tile's launches cost
    the same keys."""

    best, best_cost = 0, math.inf
    for b, tile in GPU_PREFILL_TILES:  # a plain loop: dynamo traces this
        launches = batch * -(-rows // tile)
        rate = min(1.0, tile / FULL_LAUNCH_ROWS) ** (2 / 3)
        cost = launches * (tile * rows / rate + PREFILL_LAUNCH_ELEMENTS)
        if b == 1 and cost < best_cost:
            best, best_cost = tile, cost
    return best


def _online_prefill(variant, mask, q, k_cache, v_cache, block_table, seqlen_k, scalars, kv_rows_finite):
    """A prefill bucket (static batch and rows) on the online kernel: per
    sequence, its rows in chunks of the tile's rows, each a launch of the
    one-sequence prefill tile that starts at the chunk's first row (the
    kernel's iparams[0], as plan.kernel_steps passes it); the last chunk
    padded with zero rows, whose outputs are dropped."""
    batch, rows = q.shape[:2]
    if _OPTIONS["num_splits"]:
        raise NotImplementedError(
            "export_options(num_splits=...) splits decodes (seqlen_q 1); export this prefill without it"
        )
    problem = variant.problem
    why = online_unsupported(problem)
    if why:
        raise NotImplementedError(f"export_options(formulation='online'): {why}")
    tile = _prefill_tile(batch, rows)
    kernel = online_variant(problem, 1, tile, v_guard=not (kv_rows_finite is True and variant.v_layout == "row"))
    fparams, iparams, *terms = scalars
    seqlen_q = torch.full((1,), rows, dtype=torch.int32)
    outs, lses = [], []
    for b in range(batch):
        row_outs, row_lses = [], []
        for start in range(0, rows, tile):
            n = min(tile, rows - start)
            chunk = q[b : b + 1, start : start + n]
            if n < tile:
                chunk = torch.cat([chunk, torch.zeros((1, tile - n, *chunk.shape[2:]), dtype=chunk.dtype)], 1)
            out, lse, _, _ = _FWD_ONLINE(
                chunk,
                k_cache,
                v_cache,
                block_table[b : b + 1],
                seqlen_q,
                seqlen_k[b : b + 1],
                torch.zeros((1,), dtype=torch.int32),  # kv_shift: no gappy KV
                fparams,
                torch.cat([torch.tensor([start], dtype=torch.int32), iparams[1:]]),
                *terms,
                *fwd_attrs(kernel).values(),
            )
            row_outs.append(out[:, :n])
            row_lses.append(lse[:, :, :n])
        outs.append(torch.cat(row_outs, 1) if len(row_outs) > 1 else row_outs[0])
        lses.append(torch.cat(row_lses, 2) if len(row_lses) > 1 else row_lses[0])
    return torch.cat(outs) if batch > 1 else outs[0], torch.cat(lses) if batch > 1 else lses[0]


def _check(q, k_cache, v_cache, block_table, seqlen_k, sinks, kv_layout, v_layout) -> None:
    """What the shapes and dtypes tell, each error naming its argument."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor inside an exported program, got {type(t).__name__}")
    if q.dim() != 4:
        raise NotImplementedError(
            f"q must be [batch, seqlen_q, nhead_q, hdim] inside an exported program (group mode is not "
            f"supported yet), got {q.dim()} dims"
        )
    if k_cache is v_cache:
        raise ValueError(
            "k_cache and v_cache are one tensor: torch.export would make the program read its v_cache "
            "argument as K too; export with distinct example tensors"
        )
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name} must have 4 dims, got {c.dim()}")
        if c.dtype != q.dtype:
            raise TypeError(f"{name} must be {q.dtype} like q (fp8 caches are not supported here yet), got {c.dtype}")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if v_layout not in ("row", "col"):
        raise ValueError(f"v_layout must be 'row' or 'col', got {v_layout!r}")
    nhead_q, nhead_k = q.shape[2], k_cache.shape[2 if kv_layout == "NHD" else 1]
    if nhead_q % nhead_k:
        raise ValueError(f"nhead_q ({nhead_q}) must be a multiple of nhead_k ({nhead_k})")
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache's head dim ({k_cache.shape[3]}) must equal q's ({q.shape[3]})")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be a 2-D int32 tensor, got {block_table.dim()} dims of {block_table.dtype}")
    if (
        not isinstance(seqlen_k, torch.Tensor)
        or seqlen_k.dim() != 1
        or seqlen_k.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError("seqlen_k must be a 1-D int32 tensor inside an exported program")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (nhead_q,)):
        raise ValueError(f"sinks must be a tensor [nhead_q] = [{nhead_q}]")


# The page sizes a non-paged cache is viewed as, largest first (as eager
# fmha_fwd_kvcache, less its check of which kernels a session holds).
_KVCACHE_PAGES = (128, 64, 32, 16, 1)


def call_kvcache(q, k_cache, v_cache, seqlen_k=None, *, cache_seqlens=None, cache_batch_idx=None, **kw):
    """fmha_fwd_kvcache while exporting: the non-paged caches [batch_cache,
    max_seqlen_k, nhead_k, hdim] viewed, without a copy, as pages of the
    largest of 128, 64, 32, 16 and 1 rows that divides max_seqlen_k (which
    must be static), with the block table that walks row cache_batch_idx[b]
    (default b), then call_paged."""
    for name, paged in (("v_layout", "row"), ("kv_layout", "NHD")):
        if kw.get(name, paged) != paged:
            raise ValueError(f"{name}={kw[name]!r} is supported for paged caches only (fmha_fwd_paged)")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise ValueError(f"{name} must be a 4-D torch tensor [batch_cache, max_seqlen_k, nhead_k, hdim]")
    if cache_seqlens is not None:
        if seqlen_k is not None:
            raise ValueError("seqlen_k and cache_seqlens are the same argument (cache_seqlens is flash-attn's name)")
        seqlen_k = cache_seqlens
    rows = k_cache.shape[1]
    if not isinstance(rows, int):
        raise NotImplementedError(
            "k_cache's dim 1 (max_seqlen_k) must be static inside an exported program: it sets the page size"
        )
    if tuple(v_cache.shape[:2]) != tuple(k_cache.shape[:2]):
        raise ValueError(f"v_cache's first two dims {tuple(v_cache.shape[:2])} must equal k_cache's")
    page = next(p for p in _KVCACHE_PAGES if rows % p == 0)
    per = rows // page
    batch = q.shape[0]
    if seqlen_k is None:
        seqlen_k = rows
    if isinstance(seqlen_k, int):
        seqlen_k = torch.full((batch,), seqlen_k, dtype=torch.int32)
    if cache_batch_idx is None:
        rows_of = torch.arange(batch, dtype=torch.int64)
    else:
        # A row outside the cache gets a table of -1: no page, so its
        # sequence sees no key (GUARD_PAGED) instead of a clamped row's.
        idx = cache_batch_idx.to(torch.int64)
        rows_of = torch.where(torch.logical_and(idx >= 0, idx < k_cache.shape[0]), idx, -1)
    cols = torch.arange(per, dtype=torch.int64)[None, :]
    table = torch.where(rows_of[:, None] >= 0, rows_of[:, None] * per + cols, -1).to(torch.int32)

    def paged(c):
        return c.reshape(c.shape[0] * per, page, c.shape[2], c.shape[3])

    return call_paged(q, paged(k_cache), paged(v_cache), table, seqlen_k, **kw)


def call_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, *, kv_layout="NHD", **others):
    """reshape_and_cache while exporting: k and v ([tokens, nhead_k, hdim]
    or [batch, seqlen_new, ...]) written in place into the caches' rows at
    slot_mapping (page * page_block_size + row) as torch index writes, which
    the export keeps (into the caches' globals when they are the module's
    buffers). A token whose slot is not a row of both caches (vLLM's -1
    among them) is skipped: the program cannot drop it from a write of
    static form, so it rewrites what the first valid token writes, or,
    with none valid, row 0's own contents. Token counts that disagree fail
    the invocation (GUARD_WRITE). Distinct slots are the caller's to keep,
    as the eager call checks: of two tokens on one row, either may win."""
    for name, value in others.items():
        if name not in ("session", "device") and value is not None and value is not False:
            raise NotImplementedError(
                f"{name} is not supported by reshape_and_cache inside an exported program yet (k, v, the "
                "caches, slot_mapping and kv_layout are)"
            )
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor inside an exported program, got {type(t).__name__}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if k_cache is v_cache:
        raise ValueError("k_cache and v_cache are one tensor: export with distinct example tensors")
    heads, page_dim = (2, 1) if kv_layout == "NHD" else (1, 2)
    page = k_cache.shape[page_dim]
    if page != v_cache.shape[page_dim]:
        # A slot is page * page_block_size + row in both caches.
        raise ValueError(f"v_cache's page size ({v_cache.shape[page_dim]}) must equal k_cache's ({page})")
    flats = {}
    for name, rows, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if cache.dim() != 4:
            raise ValueError(f"{name}_cache must have 4 dims, got {cache.dim()}")
        if rows.dtype != cache.dtype:
            raise TypeError(f"{name} must be {cache.dtype} like {name}_cache (values are never cast), got {rows.dtype}")
        flats[name] = rows.reshape(-1, cache.shape[heads], cache.shape[3])
    slots = _GUARD_WRITE(flats["k"], flats["v"], k_cache, v_cache, slot_mapping.reshape(-1).to(torch.int64))
    rows = torch.sym_min(k_cache.shape[0] * page, v_cache.shape[0] * v_cache.shape[page_dim])
    valid = torch.logical_and(slots >= 0, slots < rows)
    # Skipped tokens write what the first valid token writes, or with none
    # valid, row 0's own contents: one extra candidate, appended, so that
    # no index reads past the tokens when there are none.
    # The first valid token's index (the token count where none is): the
    # tokens before it, counted. (Not an argmax, which llvm-cpu fails on,
    # nor an int32 amin, which IREE 3.13 CUDA computes as -1:
    # docs/repro/cuda_i32_amin.py.)
    pick = (torch.cumsum(valid.to(torch.int32), 0) == 0).to(torch.int32).sum(0, True)
    target = torch.where(valid, slots, torch.cat([slots, torch.zeros(1, dtype=torch.int64)]).index_select(0, pick))
    for name, cache in (("k", k_cache), ("v", v_cache)):
        flat = flats[name]
        nhd = cache.view(-1, cache.shape[2], cache.shape[3]) if kv_layout == "NHD" else None
        row0 = nhd[0] if kv_layout == "NHD" else cache[0, :, 0]
        stand_in = torch.cat([flat, row0[None]]).index_select(0, pick)
        data = torch.where(valid[:, None, None], flat, stand_in)
        if kv_layout == "NHD":
            nhd.index_copy_(0, target, data)
        else:
            heads_idx = torch.arange(cache.shape[1])[None, :]
            cache.index_put_(((target // page)[:, None], heads_idx, (target % page)[:, None]), data)
    return None
