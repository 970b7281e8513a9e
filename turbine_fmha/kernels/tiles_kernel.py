"""The contiguous-tile prefill kernels' variants (mlir/prefill_tiles.mlir.jinja;
their plan: calls/tiles.py). Named and built like the attention variants."""

from __future__ import annotations

import dataclasses

from .naming import NameCodec, Named, enum, number

TILES_DTYPES = ("f16", "bf16")
# Query rows per tile: the attention's row block (the roof's tuning).
TILE_ROWS = 128
# Chunk classes: class c holds chunks of 2^c tiles of keys. A call runs the
# kernel of exactly its longest prefix's binary digits (no class may be
# empty: calls/tiles.py), so one is built per count, up to prefixes of
# 1023 tiles.
TILES_CLASSES = tuple(range(11))


@dataclasses.dataclass(frozen=True, order=True)
class TilesKernel(Named):
    """Prefill through contiguous tiles: the keys a call reads copied
    through the table into one contiguous buffer, then unpaged attention
    over whole chunks, only each tile's last block masked, partials merged
    by log-sum-exp (signature.tiles_declaration)."""

    # The metadata writes the name: prefill_tiles_<dtype>_h<nhead_q>x<nhead_k>
    # _d<hdim>_pg<page>_t<tile>_c<classes>.
    dtype: str = dataclasses.field(metadata=enum({d: f"_{d}" for d in TILES_DTYPES}))
    nhead_q: int = dataclasses.field(metadata=number("_h"))
    nhead_k: int = dataclasses.field(metadata=number("x"))
    hdim: int = dataclasses.field(metadata=number("_d"))
    page_block_size: int = dataclasses.field(metadata=number("_pg"))
    tile: int = dataclasses.field(metadata=number("_t"))
    classes: int = dataclasses.field(metadata=number("_c"))

    def __post_init__(self):
        if self.dtype not in TILES_DTYPES:
            raise ValueError(f"prefill tile kernels take f16/bf16, got dtype={self.dtype!r}")
        for f in ("nhead_q", "nhead_k", "hdim", "page_block_size", "tile"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.classes < 0:
            raise ValueError(f"classes must be >= 0, got {self.classes}")
        if self.nhead_q % self.nhead_k:
            raise ValueError(f"nhead_q ({self.nhead_q}) must be a multiple of nhead_k ({self.nhead_k})")

    @property
    def group(self) -> int:
        return self.nhead_q // self.nhead_k


TilesKernel.names = NameCodec(
    TilesKernel,
    "prefill_tiles",
    ("dtype", "nhead_q", "nhead_k", "hdim", "page_block_size", "tile", "classes"),
)
