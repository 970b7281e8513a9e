"""Hugging Face transformers on these kernels (turbine_fmha.integrations.
transformers): a small randomly initialised Llama generates the same
tokens as with HF's eager attention, prefill and decode both through the
paged kernels, with left-padded batches and with the pools in host memory
or on the session's device; its cache keeps transformers' Cache
semantics."""

import collections
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers (the optional extra) is not installed")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

import turbine_fmha  # noqa: E402
from turbine_fmha.api import cache as cache_mod  # noqa: E402
from turbine_fmha.api.cache import CacheFullError, PagedKVCache  # noqa: E402
from turbine_fmha.integrations import transformers as fmha_hf  # noqa: E402

PROMPT, NEW = 20, 16


def _llama(seed=0):
    """GQA 4/2 with head dim 64 and pages of 16: kernels other tests build
    too. initializer_range 0.2 instead of 0.02: with the default a random
    model repeats one token, which would hide most mistakes."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
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


@pytest.mark.parametrize("device_pool", [False, True])
def test_generate_f32_tokens_identical_to_eager(explicit_session, counted, device_pool):
    model, ids = _llama()
    kw = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        got = fmha_hf.generate(model, ids, session=explicit_session, device_pool=device_pool, **kw)
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


def _left_padded(seed, lens=(PROMPT, 13, 6), pad=7):
    """A model and prompts of `lens` tokens left-padded to PROMPT with the
    token `pad` (a real token: only the mask says it is padding)."""
    model, _ = _llama(seed)
    ids = torch.randint(0, model.config.vocab_size, (len(lens), PROMPT))
    mask = torch.ones_like(ids)
    for b, n in enumerate(lens):
        ids[b, : PROMPT - n] = pad
        mask[b, : PROMPT - n] = 0
    assert (mask == 0).any(1).sum() >= 2, "no padded row: the test would prove nothing"
    return model, ids, mask


def _max_logit_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("device_pool", [False, True])
def test_left_padded_batch_matches_eager(explicit_session, counted, monkeypatch, device_pool):
    """Prompts of different lengths, left-padded: the pad rows are skipped
    through kv_offset (gappy KV), so every row generates what HF eager
    generates from the same input_ids and attention_mask."""
    model, ids, mask = _left_padded(seed=3)
    kw = dict(
        attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        got = fmha_hf.generate(model, ids, session=explicit_session, device_pool=device_pool, **kw)
    assert len(set(ref.sequences[:, PROMPT:].flatten().tolist())) > 4, "degenerate model: the test would prove little"
    np.testing.assert_array_equal(got.sequences.numpy(), ref.sequences.numpy())
    assert counted == {"plan": NEW, "run": NEW * model.config.num_hidden_layers}
    # As unpadded: only the summation order differs (observed ~6e-5 on
    # logits of magnitude ~12).
    assert _max_logit_diff(got, ref) < 1e-3
    # The comparison sees the padding: with the offsets dropped, the real
    # rows also attend to the pad rows, and the logits move far past the
    # bound above.
    monkeypatch.setattr(fmha_hf, "left_padding", lambda *a: None)
    with torch.no_grad():
        wrong = fmha_hf.generate(
            model, ids, session=explicit_session, device_pool=device_pool, **dict(kw, max_new_tokens=2)
        )
    assert _max_logit_diff(wrong, ref) > 0.1


@pytest.mark.parametrize("device_pool", [False, True])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_beam_search_and_return_sequences(explicit_session, padded, device_pool):
    """reorder_cache and the expanded batch fork sequences in the pools
    (a device pool takes its host mirror then); with padding, HF reorders
    the mask itself and the offsets follow it."""
    if padded:
        model, ids, mask = _left_padded(seed=1)
        extra = dict(attention_mask=mask)
    else:
        (model, ids), extra = _llama(seed=1), {}
    kw = dict(max_new_tokens=10, do_sample=False, num_beams=3, num_return_sequences=2, **extra)
    cache = fmha_hf.PagedCache(session=explicit_session, device_pool=device_pool)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        got = fmha_hf.enable(model).generate(ids, past_key_values=cache, **kw)
    np.testing.assert_array_equal(got.numpy(), ref.numpy())
    for layer in cache.layers:  # the beams did fork: host pools, or device pools with their mirror
        assert layer.pool.k is not None and (layer.pool.k_dev is not None) == device_pool


def _teacher_forced(model, seq, cache=None):
    """Logits predicting seq[:, PROMPT:]: one forward over everything, or
    with a cache a prefill and then one decode step per token."""
    if cache is None:
        return model(seq).logits[:, PROMPT - 1 : -1]
    steps = [model(seq[:, :PROMPT], past_key_values=cache).logits[:, -1:]]
    steps += [model(seq[:, i : i + 1], past_key_values=cache).logits for i in range(PROMPT, seq.shape[1] - 1)]
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_device_pool_logits_bitwise_equal_host_pool(explicit_session, dtype):
    """The same kernels over the same K/V, wherever the pool lives: a
    left-padded f16/bf16 batch (prefill, then decode steps) gives the same
    logits to the bit with the pools on the session's device as in host
    memory (the path the tests above compare with eager)."""
    model, ids, mask = _left_padded(seed=2)
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        low = fmha_hf.enable(copy.deepcopy(model).to(dtype))
        full = torch.cat([mask, torch.ones_like(seq[:, PROMPT:])], 1)
        logits = []
        for device_pool in (False, True):
            cache = fmha_hf.PagedCache(session=explicit_session, device_pool=device_pool)
            steps = [low(seq[:, :PROMPT], attention_mask=full[:, :PROMPT], past_key_values=cache).logits]
            steps += [
                low(seq[:, i : i + 1], attention_mask=full[:, : i + 1], past_key_values=cache).logits
                for i in range(PROMPT, seq.shape[1] - 1)
            ]
            logits.append(torch.cat(steps, 1))
    assert logits[0].dtype == dtype and torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def _untouched(cache):
    return cache.get_seq_length() == 0 and all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_unsupported_masks_raise_before_running(explicit_session, counted):
    """Right padding, a hole, a custom 4D mask or a mask of the wrong
    length raise before any kernel runs, and leave the cache as it was."""
    model, ids, mask = _left_padded(seed=0)
    fmha_hf.enable(model)
    right = torch.ones_like(ids)
    right[0, -3:] = 0
    hole = mask.clone()
    hole[2, -4] = 0
    custom = torch.ones(ids.shape[0], 1, PROMPT, PROMPT, dtype=torch.bool).tril()
    cases = [
        (right, NotImplementedError, "left padding only"),
        (hole, NotImplementedError, "row 2 is not"),
        (custom, NotImplementedError, "custom mask"),
        (mask[:, 1:], ValueError, "attention_mask covers"),
    ]
    with torch.no_grad():
        for m, exc, words in cases:
            cache = fmha_hf.PagedCache(session=explicit_session)
            with pytest.raises(exc, match=words):
                model(ids, attention_mask=m, past_key_values=cache)
            assert _untouched(cache)
        with pytest.raises(NotImplementedError, match="left padding only"):
            fmha_hf.generate(model, ids, attention_mask=right, max_new_tokens=2, session=explicit_session)
        # After a good step, a bad one leaves the first step's rows.
        cache = fmha_hf.PagedCache(session=explicit_session)
        model(ids, attention_mask=mask, past_key_values=cache)
        step = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        with pytest.raises(NotImplementedError, match="custom mask"):
            model(ids[:, :1], attention_mask=step[:, None, None, :].bool(), past_key_values=cache)
        assert all(layer.get_seq_length() == PROMPT for layer in cache.layers)
        with pytest.raises(ValueError, match="PagedCache"):
            model(ids)  # transformers' own DynamicCache
    assert counted == {"plan": 1, "run": model.config.num_hidden_layers}


def test_mask_functions_other_than_causal_windows_are_refused():
    """The mask function registered for "turbine_fmha" takes transformers'
    causal mask and its sliding-window causal mask, and refuses the same
    window with anything more (an overlay the kernels would drop) or a
    window whose function is not transformers' (checked on positions)."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        or_masks,
        sliding_window_causal_mask_function,
        sliding_window_overlay,
    )

    from turbine_fmha.integrations._hf_masks import padding_mask, sliding_window_of

    assert sliding_window_of(sliding_window_causal_mask_function(8)) == 8
    assert sliding_window_of(causal_mask_function) is None
    kw = dict(batch_size=2, q_length=5, kv_length=5)
    assert padding_mask(mask_function=sliding_window_causal_mask_function(3), **kw) is None

    def extra(b, h, q, kv):
        return kv != 1

    for fn in (
        and_masks(sliding_window_overlay(8), causal_mask_function, extra),
        or_masks(sliding_window_overlay(8), causal_mask_function),
        and_masks(causal_mask_function, sliding_window_overlay(8)),
        and_masks(sliding_window_overlay(0), causal_mask_function),
    ):
        assert sliding_window_of(fn) is None
        with pytest.raises(NotImplementedError, match="with or without a sliding window"):
            padding_mask(mask_function=fn, **kw)


def test_bad_score_terms_are_refused_by_name():
    """A layer's score terms (sliding window, soft-cap, sinks) are checked
    before anything runs, each error naming its argument; sinks are read
    back once per version of their tensor."""
    from turbine_fmha.integrations._hf_masks import _SINKS, Terms, refuse_unsupported

    module = torch.nn.Module()
    bad = [
        ("sliding_window", 0),
        ("sliding_window", 2.5),
        ("softcap", -1.0),
        ("softcap", float("inf")),
        ("softcap", True),
        ("s_aux", torch.zeros(2, 3)),
        ("s_aux", torch.zeros(4, dtype=torch.int32)),
    ]
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            refuse_unsupported(module, 0.0, {name: value})
    sinks = torch.tensor([0.5, -1.0, 2.0])
    terms = refuse_unsupported(module, 0.0, dict(sliding_window=8, softcap=30, s_aux=sinks))
    assert terms == Terms(8, 30.0, np.array([0.5, -1.0, 2.0], np.float32).tobytes())
    assert terms.plan_kwargs()["window_size_left"] == 7
    with torch.no_grad():
        sinks += 1  # a new version is read again
    assert refuse_unsupported(module, 0.0, dict(s_aux=sinks)).sinks == np.float32([1.5, 0.0, 3.0]).tobytes()
    key = id(sinks)
    del sinks
    assert key not in _SINKS


def _windowed(kind, seed=0, window=8, softcap=5.0, sinks=True):
    """A small random model whose layers see sliding windows of `window`
    tokens: Mistral (every layer), Qwen2 (the second layer only, so a step
    plans one full and one windowed attention), Gemma2 (one of each, and
    its attention logits soft-capped at `softcap`) or gpt-oss (a sliding
    layer, then two full ones, and attention sinks: per-layer logits, drawn
    in [0, 3] so that they weigh; with `sinks` False, -1e4: none)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    base, _ = _llama(seed)
    torch.manual_seed(seed)
    cfg = dict(base.config.to_dict(), sliding_window=window)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**cfg))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**cfg, use_sliding_window=window is not None, max_window_layers=1))
        if window is not None:
            assert model.config.layer_types == ["full_attention", "sliding_attention"]
    elif kind == "gemma2":
        layers = ["sliding_attention" if window else "full_attention", "full_attention"]
        cfg.update(sliding_window=window or 4096, query_pre_attn_scalar=64, layer_types=layers)
        model = Gemma2ForCausalLM(Gemma2Config(**cfg, attn_logit_softcapping=softcap, final_logit_softcapping=None))
    else:
        layers = ["sliding_attention" if window else "full_attention", "full_attention", "full_attention"]
        cfg.update(sliding_window=window or 4096, layer_types=layers, num_local_experts=4, num_experts_per_tok=2)
        cfg.update(num_hidden_layers=len(layers))
        model = GptOssForCausalLM(GptOssConfig(**cfg))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.uniform_(0, 3) if sinks else layer.self_attn.sinks.fill_(-1e4)
    model.eval().set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("device_pool", [False, True])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma2", "gpt_oss"])
def test_sliding_window_models_match_eager(explicit_session, counted, kind, padded, device_pool):
    """Sliding-window models (a window of 8 tokens against prompts of 20
    and 16 new tokens; Gemma2's logits soft-capped too, gpt-oss with
    attention sinks) generate HF eager's tokens in float32, left-padded
    batches too, with one plan per kind of score terms per step (gpt-oss's
    two full layers share one, each run with its own sinks). The terms matter: without the
    window (or the soft-cap, or the sinks) eager's logits differ by far
    more than the tolerance."""
    model = _windowed(kind)
    _, ids, mask = _left_padded(seed=1)
    if not padded:
        ids, mask = ids[:2], None
        ids[:] = torch.randint(0, model.config.vocab_size, ids.shape)
    kw = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, **kw)
        others = [_windowed(kind, window=None)]
        others += [_windowed(kind, softcap=None)] if kind == "gemma2" else []
        others += [_windowed(kind, sinks=False)] if kind == "gpt_oss" else []
        for other in others:
            kept = {n: p.clone() for n, p in other.named_parameters() if n.endswith("sinks") and p.max() < 0}
            other.load_state_dict(dict(model.state_dict(), **kept))
        without = [other.generate(ids, attention_mask=mask, **kw) for other in others]
        got = fmha_hf.generate(model, ids, attention_mask=mask, session=explicit_session, device_pool=device_pool, **kw)
    assert len(set(ref.sequences[:, PROMPT:].flatten().tolist())) > 4, "degenerate model: the test would prove little"
    np.testing.assert_array_equal(got.sequences.numpy(), ref.sequences.numpy())
    # f32 differs from eager only in summation order (as for Llama above).
    assert _max_logit_diff(got, ref) < 1e-3
    assert all(_max_logit_diff(w, ref) > 0.1 for w in without)
    terms = 1 if kind == "mistral" else 2  # a sliding and a full plan; gpt-oss's full layers share theirs
    assert counted == {"plan": NEW * terms, "run": NEW * model.config.num_hidden_layers}


def test_bad_cache_arguments():
    with pytest.raises(TypeError, match="device_pool"):
        fmha_hf.PagedCache(device_pool="yes")
    with pytest.raises(ValueError, match="page_block_size"):
        fmha_hf.PagedCache(page_block_size=0)


def _dense(layer):
    """A PagedLayer's sequences as DynamicLayer holds them, [b, h, s, d]."""
    rows = [layer.pool.gather(s) for s in layer.seqs]
    return [torch.from_numpy(np.stack([r[i] for r in rows])).transpose(1, 2) for i in (0, 1)]


@pytest.mark.parametrize("device_pool", [False, True])
def test_cache_semantics_match_dynamic_cache(explicit_session, rng, device_pool):
    """Every Cache operation generate uses, applied to PagedCache and to
    transformers' DynamicCache, leaves the same K/V: appends across page
    boundaries and pool growth, beam reorders, batch selection and
    repetition (forks sharing pages) and crop. A device pool hands the
    model stand-ins without memory, and takes a host mirror only once a
    row is forked (chosen twice)."""
    paged = fmha_hf.PagedCache(session=explicit_session, page_block_size=4, device_pool=device_pool)
    dense = DynamicCache()

    def update(batch, n):
        for layer in range(2):
            k, v = (torch.from_numpy(rng.standard_normal((batch, 2, n, 8)).astype(np.float32)) for _ in range(2))
            got = paged.update(k, v, layer)
            dense.update(k, v, layer)
            assert all((t.stride() == (0, 0, 0, 0)) == device_pool for t in got)

    update(3, 5)
    for _ in range(7):
        update(3, 1)  # the pools grow past their first size
    ops = [
        ("reorder_cache", torch.tensor([1, 2, 0]), 3),
        ("reorder_cache", torch.tensor([2, 0, 0]), 3),
        ("batch_select_indices", torch.tensor([1, 2]), 2),
        ("batch_repeat_interleave", 2, 4),
        ("crop", -3, 4),
        ("crop", 0, 4),
    ]
    for i, (op, arg, batch) in enumerate(ops):
        getattr(paged, op)(arg)
        getattr(dense, op)(arg)
        update(batch, 2)
        assert paged.get_seq_length() == dense.get_seq_length()
        assert paged.get_mask_sizes(1, 0) == dense.get_mask_sizes(1, 0)
        for p, d in zip(paged.layers, dense.layers):
            assert (p.pool.k_dev is not None) == device_pool
            assert (p.pool.k is None) == (device_pool and i == 0)  # the mirror came with the first fork
            for got, want in zip(_dense(p), (d.keys, d.values)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fixed_pool_raises_when_full():
    cache = fmha_hf.PagedCache(page_block_size=4, num_pages=2)
    cache.update(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), 0)
    with pytest.raises(CacheFullError):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)


@pytest.mark.parametrize("device_pool", [False, True])
def test_a_step_costs_one_write_per_layer_whatever_the_batch(explicit_session, counted, monkeypatch, device_pool):
    """The prompt forward and each decode step of a batch of 6
    write each layer's new K/V with one call (one append-kernel call for a
    device pool), build the block tables once (the plan every layer runs)
    and read back from the device at most once, for the step's finiteness
    checks of every layer's pool. A write per sequence, each reading its
    rows' finiteness back, once made the step's cost grow with the batch
    (on the H200, 75 ms a decode step at batch 32 against HF's 5 ms)."""
    model, _ = _llama()
    fmha_hf.enable(model)
    ids = torch.randint(0, model.config.vocab_size, (6, PROMPT))
    counts = collections.Counter()
    for owner, name in (
        (PagedKVCache, "append"),
        (PagedKVCache, "append_batch"),
        (PagedKVCache, "batch"),
        (cache_mod, "run_append"),
        (torch.Tensor, "cpu"),
    ):
        real = getattr(owner, name, None)
        if real is not None:

            def wrapped(*a, _real=real, _name=name, **k):
                counts[_name] += 1
                return _real(*a, **k)

            monkeypatch.setattr(owner, name, wrapped)
    layers = model.config.num_hidden_layers
    cache = fmha_hf.PagedCache(session=explicit_session, device_pool=device_pool)
    with torch.no_grad():
        for step in range(4):  # the prompt, then decode steps
            counts.clear()
            counted.update(plan=0, run=0)
            ids = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
            assert counts["append"] + counts["append_batch"] == layers, (step, counts)
            assert counts["run_append"] == (layers if device_pool else 0), (step, counts)
            assert counts["batch"] == 1 and counts["cpu"] <= 1, (step, counts)
            assert counted == {"plan": 1, "run": layers}
    assert cache.get_seq_length() == PROMPT + 3


def _poison_a_free_page(layer):
    """Writes NaN V rows into the page that the layer's pool hands out
    next, and frees it again: the page keeps its rows (and its mark) and
    the free list its order, so the layers' tables stay alike."""
    pool = layer.pool
    s = pool.allocate()
    rows = np.zeros((pool.page_block_size,) + pool.v.shape[2:], pool.v.dtype)
    pool.append(s, rows, np.full_like(rows, np.nan))
    page = pool.pages(s)[0]
    pool.free(s)
    return page


def test_each_step_plans_once_claiming_finite_rows_only_where_checked(explicit_session, monkeypatch):
    """One plan per step serves every layer, so its kv_rows_finite (which
    lets GPU kernels skip the stale-row guard) covers every layer's pool:
    a left-padded prompt, whose own pad rows are stale rows nobody has
    checked, plans guarded; later steps check every pool's rows (written
    before the step: the rows a step writes are its keys) and claim finite
    only while all are, here until a NaN row lands in one layer's free page
    (a fact about the pool that holds until the row is overwritten)."""
    claims = []
    real = turbine_fmha.PagedAttention.plan
    monkeypatch.setattr(
        turbine_fmha.PagedAttention,
        "plan",
        lambda self, *a, **k: claims.append(k["kv_rows_finite"]) or real(self, *a, **k),
    )
    model, ids, mask = _left_padded(seed=0)
    fmha_hf.enable(model)
    cache = fmha_hf.PagedCache(session=explicit_session)
    with torch.no_grad():
        step = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
        for i in range(3):
            if i == 2:
                _poison_a_free_page(cache.layers[-1])
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            step = model(step, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
    assert claims == [False, True, True, False]
    claims.clear()
    model, ids = _llama()
    with torch.no_grad():
        fmha_hf.generate(model, ids, session=explicit_session, max_new_tokens=3, do_sample=False)
    assert claims == [True, True, True]  # unpadded: the prompt's rows are all keys


def test_stale_nan_rows_never_reach_unguarded_kernels(online_session, monkeypatch):
    """End to end on kernels that skip the stale-row guard where they may
    (the online formulation): NaN V rows in a free page of every layer but
    the one that plans become stale rows of the first sequence that takes
    that page (the tail of its new last page). The step's single plan then
    runs the guarded kernels, and the logits are those of a run without
    the poison. Claiming finite as the planning layer's own pool is gives
    NaN."""
    model, ids = _llama(seed=4)
    fmha_hf.enable(model)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        seq = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        fmha_hf.enable(model)

        def logits(poison):
            cache = fmha_hf.PagedCache(session=online_session)
            out = [model(seq[:, :PROMPT], past_key_values=cache).logits[:, -1]]
            pages = [_poison_a_free_page(layer) for layer in cache.layers[1:]] if poison else []
            guards = []
            for i in range(PROMPT, seq.shape[1] - 1):
                out.append(model(seq[:, i : i + 1], past_key_values=cache).logits[:, -1])
                guards.append(online_session.last_variant.v_guard)
            if poison:  # the first sequence took the poisoned page, past its 32nd row
                assert all(layer.pool.pages(layer.seqs[0])[-1] == p for layer, p in zip(cache.layers[1:], pages))
            return torch.stack(out), guards

        clean, guards = logits(poison=False)
        assert not any(guards), "the clean run had no unguarded kernel: the test would prove nothing"
        poisoned, guards = logits(poison=True)
        assert all(guards)
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(fmha_hf, "all_values_finite", lambda pools: pools[0].values_finite)
        wrong, _ = logits(poison=True)
    assert torch.isnan(wrong).any()
