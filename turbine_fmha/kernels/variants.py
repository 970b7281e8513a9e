"""Kernel variants: a variant is data, and its name encodes it.

A `Variant` fixes everything the MLIR template specializes on. Its canonical
name (in the spirit of ck_tile's `GetName()`) is the artifact file name and
the exported function name, and `Variant.parse(name)` reads it back.

Which sizes are static is a codegen decision:
  * ``explicit`` (the CPU formulation): batch, query rows and pages dynamic.
  * ``online`` (the GPU formulation, iree_linalg_ext.online_attention):
    batch tile ``bt`` and query rows ``mq`` static, page count dynamic. On
    gfx942 a dynamic query length compiles to per-lane FMA with no MFMA,
    while static rows and query length get MFMA; the runtime pads/chunks.
Head dims are static in every variant; the page size too, unless an
explicit variant takes any (page_block_size 0); head counts too, unless the
variant reads them at run time (Variant.group).
"""

from __future__ import annotations

import dataclasses

from .append_kernel import AppendKernel
from .naming import NameCodec, Named, enum, number
from .tiles_kernel import TilesKernel

# fp8 formats (ml_dtypes / MLIR names): OCP e4m3fn/e5m2 (gfx950, NVIDIA) and
# the fnuz variants (gfx942).
FP8_DTYPES = {"f8e4m3fn": "f8E4M3FN", "f8e4m3fnuz": "f8E4M3FNUZ", "f8e5m2": "f8E5M2", "f8e5m2fnuz": "f8E5M2FNUZ"}
# Query/output types. An fp8 dtype is ck_tile's static-quantization path
# (kDoFp8StaticQuant): fp8 Q, K, V and output, P quantized to fp8 by scale_p,
# the output by scale_o; K/V then share q's format.
DTYPES = ("f16", "bf16", "f32") + tuple(FP8_DTYPES)
MASKS = ("none", "top_left", "bottom_right")
BIASES = ("none", "alibi", "elementwise")
# Which axes an elementwise bias has (the others broadcast): "11" is
# [1, 1, sq, sk], "b1" [batch, 1, sq, sk], "1h" [1, nhead_q, sq, sk], "bh" full.
BIAS_SHAPES = ("11", "b1", "1h", "bh")
FORMULATIONS = ("explicit", "online")
V_LAYOUTS = ("row", "col")
# Page layouts of the caches (FlashInfer's names): "NHD" [pages, page,
# nhead_k, dim], "HND" [pages, nhead_k, page, dim] (head-major pages).
KV_LAYOUTS = ("NHD", "HND")
# fp8 KV caches under fp16/bf16 queries.
KV_DTYPES = FP8_DTYPES

# A window side of -1 is unbounded; the kernels take this bound instead (no
# sequence reaches it, and i + shift + bound cannot overflow their 64-bit
# index arithmetic). ALiBi's causal (VERTICAL) form is keyed on it.
UNBOUNDED = 1 << 30

_MASK_TAG = {"none": "_nmask", "top_left": "_mtl", "bottom_right": "_mbr"}


def _flag(text: str, when=True) -> dict:
    """A flag's name texts: `text` when the field is `when`, else nothing."""
    return {when: text, not when: ""}


@dataclasses.dataclass(frozen=True, order=True)
class Variant(Named):
    # The metadata writes the name (naming.NameCodec): pagedkv_fwd_<dtype>
    # _d<hdim_q>x<hdim_v>[_h<nhead_q>x<nhead_k>|_g<group>]_pg<page>[_hnd][_vcol][_kv<fp8>]
    # _<mask>[_alibi|_bias<shape>][_softcap][_sink]_<lse|nlse>_<formulation>
    # [_b<batch_tile>_q<seqlen_q_tile>][_nvguard][_m<group_rows>][_x<merge_splits>|_xn].
    dtype: str = dataclasses.field(metadata=enum({d: f"_{d}" for d in DTYPES}))
    hdim_q: int = dataclasses.field(metadata=number("_d"))
    hdim_v: int = dataclasses.field(metadata=number("x"))
    nhead_q: int = dataclasses.field(metadata=number("_h", omit=0))
    nhead_k: int = dataclasses.field(metadata=number("x", omit=0))
    # Rows per page; 0 (explicit variants only, named _pg0): any page size,
    # read from the caches' shapes at run time, so that one artifact serves
    # every page size of its other fields.
    page_block_size: int = dataclasses.field(metadata=number("_pg"))
    mask: str = dataclasses.field(default="none", metadata=enum(_MASK_TAG))
    bias: str = dataclasses.field(
        default="none", metadata=enum({"none": "", "alibi": "_alibi", "elementwise": "_bias"})
    )
    bias_shape: str = dataclasses.field(default="", metadata=enum({s: s for s in ("",) + BIAS_SHAPES}))
    softcap: bool = dataclasses.field(default=False, metadata=enum(_flag("_softcap")))
    sinks: bool = dataclasses.field(default=False, metadata=enum(_flag("_sink")))
    # V cache layout: "row" (the page layout's) or "col" [pages, nhead_k,
    # hdim_v, page] (ck_tile's column-major V).
    v_layout: str = dataclasses.field(default="row", metadata=enum({"row": "", "col": "_vcol"}))
    # fp8 KV cache format ("" = same as dtype); queries stay fp16/bf16.
    kv_dtype: str = dataclasses.field(default="", metadata=enum({"": ""} | {k: f"_kv{k}" for k in KV_DTYPES}))
    lse: bool = dataclasses.field(default=True, metadata=enum({True: "_lse", False: "_nlse"}))
    formulation: str = dataclasses.field(default="explicit", metadata=enum({f: f"_{f}" for f in FORMULATIONS}))
    # The stale-row guard: zero the value rows that hold no key (the tail of
    # a sequence's last page, the head of its first page with gappy KV)
    # before the PV product, so that non-finite stale values cannot reach
    # the output (0 * NaN). (Stale K needs nothing: every online kernel
    # turns NaN/+Inf scores into a sentinel that the mask removes.) Online
    # variants may go without it: the V copy it needs writes V out and reads
    # it back, which a decode, bound by its K/V reads, pays in full
    # (docs/devlog/perf-notes.md, "GPU speed, round 1: steps taken,
    # predicted and measured", item "The V guard"), and the runtime uses
    # them only after checking that those rows are finite
    # (plan.stale_rows_finite). Both propagate NaN exactly as the reference
    # does.
    v_guard: bool = dataclasses.field(default=True, metadata=enum(_flag("_nvguard", when=False)))
    # Static batch tile and query rows (online formulation only; 0 = dynamic).
    batch_tile: int = dataclasses.field(default=0, metadata=number("_b", omit=0))
    seqlen_q_tile: int = dataclasses.field(default=0, metadata=number("_q", omit=0))
    # Query rows per KV head the attention op computes (online only; 0 = the
    # GQA group x seqlen_q_tile, unpadded): the group is zero-padded up to
    # group_rows / seqlen_q_tile heads. IREE's GPU configuration uses no
    # matrix cores when those rows are at most 4 (a decode with a group of
    # 4), and mma.sync / MFMA tiles are 16 rows; padded, a decode reads each
    # K/V page once per KV head instead of once per query head
    # (docs/devlog/perf-notes.md).
    group_rows: int = dataclasses.field(default=0, metadata=number("_m", omit=0))
    # Split-KV merged inside the module (online only; 0 = no merge): the
    # kernel's batch_tile entries are split j of sequence b at entry
    # b * merge_splits + j (plan.split_kv), q and the results are per
    # sequence, and the partials are merged before the epilogue. A host
    # merge of the partials costs more than the splits save on a GPU
    # (plan.DECODE_ITEMS_PER_UNIT).
    merge_splits: int = dataclasses.field(default=0, metadata=number("_x", omit=0))
    # Split-KV merged inside the module for any split count n (named _xn):
    # read at run time from q's batch (batch_tile / n sequences), with the
    # entries split-major (split j of sequence b at entry j * sequences + b,
    # which keeps IREE's configuration of the merge's reductions: kernel
    # steps reorder plan.split_kv's entries). One kernel per tile serves
    # every count that divides it, where merge_splits needs one per count
    # (docs/devlog/perf-notes.md, "A run-time split count").
    merge_any: bool = dataclasses.field(default=False, metadata=enum(_flag("_xn")))
    # Run-time head counts: a variant with nhead_q = nhead_k = 0 reads both
    # from its arguments' shapes, so one artifact serves every model of its
    # other fields. `group` is then its static GQA group (nhead_q / nhead_k,
    # named _g<group>), or 0 for any group: in the online formulation any
    # group up to its padded group (group_rows / seqlen_q_tile), whose rows
    # the matrix cores need static.
    group: int = dataclasses.field(default=0, metadata=number("_g", omit=0))
    # Page layout of both caches (KV_LAYOUTS). With head-major pages a
    # page's rows of one head are a fixed hdim apart whatever the head
    # count, which keeps the addressing of run-time-head variants static
    # (docs/devlog/perf-notes.md, "Run-time head counts").
    kv_layout: str = dataclasses.field(default="NHD", metadata=enum({"NHD": "", "HND": "_hnd"}))

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.kv_dtype and (self.kv_dtype not in KV_DTYPES or self.dtype not in ("f16", "bf16")):
            raise ValueError(
                f"kv_dtype must be one of {sorted(KV_DTYPES)} with fp16/bf16 queries, "
                f"got kv_dtype={self.kv_dtype!r}, dtype={self.dtype!r}"
            )
        if self.v_layout not in V_LAYOUTS:
            raise ValueError(f"v_layout must be one of {V_LAYOUTS}, got {self.v_layout!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.bias not in BIASES:
            raise ValueError(f"bias must be one of {BIASES}, got {self.bias!r}")
        if (self.bias == "elementwise") != (self.bias_shape in BIAS_SHAPES):
            raise ValueError(
                f"bias_shape must be one of {BIAS_SHAPES} exactly when bias is "
                f"'elementwise' (got bias={self.bias!r}, bias_shape={self.bias_shape!r})"
            )
        if self.softcap and self.bias != "none":
            # ck_tile forbids it (pipeline static_assert, codegen check_feature).
            raise ValueError("logits soft-cap cannot be combined with a bias or ALiBi")
        if self.formulation not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {FORMULATIONS}")
        for f in ("hdim_q", "hdim_v"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.page_block_size < 0 or (self.runtime_page and self.formulation != "explicit"):
            raise ValueError(
                f"page_block_size must be positive, or 0 (any page size) in the explicit formulation, "
                f"got {self.page_block_size} ({self.formulation})"
            )
        self._check_heads()
        static = self.batch_tile > 0 and self.seqlen_q_tile > 0
        if self.formulation == "online" and not static:
            raise ValueError("online variants need batch_tile and seqlen_q_tile > 0")
        if self.formulation == "online":
            reason = online_unsupported(self.problem, decode=self.seqlen_q_tile == 1 and self.batch_tile > 1)
            if reason:
                raise ValueError(f"the online formulation cannot serve this variant: {reason}")
        if self.formulation == "explicit" and (self.batch_tile or self.seqlen_q_tile):
            raise ValueError("explicit variants have dynamic batch and query rows")
        if self.group_rows and (
            self.formulation != "online"
            or self.per_head_terms
            or self.group_rows % self.seqlen_q_tile
            or self.group_rows < self.group_size * self.seqlen_q_tile
        ):
            raise ValueError(
                "group_rows pads an online variant without per-head score terms: a multiple of "
                "seqlen_q_tile, at least the GQA group x seqlen_q_tile"
            )
        if self.merge_splits and (
            self.formulation != "online" or self.merge_splits < 2 or self.batch_tile % self.merge_splits
        ):
            raise ValueError(
                "merge_splits (at least 2) merges an online variant's batch entries: batch_tile "
                "must be a multiple of it"
            )
        if self.merge_any and (self.formulation != "online" or self.merge_splits or self.batch_tile < 2):
            raise ValueError(
                "merge_any merges an online variant's batch entries (a batch tile of at least 2) in a "
                "count read at run time, instead of merge_splits"
            )
        if not self.v_guard and (self.formulation != "online" or self.kv_dtype or self.v_layout != "row"):
            raise ValueError("only online variants with a row-major fp16/bf16/f32 V cache can drop the V guard")

    def _check_heads(self):
        if self.runtime_heads:
            if self.group < 0 or (self.formulation == "online" and not (self.group or self.group_rows)):
                raise ValueError(
                    f"a variant with run-time head counts has a static GQA group >= 1, or 0 (any "
                    f"group): in the online formulation, any group up to the padded one "
                    f"(group_rows); got group={self.group}"
                )
        elif self.nhead_q <= 0 or self.nhead_k <= 0 or self.group:
            raise ValueError(
                f"nhead_q and nhead_k must be positive (or both 0, for run-time head counts, with "
                f"`group`), got nhead_q={self.nhead_q}, nhead_k={self.nhead_k}, group={self.group}"
            )
        elif self.nhead_q % self.nhead_k:
            raise ValueError(f"nhead_q ({self.nhead_q}) must be a multiple of nhead_k ({self.nhead_k})")

    @property
    def runtime_heads(self) -> bool:
        """Head counts read from the arguments at run time (Variant.group)."""
        return self.nhead_q == 0 and self.nhead_k == 0

    @property
    def runtime_page(self) -> bool:
        """Any page size, read from the caches at run time (page_block_size 0)."""
        return self.page_block_size == 0

    @property
    def static_quant(self) -> bool:
        """fp8 Q/K/V/output (ck_tile's kDoFp8StaticQuant)."""
        return self.dtype in FP8_DTYPES

    @property
    def per_head_terms(self) -> bool:
        """ALiBi or a bias with a head axis: per-head score terms."""
        return self.bias == "alibi" or (self.bias == "elementwise" and self.bias_shape[1] == "h")

    @property
    def group_size(self) -> int:
        """The GQA group (0: any, decided at run time)."""
        return self.group if self.runtime_heads else self.nhead_q // self.nhead_k

    @property
    def padded_group(self) -> int:
        """Query heads per KV head the attention op computes (group_rows)."""
        return self.group_rows // self.seqlen_q_tile if self.group_rows else self.group_size

    def serves_group(self, group: int) -> bool:
        """Whether a call with this GQA group can run this variant's heads
        (selection has matched the rest)."""
        if not self.runtime_heads:
            return group == self.group_size
        return group == self.group if self.group else self.formulation == "explicit" or group <= self.padded_group

    @property
    def merging(self) -> bool:
        """Whether the variant merges split-KV entries (a static or run-time count)."""
        return bool(self.merge_splits or self.merge_any)

    def merges(self, n: int) -> bool:
        """Whether the variant serves n split-KV entries per sequence merged
        in the module (n 0 or 1: a call that merges none)."""
        if n < 2:
            return not self.merging
        return self.merge_splits == n or (self.merge_any and self.batch_tile % n == 0)

    @property
    def problem(self) -> dict:
        """The fields a call must match exactly (all but lse, tiling and the V guard)."""
        return {f: getattr(self, f) for f in PROBLEM_FIELDS}


# The order of the fields in a Variant's name.
Variant.names = NameCodec(
    Variant,
    "pagedkv_fwd",
    (
        "dtype",
        "hdim_q",
        "hdim_v",
        "nhead_q",
        "nhead_k",
        "group",
        "page_block_size",
        "kv_layout",
        "v_layout",
        "kv_dtype",
        "mask",
        "bias",
        "bias_shape",
        "softcap",
        "sinks",
        "lse",
        "formulation",
        "batch_tile",
        "seqlen_q_tile",
        "v_guard",
        "group_rows",
        "merge_splits",
        "merge_any",
    ),
)


def bias_shape_of(bias) -> str:
    """The bias_shape of an elementwise bias array [b|1, h|1, rows, keys]:
    which of its batch and head axes are full ("" without a bias)."""
    if bias is None:
        return ""
    return ("b" if bias.shape[0] != 1 else "1") + ("h" if bias.shape[1] != 1 else "1")


def online_unsupported(problem: dict, decode: bool = False) -> str | None:
    """Why the online (GPU) formulation cannot serve `problem` (in its decode
    tiles, one query row and batch tiles of 8 and more, with `decode`), or
    None.

    The runtime then runs the explicit formulation instead (on any target):
    slower on GPUs, but the same kernel the CPU tests execute.
    """
    if problem["hdim_q"] > 128 or problem["hdim_v"] > 128:
        # IREE 3.13's online_attention gave wrong results (rel err ~1) on the
        # CPU for head dims 160, 192/128 and 256; 128 and below are right.
        return f"head dims {problem['hdim_q']}/{problem['hdim_v']} > 128 compute wrong results in IREE 3.13"
    if problem["dtype"] in FP8_DTYPES:
        # Same failure as fp8 KV caches, plus the P/output quantization.
        return "fp8 static quantization runs in the explicit kernels only"
    if problem.get("kv_dtype") and not decode:
        # With the fp8 bytes decoded by integer arithmetic, the online kernels
        # compile for the decode tiles (batch tiles 8-128, matrix cores
        # included) but not for batch tile 1, the prefill tiles' (GPU codegen
        # fails on the 0-d per-sequence scalars in the V-widening dispatch).
        return "fp8 KV caches do not compile in the online kernels for every tile in IREE 3.13"
    per_head = problem["bias"] == "alibi" or (problem["bias"] == "elementwise" and problem["bias_shape"][1] == "h")
    if per_head and problem["page_block_size"] == 1:
        # The per-head loop with one-row pages fails to compile on every
        # target ("write affecting operations on global resources are
        # restricted to workgroup distributed contexts").
        return "ALiBi or a per-head bias with page_block_size 1 fails to compile in IREE 3.13"
    return None


PROBLEM_FIELDS = (
    "dtype",
    "hdim_q",
    "hdim_v",
    "nhead_q",
    "nhead_k",
    "group",
    "page_block_size",
    "mask",
    "bias",
    "bias_shape",
    "softcap",
    "sinks",
    "kv_layout",
    "v_layout",
    "kv_dtype",
)


# GPU tiles (batch tile, query rows): decode at 8 to 128 sequences per call
# (split-KV's partial calls count as sequences: batch 32 in 4 splits is one
# launch of the 128 tile);
# prefill in 128-row chunks for short prompts and 4096-row chunks for long
# ones (one launch instead of 32: each launch costs time of its own, and
# 128 rows do not fill a GPU; docs/devlog/perf-notes.md, "H200 measurements
# (CUDA sm_80 PTX)"), and 1024-row chunks that a causal prefill cuts at the
# diagonal (the masked scores they skip outweigh the three more launches
# than one 4096-row call: docs/devlog/perf-notes.md, "Causal prefill in
# 1024-row chunks; the masked roof").
# The runtime picks the least padding, then the fewest launches (for a
# prefill with a right mask edge: the least modelled time,
# selection.prefill_tile_cost).
GPU_DECODE_TILES = ((8, 1), (32, 1), (64, 1), (128, 1))
GPU_PREFILL_TILES = ((1, 128), (1, 1024), (1, 4096))
# Prefill rows as entries of 128 rows each (plan.row_entries), 16 or 32 of
# them per launch: a chunked prefill of 4 x 512 rows took 16 launches of the
# first prefill tile.
ENTRY_ROWS = GPU_PREFILL_TILES[0][1]
GPU_ENTRY_TILES = ((16, ENTRY_ROWS), (32, ENTRY_ROWS))
GPU_DECODE_TILE = GPU_DECODE_TILES[0]
# Decode variants that merge split-KV partials in the module
# (Variant.merge_splits): (batch tile, split count). The runtime splits a
# decode into at most 8 items per compute unit (plan.merged_decode_splits),
# i.e. 66-132 kernel entries for long keys on a GPU of 132 compute units:
# tile 128 for each count, 64 and 32 where short keys or small batches make
# fewer entries (a call that takes two launches sends the second through
# the padded, placed path, whose allocations and copies cost far more host
# time than one launch: docs/devlog/perf-notes.md, "GPU speed, round 2: the
# split-KV merge inside the module").
MERGED_DECODE_TILES = (
    tuple((128, n) for n in (2, 4, 8, 16, 32, 64, 128))
    + tuple((64, n) for n in (8, 16, 32, 64))
    + tuple((32, n) for n in (4, 8, 16, 32))
)
MERGE_SPLITS = tuple(sorted({n for _, n in MERGED_DECODE_TILES}))
# The batch tiles of the decode variants that merge any split count
# (Variant.merge_any): one kernel each serves every count of
# MERGED_DECODE_TILES at its tile, and the counts that divide it at the
# smaller tiles. The default sets build these; a variant of one count
# (merge_splits) is what an export or a first use compiles.
MERGED_TILES = tuple(sorted({t for t, _ in MERGED_DECODE_TILES}))
# (batch tile, split count) of the merged decodes the default sets keep
# in one count beside the tile's run-time count: at 128 splits of one
# sequence the run-time count was measurably slower, at 8 and 32 it was
# not (docs/devlog/perf-notes.md, "A run-time split count"). 64 splits
# (two sequences a launch) are kept too, not measured.
MERGED_STATIC_TILES = ((128, 64), (128, 128))
GPU_PREFILL_TILE = GPU_PREFILL_TILES[0]


# Rows of a matrix-core tile (mma.sync m16n8k16, MFMA 16x16xK): see
# Variant.group_rows.
MMA_ROWS = 16


def group_of(problem: dict) -> int:
    """The GQA group of `problem` (a call's, or a variant's: 0 for any)."""
    return problem.get("group", 0) if problem["nhead_k"] == 0 else problem["nhead_q"] // problem["nhead_k"]


def runtime_heads(problem: dict, any_group: bool = False) -> dict:
    """The problem of the variants with run-time head counts that serve a
    call of `problem`: for its GQA group, or for any group."""
    return dict(problem, nhead_q=0, nhead_k=0, group=0 if any_group else group_of(problem))


def any_page(problem: dict) -> dict:
    """The problem of the variants of any page size that serve a call of
    `problem` (explicit only: Variant.page_block_size)."""
    return dict(problem, page_block_size=0)


def group_rows_for(problem: dict, seqlen_q_tile: int) -> int:
    """The group_rows of `problem`'s online variants with `seqlen_q_tile`
    query rows: MMA_ROWS where the GQA group's rows are fewer (a decode) and
    there are no per-head score terms, else 0 (Variant.group_rows)."""
    group = group_of(problem)
    per_head = problem["bias"] == "alibi" or (problem["bias"] == "elementwise" and problem["bias_shape"][1] == "h")
    pad = group * seqlen_q_tile < MMA_ROWS and MMA_ROWS % seqlen_q_tile == 0 and not per_head
    return MMA_ROWS if pad else 0


def decode_batch_tile(batch: int, merge: int = 0) -> int:
    """The batch tile of an online decode of `batch` sequences (or entries,
    merging `merge` split-KV partials per sequence): the smallest that
    holds the batch in one launch, else the largest. A merge takes the
    merged tiles that `merge` divides (a kernel of one count, compiled on
    first use or into an export, can have any of them)."""
    tiles = [t for t, _ in GPU_DECODE_TILES] if not merge else [t for t in MERGED_TILES if t % merge == 0]
    return next((t for t in tiles if t >= batch), tiles[-1])


def online_variant(problem: dict, batch_tile: int, seqlen_q_tile: int, **fields) -> Variant:
    """The online variant serving `problem` with these tiles, its GQA group
    padded by group_rows_for."""
    fields.setdefault("group_rows", group_rows_for(problem, seqlen_q_tile))
    return Variant(**problem, formulation="online", batch_tile=batch_tile, seqlen_q_tile=seqlen_q_tile, **fields)


def target_unsupported(variant: Variant, target_kind: str) -> str | None:
    """Why `variant` cannot be built for a target of `target_kind`, or None.

    Nothing is excluded today; fp8 caches once were (docs/repro/), and this
    is where a target-specific exclusion belongs.
    """
    return None


def parse_kernel(name: str):
    """A Variant, an AppendKernel or a TilesKernel from its name."""
    if name.startswith("pagedkv_append_"):
        return AppendKernel.parse(name)
    if name.startswith("prefill_tiles_"):
        return TilesKernel.parse(name)
    return Variant.parse(name)
