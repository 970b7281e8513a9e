"""`torch.ops.turbine_fmha`: the attention and the KV writes as torch
custom ops, so that a module calling them compiles under
`torch.compile(fullgraph=True)`.

    fmha_fwd_paged(q, k_cache, v_cache, block_table, seqlen_k, seqstart_q, kv_offset,
                   alibi_slopes, bias, sinks, *, <scalars>) -> (out, lse)
    fmha_fwd_paged_out(q, k_cache, v_cache, block_table, seqlen_k, out, ...) -> lse
    fmha_fwd_kvcache(q, k_cache, v_cache, seqlen_k, cache_batch_idx, seqstart_q, ...) -> (out, lse)
    fmha_fwd_kvcache_out(q, k_cache, v_cache, seqlen_k, out, cache_batch_idx, ...) -> lse
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, q, rotary_cos, ...) -> q rotated
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, ...) -> (out, lse)

The scalars are the public functions' keyword arguments that are not
arrays (the `_SCALARS` tables; the schemas are made from them; the
attention's from the declaration of its options, calls/options.py),
`session` among them as an int handle (`session_handle`: the Session's
id, 0 for the default session of `device`): a Session cannot cross an op
schema. The `_out` forms write `out` in place, and the KV writes the
caches (mutates_args). The ops are opaque to dynamo: their implementations are
the eager functions, and their fake implementations give the results'
shapes (for the attention from the Layout of the Problem code,
`result_shapes`). The public functions route through them while
torch.compile traces (tracing.compiling), so one call works compiled and
eager, and every check of the eager call runs when the op runs: its
errors keep their types under fullgraph=True too.

The kernels have no backward: every op refuses a tensor that requires grad
while grad mode is on, by name and before anything runs (`_refusing_grad`),
never silently detaching it. Importing this module imports torch and
torch._dynamo (about a second, once) and registers the ops.
"""

from __future__ import annotations

import inspect
import itertools

import torch

from ..calls import options
from ..calls.problem import layout_of_arrays
from ..core.arrays import torch_np_dtype
from ..core.tracing import check_no_grad
from ..runtime.session import LIVE_SESSIONS, Session
from . import eager, flash_attn, kv_write
from .conventions import kvcache_seqlens, with_conventions

# Each attention op kind's public function: its front end in the
# declaration of the options (calls/options.py), and its name.
_FRONT = {"paged": "eager", "kvcache": "kvcache"}
_PUBLIC = {"paged": "fmha_fwd_paged", "kvcache": "fmha_fwd_kvcache"}
# The schema type of each option type. A Session crosses a schema as its
# int handle (session_handle; 0: the default session of `device`).
_SCHEMA_TYPES = {"int": "int", "float": "float", "str": "str", "bool": "bool", "device": "str", "session": "int"}


def _declared(kind: str, tensors: bool, positional: bool | None = None) -> tuple:
    """The declared options the `kind` ops take: their tensors (positional
    in the public function, or not) or their other arguments. `out` is
    the _out forms' own."""
    return tuple(
        o
        for o in options.front(_FRONT[kind])
        if options.OP in o.fronts
        and (o.kind == "array") == tensors
        and o.name != "out"
        and (positional is None or o.positional == positional)
    )


def _scalar(o: options.Option) -> tuple:
    if o.type == "session":
        return o.name, _SCHEMA_TYPES[o.type], 0
    return o.name, _SCHEMA_TYPES[o.type] + ("?" if o.default is None else ""), o.default


# The tensors, required and optional, of each kind.
_TENSORS = {kind: tuple(o.name for o in _declared(kind, True, True)) for kind in _FRONT}
_OPTIONAL = {kind: tuple(o.name for o in _declared(kind, True, False)) for kind in _FRONT}
# (name, schema type, default) of every other argument the ops pass on.
_SCALARS = {kind: tuple(_scalar(o) for o in _declared(kind, False)) for kind in _FRONT}
# Window sides and sink counts past every key all mean "every key" (mask.py
# clamps them); an op's int is 64-bit, so larger ones are clamped here.
_INT_MAX = 1 << 62


def _op_schema(required: tuple, optional: tuple, scalars: tuple, returns: str, mutated: tuple = ()) -> str:
    """A schema: the tensors positional (custom ops take no keyword-only
    tensors), the optional ones defaulting to None, then the scalars."""
    alias = {n: f"({chr(ord('a') + i)}!)" for i, n in enumerate(mutated)}
    tensors = [f"Tensor{alias.get(n, '')} {n}" for n in required] + [f"Tensor? {n}=None" for n in optional]
    values = [
        f"{t} {n}=" + ("None" if d is None else f'"{d}"' if isinstance(d, str) else repr(d)) for n, t, d in scalars
    ]
    return f"({', '.join(tensors)}, *, {', '.join(values)}) -> {returns}"


def _named(names: tuple, scalars: tuple, args: tuple, kwargs: dict) -> dict:
    """An op call's arguments by name, defaults filled in (the dispatcher
    leaves out keyword arguments at their defaults)."""
    kw = dict.fromkeys(names)
    kw.update((n, d) for n, _, d in scalars)
    kw.update(zip(names, args))
    kw.update(kwargs)
    return kw


def _positional(kind: str, out_form: bool) -> tuple:
    """The attention ops' tensor arguments in schema order."""
    return _TENSORS[kind] + (("out",) if out_form else ()) + _OPTIONAL[kind]


def _schema(kind: str, out_form: bool) -> str:
    out = ("out",) if out_form else ()
    return _op_schema(
        _TENSORS[kind] + out,
        _OPTIONAL[kind],
        _SCALARS[kind],
        "Tensor" if out_form else "(Tensor, Tensor)",
        mutated=out,
    )


def _arguments(kind: str, out_form: bool, args: tuple, kwargs: dict) -> dict:
    return _named(_positional(kind, out_form), _SCALARS[kind], args, kwargs)


def _impl(kind: str, out_form: bool):
    def run(*args, **kwargs):
        kw = _arguments(kind, out_form, args, kwargs)
        kw["session"] = _session(kw["session"])
        fn = eager.fmha_fwd_paged if kind == "paged" else eager.fmha_fwd_kvcache
        out, lse = fn(**kw, return_lse=True)
        # An op's results are new tensors in the fake's (contiguous) layout.
        return lse.contiguous() if out_form else (out.contiguous(), lse.contiguous())

    return run


def _fake(kind: str, out_form: bool):
    def fake(*args, **kwargs):
        kw = _arguments(kind, out_form, args, kwargs)
        q = kw["q"]
        out_shape, lse_shape = result_shapes(
            q,
            kw["k_cache"],
            kw["v_cache"],
            v_layout=kw["v_layout"],
            kv_layout=kw["kv_layout"],
            group=kw["seqstart_q"] is not None,
        )
        lse = q.new_empty(lse_shape, dtype=torch.float32)
        return lse if out_form else (q.new_empty(out_shape), lse)

    return fake


class _Meta:
    """shape / ndim / numpy dtype of a (fake) tensor for layout_of_arrays.
    Unlike arrays.TensorInfo it keeps symbolic sizes symbolic: a batch or
    query length that varies does not pin the compiled graph to one."""

    def __init__(self, t):
        self.shape, self.ndim, self.dtype = tuple(t.shape), t.dim(), torch_np_dtype(t.dtype)


def result_shapes(
    q, k_cache, v_cache, *, v_layout: str = "row", kv_layout: str = "NHD", group: bool = False
) -> tuple[tuple, tuple]:
    """(out shape, LSE shape) of a call: out is q's rows by hdim_v; LSE is
    [batch, nhead_q, seqlen_q], or [nhead_q, total_q] in group mode. From
    the Layout, which checks q and the caches on the way."""
    layout = layout_of_arrays(_Meta(q), _Meta(k_cache), _Meta(v_cache), v_layout, group, kv_layout)
    return layout.result_shapes(q.shape, group)


# The ops are defined on torch.library's Library rather than with
# custom_op: custom_op registers an autograd kernel of its own that torch
# 2.11 does not let another replace, and it cannot be given one that
# refuses inputs requiring grad for a mutating op (_refusing_grad).
_LIB = torch.library.Library("turbine_fmha", "DEF")


def _define(name: str, schema: str, impl, fake, tensors: tuple):
    """turbine_fmha::<name>: `impl` on every device, `fake` for tracing,
    and the autograd kernel that refuses tensors requiring grad."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"turbine_fmha::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.turbine_fmha, name).default
    _LIB.impl(name, _refusing_grad(op, tensors), "Autograd", with_keyset=True)
    return op


def _refusing_grad(op, names: tuple):
    """The ops' autograd kernel: an input that requires grad while grad
    mode is on is refused by name before anything runs (an _out op would
    have written out, and the outputs' backward would fail later);
    otherwise the call goes on below autograd, its results needing none."""

    def kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled():
            check_no_grad(dict(zip(names, args)), grad_mode=True)
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    return kernel


_OPS = {
    (kind, out_form): _define(
        f"fmha_fwd_{kind}" + ("_out" if out_form else ""),
        _schema(kind, out_form),
        _impl(kind, out_form),
        _fake(kind, out_form),
        _positional(kind, out_form),
    )
    for kind, out_form in itertools.product(("paged", "kvcache"), (False, True))
}


# -- KV writes -------------------------------------------------------------

# The schema types of the defaults the KV-write and flash-attn functions
# declare; a default of None takes its (optional) type from the caller.
_DEFAULT_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


def _signature_scalars(fn, tensors: tuple, none_types: dict, skip: tuple = ()) -> tuple:
    """(name, schema type, default) of `fn`'s keyword arguments that are
    not tensors, in its order, with its own defaults: a pair default
    (flash-attn's window_size) becomes `<name>_left` and `<name>_right`,
    and `session`, last, crosses as its int handle (session_handle)."""
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if name in tensors or name in skip or name == "session" or p.default is p.empty:
            continue
        if isinstance(p.default, tuple):
            out += [(f"{name}_{side}", _DEFAULT_TYPES[type(d)], d) for side, d in zip(("left", "right"), p.default)]
        elif p.default is None:
            out.append((name, none_types[name] + "?", None))
        else:
            out.append((name, _DEFAULT_TYPES[type(p.default)], p.default))
    return (*out, ("session", "int", 0))


_WRITE_TENSORS = ("k", "v", "k_cache", "v_cache", "slot_mapping")
_WRITE_OPTIONAL = ("q", "rotary_cos", "rotary_sin", "seqlen_k", "seqstart", "seqstart_q")
_WRITE_SCALARS = _signature_scalars(
    kv_write.reshape_and_cache, _WRITE_TENSORS + _WRITE_OPTIONAL, {"rotary_dim": "int", "device": "str"}
)


def _write_impl(*args, **kwargs):
    kw = _named(_WRITE_TENSORS + _WRITE_OPTIONAL, _WRITE_SCALARS, args, kwargs)
    kw["session"] = _session(kw["session"])
    rotated = kv_write.reshape_and_cache(**kw)
    # An op returns a tensor: q rotated, or an empty one without q.
    return kw["k"].new_empty(0) if rotated is None else rotated.contiguous()


def _write_fake(*args, **kwargs):
    kw = _named(_WRITE_TENSORS + _WRITE_OPTIONAL, _WRITE_SCALARS, args, kwargs)
    return kw["k"].new_empty(0) if kw["q"] is None else kw["q"].new_empty(kw["q"].shape)


_WRITE_OP = _define(
    "reshape_and_cache",
    _op_schema(_WRITE_TENSORS, _WRITE_OPTIONAL, _WRITE_SCALARS, "Tensor", mutated=("k_cache", "v_cache")),
    _write_impl,
    _write_fake,
    _WRITE_TENSORS + _WRITE_OPTIONAL,
)


def call_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, *, session=None, **kw):
    """reshape_and_cache through its op: its route while torch.compile
    traces it. Returns q rotated, or None without q."""
    tensors = dict(
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
        **{n: kw.pop(n, None) for n in _WRITE_OPTIONAL},
    )
    _torch_tensors_only(tensors)
    rotated = _WRITE_OP(**tensors, **kw, session=session_handle(session))
    return None if tensors["q"] is None else rotated


# -- flash-attn's in-call appends ------------------------------------------

_FLASH_TENSORS = ("q", "k_cache", "v_cache")
_FLASH_OPTIONAL = (
    "k",
    "v",
    "rotary_cos",
    "rotary_sin",
    "cache_seqlens",
    "cache_batch_idx",
    "cache_leftpad",
    "block_table",
    "alibi_slopes",
)
# The op always returns the LSE; call_flash_attn drops it where not asked for.
_FLASH_SCALARS = _signature_scalars(
    flash_attn.flash_attn_with_kvcache,
    _FLASH_TENSORS + _FLASH_OPTIONAL,
    {"softmax_scale": "float", "device": "str"},
    skip=("return_softmax_lse",),
)


def _flash_impl(*args, **kwargs):
    kw = _named(_FLASH_TENSORS + _FLASH_OPTIONAL, _FLASH_SCALARS, args, kwargs)
    kw["session"] = _session(kw["session"])
    kw["window_size"] = (kw.pop("window_size_left"), kw.pop("window_size_right"))
    out, lse = flash_attn.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    return out.contiguous(), lse.contiguous()


def _flash_fake(*args, **kwargs):
    kw = _named(_FLASH_TENSORS + _FLASH_OPTIONAL, _FLASH_SCALARS, args, kwargs)
    q = kw["q"]
    batch, rows, heads = q.shape[:3]
    return q.new_empty((batch, rows, heads, kw["v_cache"].shape[-1])), q.new_empty(
        (batch, heads, rows), dtype=torch.float32
    )


_FLASH_OP = _define(
    "flash_attn_with_kvcache",
    _op_schema(_FLASH_TENSORS, _FLASH_OPTIONAL, _FLASH_SCALARS, "(Tensor, Tensor)", mutated=("k_cache", "v_cache")),
    _flash_impl,
    _flash_fake,
    _FLASH_TENSORS + _FLASH_OPTIONAL,
)


def call_flash_attn(**given):
    """flash_attn_with_kvcache while torch.compile traces it: with in-call
    appends through its op (they need the tables' values, which only the
    op's eager run has), else as the attention call it maps to."""
    kw = dict(_FLASH_DEFAULTS, **given)
    if not flash_attn.appends(kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"]):
        kind, args, attn = flash_attn.attention_call(**{n: kw[n] for n in _ATTENTION_CALL_ARGS})
        return call_op(kind, **dict(zip(_POSITIONAL[kind], args)), **attn)
    tensors = {n: kw[n] for n in _FLASH_TENSORS + _FLASH_OPTIONAL}
    if isinstance(tensors["cache_seqlens"], int):
        tensors["cache_seqlens"] = torch.full((kw["q"].shape[0],), tensors["cache_seqlens"], dtype=torch.int64)
    _torch_tensors_only(tensors)
    left, right = (-1, -1) if kw["window_size"] is None else kw["window_size"]
    scalars = {n: kw[n] for n, _, _ in _FLASH_SCALARS if n not in ("window_size_left", "window_size_right", "session")}
    out, lse = _FLASH_OP(
        **tensors, **scalars, window_size_left=left, window_size_right=right, session=session_handle(kw["session"])
    )
    return (out, lse) if kw["return_softmax_lse"] else out


_FLASH_DEFAULTS = {
    n: p.default
    for n, p in inspect.signature(flash_attn.flash_attn_with_kvcache).parameters.items()
    if p.default is not p.empty
}
_ATTENTION_CALL_ARGS = tuple(inspect.signature(flash_attn.attention_call).parameters)
# The positional arguments of the attention calls attention_call maps to.
_POSITIONAL = {"paged": _TENSORS["paged"], "kvcache": _TENSORS["kvcache"]}


def session_handle(session) -> int:
    """The int that stands for `session` in an op call: 0 for None (the
    default session of the call's device), else id(session). Traced, this
    runs as plain code: dynamo folds id() of an object from outside the
    compiled region into a constant and guards on the object's identity
    (torch 2.11 and 2.13 alike, unlike assume_constant_result, which 2.11
    refuses a Session). Every Session is in runtime.LIVE_SESSIONS from its
    creation, so the op finds it by that int."""
    if session is None:
        return 0
    if not isinstance(session, Session):
        raise TypeError(f"session must be a turbine_fmha.Session, got {type(session).__name__}")
    return id(session)


def _session(handle: int) -> Session | None:
    if handle == 0:
        return None
    session = LIVE_SESSIONS.get(handle)
    if session is None:
        raise RuntimeError(
            f"session handle {handle} names no live turbine_fmha.Session (it was garbage-collected, "
            "or the int is no session_handle): keep the Session alive as long as the compiled "
            "code that uses it"
        )
    return session


def call_paged(**kw):
    """fmha_fwd_paged while torch.compile traces it."""
    return call_op("paged", **kw)


def call_kvcache(q, k_cache, v_cache, seqlen_k=None, *, cache_seqlens=None, **kw):
    """fmha_fwd_kvcache while torch.compile traces it (an int key count
    becomes a tensor in the graph)."""
    seqlen_k = kvcache_seqlens(q, k_cache, seqlen_k, cache_seqlens, kw.get("seqstart_q"))
    return call_op("kvcache", q=q, k_cache=k_cache, v_cache=v_cache, seqlen_k=seqlen_k, **kw)


def call_op(kind: str, **given):
    """fmha_fwd_paged (kind "paged") or fmha_fwd_kvcache ("kvcache")
    through the op: the public functions' route while torch.compile traces
    them, with their arguments by name (checked against the declaration,
    as the eager call's signature checks them)."""
    where = _PUBLIC[kind] + "()"
    options.check(_FRONT[kind], given, where)
    for name in _TENSORS[kind]:
        if name not in given:
            raise TypeError(f"{where} missing required argument {name!r}")
    kw = with_conventions(given)
    out = kw.pop("out", None)
    return_lse = kw.pop("return_lse", False)
    session = kw.pop("session", None)
    device = kw.pop("device", None)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    tensors = {n: kw.pop(n, None) for n in _positional(kind, False)}
    _torch_tensors_only(dict(tensors, out=out))
    check_no_grad(dict(tensors, out=out))
    for name in ("window_size_left", "window_size_right", "sink_size"):
        if isinstance(kw.get(name), int) and kw[name] > _INT_MAX:
            kw[name] = _INT_MAX
    kw.update(session=session_handle(session), device=device)
    if out is None:
        out, lse = _OPS[kind, False](**tensors, **kw)
    else:
        lse = _OPS[kind, True](**tensors, out=out, **kw)
    return (out, lse) if return_lse else out


def _torch_tensors_only(arrays: dict) -> None:
    for name, t in arrays.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch tensor in a torch.compile'd call (numpy arrays and IREE "
                f"DeviceArrays are for eager calls), got {type(t).__name__}"
            )
