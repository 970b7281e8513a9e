"""Variant selection for a Session: which built (or buildable) variant
serves a call."""

from __future__ import annotations

from ..build.artifacts import ArtifactError
from ..calls.plan import PREFILL_LAUNCH_ELEMENTS
from ..kernels.tiles_kernel import TILE_ROWS, TILES_CLASSES, TILES_DTYPES, TilesKernel
from ..kernels.variants import (
    ENTRY_ROWS,
    GPU_DECODE_TILES,
    GPU_PREFILL_TILE,
    MERGE_SPLITS,
    Variant,
    any_page,
    decode_batch_tile,
    group_of,
    online_unsupported,
    online_variant,
    runtime_heads,
)

_MISSING = object()


def problem_key(problem: dict) -> tuple:
    # A problem without `group` has static head counts (Variant.group).
    return tuple(sorted(dict({"group": 0}, **problem).items()))


def _heads_rank(v: Variant) -> int:
    """Exact head counts first, then run-time ones for the group, then for
    any group: the most specialized kernel of equal cost."""
    return 0 if not v.runtime_heads else (1 if v.group else 2)


def prefill_tile_cost(rows: int, tile: int) -> int:
    """The modelled cost of a causal prefill of `rows` query rows in chunks
    of `tile` rows, each cut at its diagonal (plan._pages_needed): the
    score elements computed, with as many keys as rows, plus
    PREFILL_LAUNCH_ELEMENTS per launch."""
    chunks = -(-rows // tile)
    return sum(tile * min(rows, (c + 1) * tile) for c in range(chunks)) + chunks * PREFILL_LAUNCH_ELEMENTS


# Selection answers a session remembers (VariantSelection._memo): past this
# many the memo starts over. A serving loop asks a handful of questions per
# step, every step the same ones.
MAX_MEMO = 4096


class VariantSelection:
    """Mixed into Session: needs `_by_problem`, `_index`, `formulation`,
    `compile_missing`, `target` and `artifact_dir`, and calls
    `_variants_changed()` whenever `_by_problem` or `_index` changes.

    Every answer depends only on the arguments and the listed variants, so
    each is computed once per session and variant list: a decode step of a
    model plans once and asks the same questions every step, and scanning
    the list took most of a plan's host time (docs/devlog/perf-notes.md, "Performance as called")."""

    def _variants_changed(self) -> None:
        self._memo = {}

    def _remembered(self, what: str, args: tuple, compute):
        memo = getattr(self, "_memo", None)
        if memo is None or len(memo) >= MAX_MEMO:
            memo = self._memo = {}
        key = (what, self.formulation, self.compile_missing) + args
        hit = memo.get(key, _MISSING)
        if hit is _MISSING:
            hit = memo[key] = compute()
        return hit

    def build_hint(self, name: str) -> str:
        """How to get the missing artifact `name`, for error messages."""
        foreign = "".join(
            f"{directory} holds {self.target.name} artifacts built for a CPU with what this one lacks "
            f"({', '.join(lacks)}), which are not loaded. "
            for directory, lacks in getattr(self, "_foreign", {}).items()
        )
        return foreign + (
            f"Build it with:\n  turbine-fmha build --targets {self.target.name} "
            f"--artifacts {self.artifact_dir} --variants {name}\n"
            f"or create the Session with compile_missing=True (either needs the build extra: "
            f"pip install 'turbine-fmha[build]')."
        )

    def select(
        self,
        problem: dict,
        seqlen_q: int,
        batch: int,
        stale_rows_finite: bool = False,
        merge: int = 0,
        skips_masked: bool = False,
    ) -> Variant:
        """Picks the variant for a call: an exact match of `problem` (see
        Variant.problem) that merges `merge` split-KV entries per sequence
        (0: none; `batch` counts entries); among static (online) variants,
        the one that pads least, then the one with the fewest launches
        (for a decode: the fewest launches, then the least padding; for a
        prefill whose mask has a right edge, `skips_masked`, so that each
        chunk skips the blocks past its diagonal: the least
        prefill_tile_cost), then one without the stale-row guard, which is
        allowed only when stale_rows_finite says the V rows holding no key
        are finite (plan.stale_rows_finite)."""
        return self._remembered(
            "select",
            (problem_key(problem), seqlen_q, batch, bool(stale_rows_finite), merge, bool(skips_masked)),
            lambda: self._select(problem, seqlen_q, batch, stale_rows_finite, merge, skips_masked),
        )

    def _select(self, problem, seqlen_q, batch, stale_rows_finite, merge, skips_masked) -> Variant:
        formulation = self.formulation_for(problem, seqlen_q == 1)
        cands = [
            v
            for v in self._served_by(problem)
            if v.formulation == formulation and (v.v_guard or stale_rows_finite) and v.merges(merge)
        ]
        if self.compile_missing:
            # The default variant for the call competes with the built ones
            # (and is compiled if chosen).
            preferred = self._default_variant_for(problem, seqlen_q, stale_rows_finite, batch, merge)
            if preferred not in cands:
                cands.append(preferred)
        if not cands:
            described = ", ".join(f"{k}={v}" for k, v in problem.items() if k != "group")
            raise ArtifactError(
                f"no {self.target.name} artifact in {self.artifact_dir} for {described}. "
                + self.build_hint(self._default_variant_for(problem, seqlen_q).name)
            )

        def cost(v: Variant):
            # Least padded work first, then fewest kernel calls; for a decode
            # the other way round: one more launch costs more host time than
            # padded batch entries cost on the device (docs/devlog/perf-notes.md).
            # At equal cost, a built variant before compiling one, then the
            # most specialized page size and heads, then a merge of the
            # call's own split count (variants.MERGED_STATIC_TILES).
            tail = (v.v_guard, v.name not in self._index, v.runtime_page, _heads_rank(v), v.merge_any)
            if v.formulation == "explicit":
                return (0, 0) + tail
            btiles = -(-batch // v.batch_tile)
            qtiles = -(-seqlen_q // v.seqlen_q_tile)
            rows = btiles * v.batch_tile * qtiles * v.seqlen_q_tile
            padded, launches = rows * (v.padded_group or group_of(problem)), btiles * qtiles
            if seqlen_q == 1:
                return (launches, padded) + tail
            return (padded, btiles * prefill_tile_cost(seqlen_q, v.seqlen_q_tile) if skips_masked else launches) + tail

        return min(cands, key=cost)

    def entry_variants(self, problem: dict, stale_rows_finite: bool = False) -> list[Variant]:
        """The built online variants that run `problem` as row entries
        (plan.row_entries: ENTRY_ROWS rows each), with the stale-row guard
        unless stale_rows_finite. Empty unless one of them takes several
        entries per launch: then entries can pay."""
        cands = [
            v
            for v in self._served_by(problem)
            if v.formulation == "online"
            and v.seqlen_q_tile == ENTRY_ROWS
            and not v.merging
            and (v.v_guard or stale_rows_finite)
        ]
        return tuple(cands) if any(v.batch_tile > 1 for v in cands) else ()

    def decode_batch_limit(self, problem: dict) -> int:
        """The largest decode batch tile select() can use for `problem`: a
        split-KV decode is kept within one launch of it (0: no such tile)."""
        if self.compile_missing:
            return GPU_DECODE_TILES[-1][0]
        return self._remembered("batch_limit", (problem_key(problem),), lambda: self._decode_batch_limit(problem))

    def _decode_batch_limit(self, problem: dict) -> int:
        formulation = self.formulation_for(problem, True)
        return max(
            (
                v.batch_tile
                for v in self._served_by(problem)
                if v.formulation == formulation and v.seqlen_q_tile == 1 and not v.merging
            ),
            default=0,
        )

    def merge_splits_for(self, problem: dict) -> tuple:
        """The split counts of the decode variants for `problem` that merge
        split-KV partials in the module (Variant.merge_splits), with the
        stale-row guard (so that select() finds one whatever the V rows
        hold)."""
        if self.formulation_for(problem, True) != "online":
            return ()
        if self.compile_missing:
            return MERGE_SPLITS
        return self._remembered("merges", (problem_key(problem),), lambda: self._merge_splits_for(problem))

    def _merge_splits_for(self, problem: dict) -> tuple:
        return tuple(
            sorted(
                {
                    n
                    for v in self._served_by(problem)
                    if v.formulation == "online" and v.seqlen_q_tile == 1 and v.merging and v.v_guard
                    for n in MERGE_SPLITS
                    if v.merges(n)
                }
            )
        )

    def serves(self, problem: dict, decode: bool = False) -> bool:
        """Whether select() can find (or, with compile_missing, build) a
        variant for `problem` (for a decode: one query row)."""
        if self.compile_missing:
            return True
        formulation = self.formulation_for(problem, decode)
        return any(v.formulation == formulation for v in self._served_by(problem))

    def _served_by(self, problem: dict) -> list[Variant]:
        """The listed variants that can serve a call of `problem`: those of
        its head counts, then those reading head counts at run time for its
        GQA group, then for any group; each of its page size, then of any."""
        return self._remembered("served", (problem_key(problem),), lambda: self._scan(problem))

    def _scan(self, problem: dict) -> tuple:
        keys = [problem]
        if problem["nhead_k"]:
            keys += [runtime_heads(problem), runtime_heads(problem, any_group=True)]
        if problem["page_block_size"]:
            keys += [any_page(k) for k in keys]
        group = group_of(problem)
        return tuple(v for k in keys for v in self._by_problem.get(problem_key(k), []) if v.serves_group(group))

    def formulation_for(self, problem: dict, decode: bool = False) -> str:
        """The session's formulation, unless the online one cannot serve the
        problem (variants.online_unsupported; `decode`: a call of one query
        row), or no online variant for it is built and none may be compiled
        while an explicit one is built (the default sets' variants for any
        head counts): then the explicit one."""
        return self._remembered(
            "formulation", (problem_key(problem), bool(decode)), lambda: self._formulation(problem, decode)
        )

    def _formulation(self, problem: dict, decode: bool) -> str:
        if self.formulation == "online" and (online_unsupported(problem, decode) or self._explicit_only(problem)):
            return "explicit"
        return self.formulation

    def _explicit_only(self, problem: dict) -> bool:
        if self.compile_missing:
            return False
        formulations = {v.formulation for v in self._served_by(problem)}
        return formulations == {"explicit"}

    def tiles_kernel(self, dtype: str, nhead_q: int, nhead_k: int, hdim: int, page: int, classes: int):
        """The tile prefill kernel (kernels.tiles_kernel) of exactly
        `classes` chunk classes that serves these shapes: a built one, else
        with compile_missing the one to build; None where the session runs
        no tiles (Session's prefill_tiles) or none serves."""
        if not getattr(self, "prefill_tiles", False):
            return None
        args = (dtype, nhead_q, nhead_k, hdim, page, classes)
        return self._remembered("tiles", args, lambda: self._tiles_kernel(*args))

    def _tiles_kernel(self, dtype, nhead_q, nhead_k, hdim, page, classes):
        want = (dtype, nhead_q, nhead_k, hdim, page)
        built = [
            k
            for k in (TilesKernel.parse(n) for n in self._index if n.startswith("prefill_tiles_"))
            if (k.dtype, k.nhead_q, k.nhead_k, k.hdim, k.page_block_size, k.tile) == want + (TILE_ROWS,)
            and k.classes == classes
        ]
        if built:
            return built[0]
        if self.compile_missing and classes in TILES_CLASSES and dtype in TILES_DTYPES and TILE_ROWS % page == 0:
            return TilesKernel(dtype, nhead_q, nhead_k, hdim, page, TILE_ROWS, classes)
        return None

    def _default_variant_for(
        self, problem: dict, seqlen_q: int, stale_rows_finite: bool = False, batch: int = 1, merge: int = 0
    ) -> Variant:
        if self.formulation_for(problem, seqlen_q == 1) == "explicit":
            # Run-time head counts cost the CPU kernels little (docs/perf-
            # notes.md), and one compile then serves every model of the group.
            return Variant(**runtime_heads(problem))
        bt, mq = (decode_batch_tile(batch, merge), 1) if seqlen_q == 1 else GPU_PREFILL_TILE
        guard = not (stale_rows_finite and problem["v_layout"] == "row")
        return online_variant(problem, bt, mq, v_guard=guard, merge_splits=merge)


class Catalog(VariantSelection):
    """Every variant of one formulation, compiled where chosen: what an
    exported program holds (iree-turbine compiles its kernels with the
    program), for the planner (calls/planner.py) to choose from as a
    session with compile_missing does."""

    def __init__(self, formulation: str, compute_units: int = 1):
        self.formulation, self.compute_units = formulation, compute_units
        self.compile_missing = True
        self._by_problem, self._index = {}, {}
        self._variants_changed()
