"""The public functions. Each runs its eager implementation, or, while
torch.compile traces it, goes through its torch op (torch_ops), whose
implementation is that same eager function: one call works compiled and
eager, and dynamo never traces the host machinery. While a module is
exported (torch.export, iree.turbine.aot.export), the attention emits its
kernel into the program instead (exported.py).
"""

from __future__ import annotations

import functools
import inspect

from ..core.tracing import compiling, exporting
from . import eager, flash_attn, kv_write


def _routed(fn, route: str, exported: str | None = None):
    """`fn`, or torch_ops.<route> with the same arguments by name while
    torch.compile traces: dynamo traces this wrapper, not the eager body.
    While exporting, exported.<exported> (the kernel in the program), or
    NotImplementedError where there is none."""
    names = tuple(
        n for n, p in inspect.signature(fn).parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if exporting():
            if exported is None:
                raise NotImplementedError(
                    f"{fn.__name__} inside an exported program is not supported yet (fmha_fwd_paged, "
                    "fmha_fwd_kvcache and reshape_and_cache are: "
                    "docs/user-guide.md, 'Inside exported programs')"
                )
            from . import exported as exported_impl  # imports torch and iree-turbine

            return getattr(exported_impl, exported)(**dict(zip(names, args)), **kwargs)
        if compiling():
            from . import torch_ops  # imports torch and registers the ops, once

            return getattr(torch_ops, route)(**dict(zip(names, args)), **kwargs)
        return fn(*args, **kwargs)

    return call


fmha_fwd_paged = _routed(eager.fmha_fwd_paged, "call_paged", "call_paged")
fmha_fwd_kvcache = _routed(eager.fmha_fwd_kvcache, "call_kvcache", "call_kvcache")
reshape_and_cache = _routed(kv_write.reshape_and_cache, "call_reshape_and_cache", "call_reshape_and_cache")
flash_attn_with_kvcache = _routed(flash_attn.flash_attn_with_kvcache, "call_flash_attn")


def export_options(*, formulation: str = "explicit", num_splits: int | None = None):
    """A context manager: the kernels that attention calls put into the
    programs exported inside it (torch.export, iree.turbine.aot.export).

        with turbine_fmha.export_options(formulation="online"):
            exported = aot.export(step, args=example)

    Args:
      formulation: 'explicit' or 'online', keyword-only, default
        'explicit'. 'explicit' compiles for every target and takes dynamic
        shapes. 'online' is the GPUs' faster formulation with static
        tiles: a decode (seqlen_q 1) of a static batch runs the batch tile
        the runtime would pick, the batch padded to it in the program; a
        prefill of a static batch and row count runs launches of the
        one-sequence prefill tile; a dynamic batch or row count raises
        NotImplementedError.
      num_splits: int or None, keyword-only, default None. Online decodes
        only: each sequence's keys in this many splits over its table's
        columns, merged inside the kernel (one of
        kernels.variants.MERGE_SPLITS, 2 to 128), for long keys over few
        sequences; a prefill under it raises NotImplementedError.

    Returns:
      The context manager; entering it imports torch and iree-turbine.

    Raises:
      ValueError, when entered: an unknown formulation, or num_splits
        without formulation='online' or not one of MERGE_SPLITS.
    """
    from . import exported  # imports torch and iree-turbine

    return exported.export_options(formulation=formulation, num_splits=num_splits)
