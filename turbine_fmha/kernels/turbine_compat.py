"""One compatibility fix between iree-turbine 3.9 and IREE 3.13's MLIR
Python bindings, applied only where it is needed.

iree-turbine 3.9 tests MLIR types with `IntegerType.isinstance(t)`, a
static method the 3.13 bindings removed (they return downcast objects, so
Python's own isinstance is the test now). `iree.turbine.aot.export` of a
module that calls a CustomOp then fails while it lowers the op
(`AttributeError: type object 'IntegerType' has no attribute 'isinstance'`,
iree/turbine/dynamo/type_conversion.py; docs/repro/README.md, "aot.export
of a CustomOp"). `ensure_mlir_isinstance` gives each binding class that
lacks its own `isinstance` one that does what the old one did.
"""

from __future__ import annotations

import inspect


def ensure_mlir_isinstance() -> int:
    """Adds `isinstance` to the MLIR binding classes (types, attributes,
    values) that lack one; returns how many it patched (0 where the
    bindings still have it, or it ran before). Checks each class's own
    `__dict__`: `hasattr` would find the base class's, whose check accepts
    every type."""
    from iree.compiler import ir

    if "isinstance" in ir.IntegerType.__dict__:
        return 0
    bases = (ir.Type, ir.Attribute, ir.Value)
    patched = 0
    for cls in vars(ir).values():
        if inspect.isclass(cls) and issubclass(cls, bases) and cls not in bases and "isinstance" not in cls.__dict__:
            cls.isinstance = staticmethod(lambda x, cls=cls: isinstance(x, cls))
            patched += 1
    return patched
