"""The attention call's options, declared once.

`fmha_fwd_paged` takes about thirty options, and several front ends take
them, or some of them: the eager function (`api/eager.py`, front end
"eager"), `fmha_fwd_kvcache` ("kvcache"), `PagedAttention.plan()` and
`.run()` ("plan", "run"), and the attention inside exported programs
("exported", `api/exported.py`); the torch ops that torch.compile traces
into (`api/torch_ops.py`) take those of the first two marked "op". Each
option is an `Option` of `OPTIONS`: its name, type, default, group, the
front ends that take it, and its documentation (shape and dtype, or type
and range, then meaning). What derives from it:

- the functions' signatures (`declared`): one that spells its keywords
  out (fmha_fwd_paged, run) must spell out exactly the declared ones,
  with their defaults (the positional ones in order), checked at import;
  one that takes `**options` (plan, the exported call_paged) gets its
  `__signature__` from here and binds its keywords with `bind`;
- the torch ops' schemas (`torch_ops._SCALARS` and the tensor lists);
- what the exported attention takes, and what it refuses by name;
- the options part of the docstrings (`documented`, `describe`):
  `help(turbine_fmha.fmha_fwd_paged)` lists every option, grouped, with
  its shape, dtype, default and meaning.

The float64 reference (testing/reference.py) is an independent oracle
and keeps its own signature; tests/test_options.py checks that it takes
the same names.

Pure data and string formatting (calls/ is below the API).
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap

# The default of an argument without one.
REQUIRED = inspect.Parameter.empty

# The front ends (functions) that take options. An option's `fronts` may
# also hold "op": the torch ops of the functions that take it (eager's and
# kvcache's) take it too.
FRONTS = ("eager", "kvcache", "plan", "run", "exported")
OP = "op"

# The groups, in the order the docstrings list them, each with what holds
# for all its options.
GROUPS = {
    "arrays": "numpy arrays, torch tensors (in host memory or on the session's GPU), or IREE "
    "DeviceArrays of the session's device; non-contiguous ones are copied",
    "layout": "what the caches look like",
    "modes": "batch mode by default; group (varlen) mode, gappy KV",
    "mask": "ck_tile's generic mask, or flash-attn's spellings of it",
    "score terms": "applied in ck_tile's order (scale, soft-cap, ALiBi or bias, mask); scalars and "
    "float arrays must be finite float32 values",
    "quantization": "fp8 KV caches (fp8 k_cache and v_cache, float16 or bfloat16 q) and fp8 static "
    "quantization (fp8 q, k_cache and v_cache of one format, fp8 output)",
    "planning": "how the call runs; the result is the same",
    "outputs": "what is returned",
    "device": "where the call runs",
}


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    # "array", or the type of a value: "int", "float", "str", "bool",
    # "pair" (two ints), "dtype", "device" or "session".
    type: str
    default: object  # REQUIRED for an argument without one
    group: str  # a key of GROUPS
    fronts: frozenset  # the front ends that take it (FRONTS), and OP
    what: str  # shape and dtype, or type and range
    doc: str  # what it means
    positional: bool = False  # positional (else keyword-only) where it is taken

    @property
    def kind(self) -> str:
        """The kind of option: "array", "flag" (a bool, or None) or "scalar"."""
        return "array" if self.type == "array" else "flag" if self.type == "bool" else "scalar"

    def line(self) -> str:
        """Its documentation: `name: what, default d. doc`."""
        default = "" if self.default is REQUIRED else f", default {self.default!r}"
        return f"{self.name}: {self.what}{default}. {self.doc}"


def _o(name, type, default, group, fronts, what, doc, positional=False) -> Option:
    return Option(name, type, default, group, frozenset(fronts.split()), what, doc, positional)


_PAGED = (
    "[num_pages, page_block_size, nhead_k, {d}] (kv_layout 'NHD') or [num_pages, nhead_k, page_block_size, {d}] ('HND')"
)
_QUANT = "eager kvcache plan op"
_MASKS = "eager kvcache plan op exported"

# fmha_fwd_paged's options in its signature's order (which the torch ops'
# schemas keep), fmha_fwd_kvcache's own after its paged namesakes, and
# plan()'s layout before the options plan() shares.
OPTIONS = (
    _o(
        "q",
        "array",
        REQUIRED,
        "arrays",
        "eager kvcache run op exported",
        "[batch, seqlen_q, nhead_q, hdim] (batch mode) or [total_q, nhead_q, hdim] (group mode, with "
        "seqstart_q); float16, bfloat16, float32, or an fp8 format (static quantization)",
        "The queries. Query head h reads KV head h // (nhead_q // nhead_k) (GQA, MQA).",
        positional=True,
    ),
    _o(
        "k_cache",
        "array",
        REQUIRED,
        "arrays",
        "eager run op exported",
        _PAGED.format(d="hdim") + "; q's dtype, or an fp8 format (ml_dtypes or torch float8_e4m3fn, "
        "float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz) under float16 or bfloat16 q",
        "The key pages. Key t of sequence b is row t % page_block_size of page "
        "block_table[b, t // page_block_size] (t shifted by kv_offset[b] with gappy KV). Host caches "
        "are read in place when C-contiguous and 16-byte aligned, else copied for the call.",
        positional=True,
    ),
    _o(
        "v_cache",
        "array",
        REQUIRED,
        "arrays",
        "eager run op exported",
        _PAGED.format(d="hdim_v") + ", or [num_pages, nhead_k, hdim_v, page_block_size] (v_layout "
        "'col'); k_cache's dtype",
        "The value pages, laid out like k_cache's.",
        positional=True,
    ),
    _o(
        "block_table",
        "array",
        REQUIRED,
        "arrays",
        "eager plan op exported",
        "[batch, max_pages_per_seq], int32 (any integer dtype)",
        "Each sequence's pages, in key order. Slots that hold none of its keys are never read as "
        "keys and may hold anything (-1).",
        positional=True,
    ),
    _o(
        "seqlen_k",
        "array",
        REQUIRED,
        "arrays",
        "eager plan op exported",
        "[batch], int32 >= 0",
        "Keys per sequence. A query row that sees no key gets output 0 and LSE -inf.",
        positional=True,
    ),
    _o(
        "k_cache",
        "array",
        REQUIRED,
        "arrays",
        "kvcache op",
        "[batch_cache, max_seqlen_k, nhead_k, hdim]; q's dtype, or an fp8 format under float16 or bfloat16 q",
        "Non-paged keys: sequence b reads cache row cache_batch_idx[b]. Viewed, without copying, as "
        "pages of the largest of 128, 64, 32, 16 and 1 rows that divides max_seqlen_k and that the "
        "session has kernels for, and run by the paged kernels.",
        positional=True,
    ),
    _o(
        "v_cache",
        "array",
        REQUIRED,
        "arrays",
        "kvcache op",
        "[batch_cache, max_seqlen_k, nhead_k, hdim_v]; k_cache's dtype",
        "Non-paged values, rows as k_cache's.",
        positional=True,
    ),
    _o(
        "seqlen_k",
        "array",
        None,
        "arrays",
        "kvcache op",
        "[batch] int32 in [0, max_seqlen_k], or one int for every sequence",
        "Keys per sequence; None: the whole cache row (max_seqlen_k).",
        positional=True,
    ),
    _o(
        "cache_seqlens",
        "array",
        None,
        "arrays",
        "kvcache",
        "as seqlen_k",
        "flash-attn's name for seqlen_k (pass one of them).",
    ),
    _o(
        "cache_batch_idx",
        "array",
        None,
        "arrays",
        "kvcache op",
        "[batch] int32 in [0, batch_cache)",
        "The cache row each sequence reads; None: row b for sequence b.",
    ),
    _o("num_pages", "int", REQUIRED, "layout", "plan", "int >= 1", "Pages in the caches (their dim 0)."),
    _o("page_block_size", "int", REQUIRED, "layout", "plan", "int >= 1", "Rows (keys) per page."),
    _o("nhead_q", "int", REQUIRED, "layout", "plan", "int >= 1", "Query heads, a multiple of nhead_k."),
    _o("nhead_k", "int", REQUIRED, "layout", "plan", "int >= 1", "KV heads."),
    _o("hdim", "int", REQUIRED, "layout", "plan", "int >= 1", "The head dim of q and K."),
    _o("hdim_v", "int", None, "layout", "plan", "int >= 1", "The head dim of V; None: hdim."),
    _o(
        "dtype",
        "dtype",
        "f16",
        "layout",
        "plan",
        "a numpy or torch dtype, or 'f16', 'bf16', 'f32'",
        "q's dtype; an fp8 format is fp8 static quantization.",
    ),
    _o(
        "kv_dtype",
        "dtype",
        None,
        "layout",
        "plan",
        "an fp8 format (numpy or torch dtype)",
        "The caches' dtype where it is not q's: an fp8 KV cache. None: q's dtype.",
    ),
    _o(
        "seqlen_q",
        "int",
        1,
        "modes",
        "plan",
        "int >= 0",
        "Batch mode: the query rows of each sequence (q's dim 1). Group mode takes seqstart_q instead.",
    ),
    _o(
        "seqstart_q",
        "array",
        None,
        "modes",
        "eager kvcache plan op",
        "[batch + 1], int32",
        "Group (varlen) mode: q is [total_q, nhead_q, hdim] and sequence b owns its rows "
        "seqstart_q[b]:seqstart_q[b + 1] (starts at 0, non-decreasing, ends at total_q). Decodes and "
        "prefills may share a call. Output [total_q, nhead_q, hdim_v], LSE [nhead_q, total_q].",
    ),
    _o(
        "kv_offset",
        "array",
        None,
        "modes",
        "eager kvcache plan op",
        "[batch], int32 >= 0",
        "Gappy KV (ck_tile's kv_l2p_offset): the first kv_offset[b] table positions of sequence b are "
        "skipped, so key t is at table position kv_offset[b] + t. Mask and ALiBi positions still count "
        "from t = 0.",
    ),
    _o(
        "min_seqlen_q",
        "int",
        0,
        "modes",
        "eager kvcache plan op",
        "int >= 0",
        "Group mode only (ck_tile's skip_min_seqlen_q): sequences with seqlen_q <= min_seqlen_q are "
        "skipped; their rows keep out's values (0 without out) and their LSE is -inf.",
    ),
    _o(
        "out",
        "array",
        None,
        "outputs",
        "eager kvcache run op",
        "an array of the output's shape and dtype (q's kind), C-contiguous",
        "Written in place and returned. It must not share memory with any input (ValueError naming the input).",
    ),
    _o(
        "scale",
        "float",
        None,
        "score terms",
        _MASKS,
        "float",
        "The softmax scale of q.k; None: 1 / sqrt(hdim).",
    ),
    _o(
        "mask_type",
        "str",
        "none",
        "mask",
        _MASKS,
        "'none', 'top_left' or 'bottom_right'",
        "With a mask, query row i of a sequence sees key t when t < seqlen_k and "
        "i + shift - window_size_left <= t <= i + shift + window_size_right, where shift is "
        "seqlen_k - seqlen_q for 'bottom_right' and 0 for 'top_left'. Causal is 'bottom_right' with "
        "window_size_right 0.",
    ),
    _o(
        "window_size_left",
        "int",
        -1,
        "mask",
        _MASKS,
        "int >= -1",
        "Keys a row sees before its diagonal; -1 unbounded, as is any count past every key. Only with a mask.",
    ),
    _o(
        "window_size_right",
        "int",
        -1,
        "mask",
        _MASKS,
        "int >= -1",
        "Keys a row sees after its diagonal; -1 unbounded. Only with a mask.",
    ),
    _o(
        "sink_size",
        "int",
        0,
        "mask",
        _MASKS,
        "int >= 0",
        "StreamingLLM sink tokens: keys t < sink_size stay visible after a local window has slid "
        "past them, up to the row's right bound (ck_tile's IsOutOfSinkBound). Only with a mask.",
    ),
    _o(
        "alibi_slopes",
        "array",
        None,
        "score terms",
        "eager kvcache plan op",
        "[nhead_q] or [batch, nhead_q], float32, finite, of any sign",
        "ALiBi: adds -slope * |i + shift - t| to the scaled score (shift as for the mask); under a "
        "causal mask ck_tile's vertical form +slope * t (same output, another LSE). Not with bias or "
        "logits_soft_cap.",
    ),
    _o(
        "bias",
        "array",
        None,
        "score terms",
        "eager kvcache plan op",
        "[batch or 1, nhead_q or 1, seqlen_q, >= max(seqlen_k)] (batch mode) or [nhead_q or 1, "
        "total_q, >= max(seqlen_k)] (group mode), float32",
        "Added to the scaled scores, broadcast over its size-1 axes. Not with alibi_slopes or logits_soft_cap.",
    ),
    _o(
        "logits_soft_cap",
        "float",
        0.0,
        "score terms",
        _MASKS,
        "float >= 0",
        "A cap > 0 turns the scaled score s into cap * tanh(s / cap); 0 disables it. Not with alibi_slopes or bias.",
    ),
    _o(
        "sinks",
        "array",
        None,
        "score terms",
        "eager kvcache plan run op exported",
        "[nhead_q], float32, finite",
        "Attention-sink logits (gpt-oss): each joins its head's softmax denominator and contributes "
        "no value; LSE includes it, and a row that sees no key gets output 0 and LSE = the sink. A "
        "PagedAttention plan's sinks serve each run that passes none; a run's own replace them (each "
        "layer's weights), and a plan without sinks refuses them.",
    ),
    _o(
        "v_layout",
        "str",
        "row",
        "layout",
        _MASKS,
        "'row' or 'col'",
        "'col' takes column-major V pages [num_pages, nhead_k, hdim_v, page_block_size] (ck_tile's). "
        "Paged caches only.",
    ),
    _o(
        "kv_layout",
        "str",
        "NHD",
        "layout",
        _MASKS,
        "'NHD' or 'HND'",
        "The page layout: 'NHD' [num_pages, page_block_size, nhead_k, hdim], or 'HND' [num_pages, "
        "nhead_k, page_block_size, hdim] (FlashInfer's). Paged caches only.",
    ),
    _o(
        "q_scale",
        "float",
        None,
        "quantization",
        _QUANT,
        "float > 0",
        "Static quantization: q's descale (true Q = q_scale * Q_fp8); None: 1.",
    ),
    _o(
        "k_scale",
        "float",
        None,
        "quantization",
        _QUANT,
        "float > 0",
        "fp8 caches: K's descale (true K = k_scale * K_fp8); None: 1.",
    ),
    _o(
        "v_scale",
        "float",
        None,
        "quantization",
        _QUANT,
        "float > 0",
        "fp8 caches: V's descale (true V = v_scale * V_fp8); None: 1.",
    ),
    _o(
        "p_scale",
        "float",
        None,
        "quantization",
        _QUANT,
        "float > 0",
        "Static quantization: the probabilities (in [0, 1], against the row max) are quantized as "
        "fp8(p * p_scale) before the PV product; None: the format's max.",
    ),
    _o(
        "out_scale",
        "float",
        None,
        "quantization",
        _QUANT,
        "float > 0",
        "Static quantization: the output is saturate(fp8(out / out_scale)); None: 1.",
    ),
    _o(
        "num_splits",
        "int",
        None,
        "planning",
        "eager kvcache plan op",
        "int >= 1",
        "Split-KV: each sequence's keys in this many runs of pages, computed as separate work items "
        "and merged by their row max and sum; 1 disables it. None: ck_tile's heuristic (splits where "
        "the work items fill less than 0.8 of the session's compute_units). Not above 1 with fp8 q.",
    ),
    _o(
        "kv_rows_finite",
        "bool",
        None,
        "planning",
        _MASKS,
        "bool or None",
        "Whether every V row of the caches is finite. GPU kernels read whole pages, stale rows (past "
        "a sequence's keys) included: True is your promise, and the kernels skip zeroing those rows; "
        "None checks them on each call (on torch GPU caches behind the kernels, which run again "
        "guarded if a row was not finite); False always guards. No effect on the CPU.",
    ),
    _o(
        "return_lse",
        "bool",
        False,
        "outputs",
        "eager kvcache run exported",
        "bool",
        "Also return the log-sum-exp of each query row's scores (float32, natural log).",
    ),
    _o(
        "causal",
        "bool",
        False,
        "mask",
        "eager kvcache plan exported",
        "bool",
        "flash-attn's spelling: True is mask_type 'bottom_right' with window_size_right 0. A mask "
        "argument that contradicts it raises ValueError naming both.",
    ),
    _o(
        "softmax_scale",
        "float",
        None,
        "score terms",
        "eager kvcache plan exported",
        "float",
        "flash-attn's name for scale (pass one of them).",
    ),
    _o(
        "window_size",
        "pair",
        None,
        "mask",
        "eager kvcache plan exported",
        "(left, right), two ints >= -1",
        "flash-attn's spelling of window_size_left and window_size_right (not with them), "
        "bottom-right aligned unless mask_type says otherwise.",
    ),
    _o(
        "device",
        "device",
        None,
        "device",
        "eager kvcache op exported",
        "'cpu', 'cuda', 'cuda:N', 'hip', 'hip:N' or a torch.device",
        "The call runs on that device's default session. With session, it may be left out, or must "
        "match the session's ('cuda' matches a session on any GPU). Without either: the CPU.",
    ),
    _o(
        "session",
        "session",
        None,
        "device",
        "eager kvcache op exported",
        "a turbine_fmha.Session",
        "The loaded kernels of one device that run the call. Tensors on another device are refused "
        "by name, never copied across devices.",
    ),
)


def front(name: str) -> tuple[Option, ...]:
    """The options front end `name` takes, in declaration order."""
    if name not in FRONTS:
        raise ValueError(f"no front end {name!r}; the front ends are {FRONTS}")
    return tuple(o for o in OPTIONS if name in o.fronts)


# Each front end's names, and its keyword options with their defaults
# (plain dicts: torch.compile traces the calls that read them).
NAMES = {f: frozenset(o.name for o in front(f)) for f in FRONTS}
KEYWORDS = {f: {o.name: o.default for o in front(f) if not o.positional} for f in FRONTS}
DEFAULTS = {o.name: o.default for o in front("eager")}
# Where results go and where the call runs: no part of a Problem or plan.
CALL_ONLY = frozenset(o.name for o in front("eager") if o.group in ("outputs", "device"))


def names(front_name: str, *, group: str | None = None, kind: str | None = None) -> tuple[str, ...]:
    """The names of front end `front_name`'s options (of `group`, of `kind`)."""
    return tuple(
        o.name for o in front(front_name) if (group is None or o.group == group) and (kind is None or o.kind == kind)
    )


def check(front_name: str, given: dict, where: str) -> None:
    """TypeError, as Python words it, for a name in `given` that front end
    `front_name` does not take; `where` is the call, e.g. "fmha_fwd_paged()"."""
    known = NAMES[front_name]
    for name in given:
        if name not in known:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")


def bind(front_name: str, given: dict, where: str) -> dict:
    """Keyword options `given` of front end `front_name`, every other one at
    its default; TypeError, as Python words it, for a name it does not take
    or a required one missing."""
    known = KEYWORDS[front_name]
    for name in given:
        if name not in known:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
    kw = dict(known)
    kw.update(given)
    missing = [n for n, v in kw.items() if v is REQUIRED]
    if missing:
        quoted = [repr(n) for n in missing]
        listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]
        plural = "s" if len(quoted) > 1 else ""
        raise TypeError(f"{where} missing {len(quoted)} required keyword-only argument{plural}: {listed}")
    return kw


def parameters(front_name: str) -> list[inspect.Parameter]:
    """The parameters front end `front_name` takes, as a signature lists them."""
    return [
        inspect.Parameter(
            o.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD if o.positional else inspect.Parameter.KEYWORD_ONLY,
            default=o.default,
        )
        for o in front(front_name)
    ]


def declared(front_name: str, *, omit: tuple = ()):
    """A decorator: `fn` takes front end `front_name`'s options.

    Every parameter `fn` spells out (but `self` and **options) must be
    declared so, positional or keyword-only, with its default, and the
    positional ones in order. Without **options it must spell out every
    declared one; with it, its `__signature__` adds those it leaves to
    **options (which its body binds, `bind`). A function that differs
    raises TypeError at import: a signature and the declaration cannot
    drift apart. Then `documented`."""

    def wrap(fn):
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != "self"]
        own = [p for p in params if p.kind is not p.VAR_KEYWORD]
        want = parameters(front_name)
        by_name = {p.name: p for p in want}
        for p in own:
            w = by_name.get(p.name)
            if w is None or w.kind != p.kind or w.default != p.default:
                raise TypeError(
                    f"{fn.__qualname__}: parameter {p} differs from calls/options.py's {front_name!r} "
                    f"declaration ({w or 'not declared'})"
                )
        spelled = [p.name for p in own]
        positional = [p.name for p in want if p.kind is p.POSITIONAL_OR_KEYWORD]
        if spelled[: len(positional)] != positional or (len(own) == len(params) and set(spelled) != set(by_name)):
            raise TypeError(
                f"{fn.__qualname__} takes {spelled}; calls/options.py declares {list(by_name)} for {front_name!r}"
            )
        if len(own) < len(params):  # **options: the declared signature
            head = [p for p in sig.parameters.values() if p.name == "self"]
            fn.__signature__ = sig.replace(parameters=head + [sig.parameters.get(p.name, p) for p in want])
        return documented(front_name, omit=omit)(fn)

    return wrap


# The line of a docstring that `documented` replaces with the options.
MARKER = "Args: declared in turbine_fmha/calls/options.py."


def documented(front_name: str, *, omit: tuple = (), extra: tuple = ()):
    """A decorator: the line MARKER of `fn`'s docstring, if it has one,
    becomes the Args section of front end `front_name`'s options
    (`describe`), less `omit`, with the function's own `extra` Options."""

    def wrap(fn):
        lines = (fn.__doc__ or "").split("\n")
        at = [i for i, line in enumerate(lines) if line.strip() == MARKER]
        if len(at) > 1:
            raise ValueError(f"{fn.__qualname__}'s docstring has {MARKER!r} {len(at)} times")
        if not at:
            return fn
        line = lines[at[0]]
        indent = line[: len(line) - len(line.lstrip())]
        text = describe(front_name, omit=omit, extra=extra)
        lines[at[0]] = "\n".join(indent + t if t else t for t in text.split("\n"))
        fn.__doc__ = "\n".join(lines)
        return fn

    return wrap


WIDTH = 72


def describe(front_name: str, *, omit: tuple = (), extra: tuple = ()) -> str:
    """The Args section of front end `front_name`'s options (less `omit`,
    and `extra` Options after them), grouped as GROUPS lists them."""
    opts = [o for o in front(front_name) if o.name not in omit] + list(extra)
    out = ["Args:"]
    for group, intro in GROUPS.items():
        members = [o for o in opts if o.group == group]
        if not members:
            continue
        out += _wrap(f"{group[0].upper()}{group[1:]}: {intro}.", "  ", "      ")
        for o in members:
            out += _wrap(o.line(), "    ", "        ")
    return "\n".join(out)


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False
    )
