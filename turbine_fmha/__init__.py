"""turbine-fmha: paged-KV flash-attention forward as IREE artifacts.

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
