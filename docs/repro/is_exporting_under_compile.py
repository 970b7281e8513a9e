"""torch 2.11's dynamo answers torch.compiler.is_exporting() with True
under torch.compile (no export anywhere); torch 2.13 answers False.

    python3 docs/repro/is_exporting_under_compile.py

torch 2.11.0+cu130 (the GPU machines): "under torch.compile: True";
torch 2.13.0+cpu: "False". torch.compiler._is_exporting_flag, which
torch.export sets and dynamo reads as a global, is False in both, so
turbine_fmha.core.tracing.exporting reads the flag.
"""

import torch


def f(x):
    return x + (1 if torch.compiler.is_exporting() else 0)


print("torch", torch.__version__)
print("under torch.compile:", bool(torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(1)).item()))
print(
    "the flag under torch.compile:",
    torch.compile(lambda x: x + torch.compiler._is_exporting_flag)(torch.zeros(1)).item() == 1,
)
