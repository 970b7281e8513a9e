"""Kernel-call planning: one validated batch-mode call -> kernel calls.

Explicit (CPU) variants chunk query rows to bound the materialized score
tile; static (online) variants pad the batch and the query rows up to the
variant's tiles. The caches are not part of the plan: they are passed as is.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..core.arrays import ops_for
from ..kernels.signature import KERNEL_ARGS, call_args
from ..kernels.variants import ENTRY_ROWS, Variant
from .mask import MaskSpec

# The explicit (CPU) kernel materializes [batch, heads, rows, keys] f32 scores
# plus probabilities; query rows are chunked to keep that under this size.
SCORE_BYTES_BUDGET = 256 << 20
# With a mask that has a right edge (causal, local windows), query rows are
# also chunked this finely, and each chunk's block table is cut after the
# last page its rows can see: the fully masked blocks past the diagonal are
# never computed (ck_tile skips them the same way). The size is measured
# (docs/devlog/perf-notes.md, "Masked-block skipping"). With a left edge (a
# sliding window without sink tokens), every call's table also starts at
# the first page its rows can see, its kv_shift moved back by as many rows
# so that keys keep their positions: a window costs in proportion to its
# width, not to the sequence.
MASKED_CHUNK_ROWS = 64
# Split-KV: a split covers at least this many keys.
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64
# A group-padded decode (Variant.group_rows) runs one 32-lane workgroup per
# (sequence, KV head): a GPU compute unit needs about this many at once to
# keep loads in flight, so a decode with fewer items runs faster split until
# it has them (docs/devlog/perf-notes.md, "GPU speed, round 2: the decode on
# the matrix cores"). The merge of the partials, though, is ~30 torch
# operations after the kernel, whose host time is more than the splits save
# (same section, "Why b32 x 4096 does not split yet"), so without a variant
# that merges them in the module (Variant.merge_splits) a decode splits only
# when it has fewer items than compute units.
DECODE_ITEMS_PER_UNIT = 8
# Splits whose partials the module merges (Variant.merge_splits) cost no
# host merge, and shorter ones paid off: a long single decode's attention
# ran faster in 128 splits of 256 keys than in 64 of 512, its workgroups
# otherwise too few to hide the reads' latency (docs/devlog/perf-notes.md,
# "Long single decodes: 128 merged splits").
MIN_KEYS_PER_MERGED_SPLIT = 256
MAX_MERGED_SPLITS = 128
# The kernel arguments each run brings, first in the signature's order; a
# plan holds the rest.
PER_RUN_ARGS = ("q", "k_cache", "v_cache")
if KERNEL_ARGS[: len(PER_RUN_ARGS)] != PER_RUN_ARGS:  # pragma: no cover - a signature edit must keep them first
    raise ImportError(f"the kernel signature must start with {PER_RUN_ARGS}, got {KERNEL_ARGS}")


@dataclasses.dataclass
class KernelCall:
    """One validated batch-mode call without its q, in the form the kernels
    take: q [batch, rows, nhead_q, hdim_q] comes with each run."""

    rows: int  # query rows of each batch entry (q.shape[1])
    q_itemsize: int
    nhead_q: int
    block_table: np.ndarray  # [batch, width] int32
    page: int  # rows per page of the caches (a variant may take any: Variant.page_block_size)
    seqlen_q: np.ndarray  # [batch] int32, query rows of each sequence (<= rows)
    seqlen_k: np.ndarray  # [batch] int32
    kv_shift: np.ndarray  # [batch] int32, key t is gathered row kv_shift + t
    scale: float  # scale_s: softmax scale times the fp8 descales of Q and K
    softcap: float
    scale_o: float  # output multiplier: fp8 V descale; static quant: ck's scale_o
    scale_p: float  # static quant: probabilities are quantized as fp8(p * scale_p)
    mask: MaskSpec
    alibi_slopes: np.ndarray | None
    bias: np.ndarray | None
    sinks: np.ndarray | None
    # split_kv's entries per sequence when a variant merges them in the
    # module (1: the entries are the sequences, or merged on the host).
    merged: int = 1
    # Whether seqlen_q and seqlen_k hold the call's values, not the most a
    # table of its shapes can hold (an exported program's plan): a step's
    # table is then cut at the last page its rows can reach, which such
    # bounds only overstate, but never at a first page (_first_page).
    exact: bool = True

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]


@dataclasses.dataclass
class Step:
    """One kernel call of a plan: q rows [s, e) of batch entries [b0, b1),
    padded to `tile` (batch tile, rows) for static variants; `args` are the
    kernel arguments after q and the caches; place(dst, res) copies the
    results into the full outputs (out, then the [batch, heads, rows] ones:
    LSE, and the row max and sum where asked for). With `merge` n > 1 the
    entries are split_kv's (n per sequence) and the variant merges them:
    q and the results are per sequence, [b0 / n, b1 / n)."""

    b0: int
    b1: int
    s: int
    e: int
    tile: tuple[int, int] | None
    args: list
    place: object
    merge: int = 1
    width: int = 0  # block table columns the step reads

    def q(self, q):
        """This step's q from the full [batch, rows, ...] q."""
        n = self.merge
        chunk = q[self.b0 // n : self.b1 // n, self.s : self.e]
        if self.tile is None:
            return _contiguous(chunk)
        return _pad_axis(_pad_rows(chunk, self.tile[0] // n), 1, self.tile[1])


def kernel_steps(variant: Variant, c: KernelCall, with_args: bool = True) -> list[Step]:
    """Splits one validated call into kernel calls. Explicit variants chunk
    query rows to bound the score tile; static (online) variants pad the
    batch (seqlen_k 0, page 0) and query rows (zeros; their outputs are
    dropped) up to the variant's tiles. Arguments follow the kernel
    signature: block_table, seqlen_q, seqlen_k, kv_shift, fparams, iparams,
    then alibi_slopes / bias / sinks where the variant has them: the order
    the kernel signature declares (signature.call_args). Without
    `with_args` the steps carry no arguments (for a cost model)."""
    fparams = np.array([c.scale, c.softcap, c.scale_o, c.scale_p], np.float32)
    left, right = c.mask.kernel_sides
    bias = c.bias
    nk = c.block_table.shape[1] * c.page
    if bias is not None and bias.shape[3] != nk:
        # The kernel reads keys up to the table width; keys past seqlen_k are
        # masked, so the padding value does not matter.
        bias = _pad_axis(bias[..., :nk], 3, nk)
    mask = c.mask if variant.mask != "none" else MaskSpec()

    arg_order = [a for a in call_args(variant) if a not in PER_RUN_ARGS]

    n = max(1, variant.merge_splits, c.merged if variant.merge_any else 1)
    if variant.merging and (c.merged != n or variant.batch_tile % n):  # pragma: no cover - split_kv's entries
        raise ValueError(f"{variant.name} cannot merge {c.merged} entries per sequence of {c.batch}")
    order = None
    if variant.merge_any:
        # Each launch's entries split-major (Variant.merge_any): entry
        # j * sequences + b is split j of the launch's sequence b.
        order = np.arange(variant.batch_tile).reshape(-1, n).T.reshape(-1)

    def step(b0, b1, s, e, tile):
        pad = (lambda a: _pad_rows(a, tile[0])) if tile else (lambda a: a)
        if order is not None:
            pad = lambda a, rows=pad: rows(a)[order]
        w = _pages_needed(c, mask, b0, b1, e)
        w0 = _first_page(c, mask, b0, b1, s, e, w)
        args = dict(
            block_table=lambda: np.ascontiguousarray(pad(c.block_table[b0:b1])[:, w0:w]),
            seqlen_q=lambda: pad(c.seqlen_q[b0:b1]),
            seqlen_k=lambda: pad(c.seqlen_k[b0:b1]),
            kv_shift=lambda: pad((c.kv_shift[b0:b1].astype(np.int64) - w0 * c.page).astype(np.int32)),
            fparams=lambda: fparams,
            iparams=lambda: np.array([s, left, right, c.mask.sink], np.int32),
            alibi_slopes=lambda: np.ascontiguousarray(pad(c.alibi_slopes[b0:b1])),
            bias=lambda: _bias_rows(bias, b0, b1, s, e, w0 * c.page, w * c.page, tile, pad),
            sinks=lambda: c.sinks,
        )
        made = [args[a]() for a in arg_order] if with_args else []
        return Step(b0, b1, s, e, tile, made, _placer(b0 // n, b1 // n, s, e), n, w - w0)

    if variant.formulation == "explicit":
        # f32 scores plus probabilities in q's type (f16 for fp8 q).
        per_row = c.batch * c.nhead_q * nk * (4 + max(2, c.q_itemsize))
        chunk = max(1, SCORE_BYTES_BUDGET // max(1, per_row))
        if mask.has_right_edge or mask.has_left_edge:
            chunk = min(chunk, MASKED_CHUNK_ROWS)
        return [step(0, c.batch, s, min(c.rows, s + chunk), None) for s in range(0, c.rows, chunk)]
    bt_t, mq = variant.batch_tile, variant.seqlen_q_tile
    return [
        step(b0, min(c.batch, b0 + bt_t), s, min(c.rows, s + mq), (bt_t, mq))
        for b0 in range(0, c.batch, bt_t)
        for s in range(0, c.rows, mq)
    ]


def _bias_rows(bias, b0, b1, s, e, n0, nk, tile, pad):
    # Bias columns are gathered rows of the full table (bias_in_table_rows):
    # a step whose table starts n0 rows later reads them from n0.
    bb = bias[:, :, s:e, n0:nk]
    if bias.shape[0] != 1:
        bb = pad(bb[b0:b1])
    return np.ascontiguousarray(_pad_axis(bb, 2, tile[1]) if tile else bb)


def _placer(b0, b1, s, e):
    def place(dst, res):
        nb = b1 - b0
        dst[0][b0:b1, s:e] = res[0][:nb, : e - s]
        for d, r in zip(dst[1:], res[1:]):
            d[b0:b1, :, s:e] = r[:nb, :, : e - s]

    return place


def _pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    return _pad_axis(a, 0, n)


def _contiguous(a):
    # q may be a torch tensor (the torch path keeps it on its device).
    return np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a.contiguous()


def _pad_axis(a: np.ndarray, axis: int, n: int) -> np.ndarray:
    if a.shape[axis] == n:
        return _contiguous(a)
    shape = list(a.shape)
    shape[axis] = n
    out = np.zeros(shape, a.dtype) if isinstance(a, np.ndarray) else a.new_zeros(shape)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(0, a.shape[axis])
    out[tuple(idx)] = a
    return out


def _pages_needed(c: KernelCall, mask: MaskSpec, b0: int, b1: int, row_end: int) -> int:
    """Table columns that query rows below `row_end` of entries b0:b1 can
    reach: with a right mask edge, later pages are never read (ck_tile
    skips those blocks the same way)."""
    width = c.block_table.shape[1]
    if not mask.has_right_edge or b1 <= b0:
        return width
    keys = mask.keys_reachable(row_end, c.seqlen_q[b0:b1], c.seqlen_k[b0:b1])
    rows = keys + c.kv_shift[b0:b1].astype(np.int64)  # gathered rows n < rows
    return int(min(width, max(1, -(-int(rows.max()) // c.page))))


def window_keys(c: KernelCall) -> KernelCall:
    """A decode (one query row) under a bottom-right mask with a left edge
    and no sink tokens sees exactly the last left + 1 keys of each
    sequence: the call over just those, as gappy keys (seqlen_k at most
    left + 1, kv_shift moved on by the keys dropped). Its mask then hides
    nothing from the row, so decode kernels without a mask (the GPU sets'
    decode tiles) serve it, and a masked kernel computes the same. The call
    as it is otherwise, and with ALiBi (its windowed form is keyed on
    positions) or a bias (laid out by gathered row)."""
    m = c.mask
    if c.rows != 1 or m.type != "bottom_right" or not m.has_left_edge:
        return c
    if c.alibi_slopes is not None or c.bias is not None:
        return c
    sk = c.seqlen_k.astype(np.int64)
    kept = np.minimum(sk, m.left + 1)
    shift = c.kv_shift.astype(np.int64) + sk - kept
    return dataclasses.replace(c, seqlen_k=kept.astype(np.int32), kv_shift=shift.astype(np.int32))


def window_cut(c: KernelCall) -> KernelCall:
    """The call with each sequence's table row starting at the first page
    its rows can see (a left mask edge without sink tokens) and ending at
    its last key's, its kv_shift moved back by as many rows so that keys
    keep their positions: kernel_steps cuts each launch's table at the
    columns its entries share, this cuts per sequence, so a ragged batch of
    windowed decodes reads each one's window only, and split_kv splits the
    window rather than the sequence. Columns past a row's last page repeat
    its new first page, as fill_unused_slots does. The call as it is
    without a left edge, or with a bias (its columns are laid out by
    gathered row of the whole table: kernel_steps cuts those per launch)."""
    if not c.mask.has_left_edge or c.bias is not None:
        return c
    page, width = c.page, c.block_table.shape[1]
    shift = c.kv_shift.astype(np.int64)
    sk = c.seqlen_k.astype(np.int64)
    last = np.clip(-(-(shift + sk) // page), 1, width)  # columns up to the last key
    first = np.clip((c.mask.first_key_visible(0, c.seqlen_q, c.seqlen_k) + shift) // page, 0, last - 1)
    first = np.where(sk > 0, first, 0)
    if not first.any():
        return c
    new_width = int((last - first).max())
    cols = np.minimum(first[:, None] + np.arange(new_width)[None, :], (last - 1)[:, None])
    bt = np.take_along_axis(c.block_table, cols, axis=1)
    bt = np.where(first[:, None] + np.arange(new_width)[None, :] < last[:, None], bt, bt[:, :1])
    return dataclasses.replace(
        c, block_table=np.ascontiguousarray(bt, np.int32), kv_shift=(shift - first * page).astype(np.int32)
    )


def _first_page(c: KernelCall, mask: MaskSpec, b0: int, b1: int, row_start: int, row_end: int, width: int) -> int:
    """The first table column that query rows [row_start, row_end) of
    entries b0:b1 can reach, in [0, width): with a left mask edge, earlier
    pages hold no key those rows see. Entries without such rows, or whose
    visible keys fall outside the first `width` columns, see nothing
    whatever the table (split_kv's entries before the window, padding), so
    they do not hold it back."""
    if not mask.has_left_edge or b1 <= b0 or not c.exact:
        return 0
    sq, sk = c.seqlen_q[b0:b1], c.seqlen_k[b0:b1]
    shift = c.kv_shift[b0:b1].astype(np.int64)
    lo = np.clip(mask.first_key_visible(row_start, sq, sk) + shift, 0, width * c.page)
    hi = np.clip(mask.keys_reachable(row_end, sq, sk) + shift, 0, width * c.page)
    active = (lo < hi) & (sq.astype(np.int64) > row_start)
    if not active.any():
        return 0
    return int(min(width - 1, lo[active].min() // c.page))


def bias_in_table_rows(bias: np.ndarray, kv_shift: np.ndarray, nk: int) -> np.ndarray:
    """The kernels index a bias by gathered row n = t + kv_shift[b]; callers
    give it by key t. Returns [batch, h, rows, nk] f32 with bias[b, h, i, t]
    at n = t + kv_shift[b] (zero where no key lands: those rows are masked)."""
    batch = kv_shift.shape[0]
    out = np.zeros((batch, bias.shape[1], bias.shape[2], nk), np.float32)
    for b in range(batch):
        src = bias[b if bias.shape[0] != 1 else 0]
        n0 = int(kv_shift[b])
        t0 = max(0, -n0)
        t1 = min(src.shape[-1], nk - n0)
        if t1 > t0:
            out[b, :, :, t0 + n0 : t1 + n0] = src[:, :, t0:t1]
    return out


# What one more prefill launch costs, in score elements (query rows x keys)
# of work: a launch's fixed time over the time per element, both fit to a
# causal 4096 prefill cut at the diagonal in row tiles of 512-4096 (the fit
# is in docs/devlog/perf-notes.md, "Causal prefill in 1024-row chunks; the
# masked roof").
PREFILL_LAUNCH_ELEMENTS = 1_400_000
# Query rows a launch needs to run at the full rate (modelled_cost).
FULL_LAUNCH_ROWS = 1024
# Row entries replace a call's own tiles only where the model makes them at
# least this much cheaper: the entries' rearrangement of q and the results
# costs host time, and a fresh causal prefill ran slower as entries than
# its 1024-row tiles though the model put them level
# (docs/devlog/perf-notes.md, "Performance as called", item "Prefill rows
# as entries").
ENTRIES_GAIN = 0.5


def row_entries(c: KernelCall, rows: int = ENTRY_ROWS) -> KernelCall | None:
    """The call with each `rows`-row chunk of each sequence as a sequence of
    its own, so that one launch of a tile of several entries runs chunks of
    many sequences (a chunked prefill's 4 x 512 rows: 16 entries of 128)
    where a tile of one entry took a launch per chunk. Entry c * batch + b
    is chunk c of sequence b (chunks of equal index need about as many keys,
    so a launch's table, cut to its entries' keys, wastes little). A chunk
    keeps every key its rows see: with a bottom-right mask whose right side
    is 0 (causal, any left window, sink tokens) its diagonal stays where it
    was when it has the keys up to its last row's, and without a mask it
    has them all. None for the calls where a chunk's scores would differ:
    ALiBi and bias (they depend on the row), another mask, one chunk of one
    sequence."""
    mask = c.mask
    if c.alibi_slopes is not None or c.bias is not None or c.rows <= 1:
        return None
    if not (mask.type == "none" or (mask.type == "bottom_right" and mask.right == 0)):
        return None
    chunks = -(-c.rows // rows)
    if chunks * c.batch == 1:
        return None
    b = np.tile(np.arange(c.batch), chunks)
    start = np.repeat(np.arange(chunks) * rows, c.batch)
    seqlen_q = np.clip(c.seqlen_q[b].astype(np.int64) - start, 0, rows)
    seqlen_k = c.seqlen_k[b].astype(np.int64)
    if mask.type == "bottom_right":
        # Keys up to the last row's diagonal: seqlen_k - seqlen_q + its
        # last row + 1, so that the chunk's diagonal (its seqlen_k minus its
        # rows) is the sequence's at that row.
        seqlen_k = np.clip(seqlen_k - c.seqlen_q[b] + start + seqlen_q, 0, seqlen_k)
    seqlen_k = np.where(seqlen_q > 0, seqlen_k, 0)
    return dataclasses.replace(
        c,
        rows=rows,
        block_table=np.ascontiguousarray(c.block_table[b]),
        seqlen_q=seqlen_q.astype(np.int32),
        seqlen_k=seqlen_k.astype(np.int32),
        kv_shift=np.ascontiguousarray(c.kv_shift[b]),
    )


def modelled_cost(variant: Variant, c: KernelCall) -> float:
    """A call's modelled device time in score elements: what its launches
    compute (each entry of a tile over the keys of its launch's table), a
    launch of fewer than FULL_LAUNCH_ROWS rows at a lower rate (it does not
    fill the device), plus PREFILL_LAUNCH_ELEMENTS per launch. The 2/3
    power puts a 128-row launch at a quarter of the full rate, as measured
    (docs/devlog/perf-notes.md, "Performance as called", item "Prefill
    rows as entries")."""
    steps = kernel_steps(variant, c, with_args=False)
    elements = 0.0
    for st in steps:
        entries, rows = st.tile or (st.b1 - st.b0, st.e - st.s)
        rate = min(1.0, entries * rows / FULL_LAUNCH_ROWS) ** (2 / 3)
        elements += entries * rows * st.width * c.page / rate
    return elements + len(steps) * PREFILL_LAUNCH_ELEMENTS


def num_splits_heuristic(work_items: int, units: int, keys: int) -> int:
    """ck_tile's num_splits_heuristic: with fewer work items than ~0.8x the
    device's compute units, split the keys so that the grid fills the device:
    the smallest split count within 85% of the best wave efficiency. Splits
    stay at least MIN_KEYS_PER_SPLIT keys long."""
    if work_items >= 0.8 * units:
        return 1
    max_splits = max(1, min(MAX_SPLITS, units, keys // MIN_KEYS_PER_SPLIT))
    eff = []
    for n in range(1, max_splits + 1):
        waves = work_items * n / units
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    return next(n for n, e in enumerate(eff, 1) if e >= 0.85 * best)


def decode_splits(work_items: int, units: int, keys: int, batch: int, max_batch: int) -> int:
    """Splits for a group-padded decode of `work_items` (sequence, KV head)
    pairs: none with at least one item per compute unit, else enough for
    DECODE_ITEMS_PER_UNIT items per unit, each
    split at least MIN_KEYS_PER_SPLIT keys long, and no more than one launch
    of the largest batch tile `max_batch` holds (batch x splits sequences)
    where the batch alone fits one."""
    if work_items <= 0 or work_items >= units:
        return 1
    target = DECODE_ITEMS_PER_UNIT * units
    n = max(1, min(MAX_SPLITS, keys // MIN_KEYS_PER_SPLIT, -(-target // work_items)))
    if batch * n > max_batch:
        n = max(1, max_batch // batch)
    return n


def merged_decode_splits(work_items: int, units: int, keys: int, available) -> int:
    """Splits for a group-padded decode of `work_items` (sequence, KV head)
    pairs whose partials a variant merges in the module (`available`: the
    merge_splits those variants have): the most that keeps within
    DECODE_ITEMS_PER_UNIT items per compute unit and MIN_KEYS_PER_MERGED_SPLIT
    keys per split; 1 when no available count fits."""
    if work_items <= 0:
        return 1
    want = min(MAX_MERGED_SPLITS, keys // MIN_KEYS_PER_MERGED_SPLIT, DECODE_ITEMS_PER_UNIT * units // work_items)
    return max((n for n in available if 1 < n <= want), default=1)


def split_kv(c: KernelCall, n: int, merged: bool = False) -> KernelCall:
    """The call as n partial calls over disjoint runs of block-table columns,
    stacked as batch entries b * n + j (q is repeated likewise: see
    repeat_rows). Entry (b, j) keeps absolute key
    positions (kv_shift - first column * page, which may be negative), so
    masks and ALiBi are unchanged, and every key lands in exactly one split.
    Sinks are left to combine_splits, or kept for a variant that merges the
    splits itself (`merged`)."""
    batch, width = c.block_table.shape
    page = c.page
    per = -(-width // n)
    # Columns past the table's width repeat each row's first page (a page
    # the sequence owns; see fill_unused_slots).
    bt = np.repeat(c.block_table[:, :1], n, axis=0).repeat(per, axis=1).astype(np.int32)
    shift = np.empty(batch * n, np.int64)
    for j in range(n):
        cols = c.block_table[:, j * per : (j + 1) * per]
        bt[j::n, : cols.shape[1]] = cols
        shift[j::n] = c.kv_shift.astype(np.int64) - j * per * page
    bias = None
    if c.bias is not None:
        # Bias columns are gathered rows (bias_in_table_rows); entry (b, j)
        # reads its split's columns.
        full = _pad_axis(c.bias, 3, max(c.bias.shape[3], width * page))
        full = np.broadcast_to(full, (batch,) + full.shape[1:])
        bias = np.zeros((batch * n,) + full.shape[1:3] + (per * page,), np.float32)
        for j in range(n):
            piece = full[..., j * per * page : (j + 1) * per * page]
            bias[j::n, ..., : piece.shape[-1]] = piece

    def rep(a):
        return None if a is None else np.repeat(a, n, axis=0)

    return dataclasses.replace(
        c,
        block_table=bt,
        seqlen_q=rep(c.seqlen_q),
        seqlen_k=rep(c.seqlen_k),
        kv_shift=shift.astype(np.int32),
        alibi_slopes=rep(c.alibi_slopes),
        bias=bias,
        sinks=c.sinks if merged else None,
        merged=n if merged else 1,
    )


def repeat_rows(q, n: int):
    """q [batch, ...] with each entry repeated n times in a row (split_kv's
    entries), numpy or torch."""
    return np.repeat(q, n, axis=0) if isinstance(q, np.ndarray) else q.repeat_interleave(n, dim=0)


def combine_splits(o, lse, m, row_sum, n: int, sinks: np.ndarray | None):
    """Merges the partial results of split_kv (o [batch * n, rows, hq, dv];
    lse, row max m and row sum row_sum [batch * n, hq, rows]) in f32, adding the
    sinks once. Split j weighs row_sum_j * exp(m_j - M), M the largest max: the
    sums and maxes stay exact where an f32 LSE would not (|m| ~ 1e6 leaves
    it no room for log(sum)). A NaN partial makes the row NaN. numpy arrays
    or torch tensors (merged on their device). Returns (out f32 [batch,
    rows, hq, dv], lse f32 [batch, hq, rows])."""
    xp = ops_for(o)
    bn, rows, hq, dv = o.shape
    o = xp.f32(o.reshape(bn // n, n, rows, hq, dv))
    lse, m, row_sum = (x.reshape(bn // n, n, hq, rows) for x in (lse, m, row_sum))
    with xp.quiet():
        some = row_sum > 0  # splits that saw a key
        top = xp.amax(xp.where(some, m, -math.inf), 1)
        top = xp.where(xp.isfinite(top), top, 0.0)
        w = xp.where(some, row_sum * xp.exp(xp.where(some, m, 0.0) - top[:, None]), 0.0)
        tot = xp.sum(w, 1)
        s = None if sinks is None else xp.f32(xp.like(sinks, tot))[None, :, None]
        den = tot if s is None else tot + xp.exp(s - top)
        out = xp.einsum("bjhr,bjrhd->brhd", xp.f32(w / xp.where(den > 0, den, 1.0)[:, None]), o)
        pos = tot > 0
        lse_out = xp.where(pos, top + xp.log(xp.where(pos, tot, 1.0)), -math.inf)
        if s is not None:
            lse_out = xp.logaddexp(lse_out, s)
    nan = xp.any(xp.isnan(lse), 1)
    out = xp.where(nan.swapaxes(1, 2)[..., None], math.nan, out)
    return xp.f32(out), xp.f32(xp.where(nan, math.nan, lse_out))


def rows_finite(cache, index, kv_layout: str = "NHD") -> bool:
    """Whether the rows (index[0], index[1]) = (page, row) of a cache
    [pages, page, heads, dim] ([pages, heads, page, dim] for kv_layout
    "HND") are all finite: numpy, or a torch cache on its own device with
    the index there too (one gather, one reduction, one sync)."""
    return math.isfinite(float(rows_sum(cache, index, kv_layout)))


def rows_sum(cache, index, kv_layout: str = "NHD"):
    """rows_finite's answer unread: the rows' float32 sum, a 0-d array
    beside the cache (on a GPU, work queued on torch's stream that nothing
    has waited for). It is finite if the rows are: a NaN or an Inf in them
    makes it NaN or +-Inf. Finite rows whose sum overflows (only values
    near float32's maximum can) make it say no, and the guarded kernels
    run: safe. One reduction, where torch's isfinite is several kernels
    (each a host launch on the call's critical path)."""
    xp = ops_for(cache)
    rows = cache[index[0], :, index[1]] if kv_layout == "HND" else cache[index[0], index[1]]
    return xp.sum_f32(rows)


def stale_rows(block_table: np.ndarray, seqlen_k: np.ndarray, kv_shift: np.ndarray, page: int):
    """The V rows that a kernel reads but that hold no key, as (pages, rows):
    cache[pages, rows] are those rows. A variant without the stale-row guard
    gives exact results only if they are finite (Variant.v_guard). Stale K
    rows do not matter: the online kernels turn a NaN/+Inf score into a
    sentinel that the mask removes.

    Those rows are the tail of each sequence's last page (past seqlen_k) and
    every row of each table row's first page: unused table slots read the
    sequence's own first page again (fill_unused_slots; split_kv pads its
    last split the same way), a sequence without keys reads another's, and
    with gappy KV the first page's head holds no key. A row that holds a key
    is stale where a slot re-reads it: a non-finite value there, times the
    probability 0 of a masked key, would make the output NaN where the
    reference's is +-Inf. None when no sequence has a key (every page read
    would then be unchecked)."""
    sk = seqlen_k.astype(np.int64)
    ks = kv_shift.astype(np.int64)
    b = np.nonzero(sk > 0)[0]
    if not b.size:
        return None
    rows = np.arange(page)[None, :]
    last_col = (ks + sk - 1) // page
    tail = rows >= (ks + sk - last_col * page)[b][:, None]  # rows past the last key
    tail_pages = np.broadcast_to(block_table[b, last_col[b]][:, None], tail.shape)[tail]
    tail_rows = np.broadcast_to(rows, tail.shape)[tail]
    first = np.unique(block_table[:, 0]).astype(np.int64)
    pages = np.concatenate([tail_pages, np.repeat(first, page)])
    picked = np.concatenate([tail_rows, np.tile(np.arange(page), first.size)])
    return pages.astype(np.int64), picked.astype(np.int64)


def stale_rows_finite(v_cache, block_table: np.ndarray, seqlen_k: np.ndarray, kv_shift: np.ndarray, page: int) -> bool:
    """Whether the stale_rows of a row-major NHD cache [pages, page, heads,
    dim] (numpy or torch) are finite."""
    index = stale_rows(block_table, seqlen_k, kv_shift, page)
    if index is None:
        return False
    return rows_finite(v_cache, [ops_for(v_cache).like(i, v_cache) for i in index])


def fill_unused_slots(block_table: np.ndarray, used: np.ndarray) -> None:
    """Points every unused column of row b (at or past used[b]) at the row's
    first page, in place, so no kernel reads a page the sequence does not
    own: its rows are masked there, but must be finite for variants without
    the stale-row guard. A row without pages reads the first page of the
    first row that has one."""
    donor = next((int(block_table[b, 0]) for b, n in enumerate(used) if n > 0), None)
    for b, n in enumerate(used):
        if n > 0:
            block_table[b, n:] = block_table[b, 0]
        elif donor is not None:
            block_table[b, :] = donor
