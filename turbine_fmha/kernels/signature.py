"""The kernels' signatures, each declared once.

In the spirit of sharktank's `mlir_kernel`: a kernel is a list of tensor
arguments with symbolic dims and a dtype rule, then compile-time attributes,
then results. Everything else is derived from the declaration: the CustomOp
signature string and `select()` (turbine_fmha.kernels), the example
arguments, the MLIR type aliases and function header of each template, the
argument order the runtime passes (`KERNEL_ARGS`, `call_args`), the
operand lists and block arguments of the templates' elementwise generics
(`operands`), and `KERNEL_ABI`, a hash of the declarations: artifacts built
against another argument list are never loaded.

Dims are symbols, bound per variant (`fwd_types`). A symbol is static in
the formulations whose `STATIC` set names it and dynamic ("?") otherwise;
an int is a static size. "B|1" is the batch axis of a bias that may
broadcast: B where the bias has it, else a static 1 (likewise "HQ|1").

Dtype rules: "Q" is the query/output type (i8 bytes under fp8 static
quantization), "KV" the cache type (i8 bytes for an fp8 cache); "f32" and
"i32" are themselves.

Pure data and string formatting: the runtime imports this without torch.
"""

from __future__ import annotations

import dataclasses
import hashlib

# Head dims are always static, and the page size and heads unless the
# variant reads them at run time (fwd_types); the online formulation also fixes
# batch tile and query rows (on gfx942 a dynamic query length gets no MFMA).
STATIC = {
    "explicit": frozenset({"HQ", "HK", "D", "DV", "PG"}),
    "online": frozenset({"HQ", "HK", "D", "DV", "PG", "B", "BO", "S"}),
    "append": frozenset({"HK", "D", "DV", "PG"}),
    "tiles": frozenset({"HQ", "HK", "D", "PG", "TR"}),
}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple
    dtype: str
    # The Variant feature that brings an optional tensor ("" = always there).
    when: str = ""
    # Dims by cache layout (layout_key), for a tensor whose layout the
    # variant chooses.
    layouts: tuple = ()

    @property
    def optional(self) -> bool:
        return bool(self.when)

    def dims_for(self, layout: str = "NHD/row") -> tuple:
        return dict(self.layouts)[layout] if self.layouts else self.dims


def layout_key(kv_layout: str = "NHD", v_layout: str = "row") -> str:
    """The key of Tensor.layouts: a variant's page layout and V layout."""
    return f"{kv_layout}/{v_layout}"


def _cache(name: str, dim: str) -> Tensor:
    """A cache argument: pages [NP, PG, HK, dim] (NHD) or [NP, HK, PG, dim]
    (HND); V column-major [NP, HK, DV, PG] under either."""
    pages = {"NHD": ("NP", "PG", "HK", dim), "HND": ("NP", "HK", "PG", dim)}
    return Tensor(
        name,
        (),
        "KV",
        layouts=tuple(
            (layout_key(kv, v), ("NP", "HK", dim, "PG") if v == "col" and dim == "DV" else dims)
            for kv, dims in pages.items()
            for v in ("row", "col")
        ),
    )


@dataclasses.dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "str" or "int"


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    args: tuple
    attrs: tuple
    results: tuple


_STATS = ("BO", "HQ", "S")

# The attention forward (both formulations). seqlen_q, seqlen_k and kv_shift
# are per sequence (kv_shift: gappy KV, key t of sequence b is gathered row
# kv_shift[b] + t); fparams = [scale, logits_soft_cap, scale_o, scale_p],
# iparams = [q_start, window_left, window_right, sink_size] (see the
# templates' prologue). Results: the output, then LSE, row max and row sum
# of exp(score - max), the split-KV merge's weights.
# "B" counts kernel entries, "BO" query sequences: they differ in a variant
# that merges split-KV partials in the module (Variant.merge_splits), where
# entry b * n + j is split j of sequence b (Variant.merge_any: any n, BO
# dynamic, entry j * BO + b); elsewhere BO is B.
FWD = Kernel(
    "pagedkv_fwd",
    args=(
        Tensor("q", ("BO", "S", "HQ", "D"), "Q"),
        _cache("k_cache", "D"),
        _cache("v_cache", "DV"),
        Tensor("block_table", ("B", "W"), "i32"),
        Tensor("seqlen_q", ("B",), "i32"),
        Tensor("seqlen_k", ("B",), "i32"),
        Tensor("kv_shift", ("B",), "i32"),
        Tensor("fparams", (4,), "f32"),
        Tensor("iparams", (4,), "i32"),
        Tensor("alibi_slopes", ("B", "HQ"), "f32", when="alibi"),
        Tensor("bias", ("B|1", "HQ|1", "S", "N"), "f32", when="elementwise"),
        Tensor("sinks", ("HQ",), "f32", when="sinks"),
    ),
    attrs=(
        Attr("mask", "str"),
        Attr("softcap", "int"),
        Attr("kv_layout", "str"),
        Attr("v_layout", "str"),
        Attr("kv_dtype", "str"),
        Attr("v_guard", "int"),
        Attr("group_rows", "int"),
        Attr("merge_splits", "int"),
        Attr("runtime_heads", "int"),
        Attr("group", "int"),
        Attr("runtime_page", "int"),
    ),
    results=(
        Tensor("out", ("BO", "S", "HQ", "DV"), "Q"),
        Tensor("lse", _STATS, "f32"),
        Tensor("row_max", _STATS, "f32"),
        Tensor("row_sum", _STATS, "f32"),
    ),
)

# The in-place append: slots [n, 2] = (page, row) of each new token; the
# results are the updated caches.
APPEND = Kernel(
    "pagedkv_append",
    args=(
        Tensor("k_new", ("T", "HK", "D"), "KV"),
        Tensor("v_new", ("T", "HK", "DV"), "KV"),
        Tensor("slots", ("T", 2), "i32"),
        Tensor("k_cache", ("NP", "PG", "HK", "D"), "KV"),
        Tensor("v_cache", ("NP", "PG", "HK", "DV"), "KV"),
    ),
    attrs=(),
    results=(Tensor("k_out", ("NP", "PG", "HK", "D"), "KV"), Tensor("v_out", ("NP", "PG", "HK", "DV"), "KV")),
)

# The append with ck_tile appendkv's rotary embedding (AppendKernel.rotary):
# the new K rows are rotated at positions k_pos before they are written, and
# q's rows at q_pos come back rotated as q_out (q may have no rows).
# rotary_dim is twice the tables' width RH; the tables are f32 (the
# rotation is computed in f32 and rounded to the cache type once).
APPEND_ROTARY = Kernel(
    "pagedkv_append_rotary",
    args=APPEND.args
    + (
        Tensor("k_pos", ("T",), "i32"),
        Tensor("q", ("TQ", "HQ", "D"), "KV"),
        Tensor("q_pos", ("TQ",), "i32"),
        Tensor("rotary_cos", ("R", "RH"), "f32"),
        Tensor("rotary_sin", ("R", "RH"), "f32"),
    ),
    attrs=(Attr("rotary", "str"),),
    results=APPEND.results + (Tensor("q_out", ("TQ", "HQ", "D"), "KV"),),
)


def tiles_declaration(classes: int) -> Kernel:
    """The contiguous-tile prefill of `classes` chunk classes
    (mlir/prefill_tiles.mlir.jinja says what each argument holds): the
    packed query rows, the caches, the region's slots (page, rows held),
    the tiles' rows and each q row's tile row, per class its entries' tiles
    and head-major chunk ids, the last blocks' mask bounds, each tile's
    entries, and fparams = [scale]. Results: out and LSE [HQ, N]."""
    per_class = []
    for c in range(classes + 1):
        per_class += [Tensor(f"tiles{c}", (f"E{c}",), "i32"), Tensor(f"chunks{c}", (f"E{c}", "HK"), "i32")]
    return Kernel(
        "prefill_tiles",
        args=(
            Tensor("q", ("QR", "HQ", "D"), "Q"),
            Tensor("k_cache", ("NP", "PG", "HK", "D"), "Q"),
            Tensor("v_cache", ("NP", "PG", "HK", "D"), "Q"),
            Tensor("slots", ("KS",), "i32"),
            Tensor("slot_rows", ("KS",), "i32"),
            Tensor("q_rows", ("NT", "TR"), "i32"),
            Tensor("out_rows", ("QR",), "i32"),
            *per_class,
            Tensor("bounds", (f"E{classes}", 2), "i32"),
            Tensor("parts", ("NT", classes + 1), "i32"),
            Tensor("fparams", (1,), "f32"),
        ),
        attrs=(),
        results=(Tensor("out", ("QR", "HQ", "D"), "Q"), Tensor("lse", ("HQ", "QR"), "f32")),
    )


def tiles_types(k) -> Types:
    """The tile declaration bound for TilesKernel `k`."""
    dynamic = {"QR": 0, "NP": 0, "KS": 0, "NT": 0} | {f"E{c}": 0 for c in range(k.classes + 1)}
    static = {"HQ": k.nhead_q, "HK": k.nhead_k, "D": k.hdim, "PG": k.page_block_size, "TR": k.tile}
    return Types(_bound(dynamic | static, STATIC["tiles"]), {"Q": k.dtype, "i32": "i32", "f32": "f32"})


# The guards an exported program runs before it touches its inputs
# (api/exported.py). A program's sizes are fixed by nothing but its
# arguments' buffers at run time: sizes that share one symbol when
# exporting (q's batch and the tables' rows, K's and V's page counts) may
# differ when it runs, and the kernels and torch's ops inside the program
# index one tensor by another's size. Each guard fails the invocation
# (cf.assert) where such sizes disagree, before any dispatch reads them.
# They are no artifacts: KERNEL_ABI leaves them out.
#
# The attention's guard also returns each sequence's seqlen_k cut where
# the table stops serving it (page_axis: the caches' page-size axis): at
# its first used slot whose page id is outside k_cache, and at the table's
# width, so that no key is read through a page id the caller did not mean.
GUARD_PAGED = Kernel(
    "guard_paged",
    args=(
        Tensor("q", ("B", "S", "HQ", "D"), "Q"),
        Tensor("k_cache", ("NP", "K1", "K2", "K3"), "KV"),
        Tensor("v_cache", ("NP", "V1", "V2", "V3"), "KV"),
        Tensor("block_table", ("B", "W"), "i32"),
        Tensor("seqlen_k", ("B",), "i32"),
    ),
    attrs=(Attr("page_axis", "int"),),
    results=(Tensor("seqlen_k_cut", ("B",), "i32"),),
)

# The cache write's guard: k, v and the slots ([T] i64) have one token
# count, and each cache has a page (a skipped token is redirected onto
# row 0).
GUARD_WRITE = Kernel(
    "guard_write",
    args=(
        Tensor("k", ("T", "KH", "KD"), "KV"),
        Tensor("v", ("T", "VH", "VD"), "KV"),
        Tensor("k_cache", ("NK", "K1", "K2", "K3"), "KV"),
        Tensor("v_cache", ("NV", "V1", "V2", "V3"), "KV"),
        Tensor("slots", ("T",), "i64"),
    ),
    attrs=(),
    results=(Tensor("slots_out", ("T",), "i64"),),
)


def guard_types(q_dtype: str, kv_dtype: str) -> Types:
    """A guard's declaration bound: every size dynamic."""
    names = {d for k in (GUARD_PAGED, GUARD_WRITE) for t in k.args + k.results for d in t.dims}
    return Types({d: "?" for d in names}, {"Q": q_dtype, "KV": kv_dtype, "i32": "i32", "i64": "i64"})


# The attention kernels' tensor arguments in call order; the optional ones
# are passed only where the variant has them (call_args).
KERNEL_ARGS = tuple(a.name for a in FWD.args)
OPTIONAL_ARGS = frozenset(a.name for a in FWD.args if a.optional)

# The kernels' argument-list version: any change to a declaration changes
# it. (An int: manifests store it as one.)
# The repr is process-independent: sets are sorted (their own order follows
# the per-process string hash).
_CANONICAL = repr(
    ([(k, sorted(v)) for k, v in sorted(STATIC.items())], FWD, APPEND, APPEND_ROTARY, tiles_declaration(1))
)
KERNEL_ABI = int(hashlib.sha256(_CANONICAL.encode()).hexdigest()[:12], 16)


def score_terms(v) -> list[str]:
    """The score terms of Variant `v`, in the order their code applies: the
    score-side features, each a file mlir/terms/<term>.mlir.jinja whose
    hooks the skeletons call (mlir/hooks.mlir.jinja). A term's tensors are
    the arguments declared `when` it (FWD)."""
    return [
        term
        for term, on in (
            ("softcap", v.softcap),
            ("alibi", v.bias == "alibi"),
            ("elementwise", v.bias == "elementwise"),
            ("sinks", v.sinks),
            ("static_quant", v.static_quant),
        )
        if on
    ]


def present(v, arg: Tensor) -> bool:
    """Whether Variant `v` takes `arg`: every argument, but a term's only
    with the term."""
    return not arg.when or arg.when in score_terms(v)


def call_args(v) -> tuple:
    """The names of the tensors a call of Variant `v` passes, in order."""
    return tuple(a.name for a in FWD.args if present(v, a))


def fwd_attrs(v) -> dict:
    """The attribute values of Variant `v`, in FWD.attrs order. kv_dtype
    names the fp8 format of K/V, and of Q and the output too under static
    quantization (q is then i8)."""
    return dict(
        mask=v.mask,
        softcap=int(v.softcap),
        kv_layout=v.kv_layout,
        v_layout=v.v_layout,
        kv_dtype=v.dtype if v.static_quant else v.kv_dtype,
        v_guard=int(v.v_guard),
        group_rows=v.group_rows,
        merge_splits=-1 if v.merge_any else v.merge_splits,  # -1: any count (Variant.merge_any)
        runtime_heads=int(v.runtime_heads),
        group=v.group,
        runtime_page=int(v.runtime_page),
    )


@dataclasses.dataclass(frozen=True)
class Types:
    """A declaration bound for one variant: `sym` maps each symbol to its
    size, or "?" where it is dynamic; `dtypes` maps each dtype rule to an
    MLIR element type."""

    sym: dict
    dtypes: dict
    layout: str = layout_key()
    # The broadcastable axes ("B|1", "HQ|1") the variant has full.
    full: frozenset = frozenset()


def _bound(sizes: dict, static: frozenset) -> dict:
    return {k: (n if k in static else "?") for k, n in sizes.items()}


def fwd_types(v) -> Types:
    """The attention declaration bound for Variant `v` (head counts and the
    page size dynamic where the variant reads them at run time)."""
    hq, hk = ("?", "?") if v.runtime_heads else (v.nhead_q, v.nhead_k)
    sym = _bound(
        {
            "B": v.batch_tile,
            "BO": v.batch_tile // max(1, v.merge_splits),
            "S": v.seqlen_q_tile,
            "HQ": hq,
            "HK": hk,
            "D": v.hdim_q,
            "DV": v.hdim_v,
            "PG": v.page_block_size,
            "NP": 0,
            "W": 0,
            "N": 0,
        },
        STATIC[v.formulation],
    )
    if v.runtime_page:
        sym["PG"] = "?"
    if v.merge_any:
        sym["BO"] = "?"  # q's batch: the split count is batch_tile / BO
    # G: query heads per KV head (HQ = HK x G), of the views that split HQ.
    sym["G"] = (v.group or "?") if v.runtime_heads else v.nhead_q // v.nhead_k
    full = frozenset()
    if v.bias == "elementwise":
        sym["B|1"] = sym["B"] if v.bias_shape[0] == "b" else 1
        sym["HQ|1"] = sym["HQ"] if v.bias_shape[1] == "h" else 1
        full = frozenset(s for s, c in zip(("B|1", "HQ|1"), v.bias_shape) if c != "1")
    q = "i8" if v.static_quant else v.dtype
    return Types(
        sym,
        {"Q": q, "KV": "i8" if v.kv_dtype else q, "f32": "f32", "i32": "i32"},
        layout_key(v.kv_layout, v.v_layout),
        full,
    )


def append_kernel(a) -> Kernel:
    """The declaration AppendKernel `a` is built from."""
    return APPEND if a.rotary == "none" else APPEND_ROTARY


def append_attrs(a) -> dict:
    """The attribute values of AppendKernel `a`, in its declaration's order."""
    return {} if a.rotary == "none" else {"rotary": a.rotary}


def append_types(a) -> Types:
    """The append declarations bound for AppendKernel `a`."""
    sizes = {
        "T": 0,
        "NP": 0,
        "HK": a.nhead_k,
        "D": a.hdim,
        "DV": a.hdim_v,
        "PG": a.page_block_size,
        "TQ": 0,
        "HQ": 0,
        "R": 0,
        "RH": 0,
    }
    return Types(_bound(sizes, STATIC["append"]), {"KV": a.dtype, "i32": "i32", "f32": "f32"})


def shape_of(t: Tensor, sym: dict, layout: str = layout_key()) -> list:
    return [d if isinstance(d, int) else sym[d] for d in t.dims_for(layout)]


def tensor_type(t: Tensor, types: Types) -> str:
    dims = "".join(f"{d}x" for d in shape_of(t, types.sym, types.layout))
    return f"tensor<{dims}{types.dtypes[t.dtype]}>"


# Where the attention templates' generics read argument tensors element by
# element (`operands`): per score (query row, key), the sequence lengths
# and the tensors of the terms added to the score; per key, what the V
# guard reads; per output row, the sinks. A variant's absent tensors are
# left out.
READS = {
    "scores": ("seqlen_q", "seqlen_k", "kv_shift", "alibi_slopes", "bias"),
    "keys": ("seqlen_k", "kv_shift"),
    "rows": ("sinks",),
}


@dataclasses.dataclass(frozen=True)
class Operand:
    """An input (or output) of a linalg.generic: SSA `value` of MLIR
    `type`, read at the results `map` of its indexing map, its element the
    block argument `arg` of type `elem`. An argument tensor's also carry
    its `name`, its bound `sizes` and whether it has a query-head axis
    (`heads`)."""

    value: str
    type: str
    map: str
    arg: str
    elem: str
    name: str = ""
    sizes: tuple = ()
    heads: bool = False


class Operands(tuple):
    """A generic's Operand list, in order (`+` joins lists); an argument
    tensor's by its name (ops.bias)."""

    def __getattr__(self, name: str) -> Operand:
        for o in self:
            if o.name == name:
                return o
        raise AttributeError(name)

    def __add__(self, other):
        return Operands(tuple(self) + tuple(other))

    def __radd__(self, other):
        return Operands(tuple(other) + tuple(self))


def operands(types: Types, args: list, reads: str, view: str = "whole", **dims) -> Operands:
    """The Operands of the tensors among `args` (a variant's, in call
    order) that READS[reads] names, as a generic over `dims` (symbol ->
    its iteration dim: B="b", S="m", ...) reads them, in view:

      whole  as declared (value %<name>, type !<name>_t);
      heads  the query-head axis split into (HK, G), the GQA layout
             (%<name>_heads; a tensor without one, whole);
      head   one query head's, the axis dropped (%<name>_head).

    A view's value is defined by its term's hooks (mlir/terms/). An X|1
    axis of size 1 is read at index 0 (it broadcasts); elsewhere a dim
    reads its symbol's iteration dim. Block arguments are %<name>_v."""
    out = []
    for t in args:
        if t.name not in READS[reads]:
            continue
        own = list(t.dims_for(types.layout))
        heads = "HQ" in own or ("HQ|1" in own and "HQ|1" in types.full)
        axis = next((i for i, d in enumerate(own) if d in ("HQ", "HQ|1")), None)
        shown, value = list(own), f"%{t.name}"
        if view == "heads" and heads:
            shown[axis : axis + 1] = ["HK", "G"]
            value = f"%{t.name}_heads"
        elif view == "head" and axis is not None:
            del shown[axis]
            value = f"%{t.name}_head"
        elem = types.dtypes[t.dtype]
        typ = f"!{t.name}_t" if value == f"%{t.name}" else f"tensor<{''.join(f'{types.sym[d]}x' for d in shown)}{elem}>"
        index = ", ".join("0" if d.endswith("|1") and types.sym[d] == 1 else dims[d.split("|")[0]] for d in shown)
        out.append(
            Operand(value, typ, index, f"%{t.name}_v", elem, t.name, tuple(shape_of(t, types.sym, types.layout)), heads)
        )
    return Operands(out)


def mlir_header(kernel: Kernel, args: list, types: Types, same: dict | None = None) -> dict:
    """What a template needs of its signature: `aliases` (one
    `!<name>_t = tensor<...>` line per argument and result), `params` (the
    function's parameter list), `results` (its result types) and `checks`
    (size_checks: the function's first lines)."""
    results = list(kernel.results)
    return dict(
        aliases="\n".join(f"!{t.name}_t = {tensor_type(t, types)}" for t in args + results),
        params=", ".join(f"%{t.name}: !{t.name}_t" for t in args),
        results=", ".join(f"!{t.name}_t" for t in results),
        checks=size_checks(kernel, args, types, same),
    )


class _Checks:
    """The lines of size_checks under construction: each dim read once
    (%chk_<arg>_<axis>), the index constants they need, and the asserts."""

    def __init__(self, kernel: Kernel):
        self.kernel, self.lines, self.consts, self.dims = kernel, [], set(), set()

    def dim(self, name: str, axis: int) -> str:
        value = f"%chk_{name}_{axis}"
        if value not in self.dims:
            self.dims.add(value)
            self.consts.add(axis)
            self.lines.append(f"  {value} = tensor.dim %{name}, %chk_c{axis} : !{name}_t")
        return value

    def check(self, cond: str, message: str) -> None:
        self.lines.append(f'  cf.assert {cond}, "turbine_fmha {self.kernel.name}: {message}"')

    def text(self) -> str:
        head = [f"  %chk_c{a} = arith.constant {a} : index" for a in sorted(self.consts)]
        return "\n".join(head + self.lines)


def _dynamic_uses(args: list, types: Types, same: dict) -> dict:
    """Dynamic symbol -> the (argument, axis) pairs that carry it."""
    uses: dict = {}
    for t in args:
        for i, d in enumerate(t.dims_for(types.layout)):
            if isinstance(d, int):
                continue
            if "|" in d:
                if d not in types.full:
                    continue
                d = d.split("|")[0]
            d = same.get(d, d)
            if types.sym.get(d) == "?":
                uses.setdefault(d, []).append((t.name, i))
    return uses


def _check_heads(c: _Checks, uses: dict, types: Types) -> None:
    """Run-time heads: q's heads are HK groups of G."""
    hq, hk = c.dim(*uses["HQ"][0]), c.dim(*uses["HK"][0])
    g = types.sym.get("G")
    c.lines += [
        f"  %chk_hk_some = arith.cmpi ugt, {hk}, %chk_c0 : index",
        f"  %chk_hk_safe = arith.select %chk_hk_some, {hk}, %chk_c1 : index",
        f"  %chk_hq_rem = arith.remui {hq}, %chk_hk_safe : index",
        "  %chk_hq_div = arith.cmpi eq, %chk_hq_rem, %chk_c0 : index",
        "  %chk_heads = arith.andi %chk_hk_some, %chk_hq_div : i1",
    ]
    c.consts.update((0, 1))
    if isinstance(g, int):
        c.lines += [
            f"  %chk_g = arith.constant {g} : index",
            f"  %chk_hq_g = arith.muli {hk}, %chk_g : index",
            f"  %chk_hq_is = arith.cmpi eq, %chk_hq_g, {hq} : index",
            "  %chk_heads_g = arith.andi %chk_heads, %chk_hq_is : i1",
        ]
        c.check("%chk_heads_g", f"q's heads must be {g} per head of k_cache")
    else:
        c.check("%chk_heads", "q's heads must be a multiple of k_cache's (one or more)")


def _check_bias_columns(c: _Checks, uses: dict, types: Types) -> None:
    """A bias holds a column per gathered key row: W * PG of them."""
    pg = types.sym.get("PG")
    if isinstance(pg, int):
        c.lines.append(f"  %chk_pg = arith.constant {pg} : index")
        pg = "%chk_pg"
    else:
        pg = c.dim(*uses["PG"][0])
    c.lines += [
        f"  %chk_keys = arith.muli {c.dim(*uses['W'][0])}, {pg} : index",
        f"  %chk_cols = arith.cmpi eq, {c.dim(*uses['N'][0])}, %chk_keys : index",
    ]
    c.check("%chk_cols", "bias must have a column per gathered key row (block_table's width x the page size)")


def _check_clamp_target(c: _Checks) -> None:
    """A table with slots needs a page to clamp its ids onto."""
    rows, width, pages = c.dim("block_table", 0), c.dim("block_table", 1), c.dim("k_cache", 0)
    c.lines += [
        f"  %chk_slots = arith.muli {rows}, {width} : index",
        "  %chk_none = arith.cmpi eq, %chk_slots, %chk_c0 : index",
        f"  %chk_some = arith.cmpi ugt, {pages}, %chk_c0 : index",
        "  %chk_clamp = arith.ori %chk_none, %chk_some : i1",
    ]
    c.consts.add(0)
    c.check("%chk_clamp", "k_cache has no page for the block table's ids to be clamped onto")


def _check_merge_any(c: _Checks, entries: int) -> None:
    """Any split count: q's batch (BO) divides the B entries at least twice."""
    bo = c.dim("q", 0)
    c.lines += [
        f"  %chk_b = arith.constant {entries} : index",
        f"  %chk_rem = arith.remui %chk_b, {bo} : index",
        f"  %chk_two = arith.muli {bo}, %chk_c2 : index",
        "  %chk_div = arith.cmpi eq, %chk_rem, %chk_c0 : index",
        "  %chk_fit = arith.cmpi ule, %chk_two, %chk_b : index",
        "  %chk_splits = arith.andi %chk_div, %chk_fit : i1",
    ]
    c.consts.update((0, 2))
    c.check("%chk_splits", "q's batch must divide the block table's entries at least twice")


def size_checks(kernel: Kernel, args: list, types: Types, same: dict | None = None) -> str:
    """MLIR that fails the call (cf.assert, on the host, before any
    dispatch) where the run-time sizes of `args` break the declaration:
    every use of a dynamic symbol must agree (`same` maps a symbol to the
    one it equals in this variant, as BO to B where no splits merge), and
    a table with slots needs a page to clamp its ids onto. A symbol static
    in `types` is checked by IREE's ABI against the argument's type.
    Where the variant merges any number of splits (BO dynamic, B static),
    BO must divide B at least twice."""
    c = _Checks(kernel)
    uses = _dynamic_uses(args, types, same or {})
    n = 0
    for d, where in uses.items():
        if len(where) < 2:
            continue
        first = c.dim(*where[0])
        for name, axis in where[1:]:
            n += 1
            c.lines.append(f"  %chk_eq{n} = arith.cmpi eq, {c.dim(name, axis)}, {first} : index")
            c.check(f"%chk_eq{n}", f"{name} dim {axis} differs from {where[0][0]} dim {where[0][1]} ({d})")
    names = {t.name for t in args}
    if "HQ" in uses and "HK" in uses:
        _check_heads(c, uses, types)
    if "N" in uses and "W" in uses:
        _check_bias_columns(c, uses, types)
    if {"block_table", "k_cache"} <= names:
        _check_clamp_target(c)
    if types.sym.get("BO") == "?" and isinstance(types.sym.get("B"), int) and "q" in names:
        _check_merge_any(c, types.sym["B"])
    return c.text()


def custom_op_signature(kernel: Kernel, op_name: str) -> str:
    """The iree-turbine CustomOp signature string of `kernel`."""
    params = [f"Tensor{'?' if a.optional else ''} {a.name}" for a in kernel.args]
    params += [f"{a.kind} {a.name}" for a in kernel.attrs]
    results = ", ".join("Tensor" for _ in kernel.results)
    return f"{op_name}({', '.join(params)}) -> ({results})"
