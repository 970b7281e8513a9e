#!/usr/bin/env python3
"""iree-turbine 3.9's aot.export of a module that calls a CustomOp, on
IREE 3.13's MLIR Python bindings: fails while lowering the op, since the
bindings no longer have `IntegerType.isinstance` (3.13 returns downcast
objects; Python's isinstance is the test now).

    .venv/bin/python docs/repro/aot_export_custom_op.py          # AttributeError
    .venv/bin/python docs/repro/aot_export_custom_op.py --fixed  # exports

The module is the smallest CustomOp there is (an elementwise copy), not
this project's kernels: the failure is iree-turbine's. --fixed applies
turbine_fmha.kernels.turbine_compat.ensure_mlir_isinstance first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from iree.turbine import aot
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection

if "--fixed" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from turbine_fmha.kernels.turbine_compat import ensure_mlir_isinstance

    print(f"patched {ensure_mlir_isinstance()} binding classes")


@CustomOp.register(library=torch.library.Library("repro_copy", "DEF"))
class Copy(CustomOp):
    signature = "repro_copy(Tensor x) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        x = ksel.arg_tensor(0)
        ksel.return_new_tensor(list(x.t.shape), x.t.dtype).specialize_all_dims()
        x.specialize_all_dims()

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        kb.yield_results(kb.arg_value(0))


class M(torch.nn.Module):
    def forward(self, x):
        return torch.ops.repro_copy.repro_copy(x)


try:
    exported = aot.export(M(), args=(torch.zeros(4, dtype=torch.int32),))
    print("exported:", "func.func @main" in str(exported.mlir_module))
except AttributeError as e:
    print(f"AttributeError: {e}")
    sys.exit(1)
