"""The planner: a validated `Problem` and the kernels a device offers ->
an immutable `Plan` (FlashInfer's plan, a pure function of the tables).

Every front end takes its kernel steps from here: the eager calls and
`PagedAttention` (run by `runtime.executor.Executor`), the torch ops (the
eager calls again) and the exported programs (`api/exported.py`, which
plans a problem of their declared shapes and emits one kernel op per
step). What the plan decides:

- the parts: a mixed group-mode batch (decodes and prefills, as continuous
  batching makes) is two parts over the same outputs, so the decodes are
  not padded to the prefill rows and get the decode kernels;
- per part, the batch-mode kernel call (`plan.KernelCall`: group mode
  regrouped, gappy tables, the bias laid out by gathered row), a windowed
  decode as one over its window's keys and each table row cut to the
  pages its rows see;
- the split-KV count and whether a variant merges the splits in the
  module, or the host merges them (`plan.combine_splits`);
- whether the rows run as row entries (`plan.row_entries`) where the cost
  model finds a built tile of several entries cheaper;
- the variant of each part for finite and non-finite stale V rows
  (`part_variant`), its kernel steps (`plan.kernel_steps`), and how the
  steps' results make the outputs (`direct`, `join_axis`).

The catalog is what the device holds: a `runtime.selection.VariantSelection`
(the session, or for an export the variants its program can compile);
the planner only asks it (`formulation_for`, `serves`, `select`,
`entry_variants`, `merge_splits_for`, `decode_batch_limit`,
`compute_units`).

`Policy` says what the values of the tables may decide. An exported
program is planned before its tables have values: its policy keeps
the table cuts that its shapes bound (a step's keys are at most the
table's width) and leaves out what only values decide (window cuts, row
entries, splits merged on the host).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..build.artifacts import ArtifactError
from ..kernels.tiles_kernel import TILE_ROWS
from ..kernels.variants import ENTRY_ROWS, Variant, bias_shape_of, group_rows_for
from . import tiles as tiling
from .modes import active_sequences, bias_rows, gappy_table
from .plan import (
    ENTRIES_GAIN,
    KernelCall,
    Step,
    decode_splits,
    kernel_steps,
    merged_decode_splits,
    modelled_cost,
    num_splits_heuristic,
    row_entries,
    split_kv,
    stale_rows,
    window_cut,
    window_keys,
)
from .problem import Problem
from .tiles import Sequence, TilesPlan, classes_needed, tiles_plan


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a plan may take from the tables' values."""

    # The tables hold the call's values. Without them (an exported program's
    # plan is made of a problem of its shapes, seqlen_k the most its tables
    # hold), no cut that only values decide: a window's first pages, a
    # windowed decode's keys (plan.window_cut, window_keys, KernelCall.exact).
    values_known: bool = True
    # Run prefill rows as row entries (plan.row_entries) where cheaper.
    entries: bool = True
    # Split the keys where no variant merges the splits in the module (the
    # host merges them: plan.combine_splits).
    host_merge: bool = True


EAGER = Policy()
# An exported program: its tables are inputs of the program.
EXPORTED = Policy(values_known=False, entries=False, host_merge=False)


@dataclasses.dataclass(frozen=True)
class Part:
    """The kernel calls of one set of sequences of a call."""

    active: np.ndarray  # the sequences (of the call's batch) it computes
    rows: int  # query rows per batch entry (0: nothing to compute)
    call: KernelCall | None  # the batch-mode call its steps come from
    key: dict | None  # the variant key (Variant.problem) of the call
    splits: int = 1  # split-KV count
    merge: int = 0  # the splits a variant merges in the module (0: host merge or none)
    entries: int = 0  # row chunks per sequence when run as row entries
    window_decode: bool = False  # a windowed decode run over its window's keys
    guard_free: bool = False  # an unguarded variant may run when the stale rows are finite
    stale: tuple | None = None  # the stale V rows (plan.stale_rows) an unguarded variant needs finite

    @property
    def host_split(self) -> bool:
        """Partials merged on the host (plan.combine_splits)."""
        return self.splits > max(1, self.merge)


@dataclasses.dataclass(frozen=True)
class TilesCall:
    """One call of a tile kernel: q's flat rows [start, stop) in, their
    output and LSE out."""

    start: int
    stop: int
    plan: TilesPlan
    kernel: object


@dataclasses.dataclass(frozen=True)
class Plan:
    """A call's plan: everything that does not depend on q or the caches."""

    problem: Problem
    parts: tuple[Part, ...]
    # Compute-bound prefill through contiguous tiles (calls/tiles.py): where
    # set, these calls compute the rows of part tiles_part, which is not
    # run (the other part of a mixed batch is).
    tiles: tuple[TilesCall, ...] | None = None
    tiles_part: int = 0

    @property
    def mixed(self) -> bool:
        return len(self.parts) > 1


def make_plan(p: Problem, catalog, policy: Policy = EAGER) -> Plan:
    """The plan of problem `p` on the kernels `catalog` offers."""
    t = p.tables
    active = active_sequences(t, p.min_seqlen_q)
    lens = t.seqlens_q[active]
    if t.group and (lens == 1).any() and (lens > 1).any():
        # Continuous batching: the decodes and the prefills, each part with
        # its own kernels (the prefills' may be tiles).
        parts = tuple(_part(p, catalog, policy, active[sel]) for sel in (lens == 1, lens > 1))
        tiles = _tiles(p, catalog, policy, parts[1], active, mixed=True)
        return Plan(p, parts, tiles, tiles_part=1) if tiles else Plan(p, parts)
    part = _part(p, catalog, policy, active)
    return Plan(p, (part,), _tiles(p, catalog, policy, part, active))


def _tiles(p: Problem, catalog, policy: Policy, part: Part, active: np.ndarray, mixed: bool = False):
    """The tile calls (TilesCall) where the part is a compute-bound prefill
    that tile kernels of the catalog serve exactly: no score terms beyond
    the scale, no window, pages of whole tiles' rows; else None. `active`:
    the call's computed sequences (rows of others keep out's zeros). One
    call where its partials fit the budget, else (not in a mixed batch)
    calls of consecutive rows that each fit."""
    lay, s, t = p.layout, p.scores, p.tables
    m = s.mask
    # A mask of no window sides shows every key, as no mask does.
    edges = (m.left, m.right, m.sink)
    mask = "none" if m.type == "none" or edges == (-1, -1, 0) else m.type if edges == (-1, 0, 0) else None
    if (
        not policy.values_known
        or part.rows < tiling.MIN_ROWS
        or mask is None
        or lay.kv_dtype
        or lay.static_quant
        or (lay.kv_layout, lay.v_layout) != ("NHD", "row")
        or lay.hdim_q != lay.hdim_v
        or s.softcap
        or s.alibi_slopes is not None
        or s.bias is not None
        or s.sinks is not None
        or s.v_scale != 1
        or p.num_splits not in (None, 1)
    ):
        return None
    # Rows of skipped sequences keep out's zeros: only where there are none.
    skipped = np.setdiff1d(np.arange(t.batch), active)
    if (t.seqlens_q[skipped] > 0).any() or (t.offsets % lay.page_block_size).any():
        return None
    starts = t.seqstart[:-1] if t.group else np.arange(t.batch) * t.seqlen_q
    seqs = [
        Sequence(
            int(starts[b]),
            int(t.seqlens_q[b]),
            int(t.seqlen_k[b]),
            t.block_table[b, int(t.offsets[b]) // lay.page_block_size :],
        )
        for b in part.active
        if t.seqlens_q[b] > 0
    ]
    if not seqs or any(x.keys == 0 for x in seqs):
        return None

    def fits(c: TilesCall | None) -> bool:
        return c is not None and c.plan.partial_bytes(lay.nhead_q, lay.hdim_v) <= tiling.MAX_PARTIAL_BYTES

    one = _tiles_call(p, catalog, seqs, mask, 0, t.total_q)
    if one is None:
        return None
    if fits(one):
        return (one,) if one.plan.waste <= tiling.MAX_WASTE else None
    if mixed:
        return None
    # Each group's class filling may add entries: its budget keeps 10% free.
    per_entry = tiling.entry_bytes(lay.nhead_q, TILE_ROWS, lay.hdim_v)
    grouped = tiling.row_groups(seqs, mask, TILE_ROWS, int(0.9 * tiling.MAX_PARTIAL_BYTES) // per_entry)
    if grouped is None:
        return None
    calls = tuple(_tiles_call(p, catalog, sub, grouped[0], a, b) for a, b, sub in grouped[1])
    return calls if all(fits(c) and c.plan.waste <= tiling.MAX_WASTE for c in calls) else None


def _tiles_call(p: Problem, catalog, seqs: list[Sequence], mask: str, start: int, stop: int) -> TilesCall | None:
    """The tile call of `seqs` (q_start from row `start`) over q's rows
    [start, stop), where the catalog has its kernel."""
    lay, s = p.layout, p.scores
    classes = classes_needed(seqs, mask, TILE_ROWS)
    kernel = None
    if classes is not None:
        kernel = catalog.tiles_kernel(lay.dtype, lay.nhead_q, lay.nhead_k, lay.hdim_q, lay.page_block_size, classes)
    if kernel is None:
        return None
    scale = s.scale * s.q_scale * s.k_scale
    plan = tiles_plan(
        seqs,
        stop - start,
        mask,
        lay.page_block_size,
        kernel.tile,
        kernel.classes,
        lay.nhead_k,
        scale,
        tiling.wave_entries(lay.nhead_q),
    )
    return TilesCall(start, stop, plan, kernel)


def _part(p: Problem, catalog, policy: Policy, active: np.ndarray) -> Part:
    t, lay, s = p.tables, p.layout, p.scores
    rows = int(t.seqlens_q[active].max()) if active.size else 0
    if rows == 0:
        return Part(active, 0, None, None)
    bt, shift = gappy_table(t, active, lay.page_block_size)
    bias = None if s.bias is None else bias_rows(s.bias, t, active, rows, shift, bt.shape[1] * lay.page_block_size)
    call = KernelCall(
        rows=rows,
        q_itemsize=lay.q_dtype.itemsize,
        nhead_q=lay.nhead_q,
        block_table=bt,
        page=lay.page_block_size,
        seqlen_q=t.seqlens_q[active].astype(np.int32),
        seqlen_k=t.seqlen_k[active].astype(np.int32),
        kv_shift=shift.astype(np.int32),
        scale=s.scale * s.q_scale * s.k_scale,
        softcap=s.softcap,
        scale_o=s.v_scale / (s.p_scale * s.out_scale) if lay.static_quant else s.v_scale,
        scale_p=s.p_scale,
        mask=s.mask,
        alibi_slopes=None if s.alibi_slopes is None else np.ascontiguousarray(s.alibi_slopes[active], np.float32),
        bias=bias,
        sinks=s.sinks,
    )
    window_decode = False
    if not policy.values_known:
        call = dataclasses.replace(call, exact=False)
    else:
        # A windowed decode becomes one over its window's keys, which the
        # mask-free decode tiles serve (_key); any window then reads from
        # the first page it sees.
        windowed = window_keys(call)
        window_decode = windowed is not call
        call = window_cut(windowed)
    stale = stale_rows(call.block_table, call.seqlen_k, call.kv_shift, lay.page_block_size)
    splits, merge = _split_count(p, catalog, policy, call, rows, window_decode)
    splits = min(splits, call.block_table.shape[1])
    merge = merge if merge == splits else 0
    if splits > 1 and not merge and not policy.host_merge:
        splits = 1
    call = split_kv(call, splits, merge > 1) if splits > 1 else call
    key = _key(p, catalog, rows, window_decode, splits, bias_shape_of(call.bias), merge > 1)
    online = catalog.formulation_for(key, rows == 1) == "online"
    part = Part(
        active=active,
        rows=rows,
        call=call,
        key=key,
        splits=splits,
        merge=merge,
        window_decode=window_decode,
        guard_free=online and lay.v_layout == "row" and not lay.kv_dtype,
        stale=stale,
    )
    if policy.entries and online and splits == 1 and rows > 1:
        return _with_entries(p, catalog, part)
    return part


def _with_entries(p: Problem, catalog, part: Part) -> Part:
    """The part as row entries when a built tile of several entries makes
    it cheaper in the modelled cost (plan.modelled_cost: what the launches
    compute, at their rate, plus a cost per launch) by ENTRIES_GAIN than the
    tile select() picks for it as it is."""
    alt = row_entries(part.call)
    # Each entry's own window: a chunk's rows see less than the whole
    # sequence's rows do, and a launch reads the widest of its entries.
    alt = window_cut(alt) if alt is not None else None
    tiles = catalog.entry_variants(part.key) if alt is not None else []
    if not tiles:
        return part
    cost = _Costs()
    best = min(tiles, key=lambda v: cost(v, alt))
    try:
        here = catalog.select(part.key, part.rows, part.call.batch, False, 0, p.scores.mask.has_right_edge)
    except ArtifactError:  # nothing serves the call as it is: the entries do
        here = None
    if here is not None and cost(best, alt) > ENTRIES_GAIN * cost(here, part.call):
        return part
    # The entries' tables start at their own windows' first pages.
    stale = stale_rows(alt.block_table, alt.seqlen_k, alt.kv_shift, p.layout.page_block_size)
    return dataclasses.replace(part, call=alt, entries=-(-part.rows // ENTRY_ROWS), stale=stale)


class _Costs:
    """modelled_cost, once per tile geometry and call: the built tiles are
    many variants (guards, head counts) of a few geometries."""

    def __init__(self):
        self._memo: dict[tuple, float] = {}

    def __call__(self, v: Variant, call: KernelCall) -> float:
        key = (id(call), v.formulation, v.batch_tile, v.seqlen_q_tile, v.mask, v.merge_splits, v.merge_any)
        if key not in self._memo:
            self._memo[key] = modelled_cost(v, call)
        return self._memo[key]


def _key(p: Problem, catalog, rows: int, window_decode: bool, splits: int, bias_shape: str, merged=False) -> dict:
    """The variant key of the call in `splits` splits (`merged` in the
    module, which adds the sinks), its bias (if any) of `bias_shape`."""
    s = p.scores
    key = dict(p.key, bias_shape=bias_shape, sinks=p.key["sinks"] and (splits == 1 or merged))
    if (
        rows == 1
        and (window_decode or not s.mask.decode_needs_mask(s.alibi_slopes is not None))
        and catalog.serves(dict(key, mask="none"), True)
    ):
        key["mask"] = "none"  # GPU default sets have decode tiles only without a mask
    return key


def _split_count(p: Problem, catalog, policy: Policy, call: KernelCall, rows: int, window_decode: bool):
    """(splits, the count a decode variant could merge in the module or 0)."""
    # The keys its table reads: a window's (window_cut), not the sequence's.
    lay, keys = p.layout, min(int(call.seqlen_k.max()), call.block_table.shape[1] * call.page)
    # A split call's bias has a batch axis (split_kv).
    split_shape = "b" + bias_shape_of(call.bias)[1:] if call.bias is not None else ""
    split_key = _key(p, catalog, rows, window_decode, 2, split_shape)
    merges = catalog.merge_splits_for(_key(p, catalog, rows, window_decode, 2, split_shape, True)) if rows == 1 else ()
    if p.num_splits is not None:
        return p.num_splits, p.num_splits if p.num_splits in merges else 0
    if lay.static_quant:
        return 1, 0
    if rows == 1 and catalog.formulation_for(split_key, True) == "online" and group_rows_for(split_key, 1):
        merge = merged_decode_splits(call.batch * lay.nhead_k, catalog.compute_units, keys, merges)
        if merge > 1:
            return merge, merge
        limit = catalog.decode_batch_limit(split_key)
        return decode_splits(call.batch * lay.nhead_k, catalog.compute_units, keys, call.batch, limit), 0
    # Work items: sequences x query heads x 64-row query blocks, as in
    # ck_tile (docs/devlog/perf-notes.md has the measurements behind it).
    work = call.batch * lay.nhead_q * -(-rows // 64)
    return num_splits_heuristic(work, catalog.compute_units, keys), 0


def part_variant(p: Problem, part: Part, catalog, rows_finite: bool) -> Variant:
    """The variant that runs `part`: unguarded only where `rows_finite`."""
    if part.entries:
        tiles = catalog.entry_variants(part.key, rows_finite)
        cost = _Costs()
        return min(tiles, key=lambda t: (cost(t, part.call), t.v_guard))
    return catalog.select(part.key, part.rows, part.call.batch, rows_finite, part.merge, p.scores.mask.has_right_edge)


def part_steps(part: Part, variant: Variant, with_args: bool = True) -> list[Step]:
    """The part's kernel calls for `variant` (plan.kernel_steps)."""
    return kernel_steps(variant, part.call, with_args)


def direct(plan: Plan, part: Part, steps) -> bool:
    """Whether one kernel call's results are exactly the outputs (no
    regrouping, splitting, chunking or padding)."""
    p = plan.problem
    if plan.mixed or len(steps) != 1 or part.entries or p.tables.group or part.host_split or p.layout.static_quant:
        return False
    st = steps[0]
    return (st.b0, st.b1, st.s, st.e) == (0, part.call.batch, 0, part.rows) and st.tile in (
        None,
        (part.call.batch, part.rows),
    )


def join_axis(plan: Plan, part: Part, steps) -> int | None:
    """The axis of out (0: batch, 1: rows) along which the steps' results,
    cut to their rows, tile the outputs exactly and in order (for row
    entries: the entries, whose join is then rearranged; one step: its
    padded tile, cut); None where they do not (a 2-D grid of tiles,
    split-KV partials merged on the host, varlen rows, a mixed batch)."""
    p = plan.problem
    if plan.mixed or p.tables.group or part.host_split or p.layout.static_quant:
        return None
    # Batch spans in sequences: a merging variant's steps count split
    # entries (Step.merge per sequence). Row entries: ENTRY_ROWS, entries.
    rows, n = part.call.rows, part.call.batch // max(1, part.merge)
    batch = [(st.b0 // st.merge, st.b1 // st.merge) for st in steps]
    spans = {
        1: (batch, [(st.s, st.e) for st in steps], (0, n), rows),
        0: ([(st.s, st.e) for st in steps], batch, (0, rows), n),
    }
    for axis, (other, along, whole, size) in spans.items():
        if part.entries and axis:
            continue  # entries join along the entries, then are rearranged
        ends = [e for _, e in along]
        if all(o == whole for o in other) and [s for s, _ in along] == [0] + ends[:-1] and ends[-1] == size:
            return axis
    return None
