"""The Hugging Face integration on the GPU (turbine_fmha.integrations.
transformers; benchmarks/probes/h200_verify.sh's `hf` part checks it
through as_called.py --hf): a random Llama of the kernels' shapes (32/8
heads of 128, pages of 16), fp16 on the GPU, its pools on the device; the
prompt forward and decode steps on a PagedCache against HF's own fp16
`sdpa` with a DynamicCache, both against the same model in float32 with
HF's eager attention.

The bound: fp16 rounds every layer's activations, so the logits of the
fp16 model differ from float32's by far more than an attention output's
OUT_TOL; ours must be no further from float32 than HF's fp16 sdpa is,
within a factor of 2 (and a floor of 5e-3, for a model HF happens to
compute unusually close). A wrong attention (a missed key, a wrong mask
or position) moves the logits by far more."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import PAGE, host

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.gpu

PROMPT, STEPS, BATCH = 40, 6, 2


def _rel(a, b) -> float:
    a, b = host(a), host(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_llama_prompt_and_decode_steps(gpu):
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from turbine_fmha.integrations import transformers as fmha_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    dev = gpu.torch_device
    model = LlamaForCausalLM(cfg).to(dev).eval()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT + STEPS), device=dev)

    def steps(cache):
        """Logits of the prompt forward, then of each decode step (the
        next tokens given, the same for every model)."""
        out = [model(ids[:, :PROMPT], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(PROMPT, PROMPT + STEPS):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        return torch.stack(out)

    def dynamic():
        try:
            return DynamicCache(config=model.config)
        except TypeError:
            return DynamicCache()

    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = steps(dynamic())
        model.half()
        model.set_attn_implementation("sdpa")
        hf = steps(dynamic())
        fmha_hf.enable(model)
        cache = fmha_hf.PagedCache(session=gpu.session, page_block_size=PAGE, device_pool=True)
        ours = steps(cache)
    assert model.config._attn_implementation == "turbine_fmha"
    assert ours.device == hf.device
    err_hf, err_ours = _rel(hf, ref), _rel(ours, ref)
    bound = max(2 * err_hf, 5e-3)
    assert err_ours <= bound, f"logits vs float32 eager: ours {err_ours:.2e}, HF fp16 sdpa {err_hf:.2e}"
