"""Where torch.compile's tracing stops.

Host machinery (loading and compiling kernels, numpy planning, IREE calls)
must never be traced by dynamo: it would try to trace pybind objects,
frozen dataclasses and the compiler. The array-level entry points route to
`torch.ops.turbine_fmha` while tracing (torch_ops), so they work under
`fullgraph=True`; the stateful ones (sessions, plans, cache pools) are
`untraced`: a compiled function breaks its graph there and runs them
eagerly, exactly as an eager call would.

Nothing here imports torch: a caller without torch is never traced.
"""

from __future__ import annotations

import functools
import sys
import types


def compiling() -> bool:
    """Whether torch.compile traces the current call."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def exporting() -> bool:
    """Whether torch.export (iree.turbine.aot.export) traces the current
    call: the public functions then emit their kernels into the program
    (api/exported.py)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    # The flag torch.export sets, read as a global (dynamo reads it as it
    # is): torch 2.11's dynamo answers torch.compiler.is_exporting() with
    # True under torch.compile too, which sent compiled calls to the
    # exported route (docs/repro/README.md, "is_exporting under torch.compile").
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def untraced(fn):
    """`fn`, run eagerly when called from code that torch.compile traces
    (a graph break there). Under `fullgraph=True` dynamo refuses such a
    call ("Attempted to call function marked as skipped")."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if compiling():
            return sys.modules["torch"].compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def untraced_methods(cls):
    """`cls` with its constructor and public methods `untraced`."""
    for name, member in list(vars(cls).items()):
        if isinstance(member, types.FunctionType) and (name == "__init__" or not name.startswith("_")):
            setattr(cls, name, untraced(member))
    return cls


def check_no_grad(arrays: dict, *, grad_mode: bool | None = None) -> None:
    """The kernels have no backward: a tensor that requires grad, while
    grad mode (default: torch's current one) is on, is an error naming it
    rather than a result silently cut from the autograd graph."""
    torch = sys.modules.get("torch")
    if torch is None or not (torch.is_grad_enabled() if grad_mode is None else grad_mode):
        return
    for name, a in arrays.items():
        if isinstance(a, torch.Tensor) and a.requires_grad:
            raise ValueError(
                f"{name} requires grad, but turbine_fmha's attention is forward-only (no backward): "
                f"call it under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()"
            )
