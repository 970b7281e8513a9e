"""torch 2.13: a function compiled once with an `out` that aliases another
input is reused for an `out` that does not, and fails.

A custom op that writes `out` in place (mutates_args) is compiled with
`out` a view of `x`; the same function then runs with a separate `out`.
Inductor fails with "AssertionError: wrong number of dimensions1 for op:
input", aot_eager with a size mismatch. torch._dynamo.reset() alone does
not help (inductor's caches hand back the same artifact); a reset with
TORCHINDUCTOR_FX_GRAPH_CACHE=0 and TORCHINDUCTOR_AUTOGRAD_CACHE=0 does.
turbine-fmha refuses an aliasing `out` when the call runs (ValueError), so
a service that passes one and then fixes its call meets this. No
turbine-fmha code is involved:

    .venv/bin/python docs/repro/torch_compile_aliased_out.py [inductor|aot_eager] [reset]
"""

import sys

import torch


@torch.library.custom_op("repro::twice_out", mutates_args=("out",))
def twice_out(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(x * 2)
    return x.sum().reshape(1)


@twice_out.register_fake
def _(x, out):
    return x.new_empty(1)


def fn(x, out):
    return twice_out(x, out)


backend = sys.argv[1] if len(sys.argv) > 1 else "inductor"
x = torch.randn(4, 8)
y = x.clone()
torch.compile(fn, backend=backend)(y, y.view(-1)[:32].view(4, 8))  # out is y's own memory
if "reset" in sys.argv:
    torch._dynamo.reset()
out = torch.empty(4, 8)
try:
    torch.compile(fn, backend=backend)(x, out)
    print("separate out: ok" if torch.equal(out, x * 2) else "separate out: WRONG RESULT")
except Exception as e:
    print(f"separate out: {type(e).__name__}: {e}")
