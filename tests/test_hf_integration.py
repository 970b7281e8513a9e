"""Hugging Face transformers on these kernels (turbine_fmha.integrations.
transformers): a small randomly initialised Llama generates the same
tokens as with HF's eager attention, prefill and decode both through the
paged kernels; its cache keeps transformers' Cache semantics."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers (the optional extra) is not installed")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import turbine_fmha  # noqa: E402
from turbine_fmha.cache import CacheFullError  # noqa: E402
from turbine_fmha.integrations import transformers as fmha_hf  # noqa: E402

PROMPT, NEW = 20, 16


def _llama(seed=0):
    """GQA 4/2 with head dim 64 and pages of 16: kernels other tests build
    too. initializer_range 0.2 instead of 0.02: with the default a random
    model repeats one token, which would hide most mistakes."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    return model, torch.randint(0, cfg.vocab_size, (2, PROMPT))


@pytest.fixture
def counted(monkeypatch):
    """Counts plan() and run() calls: proof that the kernels, not HF's
    attention, produced the tokens."""
    calls = {"plan": 0, "run": 0}
    for name in calls:
        orig = getattr(turbine_fmha.PagedAttention, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(turbine_fmha.PagedAttention, name, wrapped)
    return calls


def test_generate_f32_tokens_identical_to_eager(explicit_session, counted):
    model, ids = _llama()
    kw = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        got = fmha_hf.generate(model, ids, session=explicit_session, **kw)
    assert model.config._attn_implementation == "turbine_fmha"
    assert len(set(ref.sequences[:, PROMPT:].flatten().tolist())) > 4, "degenerate model: the test would prove little"
    np.testing.assert_array_equal(got.sequences.numpy(), ref.sequences.numpy())
    # One prefill and NEW - 1 decode steps, planned once each and run
    # once per layer.
    assert counted == {"plan": NEW, "run": NEW * model.config.num_hidden_layers}
    # f32 differs from eager only in summation order: observed ~2e-5 on
    # logits of magnitude ~12.
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits))
    assert diff < 1e-3


def test_beam_search_and_return_sequences(explicit_session):
    """reorder_cache and the expanded batch fork sequences in the pools."""
    model, ids = _llama(seed=1)
    kw = dict(max_new_tokens=10, do_sample=False, num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        got = fmha_hf.generate(model, ids, session=explicit_session, **kw)
    np.testing.assert_array_equal(got.numpy(), ref.numpy())


def _teacher_forced(model, seq, cache=None):
    """Logits predicting seq[:, PROMPT:]: one forward over everything, or
    with a cache a prefill and then one decode step per token."""
    if cache is None:
        return model(seq).logits[:, PROMPT - 1:-1]
    steps = [model(seq[:, :PROMPT], past_key_values=cache).logits[:, -1:]]
    steps += [model(seq[:, i:i + 1], past_key_values=cache).logits for i in range(PROMPT, seq.shape[1] - 1)]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits_as_close_as_eager(explicit_session, dtype):
    """In f16/bf16 greedy streams may legitimately part, so the logits are
    compared along one f32 token stream (teacher forcing) against the f32
    model. The kernels keep scores and sums in f32 and round P and O once,
    where eager also rounds its score product; the rest of the model
    (projections, MLP, norms: the same code in both runs) dominates the
    error. Over seeds 0-7 ours measured 0.75-1.12x eager's largest error
    and 0.87-1.06x its mean error; the bounds are 2x and 1.5x."""
    model, ids = _llama(seed=2)
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        ref = _teacher_forced(model, seq).double()
        low = copy.deepcopy(model).to(dtype)
        eager = (_teacher_forced(low, seq).double() - ref).abs()
        fmha_hf.enable(low)
        ours = (_teacher_forced(low, seq, fmha_hf.PagedCache(session=explicit_session)).double() - ref).abs()
    assert 0 < ours.max() <= 2 * eager.max(), (ours.max(), eager.max())
    assert ours.mean() <= 1.5 * eager.mean(), (ours.mean(), eager.mean())


def test_unsupported_inputs_raise(explicit_session):
    model, ids = _llama()
    fmha_hf.enable(model)
    left_padded = torch.ones_like(ids)
    left_padded[0, :3] = 0
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="attention mask with padding"):
            fmha_hf.generate(model, ids, attention_mask=left_padded, max_new_tokens=2, session=explicit_session)
        with pytest.raises(ValueError, match="PagedCache"):
            model(ids)  # transformers' own DynamicCache


def _dense(layer):
    """A PagedLayer's sequences as DynamicLayer holds them, [b, h, s, d]."""
    rows = [layer.pool.gather(s) for s in layer.seqs]
    return [torch.from_numpy(np.stack([r[i] for r in rows])).transpose(1, 2) for i in (0, 1)]


def test_cache_semantics_match_dynamic_cache(rng):
    """Every Cache operation generate uses, applied to PagedCache and to
    transformers' DynamicCache, leaves the same K/V: appends across page
    boundaries and pool growth, beam reorders, batch selection and
    repetition (forks sharing pages) and crop."""
    paged, dense = fmha_hf.PagedCache(page_block_size=4), DynamicCache()

    def update(batch, n):
        for layer in range(2):
            k, v = (torch.from_numpy(rng.standard_normal((batch, 2, n, 8)).astype(np.float32)) for _ in range(2))
            paged.update(k, v, layer)
            dense.update(k, v, layer)

    update(3, 5)
    for _ in range(7):
        update(3, 1)  # the pools grow past their first size
    ops = [("reorder_cache", torch.tensor([2, 0, 0]), 3), ("batch_select_indices", torch.tensor([1, 2]), 2),
           ("batch_repeat_interleave", 2, 4), ("crop", -3, 4), ("crop", 0, 4)]
    for op, arg, batch in ops:
        getattr(paged, op)(arg)
        getattr(dense, op)(arg)
        update(batch, 2)
        assert paged.get_seq_length() == dense.get_seq_length()
        assert paged.get_mask_sizes(1, 0) == dense.get_mask_sizes(1, 0)
        for p, d in zip(paged.layers, dense.layers):
            for got, want in zip(_dense(p), (d.keys, d.values)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fixed_pool_raises_when_full():
    cache = fmha_hf.PagedCache(page_block_size=4, num_pages=2)
    cache.update(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), 0)
    with pytest.raises(CacheFullError):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)
