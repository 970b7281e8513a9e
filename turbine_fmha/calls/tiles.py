"""The contiguous-tile prefill's plan (kernels.tiles_kernel.TilesKernel,
mlir/prefill_tiles.mlir.jinja): a pure function of the tables.

Query rows are cut into tiles of T rows by key position (row r of a
sequence with `shift` = its first row's position sits at shift + r), so a
causal tile k sees keys [0, kT) whole and its own block [kT, kT + T)
causally. Its prefix of p = k blocks is cut by the binary digits of p:
digit b set gives one chunk of 2^b blocks at ((p >> (b + 1)) << (b + 1)) * T,
an entry of class b. The last block is an entry of the masked class.
Without a mask, every tile of a sequence sees its first (K - 1) // T
blocks the same way, and the rest (1 to T keys) as its masked block.

No class may be empty (a dispatch over no entry faults IREE's CUDA
device: docs/repro/cuda_zero_entries.py):
the kernel has as many classes as the longest prefix has digits, and a
class no digit fills takes pieces of a longer chunk split down to it
(the same keys, more entries to merge), or, where no chunk can be
spared, a dummy entry that no tile merges (its cost is the plan's
`waste`).

The keys the entries read are laid out in one region: per sequence, the
largest intervals its entries read (dyadic, so any two are nested or
apart), all sequences' sorted by length, longest first, so that each
starts at a multiple of its length and every entry's chunk is a whole
chunk of the region viewed as chunks of its class's length.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The masks the tiles serve (calls/mask.MaskSpec kinds without a window).
TILE_MASKS = ("none", "top_left", "bottom_right")
# A part runs in tiles from this many query rows (its longest sequence's;
# on an H100 one sequence of 512 rows ran 1.7x faster in tiles, 8 of 256
# 1.4x slower: docs/benchmarks.md), and where dummy entries add at most
# this share of its work.
MIN_ROWS = 512
MAX_WASTE = 0.25
# The entries' f32 partials (accumulator, max and sum per row and head) a
# tile call may hold (about 500 entries at 32 heads of 128, a causal
# prefill of some 10k rows): a larger call runs as several tile calls of
# consecutive rows (row_groups).
MAX_PARTIAL_BYTES = 1 << 30
# (entry, query head) pairs one wave of the GPU runs at once: a pair is
# two attention workgroups (the 64-row halves of its tile) and an SM holds
# two or three of them, so this is about the smallest wave among the GPUs
# the tiles serve (the launch geometry measured: docs/benchmarks.md,
# "Prefill through contiguous tiles"); an entry is nhead_q pairs
# (wave_entries).
WAVE_HEAD_TILES = 128


@dataclasses.dataclass(frozen=True)
class Sequence:
    """One sequence of a call: its q rows start at flat row `q_start`."""

    q_start: int
    rows: int
    keys: int
    pages: np.ndarray  # its block-table row (page ids, in key order)


@dataclasses.dataclass(frozen=True)
class TilesPlan:
    classes: int  # the kernel's chunk classes (TilesKernel.classes)
    tile: int
    rows: int  # q's flat rows
    # Score elements (per head) of the dummy entries, over the entries'.
    waste: float
    # The kernel's arguments after q, k_cache and v_cache, in
    # signature.tiles_declaration's order.
    args: tuple

    @property
    def entries(self) -> int:
        return sum(self.args[4 + 2 * c].shape[0] for c in range(self.classes + 1))

    def partial_bytes(self, nhead_q: int, hdim: int) -> int:
        """The f32 partials the call's entries write."""
        return self.entries * entry_bytes(nhead_q, self.tile, hdim)


def wave_entries(nhead_q: int) -> int:
    """The entries of a class that fill one wave of the GPU."""
    return max(1, WAVE_HEAD_TILES // nhead_q)


def entry_bytes(nhead_q: int, tile: int, hdim: int) -> int:
    """One entry's f32 partials: the accumulator, the row max and the row
    sum of its rows and heads."""
    return nhead_q * tile * (hdim + 2) * 4


def shift_of(mask: str, rows: int, keys: int) -> int | None:
    """The key position of a sequence's first row (None: no mask)."""
    if mask == "none":
        return None
    return keys - rows if mask == "bottom_right" else 0


def classes_needed(seqs: list[Sequence], mask: str, tile: int) -> int | None:
    """The chunk classes of a call (its longest prefix's binary digits), or
    None where the tiles cannot serve it: a sequence without keys, or a
    causal row that sees none, or past them."""
    need = 0
    for s in seqs:
        shift = shift_of(mask, s.rows, s.keys)
        if s.keys <= 0:
            return None
        if shift is None:
            top = (s.keys - 1) // tile
        elif shift < 0 or shift + s.rows > s.keys:
            return None
        else:
            top = (shift + s.rows - 1) // tile
        need = max(need, top.bit_length())
    return need


def row_groups(seqs: list[Sequence], mask: str, tile: int, max_entries: int) -> tuple[str, list] | None:
    """A call too large for one tile call (its partials past the budget)
    cut into calls of consecutive q rows, each of at most about
    `max_entries` entries before the class filling: (the groups' mask,
    [(first q row, end q row, the group's sequences with q_start from its
    first row)]), or None where no cut serves (a tile alone past the
    budget). A causal sequence may be cut between its tiles: rows [r0, r1)
    of it are the bottom-right sequence of r1 + shift keys, so top-left
    calls become bottom-right ones; mask-free rows see every key."""
    units = []  # per tile: (sequence, first row, end row, keys it sees, entries)
    for i, s in enumerate(seqs):
        shift = shift_of(mask, s.rows, s.keys)
        if shift is None:
            n = bin((s.keys - 1) // tile).count("1") + 1
            units += [(i, k * tile, min(s.rows, (k + 1) * tile), s.keys, n) for k in range(-(-s.rows // tile))]
        else:
            for k in range(shift // tile, (shift + s.rows - 1) // tile + 1):
                r0, r1 = max(0, k * tile - shift), min(s.rows, (k + 1) * tile - shift)
                units.append((i, r0, r1, shift + r1, bin(k).count("1") + 1))
    if any(u[4] > max_entries for u in units):
        return None
    # As few groups as fit, of about equal entries (a small last group
    # would leave classes empty: dummy entries), each tile in the group
    # its middle entry falls in.
    total = sum(u[4] for u in units)
    for n in range(-(-total // max_entries), len(units) + 1):
        groups, before = [[] for _ in range(n)], 0
        for u in units:
            groups[min(n - 1, int((before + u[4] / 2) * n // total))].append(u)
            before += u[4]
        groups = [g for g in groups if g]
        if all(sum(u[4] for u in g) <= max_entries for g in groups):
            break
    out = []
    for g in groups:
        pieces = {}  # per sequence: (first row, end row, keys)
        for i, r0, r1, keys, _ in g:
            first = pieces.get(i, (r0,))[0]
            pieces[i] = (first, r1, keys)
        start = min(seqs[i].q_start + r0 for i, (r0, _, _) in pieces.items())
        end = max(seqs[i].q_start + r1 for i, (_, r1, _) in pieces.items())
        sub = [
            Sequence(seqs[i].q_start + r0 - start, r1 - r0, keys, seqs[i].pages) for i, (r0, r1, keys) in pieces.items()
        ]
        out.append((start, end, sub))
    return ("none" if mask == "none" else "bottom_right"), out


def _tiles(s: Sequence, mask: str, tile: int):
    """(q row of each tile row, which rows are real, prefix blocks, last
    block (start, off, lim) or None) per tile of sequence `s`; padding rows
    repeat its first row."""
    shift = shift_of(mask, s.rows, s.keys)
    out = []
    if shift is None:
        p = (s.keys - 1) // tile
        last = (p * tile, tile, s.keys - p * tile)
        for k in range(-(-s.rows // tile)):
            r = np.arange(k * tile, (k + 1) * tile)
            out.append((np.where(r < s.rows, r, 0) + s.q_start, r < s.rows, p, last))
        return out
    for k in range(shift // tile, (shift + s.rows - 1) // tile + 1):
        r = np.arange(k * tile, (k + 1) * tile) - shift
        real = (r >= 0) & (r < s.rows)
        out.append((np.where(real, r, 0) + s.q_start, real, k, (k * tile, 0, min(tile, s.keys - k * tile))))
    return out


def _prefix_chunks(p: int, tile: int):
    """(class, start, length) of the chunks that cut a prefix of p blocks."""
    return [(b, ((p >> (b + 1)) << (b + 1)) * tile, tile << b) for b in range(p.bit_length()) if p >> b & 1]


def _fill_classes(tiles: list, classes: int, tile: int, wave: int = 1) -> list[int]:
    """Gives every class below `classes` an entry where a chunk can be
    split for it: the shortest empty class c takes chunks of the smallest
    longer class k that has two or more (so k keeps one) in tiles with
    room for the pieces (classes + 1 entries a tile), each split into
    pieces of classes k - 1, ..., c and c again, each at a multiple of its
    length (the empty classes between c and k filled with it). Returns
    the classes left empty: each gets a dummy entry that no tile merges.

    How many chunks: a class of fewer entries than a wave of the GPU
    (`wave` entries) lasts as long as one entry's reduction, so the split
    classes cost as much for one chunk as for a wave of them, while the
    class they come from loses that work; the count that the model
    max(one entry's time, entries / wave) summed over the classes rates
    fastest, the fewest on a tie (each split adds entries to merge)."""
    dummies = []
    for c in range(classes):
        counts = [0] * classes
        for _, _, _, ent in tiles:
            for e in ent:
                if e[0] < classes:
                    counts[e[0]] += 1
        if counts[c]:
            continue
        k, donors = None, []
        for k in (k for k in range(c + 1, classes) if counts[k] >= 2):
            donors = [
                (ent, next(j for j, e in enumerate(ent) if e[0] == k))
                for _, _, _, ent in tiles
                if len(ent) + k - c <= classes + 1 and any(e[0] == k for e in ent)
            ]
            if donors:
                break
        if not donors:
            dummies.append(c)
            continue

        def cost(m: int) -> int:
            # Class j's time in waves times its length, over class c's.
            split = sum(max(wave, counts[j] + m * (1 + (j == c))) << (j - c) for j in range(c, k))
            return split + (max(wave, counts[k] - m) << (k - c))

        m = min(range(1, min(len(donors), counts[k] - 1) + 1), key=lambda m: (cost(m), m))
        for ent, j in donors[:m]:
            _, start, _, _, _ = ent.pop(j)
            for b in list(range(k - 1, c - 1, -1)) + [c]:
                ent.insert(j, (b, start, tile << b, 0, 0))
                start += tile << b
                j += 1
    return dummies


def tiles_plan(
    seqs: list[Sequence],
    rows: int,
    mask: str,
    page: int,
    tile: int,
    classes: int,
    nhead_k: int,
    scale: float,
    wave: int = 1,
) -> TilesPlan:
    """The kernel's arguments for `seqs` (their q rows among `rows`);
    `wave`: the entries one wave of the GPU runs at once (wave_entries)."""
    if mask not in TILE_MASKS:
        raise ValueError(f"the tiles serve masks {TILE_MASKS}, got {mask!r}")
    if tile % page:
        raise ValueError(f"the tile ({tile} rows) must be a multiple of the page ({page})")
    tiles = _entries(seqs, mask, tile, classes)
    dummies = _fill_classes(tiles, classes, tile, wave)
    # Padded to whole chunks of the longest class: every class's view of
    # the region is then a reshape, not a copy (zeros past the keys).
    longest = tile << (classes - 1) if classes else tile
    where, total = _region(seqs, tiles, longest)
    # q rows of no sequence read tile row 0 (their output is the caller's).
    out_rows = np.zeros(rows, np.int32)
    for t, (_, qrows, real, _) in enumerate(tiles):
        out_rows[qrows[real]] = t * tile + np.flatnonzero(real)
    args = [*_slots(seqs, where, total, page), np.stack([q for _, q, _, _ in tiles]).astype(np.int32), out_rows]
    args += _class_args(tiles, dummies, where, total, tile, classes, nhead_k)
    args.append(np.array([scale], np.float32))
    work = sum(tile * length for _, _, _, ent in tiles for _, _, length, _, _ in ent)
    waste = sum(tile * (tile << c) for c in dummies) / work
    return TilesPlan(classes, tile, rows, waste, tuple(args))


def _entries(seqs: list[Sequence], mask: str, tile: int, classes: int) -> list:
    """Per tile: (its sequence, q rows, which are real, [(class, start,
    length, off, lim)]): its prefix's chunks by binary digits, then its
    last block in the masked class."""
    tiles = []
    for i, s in enumerate(seqs):
        for qrows, real, p, last in _tiles(s, mask, tile):
            if p >= 1 << classes:
                raise ValueError(f"a prefix of {p} tiles needs more than {classes} classes")
            ent = [(b, start, length, 0, 0) for b, start, length in _prefix_chunks(p, tile)]
            ent.append((classes, last[0], tile, last[1], last[2]))
            tiles.append((i, qrows, real, ent))
    return tiles


def _region(seqs: list[Sequence], tiles: list, longest: int) -> tuple[dict, int]:
    """Where each sequence's largest intervals start in the region ({seq:
    [(start, length, base)]}), placed longest first, and the region's keys
    (a multiple of `longest`)."""
    used = [set() for _ in seqs]
    for i, _, _, ent in tiles:
        used[i].update((start, length) for _, start, length, _, _ in ent)
    top = []
    for i, iv in enumerate(used):
        chosen: dict[int, set] = {}
        for start, length in sorted(iv, key=lambda x: -x[1]):
            if not any(start // big * big in chosen[big] for big in chosen if big >= length):
                chosen.setdefault(length, set()).add(start)
        top += [(length, i, start) for length, starts in chosen.items() for start in starts]
    top.sort(key=lambda x: (-x[0], x[1], x[2]))
    base, where = 0, {}
    for length, i, start in top:
        where.setdefault(i, []).append((start, length, base))
        base += length
    return where, -(-base // longest) * longest


def _slots(seqs: list[Sequence], where: dict, total: int, page: int) -> list:
    """The region's slots: each one's page and the rows of it that hold keys."""
    slots = np.zeros(total // page, np.int32)
    slot_rows = np.zeros(total // page, np.int32)
    for i, placed in where.items():
        s = seqs[i]
        for start, length, b in placed:
            for j in range(length // page):
                key = start + j * page
                pi = key // page
                slots[b // page + j] = s.pages[pi] if pi < len(s.pages) else 0
                slot_rows[b // page + j] = min(max(s.keys - key, 0), page)
    return [slots, slot_rows]


def _class_args(tiles: list, dummies: list, where: dict, total: int, tile: int, classes: int, nhead_k: int) -> list:
    """Per class its entries' tiles and head-major chunk ids, then the last
    blocks' bounds and each tile's entries (numbered over the classes)."""

    def loc(i: int, start: int, length: int) -> int:
        for a, al, b in where[i]:
            if a <= start and start + length <= a + al:
                return b + start - a
        raise AssertionError("an interval outside its sequence's region")

    # Per class: (tile, chunk id, whether the tile merges it).
    per_class = [[] for _ in range(classes + 1)]
    for c in dummies:  # chunk 0: the region holds a longer chunk
        per_class[c].append((0, 0, False))
    bounds = []
    for t, (i, _, _, ent) in enumerate(tiles):
        for c, start, length, off, lim in ent:
            per_class[c].append((t, loc(i, start, length) // length, True))
            if c == classes:
                bounds.append((off, lim))
    args, parts = [], np.full((len(tiles), classes + 1), -1, np.int32)
    e0, filled = 0, np.zeros(len(tiles), np.int64)
    hk = np.arange(nhead_k, dtype=np.int64)
    for c, ent in enumerate(per_class):
        nch = total // (tile if c == classes else tile << c)
        tl = np.array([t for t, _, _ in ent], np.int32)
        ch = np.array([[h * nch + j for h in hk] for _, j, _ in ent], np.int32).reshape(len(ent), nhead_k)
        args += [tl, ch]
        for k, (t, _, merged) in enumerate(ent):
            if merged:  # a tile's entries in any order: the merge sums them
                parts[t, filled[t]] = e0 + k
                filled[t] += 1
        e0 += len(ent)
    return args + [np.array(bounds, np.int32).reshape(-1, 2), parts]
