"""Each artifact's ABI as data: what a host that is not this project (C,
C++, Rust, `iree-run-module`) needs to call it. Derived from the kernel
declarations (signature.py) bound for the variant: the function, its
arguments and results in call order with dims, sizes and element types,
its attributes, and the contract the Python runtime otherwise keeps for
its callers (calls/plan.py): the preconditions a call must meet and the
planning it must redo, by id.

Each manifest entry carries its kernel's `abi(kernel)`; the manifest's
top-level "abi" (`abi_docs()`) says once what every name, symbol,
packed scalar, mask and id means, so entries stay small (a build
rewrites the manifest after each artifact). `describe(kernel)` joins the
two, as `turbine-fmha inspect --abi NAME` prints it; docs/abi.md explains
it for C, C++ and Rust hosts.

The meanings are written here once; a test checks that every declared
name has one, so a new argument cannot ship undocumented. Pure data: the
runtime imports this without torch.
"""

from __future__ import annotations

from .append_kernel import AppendKernel
from .signature import (
    FWD,
    KERNEL_ABI,
    Tensor,
    append_attrs,
    append_kernel,
    append_types,
    fwd_attrs,
    fwd_types,
    present,
    shape_of,
    tiles_declaration,
    tiles_types,
)
from .tiles_kernel import TILES_CLASSES, TilesKernel
from .variants import UNBOUNDED, Variant

# The version of this description's layout (not of the kernels: that is
# KERNEL_ABI).
ABI_VERSION = 1

CONVENTION = (
    "IREE coarse-fences (iree.abi.model): the arguments below in order as buffer views, then a wait fence "
    "and a signal fence: `len(args) + 2` arguments. The call returns once the work is queued; the results are "
    "ready when the signal fence is. iree-run-module takes the arguments below only and appends both fences "
    "itself (no wait fence, and a signal fence it waits on). A runtime-API caller pushes both, in C "
    "(iree_runtime_call_*) as in Python: there, push the buffer views, iree.runtime.HalFence(1) (empty: start "
    "at once) and HalFence.create_at(device.create_semaphore(0), 1) into a VmVariantList, call "
    "VmContext.invoke, then wait on the signal fence. The Python bindings' FunctionInvoker "
    "(SystemContext.modules.<module>.<function>) adds no fences and cannot pass them: called with the "
    "buffer arguments alone it fails (expected len(args) + 2 arguments)."
)

SYMBOLS = {
    "B": (
        "kernel entries: sequences, or split-KV entries (sequence b's split j at entry b * n + j, n = merge_splits; "
        "at entry j * BO + b where merge_splits is -1)"
    ),
    "BO": (
        "query sequences (B / merge_splits where the variant merges split-KV entries, else B; where merge_splits "
        "is -1, dynamic: q's batch, and n = B / BO)"
    ),
    "S": "query rows per entry",
    "HQ": "query heads",
    "HK": "KV heads (HQ is a multiple: GQA group HQ / HK)",
    "D": "head dim of q and K",
    "DV": "head dim of V and the output",
    "PG": "rows per page (page_block_size)",
    "NP": "pages in the pools",
    "W": "block-table columns",
    "N": "bias columns: gathered key rows (W * PG; key t of entry b is row kv_shift[b] + t)",
    "B|1": "B, or 1 where the bias broadcasts over entries",
    "HQ|1": "HQ, or 1 where the bias broadcasts over heads",
    "T": "new tokens",
    "TQ": "q rows to rotate (0 for none)",
    "R": "rotary table positions",
    "RH": "rotary table width (rotary_dim / 2)",
    "QR": "query rows, packed over the sequences",
    "KS": "slots of the contiguous key region (PG keys each)",
    "NT": "query tiles",
    "TR": "query rows per tile",
} | {
    f"E{c}": f"entries of chunk class {c} (the last blocks, masked, in the highest class)"
    for c in range(max(TILES_CLASSES) + 1)
}

# By kernel family (Kernel.name of FWD; the appends share one), then name.
MEANINGS = {
    "pagedkv_fwd": {
        "q": "queries [entry, row, head, dim]; rows past seqlen_q[b] are padding (their outputs mean nothing)",
        "k_cache": "K pages, in the variant's page layout (NHD [page, row, head, dim] or HND [page, head, row, dim])",
        "v_cache": "V pages, same layout; column-major V ([page, head, dim, row]) in a _vcol variant",
        "block_table": "page ids per entry: slot j holds gathered key rows j * PG .. j * PG + PG - 1",
        "seqlen_q": "query rows of each entry's sequence (the bottom-right mask aligns on them)",
        "seqlen_k": "keys of each entry's sequence",
        "kv_shift": "gathered row of key 0: key t is row kv_shift[b] + t (0 unless gappy KV or split-KV; may be < 0)",
        "fparams": "packed f32 scalars (see fparams)",
        "iparams": "packed i32 scalars (see iparams)",
        "alibi_slopes": "ALiBi slope per entry and query head",
        "bias": "f32 added to the score of (row, gathered key row)",
        "sinks": "attention-sink logit per query head, joining each row's softmax denominator unscaled",
        # attention results
        "out": "the attention output, softmax(scale_s * q.k + terms) . v, times scale_o",
        "lse": "log-sum-exp of each row's scores in natural units; -inf for a row that sees no key",
        "row_max": "each row's largest score (natural units): with row_sum, what a split-KV merge weighs",
        "row_sum": "sum of exp(score - row_max) over the row's visible keys",
    },
    "pagedkv_append": {
        "k_new": "the new tokens' K rows",
        "v_new": "the new tokens' V rows",
        "slots": "(page, row) of each new token",
        "k_cache": "K pages [page, row, head, dim], written in place",
        "v_cache": "V pages [page, row, head, dim], written in place",
        "q": "query rows to rotate with the new K rows (none: TQ = 0)",
        "k_out": "k_cache with the new rows written (the same buffer: iree.abi.output)",
        "v_out": "v_cache with the new rows written (the same buffer)",
        "k_pos": "each new K row's position in the rotary tables",
        "q_pos": "each q row's position in the rotary tables",
        "rotary_cos": "cos table [position, rotary_dim / 2]",
        "rotary_sin": "sin table [position, rotary_dim / 2]",
        "q_out": "q rotated (the first rotary_dim lanes of each head; the rest copied)",
    },
    "prefill_tiles": {
        "q": "query rows [row, head, dim], the sequences' rows one after another",
        "k_cache": "K pages [page, row, head, dim]",
        "v_cache": "V pages [page, row, head, dim]",
        "slots": "page id of each region slot (clamped into [0, NP))",
        "slot_rows": "rows of that page that hold keys; the rest of the slot reads as zeros",
        "q_rows": "the q row of each tile row (clamped into q; padding rows repeat any row of the tile's sequence)",
        "out_rows": "the tile row (tile * TR + row) whose result is each q row's output",
        **{f"tiles{c}": f"the tile of each entry of class {c}" for c in range(max(TILES_CLASSES) + 1)},
        **{
            f"chunks{c}": (
                f"per KV head h, the chunk of each entry of class {c}: h * (KS * PG / length) + j, chunk j of the "
                f"region viewed as chunks of the class's length (TR * 2^{c} keys; TR in the last class), clamped"
            )
            for c in range(max(TILES_CLASSES) + 1)
        },
        "bounds": "(off, lim) of each last-block entry: row m sees its key n when n <= m + off and n < lim",
        "parts": "each tile's entry in each class, numbered over the classes in order; -1 for none",
        "fparams": "[scale_s]: the softmax scale",
        "out": "the attention output, softmax(scale_s * q.k) . v, at each q row",
        "lse": "log-sum-exp of each row's scores in natural units, [head, row]",
    },
}


def family(decl) -> str:
    """The MEANINGS key of a kernel declaration (signature.Kernel)."""
    if decl.name in (FWD.name, "prefill_tiles"):
        return decl.name
    return "pagedkv_append"


FPARAMS = (
    ("scale_s", "the softmax scale, times the fp8 descales of q and K"),
    ("logits_soft_cap", "cap of s = cap * tanh(s / cap) on the scaled score (_softcap variants; else ignored)"),
    (
        "scale_o",
        "multiplies the normalized output: 1, or the fp8 V descale; static quantization also 1 / (scale_p * out descale)",
    ),
    ("scale_p", "static quantization: probabilities are quantized as fp8(p * scale_p); else ignored"),
)
IPARAMS = (
    (
        "q_start",
        "absolute row of the call's first q row (the mask counts rows from the sequence's first): 0 unless the rows are chunked",
    ),
    ("window_left", "keys left of the diagonal a row sees (UNBOUNDED for no edge)"),
    ("window_right", "keys right of the diagonal a row sees (UNBOUNDED for no edge; 0 for causal)"),
    ("sink_size", "leading keys a row may see past its window's left edge (0 for none; see mask for when)"),
)

# Formulas between backquotes are Python expressions over the names the
# ABI gives (integers; `and`, `or`, chained comparisons), so that a test
# evaluates the very text the manifest and docs/abi.md carry against the
# kernels (tests/test_abi_doc.py). The sink clause is ck_tile's
# IsOutOfSinkBound as mask_visible (mlir/common.mlir.jinja) computes it,
# less its test that the window's left edge lies inside the rows
# (window_left + 1 - shift < seqlen_q): where it fails, every row below
# seqlen_q already has all the keys a sink would add in its window.
MASK_RULE = {
    "none": "row i of entry b sees key t when `0 <= t < seqlen_k[b]`",
    "top_left": (
        "row i of entry b (absolute: q_start + its index in q; rows from seqlen_q[b] on are padding) sees key t "
        "when `0 <= t < seqlen_k[b] and (i - window_left <= t <= i + window_right or (t < sink_size and t <= i + "
        "window_right and i < seqlen_k[b]))`: sink keys count only for rows below seqlen_k[b]"
    ),
    "bottom_right": (
        "row i of entry b (absolute: q_start + its index in q; rows from seqlen_q[b] on are padding) sees key t "
        "when `0 <= t < seqlen_k[b] and (i + shift - window_left <= t <= i + shift + window_right or (t < "
        "sink_size and t <= i + shift + window_right and i < seqlen_k[b]))`, with `shift = seqlen_k[b] - "
        "seqlen_q[b]`: sink keys count only for rows below seqlen_k[b]"
    ),
}


PRECONDITIONS = {
    "slots": (
        "slot j of entry b (0 <= j < W, gathered rows j * PG .. j * PG + PG - 1) holds a page id in [0, NP) "
        "when it holds a key: `max(j * PG, kv_shift[b]) < min(j * PG + PG, kv_shift[b] + seqlen_k[b])`; other "
        "slots may hold anything (ids are clamped into range, their rows masked)"
    ),
    "lengths": (
        "the call requires `seqlen_q[b] >= 0 and seqlen_k[b] >= 0`; kv_shift[b] may be any i32, negative too. "
        "The kernel reads all W * PG gathered rows of entry b (every slot's page) and takes row n as key t = n - "
        "kv_shift[b], masking rows with t outside 0 .. seqlen_k[b] - 1: key t takes part when `0 <= kv_shift[b] "
        "+ t < W * PG` and the mask shows it to the row. A key whose row lies outside the table is absent, not "
        "an error: a split-KV entry (merge_splits, host_merge) keeps its sequence's seqlen_k and sees the keys "
        "of its own columns. To attend to all seqlen_k[b] keys, keep 0 <= kv_shift[b] and kv_shift[b] + "
        "seqlen_k[b] <= W * PG"
    ),
    "windows": "window sides and sink_size in [0, unbounded], unbounded meaning no edge (see mask)",
    "static_tiles": "exactly the sizes B and S that the entry gives (static tiles)",
    "merge_splits": (
        "the B entries are split-KV entries, n = attributes.merge_splits per sequence: entry b * n + j is split j "
        "of sequence b, its seqlen_q and seqlen_k the sequence's, its kv_shift the sequence's minus the split's "
        "first gathered row (negative past split 0: see lengths); q and the results are per sequence (BO = B / n)"
    ),
    "merge_any": (
        "attributes.merge_splits -1: the same for any n of 2 or more that divides B, read from q's batch (BO = B / n "
        "sequences), with the entries split-major: entry j * BO + b is split j of sequence b"
    ),
    "finite_stale_rows": (
        "every V row the kernel reads is finite, also rows that hold no key (past seqlen_k in a sequence's last "
        "page, before kv_shift in its first, and the pages that unused slots name): this variant (v_guard 0, "
        "_nvguard) multiplies them by a probability of 0 without zeroing them first, and 0 x NaN is NaN. Point "
        "unused slots at a page the sequence owns (the Python runtime repeats its first page)"
    ),
    "fp8_kv": "K and V are the bytes (i8) of attributes.kv_dtype values",
    "fp8_static": "q, K, V and the output are the bytes (i8) of attributes.kv_dtype values",
    "append_slots": "every slot (page, row) is in range and no two new tokens share one (the kernel writes where they say)",
    "append_in_place": "k_cache and v_cache are written in place (k_out and v_out are those buffers); they must not alias the new rows",
    "append_rotary": "positions (k_pos, q_pos) within the tables' R rows; attributes.rotary names the pairing",
    "tiles_plan": (
        "the arguments are a plan of calls/tiles.py: each entry's rows see every key of its chunk (and of its last "
        "block, within bounds), each row of a tile belongs to one sequence, and a tile's entries are the keys its "
        "rows see; ids out of range are clamped, so other arguments give wrong results, never reads outside them"
    ),
}

PLANNING = {
    "pad_to_tiles": (
        "pad the batch to B entries (seqlen_q 0, seqlen_k 0, kv_shift 0, page 0) and the rows to S (zeros); run "
        "longer batches or queries as several calls, each call's rows at iparams q_start = its first row; drop "
        "the padding's outputs"
    ),
    "chunk_rows": (
        "any batch and rows in one call; the kernel materializes f32 scores (B * HQ * W * PG * (4 + itemsize) "
        "bytes per query row), so the Python runtime chunks rows to bound them, each chunk at q_start = its "
        "first row"
    ),
    "trim_table": (
        "a table may be cut to the columns a call's rows can see (with a mask that has a right edge, a row's "
        "keys end early): the rest is never computed"
    ),
    "host_merge": (
        "split-KV without a merging variant: run the splits as entries (as merge_splits describes) and merge on "
        "the host: split j weighs row_sum_j * exp(row_max_j - M), M the largest row_max; add sinks once, after "
        "the merge"
    ),
}


def abi_docs() -> dict:
    """What every name and id of the entries' ABIs means (the manifest's
    top-level "abi")."""
    return {
        "abi_version": ABI_VERSION,
        "kernel_abi": KERNEL_ABI,
        "convention": CONVENTION,
        "symbols": SYMBOLS,
        "tensors": MEANINGS,
        "fparams": [{"index": i, "name": n, "meaning": m} for i, (n, m) in enumerate(FPARAMS)],
        "iparams": [{"index": i, "name": n, "meaning": m} for i, (n, m) in enumerate(IPARAMS)],
        "unbounded": UNBOUNDED,
        "mask": MASK_RULE,
        "preconditions": PRECONDITIONS,
        "planning": PLANNING,
    }


def abi(kernel: Variant | AppendKernel | TilesKernel) -> dict:
    """The ABI of an attention variant, an append kernel or a tile
    prefill, as its manifest entry carries it (JSON-ready; the ids and
    names are abi_docs()')."""
    if isinstance(kernel, TilesKernel):
        decl, types, attrs = tiles_declaration(kernel.classes), tiles_types(kernel), {}
        args = [_tensor(t, types) for t in decl.args]
        pre, planning = ["tiles_plan"], []
    elif isinstance(kernel, AppendKernel):
        decl, types, attrs = append_kernel(kernel), append_types(kernel), append_attrs(kernel)
        args = [_tensor(t, types) for t in decl.args]
        pre = ["append_slots", "append_in_place"] + (["append_rotary"] if kernel.rotary != "none" else [])
        planning = []
    else:
        v = kernel
        types, attrs = fwd_types(v), fwd_attrs(v)
        decl = FWD
        args = [_tensor(a, types, a.when) for a in FWD.args if present(v, a)]
        pre = ["slots", "lengths", "windows"]
        pre += (
            ["static_tiles"] * bool(v.batch_tile)
            + ["merge_splits"] * bool(v.merge_splits)
            + ["merge_any"] * v.merge_any
        )
        pre += ["finite_stale_rows"] * (not v.v_guard)
        pre += ["fp8_static"] * v.static_quant + ["fp8_kv"] * bool(v.kv_dtype and not v.static_quant)
        planning = ["pad_to_tiles" if v.batch_tile else "chunk_rows", "trim_table", "host_merge"]
    results = [_tensor(t, types) for t in decl.results]
    return {
        "function": kernel.name,
        "kernel": family(decl),
        "args": args,
        "results": results,
        "sizes": _sizes(args + results, types),
        "attributes": attrs,
        "preconditions": pre,
        "planning": planning,
    }


def describe(kernel: Variant | AppendKernel | TilesKernel) -> dict:
    """abi(kernel) with every name and id spelled out: what `turbine-fmha
    inspect --abi` prints."""
    return join(abi(kernel), abi_docs())


def join(entry: dict, docs: dict) -> dict:
    """An entry's ABI with every name and id spelled out from `docs` (a
    manifest's top-level "abi"): data only, so it reads a manifest as
    written."""
    out = dict(entry, abi_version=docs["abi_version"], kernel_abi=docs["kernel_abi"], convention=docs["convention"])
    for part in ("args", "results"):
        out[part] = [dict(t, meaning=docs["tensors"][entry["kernel"]][t["name"]]) for t in entry[part]]
    out["sizes"] = {s: {"size": n, "meaning": docs["symbols"][s]} for s, n in entry["sizes"].items()}
    if entry["kernel"] == "pagedkv_fwd":  # the packed scalars and the mask rule are the attention's
        out["fparams"], out["iparams"], out["unbounded"] = docs["fparams"], docs["iparams"], docs["unbounded"]
        out["mask"] = docs["mask"][entry["attributes"]["mask"]]
    out["preconditions"] = [docs["preconditions"][p] for p in entry["preconditions"]]
    out["planning"] = [docs["planning"][p] for p in entry["planning"]]
    return out


def as_text(described: dict) -> str:
    """A joined ABI as a C-like signature with its contract, for people."""

    def tensor(t):
        dims = ", ".join(f"{d}={n}" if isinstance(d, str) else str(d) for d, n in zip(t["dims"], t["shape"]))
        extra = f" (with {t['brought_by']})" if t.get("brought_by") else ""
        return f"  {t['name']:<13} {t['dtype']:<4} [{dims}]{extra}\n      {t['meaning']}"

    lines = [f"{described['function']}(", *map(tensor, described["args"]), ") -> (", *map(tensor, described["results"])]
    lines += [")", f"convention: {described['convention']}"]
    for part in ("fparams", "iparams"):
        for p in described.get(part, ()):
            lines.append(f"{part}[{p['index']}] {p['name']}: {p['meaning']}")
    if "unbounded" in described:
        lines.append(f"unbounded: {described['unbounded']}")
        lines.append(f"mask ({described['attributes']['mask']}): {described['mask']}")
    lines.append("attributes: " + ", ".join(f"{k}={v}" for k, v in described["attributes"].items()))
    for part in ("preconditions", "planning"):
        if described[part]:
            lines.append(f"{part}:")
            lines += [f"  - {p}" for p in described[part]]
    return "\n".join(lines)


def _tensor(t: Tensor, types, brought_by: str = "") -> dict:
    out = {
        "name": t.name,
        "dims": list(t.dims_for(types.layout)),
        "shape": shape_of(t, types.sym, types.layout),
        "dtype": types.dtypes[t.dtype],
    }
    if brought_by:
        out["brought_by"] = brought_by
    return out


def _sizes(tensors: list[dict], types) -> dict:
    """Each symbol the tensors use: its size, or "?" (dynamic)."""
    out = {}
    for t in tensors:
        for d in t["dims"]:
            if isinstance(d, str):
                out.setdefault(d, types.sym[d])
    return out
