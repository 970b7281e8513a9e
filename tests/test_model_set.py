"""A model's variant set (turbine_fmha.model_set): read from HF-style
configs, and exactly what the runtime selects for the model's calls."""

from __future__ import annotations

import json

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.build.model_set import ModelShape, model_variants, read_config, shape_from_config
from turbine_fmha.build.targets import get_target
from turbine_fmha.kernels.append_kernel import AppendKernel
from turbine_fmha.kernels.signature import KERNEL_ABI
from turbine_fmha.kernels.variants import MERGED_DECODE_TILES, Variant

LLAMA = dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, torch_dtype="bfloat16")


def test_shape_from_hf_configs():
    assert shape_from_config(LLAMA) == ModelShape(32, 8, 128, 128, "bf16", (16,))
    # head_dim wins over hidden_size / heads (Gemma: 8 heads of 256 in 2048).
    gemma = dict(num_attention_heads=8, num_key_value_heads=1, head_dim=256, hidden_size=2048, torch_dtype="float16")
    assert shape_from_config(gemma) == ModelShape(8, 1, 256, 256, "f16")
    # A multimodal config keeps its language model's in text_config; MHA
    # without num_key_value_heads; the newer "dtype" key.
    wrapped = dict(architectures=["X"], text_config=dict(num_attention_heads=16, hidden_size=1024, dtype="float32"))
    assert shape_from_config(wrapped) == ModelShape(16, 16, 64, 64, "f32")
    # Values given explicitly win over the config's.
    assert shape_from_config(LLAMA, nhead_k=4, dtype="f16", pages=[16, 64], hdim_v=64) == ModelShape(
        32, 4, 128, 64, "f16", (16, 64)
    )


@pytest.mark.parametrize(
    "config, words",
    [
        (dict(LLAMA, num_attention_heads=None), "num_attention_heads is missing"),
        (dict(LLAMA, hidden_size=1000), "hidden_size (1000) is not a multiple"),
        (dict(LLAMA, num_key_value_heads=0), "num_key_value_heads must be a positive integer"),
        (dict(LLAMA, num_key_value_heads=5), "num_attention_heads (32) must be a multiple of num_key_value_heads (5)"),
        (dict(LLAMA, num_key_value_heads=6), "num_attention_heads (32) must be a multiple of num_key_value_heads (6)"),
        (dict(LLAMA, torch_dtype="int8"), "torch_dtype 'int8'"),
        (dict(LLAMA, torch_dtype=["bfloat16"]), "torch_dtype ['bfloat16']"),
        ({k: v for k, v in LLAMA.items() if k != "torch_dtype"}, "torch_dtype None"),
        # Each key's type and range, before any use of it (2**63 heads
        # overflowed torch deep in the build).
        (dict(LLAMA, num_attention_heads=2**63), "num_attention_heads must be a positive integer up to 2147483647"),
        (dict(LLAMA, num_attention_heads=-32), "num_attention_heads must be a positive integer"),
        (dict(LLAMA, num_attention_heads=32.0), "num_attention_heads must be a positive integer"),
        (dict(LLAMA, num_attention_heads=True), "num_attention_heads must be a positive integer"),
        (dict(LLAMA, num_attention_heads="32"), "num_attention_heads must be a positive integer"),
        (dict(LLAMA, num_key_value_heads=10**30), "num_key_value_heads must be a positive integer up to"),
        (dict(LLAMA, head_dim=2**40), "head_dim must be a positive integer up to"),
        (dict(LLAMA, hidden_size=2**70), "hidden_size must be a positive integer up to"),
        (dict(LLAMA, hidden_size=[4096]), "hidden_size must be a positive integer"),
    ],
)
def test_bad_configs_name_the_key(config, words):
    with pytest.raises(ValueError, match=None) as e:
        shape_from_config(config, source="cfg.json")
    assert str(e.value).startswith("cfg.json: ") and words in str(e.value)


def test_read_config_errors_name_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not a JSON file"):
        read_config(bad)
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_config(bad)
    for deep in ("[" * 100000 + "]" * 100000, '{"a": ' * 100000 + "1" + "}" * 100000):
        bad.write_text(deep)
        with pytest.raises(ValueError, match="config.json: its JSON is nested too deeply"):
            read_config(bad)
    bad.write_text(json.dumps(LLAMA))
    assert read_config(bad) == LLAMA


@pytest.fixture
def one_gpu_each(monkeypatch):
    """The GPU targets' cases make a session of the target's own device on
    this GPU-less machine: IREE's cuda and hip drivers, as Session() checks
    them (the device list it keeps per driver), list one GPU each. Nothing
    opens one: selection reads only the manifest."""
    import turbine_fmha.runtime.session as session_mod

    for driver in ("cuda", "hip"):
        monkeypatch.setitem(session_mod._DRIVER_DEVICES, driver, [{"device_id": 1, "path": "", "name": "stand-in"}])


def _session_over(tmp_path, target: str, kernels) -> turbine_fmha.Session:
    """A Session whose manifest lists exactly `kernels` for `target`
    (selection reads only the manifest; nothing is loaded)."""
    entries = [
        dict(
            variant=k.name,
            target=target,
            path=f"{target}/{k.name}.vmfb",
            sha256="0" * 64,
            compiler_version="3.13.0",
            kernel_abi=KERNEL_ABI,
        )
        for k in kernels
    ]
    (tmp_path / "manifest.json").write_text(json.dumps(dict(manifest_version=1, artifacts=entries)))
    device = {"cpu": "cpu", "cuda": "cuda", "rocm": "hip"}[get_target(target).kind]
    return turbine_fmha.Session(device, artifact_dir=tmp_path, target=target)


def _calls(shape: ModelShape, online: bool):
    """The model's calls: decode at several batch sizes (split-KV forced and
    automatic), prefill short and long; no mask and causal (top-left too
    where the formulation serves it)."""
    masks = ("none", "bottom_right") if online else ("none", "bottom_right", "top_left")
    for batch, rows, keys in (
        (1, 1, 3000),
        (8, 1, 700),
        (32, 1, 100),
        (40, 1, 50),
        (64, 1, 50),
        (128, 1, 30),
        (1, 100, 300),
        (1, 2000, 2000),
        (1, 4096, 4096),
    ):
        for mask in masks:
            for splits in (None, 3) if rows == 1 else (None,):
                yield batch, rows, keys, mask, splits
    # A sliding window without a right edge computes every block: one long
    # launch, unlike a causal prefill's chunks cut at the diagonal.
    yield 1, 4096, 4096, "bottom_right_left_window", None
    # Chunked prefills of several sequences over long cached keys run as row
    # entries (plan.row_entries): 16 and 32 entries of 128 rows.
    for batch in (4, 8) if online else ():
        for mask in masks:
            yield batch, 512, 8704, mask, None
    # Decodes whose splits a variant merges in the module: each (tile, count)
    # filled exactly by batch x count entries.
    for tile, n in MERGED_DECODE_TILES if online else ():
        yield tile // n, 1, 4096, "none", n


def _selected(session, shape: ModelShape, online: bool) -> set[Variant]:
    page = shape.pages[0]
    chosen = set()
    for batch, rows, keys, mask, splits in _calls(shape, online):
        width = -(-keys // page)
        bt = np.arange(batch * width, dtype=np.int32).reshape(batch, width)
        window = (
            dict(window_size_left=256, window_size_right=-1)
            if mask.endswith("_left_window")
            else dict(window_size_right=0 if mask != "none" else -1)
        )
        attn = turbine_fmha.PagedAttention(session).plan(
            bt,
            np.full(batch, keys, np.int32),
            num_pages=batch * width,
            page_block_size=page,
            nhead_q=shape.nhead_q,
            nhead_k=shape.nhead_k,
            hdim=shape.hdim_q,
            hdim_v=shape.hdim_v,
            dtype=shape.dtype,
            seqlen_q=rows,
            mask_type=mask.removesuffix("_left_window"),
            num_splits=splits,
            kv_layout=shape.kv_layout,
            **window,
        )
        chosen |= {attn._plan.variant(0, finite) for finite in (False, True)}
    return chosen


@pytest.mark.parametrize(
    "target, shape",
    [
        ("host", ModelShape(12, 4, 64, 64, "bf16")),
        ("cuda", ModelShape(12, 4, 64, 64, "bf16")),
        ("gfx942", ModelShape(8, 1, 256, 256, "f16", (32,))),  # head dims the online kernels cannot serve
        ("cuda", ModelShape(12, 4, 64, 64, "bf16", kv_layout="HND")),
        ("host", ModelShape(8, 2, 128, 128, "f16", (64,), kv_layout="HND")),
    ],
)
def test_model_set_is_what_the_models_calls_select(tmp_path, one_gpu_each, target, shape):
    """Every call of the model finds its variant in the set, and every
    attention variant in the set serves some call: the set is the
    runtime's own choice, not a guess."""
    kernels = model_variants(shape, target)
    session = _session_over(tmp_path, target, kernels)
    online = (
        session.formulation_for(
            Variant(shape.dtype, shape.hdim_q, shape.hdim_v, shape.nhead_q, shape.nhead_k, shape.pages[0]).problem
        )
        == "online"
    )
    assert online == (target != "host" and shape.hdim_q <= 128)
    assert _selected(session, shape, online) == {k for k in kernels if isinstance(k, Variant)}
    appends = [k for k in kernels if isinstance(k, AppendKernel)]
    # HND caches are written as one-head pages (reshape_and_cache, PagedKVCache).
    heads = 1 if shape.kv_layout == "HND" else shape.nhead_k
    assert appends == [AppendKernel(shape.dtype, heads, shape.hdim_q, shape.hdim_v, p) for p in shape.pages]


def test_model_shape_rejects_bad_values():
    with pytest.raises(ValueError, match="hdim_q must be a positive integer"):
        ModelShape(8, 8, 0, 64, "f16")
    with pytest.raises(ValueError, match="pages must be a positive integer"):
        ModelShape(8, 8, 64, 64, "f16", (16, 0))
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelShape(8, 8, 64, 64, "f8e4m3fn")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        ModelShape(8, 8, 64, 64, "f16", kv_layout="hnd")
    with pytest.raises(ValueError, match="nhead_q must be a positive integer up to 2147483647"):
        ModelShape(2**63, 8, 64, 64, "f16")


def test_repeated_pages_count_once():
    """Pages 16,16 would build (and count) each page-16 kernel twice."""
    shape = ModelShape(8, 2, 64, 64, "f16", (16, 64, 16))
    assert shape == ModelShape(8, 2, 64, 64, "f16", (16, 64))
    kernels = model_variants(shape, "host")
    assert len(kernels) == len(set(kernels))
    assert shape_from_config(LLAMA, pages=[16, 16]).pages == (16,)
