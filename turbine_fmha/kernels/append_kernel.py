"""The in-place append kernels' variants (PagedKVCache on a device,
turbine_fmha.reshape_and_cache): named and built like the attention
variants (turbine_fmha.variants re-exports them)."""

from __future__ import annotations

import dataclasses

from .naming import NameCodec, Named, enum, number

# i8: the bytes of an fp8 cache of any format (a scatter copies bits).
APPEND_DTYPES = ("f16", "bf16", "f32", "i8")
# ck_tile appendkv's rotary embedding of the new K rows (and of q):
# "interleaved" rotates pairs (0, 1), (2, 3), ... (GPT-J), "half" pairs
# (i, i + rotary_dim / 2) (GPT-NeoX).
ROTARY_MODES = ("none", "interleaved", "half")


@dataclasses.dataclass(frozen=True, order=True)
class AppendKernel(Named):
    """The in-place append of tokens' K/V into a page pool (PagedKVCache on
    a device, turbine_fmha.reshape_and_cache). Named and built like the
    attention variants. With `rotary`, it also rotates the new K rows and a
    q (signature.APPEND_ROTARY)."""

    # The metadata writes the name: pagedkv_append_<dtype>_h<nhead_k>
    # _d<hdim>x<hdim_v>_pg<page>[_ropei|_ropeh].
    dtype: str = dataclasses.field(metadata=enum({d: f"_{d}" for d in APPEND_DTYPES}))
    nhead_k: int = dataclasses.field(metadata=number("_h"))
    hdim: int = dataclasses.field(metadata=number("_d"))
    hdim_v: int = dataclasses.field(metadata=number("x"))
    page_block_size: int = dataclasses.field(metadata=number("_pg"))
    rotary: str = dataclasses.field(
        default="none", metadata=enum({"none": "", "interleaved": "_ropei", "half": "_ropeh"})
    )

    def __post_init__(self):
        if self.dtype not in APPEND_DTYPES:
            raise ValueError(f"append kernels take f16/bf16/f32/i8 caches, got dtype={self.dtype!r}")
        for f in ("nhead_k", "hdim", "hdim_v", "page_block_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.rotary not in ROTARY_MODES:
            raise ValueError(f"rotary must be one of {ROTARY_MODES}, got {self.rotary!r}")
        if self.rotary != "none" and self.dtype == "i8":
            # fp8 rows are copied as bits: rotating them would need the fp8 codec.
            raise ValueError("rotary embedding needs an f16/bf16/f32 cache, got dtype='i8' (fp8 bytes)")


# The order of the fields in a AppendKernel's name.
AppendKernel.names = NameCodec(
    AppendKernel,
    "pagedkv_append",
    (
        "dtype",
        "nhead_k",
        "hdim",
        "hdim_v",
        "page_block_size",
        "rotary",
    ),
)
