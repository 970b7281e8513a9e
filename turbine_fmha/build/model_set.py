"""A model's variant set: every kernel that its attention calls select, from
its head counts, head dims, dtype and page sizes (an HF-style config.json or
explicit values). `turbine-fmha build --model-config` builds it.

The set is the default sets' rule (default_sets.plain_variants: decode and
prefill tiles, masks, the explicit fallback where the online formulation
cannot serve; split-KV uses the same kernels) applied to the model's shape,
plus the append kernels of its cache (PagedKVCache on a device).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..kernels.append_kernel import AppendKernel
from ..kernels.variants import KV_LAYOUTS, Variant
from .default_sets import plain_variants, without_v_guard
from .targets import Target, get_target

# torch_dtype names in HF configs -> variant dtypes.
HF_DTYPES = {"float16": "f16", "half": "f16", "bfloat16": "bf16", "float32": "f32", "float": "f32"}
MODEL_DTYPES = ("f16", "bf16", "f32")
DEFAULT_MODEL_PAGES = (16,)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    nhead_q: int
    nhead_k: int
    hdim_q: int
    hdim_v: int
    dtype: str
    pages: tuple[int, ...] = DEFAULT_MODEL_PAGES
    kv_layout: str = "NHD"  # the cache's pages (Variant.kv_layout)

    def __post_init__(self):
        for f in ("nhead_q", "nhead_k", "hdim_q", "hdim_v"):
            _positive(getattr(self, f), f)
        if not self.pages:
            raise ValueError("pages must name at least one page size")
        for p in self.pages:
            _positive(p, "pages")
        if self.nhead_q % self.nhead_k:
            raise ValueError(f"nhead_q ({self.nhead_q}) must be a multiple of nhead_k ({self.nhead_k})")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")


def _positive(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def model_variants(shape: ModelShape, target: Target | str) -> list[Variant | AppendKernel]:
    """The attention variants a model of `shape` selects on `target`, each
    online one also without the V guard, and its cache's append kernels
    (one-head ones for HND pages, which they write as one-head pages)."""
    target = get_target(target) if isinstance(target, str) else target
    hdims, heads = ((shape.hdim_q, shape.hdim_v),), ((shape.nhead_q, shape.nhead_k),)
    variants = [
        dataclasses.replace(v, kv_layout=shape.kv_layout)
        for v in plain_variants(target.formulation, (shape.dtype,), hdims, heads, shape.pages)
    ]
    heads_k = 1 if shape.kv_layout == "HND" else shape.nhead_k
    appends = [AppendKernel(shape.dtype, heads_k, shape.hdim_q, shape.hdim_v, page) for page in shape.pages]
    return variants + without_v_guard(variants) + appends


def read_config(path: str | Path) -> dict:
    """An HF-style config.json as a dict; errors name the file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a JSON file: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def shape_from_config(config: dict, *, source: str = "config", **overrides) -> ModelShape:
    """The ModelShape of an HF-style config: num_attention_heads,
    num_key_value_heads (default: num_attention_heads, MHA), head_dim (or
    hidden_size / num_attention_heads) and torch_dtype (or dtype). A
    multimodal config's text_config is read when the top level has no
    attention heads. `overrides` (nhead_q, nhead_k, hdim_q, hdim_v, dtype,
    pages, kv_layout), where not None, win over the config. Errors name `source` and
    the key."""
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    given = {k: v for k, v in overrides.items() if v is not None}

    def key(name):
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")
        return value

    nhead_q = given.get("nhead_q") or key("num_attention_heads")
    if nhead_q is None:
        raise ValueError(f"{source}: num_attention_heads is missing")
    hdim = given.get("hdim_q") or key("head_dim")
    if hdim is None:
        hidden = key("hidden_size")
        if hidden is None or hidden % nhead_q:
            raise ValueError(
                f"{source}: head_dim is missing and hidden_size ({hidden}) is not a multiple of "
                f"num_attention_heads ({nhead_q})"
            )
        hdim = hidden // nhead_q
    dtype = given.get("dtype")
    if dtype is None:
        name = config.get("torch_dtype", config.get("dtype"))
        if name not in HF_DTYPES:
            raise ValueError(f"{source}: torch_dtype {name!r} is not one of {sorted(HF_DTYPES)}; give the dtype")
        dtype = HF_DTYPES[name]
    return ModelShape(
        nhead_q=nhead_q,
        nhead_k=given.get("nhead_k") or key("num_key_value_heads") or nhead_q,
        hdim_q=hdim,
        hdim_v=given.get("hdim_v") or hdim,
        dtype=dtype,
        pages=tuple(given.get("pages") or DEFAULT_MODEL_PAGES),
        kv_layout=given.get("kv_layout") or "NHD",
    )
