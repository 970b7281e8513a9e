"""turbine-fmha: paged-KV flash-attention forward as IREE artifacts.

The public names (help() on each lists its arguments with their shapes,
dtypes, defaults and meanings; docs/user-guide.md has the rest):

- fmha_fwd_paged: attention over paged K/V caches (one call).
- fmha_fwd_kvcache: the same over non-paged caches (a row per sequence).
- fmha_fwd_paged_async: fmha_fwd_paged on a session's worker threads.
- flash_attn_with_kvcache: flash-attn's function, its names and semantics.
- PagedAttention: plan a batch step once, run it per layer.
- PagedKVCache, CacheFullError: a page pool with per-sequence page lists.
- reshape_and_cache: vLLM's KV write into caches you own, in place.
- aligned_zeros: arrays a CPU session reads and writes in place.
- Session: the loaded kernels of one device; ArtifactError, Variant.
- export_options: the kernels attention puts into exported programs.
- fmha_fwd_paged_ref: the float64 reference the kernels are tested against.

Every attention option is declared once, in turbine_fmha/calls/options.py,
and the functions' signatures, torch op schemas and docstrings derive
from it.

The runtime (`fmha_fwd_paged`, `Session`) needs numpy and iree-base-runtime
only; building artifacts (`turbine_fmha.build`, `turbine_fmha.kernels`) also
needs iree-base-compiler and iree-turbine. The package is layered, each
layer importing only the ones below it: core, kernels, build, calls,
testing, runtime, api, integrations, cli (docs/architecture.md).
"""

from .api.attention import PagedAttention
from .api.cache import CacheFullError, PagedKVCache, aligned_zeros
from .api.eager import fmha_fwd_paged_async
from .api.public import export_options, flash_attn_with_kvcache, fmha_fwd_kvcache, fmha_fwd_paged, reshape_and_cache
from .build.artifacts import ArtifactError
from .core.version import VERSION as __version__
from .kernels.variants import Variant
from .runtime.session import Session
from .testing.reference import fmha_fwd_paged_ref

__all__ = [
    "__version__",
    "fmha_fwd_paged",
    "fmha_fwd_paged_async",
    "fmha_fwd_kvcache",
    "flash_attn_with_kvcache",
    "PagedAttention",
    "PagedKVCache",
    "reshape_and_cache",
    "CacheFullError",
    "Session",
    "Variant",
    "ArtifactError",
    "aligned_zeros",
    "fmha_fwd_paged_ref",
    "export_options",
]
