"""`torch.ops.turbine_fmha`: the attention as torch custom ops, so that a
module calling it compiles under `torch.compile(fullgraph=True)`.

    fmha_fwd_paged(q, k_cache, v_cache, block_table, seqlen_k, seqstart_q, kv_offset,
                   alibi_slopes, bias, sinks, *, <scalars>) -> (out, lse)
    fmha_fwd_paged_out(q, k_cache, v_cache, block_table, seqlen_k, out, ...) -> lse
    fmha_fwd_kvcache(q, k_cache, v_cache, seqlen_k, cache_batch_idx, seqstart_q, ...) -> (out, lse)
    fmha_fwd_kvcache_out(q, k_cache, v_cache, seqlen_k, out, cache_batch_idx, ...) -> lse

The scalars are fmha_fwd_paged's keyword arguments that are not arrays
(`_SCALARS`; the schemas are made from these tables), plus `session`, an
int handle (`session_handle`: the Session's id, 0 for the default
session of `device`): a Session cannot cross an op schema. The `_out`
forms write `out` in place (mutates_args). The ops are opaque to dynamo:
their implementations are the eager fmha_fwd_paged / fmha_fwd_kvcache,
and their fake implementations give the results' shapes from the Layout
of the Problem code (`result_shapes`). The public functions route
through them while torch.compile traces (api._compiling), so one call
works compiled and eager.

The kernels have no backward: tensors that require grad are refused by
name while grad mode is on (`check_no_grad`), never silently detached.
Importing this module imports torch and torch._dynamo (about a second, once)
and registers the ops; eager calls import it only to refuse a tensor that
requires grad.
"""

from __future__ import annotations

import itertools

import torch

from . import api
from .arrays import _torch_np_dtype
from .flash_attn import conventions
from .problem import layout_of_arrays
from .runtime import LIVE_SESSIONS, Session

_TENSORS = {"paged": ("q", "k_cache", "v_cache", "block_table", "seqlen_k"),
            "kvcache": ("q", "k_cache", "v_cache", "seqlen_k")}
_OPTIONAL = {"paged": (), "kvcache": ("cache_batch_idx",)}
_OPTIONAL_BOTH = ("seqstart_q", "kv_offset", "alibi_slopes", "bias", "sinks")
# (name, schema type, default) of every other argument the ops pass on.
_SCALARS = (
    ("min_seqlen_q", "int", 0), ("scale", "float?", None), ("mask_type", "str", "none"),
    ("window_size_left", "int", -1), ("window_size_right", "int", -1), ("sink_size", "int", 0),
    ("logits_soft_cap", "float", 0.0), ("v_layout", "str", "row"), ("kv_layout", "str", "NHD"),
    ("q_scale", "float?", None),
    ("k_scale", "float?", None), ("v_scale", "float?", None), ("p_scale", "float?", None),
    ("out_scale", "float?", None), ("num_splits", "int?", None), ("kv_rows_finite", "bool?", None),
    ("device", "str", "cpu"), ("session", "int", 0),
)
_DEFAULTS = {name: default for name, _, default in _SCALARS}
# Window sides and sink counts past every key all mean "every key" (mask.py
# clamps them); an op's int is 64-bit, so larger ones are clamped here.
_INT_MAX = 1 << 62


def _positional(kind: str, out_form: bool) -> tuple:
    """The ops' tensor arguments in schema order (tensors cannot be
    keyword-only in a custom op)."""
    return _TENSORS[kind] + (("out",) if out_form else ()) + _OPTIONAL[kind] + _OPTIONAL_BOTH


def _schema(kind: str, out_form: bool) -> str:
    required = _TENSORS[kind] + (("out",) if out_form else ())
    tensors = [f"Tensor(a!) {n}" if n == "out" else f"Tensor {n}" for n in required]
    tensors += [f"Tensor? {n}=None" for n in _OPTIONAL[kind] + _OPTIONAL_BOTH]
    scalars = [f"{t} {n}=" + ("None" if d is None else f'"{d}"' if isinstance(d, str) else repr(d))
               for n, t, d in _SCALARS]
    return f"({', '.join(tensors)}, *, {', '.join(scalars)}) -> " + ("Tensor" if out_form else "(Tensor, Tensor)")


def _arguments(kind: str, out_form: bool, args: tuple, kwargs: dict) -> dict:
    """An op call's arguments by name, defaults filled in (the dispatcher
    leaves out keyword arguments at their defaults)."""
    names = _positional(kind, out_form)
    kw = dict.fromkeys(names)
    kw.update(_DEFAULTS)
    kw.update(zip(names, args))
    kw.update(kwargs)
    return kw


def _impl(kind: str, out_form: bool):
    def run(*args, **kwargs):
        kw = _arguments(kind, out_form, args, kwargs)
        kw["session"] = _session(kw["session"])
        fn = api.fmha_fwd_paged if kind == "paged" else api.fmha_fwd_kvcache
        out, lse = fn(**kw, return_lse=True)
        # An op's results are new tensors in the fake's (contiguous) layout.
        return lse.contiguous() if out_form else (out.contiguous(), lse.contiguous())

    return run


def _fake(kind: str, out_form: bool):
    def fake(*args, **kwargs):
        kw = _arguments(kind, out_form, args, kwargs)
        q = kw["q"]
        out_shape, lse_shape = result_shapes(q, kw["k_cache"], kw["v_cache"], v_layout=kw["v_layout"],
                                             kv_layout=kw["kv_layout"], group=kw["seqstart_q"] is not None)
        lse = q.new_empty(lse_shape, dtype=torch.float32)
        return lse if out_form else (q.new_empty(out_shape), lse)

    return fake


class _Meta:
    """shape / ndim / numpy dtype of a (fake) tensor for layout_of_arrays.
    Unlike arrays._TensorInfo it keeps symbolic sizes symbolic: a batch or
    query length that varies does not pin the compiled graph to one."""

    def __init__(self, t):
        self.shape, self.ndim, self.dtype = tuple(t.shape), t.dim(), _torch_np_dtype(t.dtype)


def result_shapes(q, k_cache, v_cache, *, v_layout: str = "row", kv_layout: str = "NHD",
                  group: bool = False) -> tuple[tuple, tuple]:
    """(out shape, LSE shape) of a call: out is q's rows by hdim_v; LSE is
    [batch, nhead_q, seqlen_q], or [nhead_q, total_q] in group mode. From
    the Layout, which checks q and the caches on the way."""
    layout = layout_of_arrays(_Meta(q), _Meta(k_cache), _Meta(v_cache), v_layout, group, kv_layout)
    return layout.result_shapes(q.shape, group)


def _refuse_grad(kind: str):
    """setup_context of the functional ops: torch calls it, after the
    kernels, only when grad mode is on and an input requires grad. The
    public functions refuse such inputs before any work; this catches
    direct op calls, which would otherwise return outputs whose backward
    fails later. (torch allows no autograd formula on the mutating _out
    ops: a direct call of those gets torch's error at backward.)"""
    names = _positional(kind, False)

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        check_no_grad(dict(zip(names, inputs)), grad_mode=True)

    return setup_context


def _no_backward(ctx, *grads):  # pragma: no cover - setup_context refuses first
    raise NotImplementedError("turbine_fmha's attention has no backward")


_OPS = {}
for _kind, _out_form in itertools.product(("paged", "kvcache"), (False, True)):
    _op = torch.library.custom_op(f"turbine_fmha::fmha_fwd_{_kind}" + ("_out" if _out_form else ""),
                                  _impl(_kind, _out_form), mutates_args=("out",) if _out_form else (),
                                  schema=_schema(_kind, _out_form))
    _op.register_fake(_fake(_kind, _out_form))
    if not _out_form:
        _op.register_autograd(_no_backward, setup_context=_refuse_grad(_kind))
    _OPS[_kind, _out_form] = _op

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
        raise RuntimeError(f"session handle {handle} names no live turbine_fmha.Session (it was garbage-collected, "
                           "or the int is no session_handle): keep the Session alive as long as the compiled "
                           "code that uses it")
    return session


def check_no_grad(arrays: dict, *, grad_mode: bool | None = None) -> None:
    """The kernels have no backward: a tensor that requires grad, while
    grad mode (default: torch's current one) is on, is an error naming it
    rather than a result silently cut from the autograd graph."""
    if not (torch.is_grad_enabled() if grad_mode is None else grad_mode):
        return
    for name, a in arrays.items():
        if isinstance(a, torch.Tensor) and a.requires_grad:
            raise ValueError(f"{name} requires grad, but turbine_fmha's attention is forward-only (no backward): "
                             f"call it under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def call_op(kind: str, *, q, k_cache, v_cache, seqlen_k, block_table=None, cache_batch_idx=None, out=None,
            return_lse=False, session=None, device="cpu", scale=None, softmax_scale=None, causal=False,
            window_size=None, mask_type="none", window_size_left=-1, window_size_right=-1, **rest):
    """fmha_fwd_paged (kind "paged") or fmha_fwd_kvcache ("kvcache")
    through the op: the public functions' route while torch.compile traces
    them, with their arguments."""
    kw = dict(rest, **conventions(scale=scale, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                  mask_type=mask_type, window_size_left=window_size_left,
                                  window_size_right=window_size_right))
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, seqlen_k=seqlen_k, block_table=block_table,
                 cache_batch_idx=cache_batch_idx, **{n: kw.pop(n, None) for n in _OPTIONAL_BOTH})
    tensors = {n: given[n] for n in _positional(kind, False)}
    for name, t in dict(tensors, out=out).items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor in a torch.compile'd call (numpy arrays and IREE "
                            f"DeviceArrays are for eager calls), got {type(t).__name__}")
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
