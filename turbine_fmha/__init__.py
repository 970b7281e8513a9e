"""turbine-fmha: paged-KV flash-attention forward as IREE artifacts.

The runtime (`fmha_fwd_paged`, `Session`) needs numpy and iree-base-runtime
only; building artifacts (`turbine_fmha.build`, `turbine_fmha.kernels`) also
needs iree-base-compiler and iree-turbine.
"""

from .api import fmha_fwd_kvcache, fmha_fwd_paged, fmha_fwd_paged_async
from .attention import PagedAttention
from .cache import CacheFullError, PagedKVCache
from .runtime import ArtifactError, Session
from .variants import Variant

__all__ = [
    "fmha_fwd_paged",
    "fmha_fwd_paged_async",
    "fmha_fwd_kvcache",
    "PagedAttention",
    "PagedKVCache",
    "CacheFullError",
    "Session",
    "Variant",
    "ArtifactError",
]
