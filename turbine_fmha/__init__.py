"""turbine-fmha: paged-KV flash-attention forward as IREE artifacts.

The runtime (`fmha_fwd_paged`, `Session`) needs numpy and iree-base-runtime
only; building artifacts (`turbine_fmha.build`, `turbine_fmha.kernels`) also
needs iree-base-compiler and iree-turbine.
"""

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version

try:
    __version__ = _version("turbine-fmha")
except _NotInstalled:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

from .api import fmha_fwd_kvcache, fmha_fwd_paged, fmha_fwd_paged_async  # noqa: E402
from .attention import PagedAttention  # noqa: E402
from .cache import CacheFullError, PagedKVCache  # noqa: E402
from .flash_attn import flash_attn_with_kvcache  # noqa: E402
from .kv_write import reshape_and_cache  # noqa: E402
from .runtime import ArtifactError, Session  # noqa: E402
from .variants import Variant  # noqa: E402

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
]
