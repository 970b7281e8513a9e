"""The attention's options, declared once (turbine_fmha/calls/options.py):
the declaration is well formed, every front end takes exactly what it
declares (the eager signature, PagedAttention.plan/run, the torch ops'
schemas, the exported attention, fmha_fwd_kvcache), the public API is the
one outside callers know, the reference takes the same names, and the
docstrings list every option."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.api import conventions, eager
from turbine_fmha.calls import options
from turbine_fmha.calls.options import GROUPS, OPTIONS, REQUIRED

# The public API as outside test suites (vLLM, FlashInfer and flash-attn
# styles) call it, pinned here on purpose: a change to the declaration that
# changes it must change this too.
PAGED_KEYWORDS = {
    "seqstart_q": None,
    "kv_offset": None,
    "min_seqlen_q": 0,
    "out": None,
    "scale": None,
    "mask_type": "none",
    "window_size_left": -1,
    "window_size_right": -1,
    "sink_size": 0,
    "alibi_slopes": None,
    "bias": None,
    "logits_soft_cap": 0.0,
    "sinks": None,
    "v_layout": "row",
    "kv_layout": "NHD",
    "q_scale": None,
    "k_scale": None,
    "v_scale": None,
    "p_scale": None,
    "out_scale": None,
    "num_splits": None,
    "kv_rows_finite": None,
    "return_lse": False,
    "causal": False,
    "softmax_scale": None,
    "window_size": None,
    "device": None,
    "session": None,
}
PLAN_LAYOUT = {
    "num_pages": REQUIRED,
    "page_block_size": REQUIRED,
    "nhead_q": REQUIRED,
    "nhead_k": REQUIRED,
    "hdim": REQUIRED,
    "hdim_v": None,
    "dtype": "f16",
    "kv_dtype": None,
    "seqlen_q": 1,
}
NOT_PLANNED = ("out", "return_lse", "device", "session")
PAGED_OP_SCHEMA = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seqlen_k, Tensor? seqstart_q=None, "
    "Tensor? kv_offset=None, Tensor? alibi_slopes=None, Tensor? bias=None, Tensor? sinks=None, *, int "
    'min_seqlen_q=0, float? scale=None, str mask_type="none", int window_size_left=-1, int window_size_right=-1, '
    'int sink_size=0, float logits_soft_cap=0.0, str v_layout="row", str kv_layout="NHD", float? q_scale=None, '
    "float? k_scale=None, float? v_scale=None, float? p_scale=None, float? out_scale=None, int? num_splits=None, "
    "bool? kv_rows_finite=None, str? device=None, int session=0) -> (Tensor, Tensor)"
)


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_declaration_is_well_formed():
    for front in options.FRONTS:
        opts = options.front(front)
        names = [o.name for o in opts]
        assert len(names) == len(set(names)), f"{front}: a name declared twice"
        positional = [o.positional for o in opts]
        assert positional == sorted(positional, reverse=True), f"{front}: positional options come first"
    for o in OPTIONS:
        assert o.group in GROUPS, o
        assert o.fronts - {options.OP} and o.fronts <= {*options.FRONTS, options.OP}, o
        assert options.OP not in o.fronts or o.fronts & {"eager", "kvcache"}, o
        assert o.kind in ("array", "flag", "scalar")
        assert o.what and o.doc.endswith("."), o
        assert o.default is not REQUIRED or o.positional or o.fronts == {"plan"}, o


def test_public_signatures_are_unchanged():
    """The names, defaults and kinds outside callers use."""
    arrays = ["q", "k_cache", "v_cache", "block_table", "seqlen_k"]
    kw = inspect.Parameter.KEYWORD_ONLY
    pos = inspect.Parameter.POSITIONAL_OR_KEYWORD
    want = [(n, pos, inspect.Parameter.empty) for n in arrays] + [(n, kw, d) for n, d in PAGED_KEYWORDS.items()]
    assert _params(turbine_fmha.fmha_fwd_paged) == want
    assert _params(eager.fmha_fwd_paged) == want
    plan = {n: d for n, _, d in _params(turbine_fmha.PagedAttention.plan)[3:]}
    assert _params(turbine_fmha.PagedAttention.plan)[:3] == [("self", pos, REQUIRED)] + want[3:5]
    assert plan == dict(PLAN_LAYOUT, **{n: d for n, d in PAGED_KEYWORDS.items() if n not in NOT_PLANNED})
    run = _params(turbine_fmha.PagedAttention.run)
    assert run == [("self", pos, REQUIRED)] + want[:3] + [
        ("out", kw, None),
        ("return_lse", kw, False),
        ("sinks", kw, None),
    ]
    kvcache = _params(turbine_fmha.fmha_fwd_kvcache)
    assert kvcache[:4] == want[:3] + [("seqlen_k", pos, None)]
    assert {n: d for n, _, d in kvcache[4:]} == dict(
        cache_seqlens=None, cache_batch_idx=None, **{n: d for n, d in PAGED_KEYWORDS.items()}
    )


@pytest.mark.parametrize("front", ["eager", "run"])
def test_spelled_out_signatures_are_the_declaration(front):
    """fmha_fwd_paged and run keep explicit signatures (Python's own
    argument errors, readable source); `declared` checks them at import,
    and here: every declared option, nothing else, each with its default."""
    fn = {"eager": eager.fmha_fwd_paged, "run": turbine_fmha.PagedAttention.run}[front]
    mine = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    declared = options.parameters(front)
    assert [(p.name, p.kind, p.default) for p in mine if p.kind != p.KEYWORD_ONLY] == [
        (p.name, p.kind, p.default) for p in declared if p.kind != p.KEYWORD_ONLY
    ]
    assert {(p.name, p.default) for p in mine if p.kind == p.KEYWORD_ONLY} == {
        (p.name, p.default) for p in declared if p.kind == p.KEYWORD_ONLY
    }


def test_declared_refuses_a_signature_that_drifts():
    def ok(q, k_cache, v_cache, *, out=None, return_lse=False, sinks=None):
        pass

    options.declared("run")(ok)

    def wrong_default(q, k_cache, v_cache, *, out=None, return_lse=True, sinks=None):
        pass

    def missing(q, k_cache, v_cache, *, out=None, return_lse=False):
        pass

    def extra(q, k_cache, v_cache, *, out=None, return_lse=False, sinks=None, other=None):
        pass

    def swapped(q, v_cache, k_cache, *, out=None, return_lse=False, sinks=None):
        pass

    for fn in (wrong_default, missing, extra, swapped):
        with pytest.raises(TypeError, match=fn.__name__):
            options.declared("run")(fn)

    def partial(q, k_cache, v_cache, *, out=None, **rest):
        pass

    options.declared("run")(partial)  # **rest: the declared signature
    assert _params(partial) == [(p.name, p.kind, p.default) for p in options.parameters("run")]


def test_plan_takes_the_declared_names(trap):
    """plan(**options): the declaration's names, each at its default, and
    Python's errors for others, raised before anything is validated."""
    attn = turbine_fmha.PagedAttention(trap)
    layout = dict(num_pages=4, page_block_size=16, nhead_q=2, nhead_k=1, hdim=32)
    bad_table = np.full((1, 1), 99, np.int32)
    with pytest.raises(TypeError, match=r"PagedAttention.plan\(\) got an unexpected keyword argument 'causall'"):
        attn.plan(bad_table, np.array([5], np.int32), causall=True, **layout)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'out'"):
        attn.plan(bad_table, np.array([5], np.int32), out=None, **layout)
    with pytest.raises(TypeError, match=r"missing 2 required keyword-only arguments: 'nhead_k' and 'hdim'"):
        attn.plan(bad_table, np.array([5], np.int32), num_pages=4, page_block_size=16, nhead_q=2)
    assert set(options.KEYWORDS["plan"]) == set(PLAN_LAYOUT) | set(PAGED_KEYWORDS) - set(NOT_PLANNED)
    table = np.zeros((1, 1), np.int32)
    assert attn.plan(table, np.array([5], np.int32), causal=True, **layout) is attn


def test_torch_op_schemas_derive_from_the_declaration():
    pytest.importorskip("torch")
    from turbine_fmha.api import torch_ops

    assert torch_ops._schema("paged", False) == PAGED_OP_SCHEMA
    for kind, front in (("paged", "eager"), ("kvcache", "kvcache")):
        op = [o for o in options.front(front) if "op" in o.fronts and o.name != "out"]
        assert [n for n, _, _ in torch_ops._SCALARS[kind]] == [o.name for o in op if o.kind != "array"]
        assert torch_ops._positional(kind, False) == tuple(o.name for o in op if o.kind == "array")
    assert torch_ops._schema("kvcache", True).startswith(
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlen_k, Tensor(a!) out, Tensor? cache_batch_idx=None, "
        "Tensor? seqstart_q=None"
    )
    assert torch_ops._SCALARS["kvcache"] == torch_ops._SCALARS["paged"]
    # The compiled route names an unknown keyword as the eager call does.
    for kind, name in (("paged", "fmha_fwd_paged"), ("kvcache", "fmha_fwd_kvcache")):
        with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'causall'"):
            torch_ops.call_op(kind, q=None, k_cache=None, v_cache=None, seqlen_k=None, causall=True)
    with pytest.raises(TypeError, match=r"fmha_fwd_kvcache\(\) got an unexpected keyword argument 'block_table'"):
        torch_ops.call_op("kvcache", q=None, k_cache=None, v_cache=None, seqlen_k=None, block_table=None)


def test_exported_supported_and_unsupported_sets():
    pytest.importorskip("iree.turbine")
    from turbine_fmha.api import exported

    assert exported._UNSUPPORTED == {n: d for n, d in PAGED_KEYWORDS.items() if n not in options.KEYWORDS["exported"]}
    assert set(exported._UNSUPPORTED) == {
        "seqstart_q",
        "kv_offset",
        "min_seqlen_q",
        "out",
        "alibi_slopes",
        "bias",
        "q_scale",
        "k_scale",
        "v_scale",
        "p_scale",
        "out_scale",
        "num_splits",
    }
    assert _params(exported.call_paged) == [(p.name, p.kind, p.default) for p in options.parameters("exported")]
    with pytest.raises(TypeError, match=r"fmha_fwd_paged\(\) got an unexpected keyword argument 'causall'"):
        exported.call_paged(None, None, None, None, None, causall=True)
    with pytest.raises(NotImplementedError, match="num_splits is not supported inside an exported program"):
        exported.call_paged(None, None, None, None, None, num_splits=2)


def test_conventions_from_a_dict():
    """with_conventions: flash-attn's spellings, each at the declared default."""
    assert conventions.SPELLINGS == {n: options.DEFAULTS[n] for n in conventions.SPELLINGS}
    got = conventions.with_conventions({"causal": True, "softmax_scale": 0.5, "sink_size": 4})
    assert got == dict(sink_size=4, scale=0.5, mask_type="bottom_right", window_size_left=-1, window_size_right=0)
    got = conventions.with_conventions({"window_size": (8, 0)})
    assert got == dict(scale=None, mask_type="bottom_right", window_size_left=8, window_size_right=0)
    with pytest.raises(ValueError, match="scale and softmax_scale"):
        conventions.with_conventions({"scale": 1.0, "softmax_scale": 0.5})


def test_reference_takes_the_same_names():
    """The reference keeps its own signature (an independent oracle), with
    the declared names and defaults of every option that shapes the
    result; the others plan the call (num_splits, kv_rows_finite), say
    where results go or where it runs, or are flash-attn's spellings, and
    min_seqlen_q leaves rows out (the tests mask them themselves)."""
    ref = {n: p.default for n, p in inspect.signature(turbine_fmha.fmha_fwd_paged_ref).parameters.items()}
    for name in ("q", "k_cache", "v_cache", "block_table", "seqlen_k"):
        assert ref.pop(name) is inspect.Parameter.empty
    spellings = set(conventions.SPELLINGS) - {"scale", "mask_type", "window_size_left", "window_size_right"}
    shaping = {
        o.name: o.default
        for o in options.front("eager")
        if not o.positional
        and o.group not in ("planning", "outputs", "device")
        and o.name not in spellings | {"min_seqlen_q"}
    }
    assert ref == shaping


def _documented():
    """Public callables, and the declared front end (if any) whose options
    their docstring lists."""
    cls, cache = turbine_fmha.PagedAttention, turbine_fmha.PagedKVCache
    return [
        (turbine_fmha.fmha_fwd_paged, "eager", ()),
        (turbine_fmha.fmha_fwd_kvcache, "kvcache", ()),
        (turbine_fmha.fmha_fwd_paged_async, "eager", ()),
        (cls.plan, "plan", ()),
        (cls.run, "run", ()),
        (cache.attend, "eager", ("k_cache", "v_cache", "block_table", "seqlen_k", "kv_layout")),
        (cls, None, ()),
        (cache, None, ()),
        (cache.allocate, None, ()),
        (cache.fork, None, ()),
        (cache.free, None, ()),
        (cache.seqlen, None, ()),
        (cache.pages, None, ()),
        (cache.append, None, ()),
        (cache.append_batch, None, ()),
        (cache.batch, None, ()),
        (cache.gather, None, ()),
        (turbine_fmha.reshape_and_cache, None, ()),
        (turbine_fmha.flash_attn_with_kvcache, None, ()),
        (turbine_fmha.Session, None, ()),
        (turbine_fmha.export_options, None, ()),
        (turbine_fmha.aligned_zeros, None, ()),
    ]


@pytest.mark.parametrize("fn, front, omit", _documented(), ids=lambda x: getattr(x, "__qualname__", None))
def test_docstrings_list_every_argument(fn, front, omit):
    """help() is enough: every argument by name, with the declared
    options' text (shape and dtype, default, meaning) where they apply."""
    doc = inspect.getdoc(fn)
    assert options.MARKER not in doc
    init = fn.__init__ if inspect.isclass(fn) else fn
    for p in inspect.signature(init).parameters.values():
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            assert f"{p.name}:" in doc, f"{fn.__qualname__}: {p.name} is not documented"
    if front is not None:
        flat = " ".join(doc.split())
        for o in options.front(front):
            if o.name not in omit:
                assert " ".join(o.line().split()) in flat, f"{fn.__qualname__}: {o.name}"
        for o in omit:
            assert f"\n    {o}:" not in doc
        assert max(len(line) for line in options.describe(front).split("\n")) <= options.WIDTH


def test_kv_write_and_flash_op_schemas_take_the_functions_defaults():
    """The KV-write and flash-attn ops' scalars come from their public
    functions' signatures: every keyword default there is the registered
    schema's (window_size as its two sides), so a default changed in the
    function reaches the op."""
    torch = pytest.importorskip("torch")
    import inspect

    from turbine_fmha.api import flash_attn, kv_write, torch_ops  # noqa: F401 (registers the ops)

    for fn, op in (
        (kv_write.reshape_and_cache, torch.ops.turbine_fmha.reshape_and_cache.default),
        (flash_attn.flash_attn_with_kvcache, torch.ops.turbine_fmha.flash_attn_with_kvcache.default),
    ):
        schema = {a.name: a for a in op._schema.arguments}
        for name, p in inspect.signature(fn).parameters.items():
            if p.default is p.empty or name in ("session", "return_softmax_lse"):
                continue
            if isinstance(p.default, tuple):
                got = tuple(schema[f"{name}_{side}"].default_value for side in ("left", "right"))
            else:
                got = schema[name].default_value
            assert got == p.default, (fn.__name__, name)
        assert schema["session"].default_value == 0
