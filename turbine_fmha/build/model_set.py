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
import reprlib
from pathlib import Path

from ..kernels.append_kernel import AppendKernel
from ..kernels.variants import KV_LAYOUTS, Variant
from .default_sets import plain_variants, without_v_guard
from .targets import Target, get_target

# torch_dtype names in HF configs -> variant dtypes.
HF_DTYPES = {"float16": "f16", "half": "f16", "bfloat16": "bf16", "float32": "f32", "float": "f32"}
MODEL_DTYPES = ("f16", "bf16", "f32")
DEFAULT_MODEL_PAGES = (16,)
# The largest 32-bit int, far above any real model's head counts and dims
# (hundreds at most): larger values come from a corrupt or mistyped config,
# and failed deep in the build (2**63 heads overflowed torch while
# exporting) instead of naming the key.
MAX_MODEL_DIM = 2**31 - 1


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
        # A page size given twice would build (and count) each of its
        # kernels twice.
        object.__setattr__(self, "pages", tuple(dict.fromkeys(self.pages)))
        if self.nhead_q % self.nhead_k:
            raise ValueError(f"nhead_q ({self.nhead_q}) must be a multiple of nhead_k ({self.nhead_k})")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")


def _positive(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MODEL_DIM:
        raise ValueError(f"{name} must be a positive integer up to {MAX_MODEL_DIM}, got {_shown(value)}")


_SHORT = reprlib.Repr()
_SHORT.maxlong = _SHORT.maxstring = 40


def _shown(value) -> str:
    """repr(value), cut short: a config's value may be a huge number, a long
    string or a deep structure, and errors are one line."""
    return _SHORT.repr(value)


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
    except RecursionError:
        raise ValueError(
            f"{path}: its JSON is nested too deeply to read; a model config is a few levels deep"
        ) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def shape_from_config(config: dict, *, source: str = "config", **overrides) -> ModelShape:
    """The ModelShape of an HF-style config: num_attention_heads,
    num_key_value_heads (default: num_attention_heads, MHA), head_dim (or
    hidden_size / num_attention_heads) and torch_dtype (or dtype). A
    multimodal config's text_config is read when the top level has no
    attention heads. `overrides` (nhead_q, nhead_k, hdim_q, hdim_v, dtype,
    pages, kv_layout), where not None, win over the config. Each key read
    is checked (a positive integer, at most MAX_MODEL_DIM) before it is
    used; errors name `source` and the key (an override by its name)."""
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    given = {k: v for k, v in overrides.items() if v is not None}
    named = {}  # field -> the key (or override) its value came from

    def value(field, key):
        if field in given:
            _positive(given[field], field)
            named[field] = field
            return given[field]
        v = config.get(key)
        if v is not None:
            try:
                _positive(v, key)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
            named[field] = key
        return v

    nhead_q = value("nhead_q", "num_attention_heads")
    if nhead_q is None:
        raise ValueError(f"{source}: num_attention_heads is missing")
    nhead_k = value("nhead_k", "num_key_value_heads")
    if nhead_k is None:
        nhead_k, named["nhead_k"] = nhead_q, named["nhead_q"]
    hdim = value("hdim_q", "head_dim")
    if hdim is None:
        hidden = value("hidden_size", "hidden_size")
        if hidden is None or hidden % nhead_q:
            raise ValueError(
                f"{source}: head_dim is missing and hidden_size ({hidden}) is not a multiple of "
                f"{named['nhead_q']} ({nhead_q})"
            )
        hdim = hidden // nhead_q
    if nhead_q % nhead_k:
        raise ValueError(
            f"{source}: {named['nhead_q']} ({nhead_q}) must be a multiple of {named['nhead_k']} ({nhead_k})"
        )
    dtype = given.get("dtype")
    if dtype is None:
        key = "torch_dtype" if config.get("torch_dtype") is not None or "dtype" not in config else "dtype"
        name = config.get(key)
        if not isinstance(name, str) or name not in HF_DTYPES:
            raise ValueError(f"{source}: {key} {_shown(name)} is not one of {sorted(HF_DTYPES)}; give the dtype")
        dtype = HF_DTYPES[name]
    return ModelShape(
        nhead_q=nhead_q,
        nhead_k=nhead_k,
        hdim_q=hdim,
        hdim_v=given.get("hdim_v") or hdim,
        dtype=dtype,
        pages=tuple(given.get("pages") or DEFAULT_MODEL_PAGES),
        kv_layout=given.get("kv_layout") or "NHD",
    )
