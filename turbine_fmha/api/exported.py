"""The public attention inside exported programs (`iree.turbine.aot.export`,
torch.export): while a module is exported, `fmha_fwd_paged` emits the
kernel itself (the kernels' CustomOp, lowered into the program by
iree-turbine) instead of the eager call or the opaque torch op that
torch.compile gets. The exported program then holds the paged gather and
the attention with the rest of the model: one compiled program, one
invoke per step, any IREE host.

What is decided at export time is planned by the eager call's planner
(calls/planner.py) for a problem of the declared shapes: the variant
(dtype, head counts, head dims, page size, page layout, mask, score
terms, tiles, splits), the launches and their scalars. Batch, page count
and table width stay dynamic where the export declares them so (with a
dynamic batch or row count, or the explicit kernel's dynamic width, the
program is one launch over the whole call). The kernel is the
explicit formulation, which every target compiles, or under
export_options(formulation="online") the GPUs' online kernel for a static
batch and row count (docs/user-guide.md, "Inside exported programs";
docs/architecture.md, "One planner, eager and exported").
fmha_fwd_kvcache and reshape_and_cache are here too.

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

import numpy as np
import torch

from ..calls.mask import MaskSpec
from ..calls.options import KEYWORDS, declared
from ..calls.plan import PER_RUN_ARGS
from ..calls.planner import EXPORTED, make_plan, part_steps, part_variant
from ..calls.problem import layout_of_params, problem, scores, tables
from ..core.checks import check_float
from ..kernels import custom_ops
from ..kernels.signature import call_args, fwd_attrs
from ..kernels.turbine_compat import ensure_mlir_isinstance
from ..kernels.variants import MERGE_SPLITS, online_unsupported
from ..runtime.selection import Catalog
from .conventions import with_conventions

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


# Arguments of fmha_fwd_paged the exported attention does not take yet
# (those the declaration, calls/options.py, does not give front end
# "exported"), each with the value that means "not used".
_UNSUPPORTED = {n: d for n, d in KEYWORDS["eager"].items() if n not in KEYWORDS["exported"]}


@declared("exported")
def call_paged(q, k_cache, v_cache, block_table, seqlen_k, **given):
    """fmha_fwd_paged while exporting (the public function routes here).
    It takes the options calls/options.py declares for front end
    "exported" (its signature); fmha_fwd_paged's others (_UNSUPPORTED)
    only at their defaults. `kv_rows_finite`, `device` and `session` have
    no meaning in an exported program (it runs where it is compiled for,
    and the explicit kernels keep their stale-row guard) and are ignored."""
    kw = dict(KEYWORDS["exported"])
    for name, value in given.items():
        if name in kw:
            kw[name] = value
            continue
        if name not in _UNSUPPORTED:
            raise TypeError(f"fmha_fwd_paged() got an unexpected keyword argument {name!r}")
        default = _UNSUPPORTED[name]
        if not (value is None if default is None else isinstance(value, type(default)) and value == default):
            raise NotImplementedError(
                f"{name} is not supported inside an exported program yet (batch mode with masks, scale, "
                "logits_soft_cap and sinks is; docs/user-guide.md, 'Inside exported programs')"
            )
    terms = with_conventions(kw)
    sink_size, logits_soft_cap, sinks, kv_layout, v_layout, return_lse, kv_rows_finite = [
        terms[n]
        for n in ("sink_size", "logits_soft_cap", "sinks", "kv_layout", "v_layout", "return_lse", "kv_rows_finite")
    ]
    MaskSpec.from_args(
        terms["mask_type"], terms["window_size_left"], terms["window_size_right"], sink_size
    )  # its errors first
    _check(q, k_cache, v_cache, block_table, seqlen_k, sinks, kv_layout, v_layout)
    softmax = math.sqrt(1.0 / q.shape[3]) if terms["scale"] is None else check_float(terms["scale"], "scale")
    cap = check_float(logits_soft_cap, "logits_soft_cap")
    if cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0, got {cap}")
    terms = dict(
        scale=softmax,
        logits_soft_cap=cap,
        mask_type=terms["mask_type"],
        window_size_left=terms["window_size_left"],
        window_size_right=terms["window_size_right"],
        sink_size=sink_size,
        sinks=sinks is not None,
    )
    shapes = _Shapes(q, k_cache, v_cache, block_table, kv_layout, v_layout)
    options = dict(_OPTIONS, kv_rows_finite=kv_rows_finite)
    planned = _plan(shapes.batch, shapes.rows, shapes.width, shapes.sizes, terms, options)
    if planned[0] == "error":
        raise {"NotImplementedError": NotImplementedError}.get(planned[1], ValueError)(planned[2])
    block_table, seqlen_k = _guarded(q, k_cache, v_cache, block_table, seqlen_k, kv_layout)
    sinks = None if sinks is None else sinks.to(torch.float32)
    out, lse = _launch(shapes, planned, q, k_cache, v_cache, block_table, seqlen_k, sinks)
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


class _Shapes:
    """The call's declared sizes: ints where static, None where the export
    declares them dynamic (kept out of the plan: _plan runs on constants)."""

    def __init__(self, q, k_cache, v_cache, block_table, kv_layout, v_layout):
        def static(x):
            # Under dynamo a declared-dynamic size is an int to isinstance
            # and to type(); its __class__ tells.
            return x if x.__class__ is int else None

        nhd = kv_layout == "NHD"
        self.batch, self.rows = static(q.shape[0]), static(q.shape[1])
        self.width = static(block_table.shape[1])
        self.sizes = dict(
            page=k_cache.shape[1 if nhd else 2],
            nhead_q=q.shape[2],
            nhead_k=k_cache.shape[2 if nhd else 1],
            hdim=q.shape[3],
            hdim_v=v_cache.shape[2 if v_layout == "col" else 3],
            dtype=custom_ops.torch_dtype_name(q.dtype),
            kv_layout=kv_layout,
            v_layout=v_layout,
        )


@torch._dynamo.assume_constant_result
def _plan(batch, rows, width, sizes: dict, terms: dict, options: dict) -> tuple:
    """The planner's plan (calls/planner.py), as the eager call plans, of a
    problem of the call's shapes whose seqlen_k is the most its table holds
    (planner.EXPORTED: no cut that only values decide), on the variants an
    exported program can compile (selection.Catalog), as constants for the
    program: ("ok", the variant's formulation, its attributes, its argument
    names after the caches, whether it takes sinks, the split count, the
    steps or None, the first step's fparams and iparams), or ("error",
    exception name, message). The steps (b0, b1, s, e, tile, width, merge,
    seqlen_q, fparams, iparams) are the program's launches where they pay
    (_launches_pay; a dynamic table width is planned as one column, so no
    step is cut for it); otherwise the program is one launch of the planned
    variant over the whole call. Dynamo calls it once while tracing, on
    constants (it runs numpy, which dynamo does not trace)."""
    formulation, splits = options["formulation"], options["num_splits"]
    if formulation == "online" and (batch is None or rows is None):
        return (
            "error",
            "NotImplementedError",
            "export_options(formulation='online') takes a static batch and static query rows (a decode, "
            "seqlen_q 1, or a prefill bucket); export this call with the explicit formulation (the "
            "default), or declare its batch and rows static",
        )
    if splits and rows != 1:
        return (
            "error",
            "NotImplementedError",
            "export_options(num_splits=...) splits decodes (seqlen_q 1); export this prefill without it",
        )
    page = sizes["page"]
    nb = batch if batch is not None else 1
    nr = rows if rows is not None else 2  # not a decode: its mask stays
    nw = width if width is not None else max(1, splits or 1)
    layout = layout_of_params(num_pages=1, page_block_size=page, **{k: v for k, v in sizes.items() if k != "page"})
    t = tables(np.zeros((nb, nw), np.int32), np.full(nb, nw * page, np.int32), layout, q_shape=(nb, nr))
    sinks = np.zeros(sizes["nhead_q"], np.float32) if terms["sinks"] else None
    s = scores(layout, t, **dict(terms, sinks=sinks))
    p = problem(layout, t, s, num_splits=splits or 1, kv_rows_finite=options["kv_rows_finite"])
    catalog = Catalog(formulation)
    plan = make_plan(p, catalog, EXPORTED)
    part = plan.parts[0]
    variant = part_variant(p, part, catalog, part.guard_free and options["kv_rows_finite"] is True)
    if formulation == "online" and variant.formulation != "online":
        why = online_unsupported(part.key, nr == 1) or "no online kernel serves it"
        return ("error", "NotImplementedError", f"export_options(formulation='online'): {why}")
    steps = part_steps(part, variant)
    if _RECORD is not None:
        _RECORD.append((variant, steps if _launches_pay(batch, rows, width, formulation) else None))
    names = tuple(a for a in call_args(variant) if a not in PER_RUN_ARGS)
    at = {n: i for i, n in enumerate(names)}
    launches = tuple(
        (st.b0, st.b1, st.s, st.e, st.tile, st.width, st.merge, tuple(int(x) for x in st.args[at["seqlen_q"]]))
        + tuple(tuple(float(x) if a == "fparams" else int(x) for x in st.args[at[a]]) for a in ("fparams", "iparams"))
        for st in steps
    )
    return (
        "ok",
        variant.formulation,
        tuple(fwd_attrs(variant).values()),
        bool(variant.sinks),
        part.splits,
        launches if _launches_pay(batch, rows, width, formulation) else None,
        launches[0][8:10],
    )


def _launches_pay(batch, rows, width, formulation: str) -> bool:
    """Whether the program runs the planned steps, not one launch over the
    whole call: it can with a static batch and row count; the online
    kernels' static tiles need them; the explicit kernel's row chunks pay
    only where their tables are cut, which needs a static width."""
    return None not in (batch, rows) and (formulation == "online" or width is not None)


# A list while a test records what each exported call planned: (variant,
# steps or None) per call.
_RECORD = None


def _launch(shapes, planned, q, k_cache, v_cache, block_table, seqlen_k, sinks):
    """The kernel op once per planned step, each step's tables taken from
    the program's inputs (the plan's own are of its stand-in problem), the
    results joined as the steps tile the outputs."""
    _, formulation, attrs, takes_sinks, n, steps, (fparams, iparams) = planned
    op = _FWD_ONLINE if formulation == "online" else _FWD_EXPLICIT
    sinks = sinks if takes_sinks else None
    if steps is None:  # dynamic sizes: one launch over the whole call
        out, lse, _, _ = op(
            q,
            k_cache,
            v_cache,
            block_table,
            torch.full_like(seqlen_k, q.shape[1]),  # batch mode: every sequence has all q's rows
            seqlen_k,
            torch.zeros_like(seqlen_k),  # kv_shift: no gappy KV
            torch.tensor(fparams, dtype=torch.float32),
            torch.tensor(iparams, dtype=torch.int32),
            None,
            None,
            sinks,
            *attrs,
        )
        return out, lse
    table, shift, keys = block_table, torch.zeros_like(seqlen_k), seqlen_k
    if n > 1:  # merged in the module (planner.EXPORTED merges no splits on the host)
        table, shift, keys = _split_entries(block_table, seqlen_k, n, shapes)
    rows_out, outs, lses, span = [], [], [], None
    for b0, b1, s, e, tile, width, m, seqlen_q, fparams, iparams in steps:
        size = tile[0] if tile else b1 - b0
        tb = table[b0:b1]
        if n == 1 and shapes.width is not None and width < shapes.width:
            tb = tb[:, :width]  # the columns its rows can reach (plan.kernel_steps)
        qs = q[b0 // m : b1 // m, s:e]
        if tile:
            qs = _padded(_padded(qs, 1, tile[1], _zeros), 0, size // m, _zeros)
        out, lse, _, _ = op(
            qs,
            k_cache,
            v_cache,
            _padded(tb, 0, size, _first_row),
            torch.tensor(seqlen_q, dtype=torch.int32),
            _padded(keys[b0:b1], 0, size, _zeros),
            _padded(shift[b0:b1], 0, size, _zeros),
            torch.tensor(fparams, dtype=torch.float32),
            torch.tensor(iparams, dtype=torch.int32),
            None,
            None,
            sinks,
            *attrs,
        )
        nb = (b1 - b0) // m
        if span != (b0, b1) and rows_out:
            outs.append(_cat([o for o, _ in rows_out], 1))
            lses.append(_cat([x for _, x in rows_out], 2))
            rows_out = []
        span = (b0, b1)
        rows_out.append((out[:nb, : e - s], lse[:nb, :, : e - s]))
    outs.append(_cat([o for o, _ in rows_out], 1))
    lses.append(_cat([x for _, x in rows_out], 2))
    return _cat(outs, 0), _cat(lses, 0)


def _split_entries(block_table, seqlen_k, n: int, shapes: _Shapes):
    """plan.split_kv's entries in the program: entry b * n + j is split j
    of sequence b over its run of the table's columns, absolute key
    positions kept (kv_shift -j * columns * page), each row padded with its
    first page. One column more than the width needs: a run of one column
    is a size torch.export specializes (it guards per != 1 and refuses a
    width Dim that allows it); the extra column holds no keys."""
    batch, width = block_table.shape
    per = (width + n - 1) // n + 1
    # Columns past the width read column 0 (an index, not a cat of an
    # expand, whose symbolic size torch.export would guard too).
    cols = torch.arange(per * n)
    table = block_table[:, torch.where(cols < width, cols, 0)].reshape(batch * n, per)
    shift = (torch.arange(n, dtype=torch.int32) * (-per * shapes.sizes["page"])).repeat(batch)
    return table, shift, seqlen_k.repeat_interleave(n)


def _zeros(k, part):
    return torch.zeros((k, *part.shape[1:]), dtype=part.dtype)


def _first_row(k, part):
    return part[:1].expand(k, *part.shape[1:])


def _padded(t, axis: int, size: int, fill):
    """t padded along `axis` to `size` (fill(count, t) makes the rows)."""
    have = t.shape[axis]
    if have == size:
        return t
    if axis == 0:
        return torch.cat([t, fill(size - have, t)])
    return torch.cat([t, torch.zeros((t.shape[0], size - have, *t.shape[2:]), dtype=t.dtype)], axis)


def _cat(xs, axis: int):
    return xs[0] if len(xs) == 1 else torch.cat(xs, axis)


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
