#!/usr/bin/env python3
"""A Hugging Face Llama generating with these kernels.

Builds a small randomly initialised Llama (nothing is downloaded), then
runs greedy `model.generate` twice on the same prompts: with HF's eager
attention, and through turbine_fmha.integrations.transformers (a paged KV
cache, prefill and decode on the paged kernels). Prints both token streams
and the largest difference between their logits over the generated steps.
In float32 the tokens must be identical (exit status 1 otherwise); in
float16/bfloat16 they may part once two logits are closer than the
rounding, so the logit difference is what to read there.

The model has 8 query and 8 KV heads of dimension 64 and the cache pages of
16 rows: kernels of the default host set. Missing kernels are compiled
into --cache-dir on first use (a few seconds each).

--padded gives the prompts different lengths, left-padded (HF's batched
generation; both runs get the same attention_mask). --device cuda runs the
model on the GPU with a cuda Session (artifacts from `turbine-fmha build
--targets cuda`, missing ones compiled): the cache's pools then live on
the GPU.

    .venv/bin/python examples/hf_generate.py                   # float32
    .venv/bin/python examples/hf_generate.py --dtype bfloat16 --batch 4
    .venv/bin/python examples/hf_generate.py --padded --batch 3
    .venv/bin/python examples/hf_generate.py --device cuda --padded
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import turbine_fmha  # noqa: E402
from turbine_fmha.integrations import transformers as fmha_hf  # noqa: E402


def small_llama(dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    # initializer_range 0.2, not 0.02: with the default a random model
    # repeats one token, and two token streams agreeing would say little.
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("eager")
    return model


def logit_difference(hf, ours, prompt_len: int) -> tuple[float, int]:
    """The largest logit difference over the steps whose inputs were the
    same in both runs: a row's step i saw the same tokens while the rows
    agreed before i (after that, the logits belong to other texts)."""
    diff, steps = 0.0, 0
    for b in range(hf.sequences.shape[0]):
        for i, (a, c) in enumerate(zip(hf.logits, ours.logits)):
            diff = max(diff, (a[b].float() - c[b].float()).abs().max().item())
            steps += 1
            if hf.sequences[b, prompt_len + i] != ours.sequences[b, prompt_len + i]:
                break
    return diff, steps


def teacher_forced(model, seq, prompt_len: int, mask, cache=None):
    """Logits predicting seq[:, prompt_len:]: one forward over everything,
    or with a cache a prefill and then one decode step per token. `mask`:
    the prompts' attention_mask (None without padding)."""
    full = None if mask is None else torch.cat([mask, torch.ones_like(seq[:, prompt_len:])], 1)

    def upto(i):
        return None if full is None else full[:, :i]

    if cache is None:
        return model(seq, attention_mask=full).logits[:, prompt_len - 1 : -1].double()
    steps = [model(seq[:, :prompt_len], attention_mask=upto(prompt_len), past_key_values=cache).logits[:, -1:]]
    steps += [
        model(seq[:, i : i + 1], attention_mask=upto(i + 1), past_key_values=cache).logits
        for i in range(prompt_len, seq.shape[1] - 1)
    ]
    return torch.cat(steps, 1).double()


def low_precision_errors(model, seq, prompt_len: int, mask, session, dtype) -> tuple[float, float]:
    """Along one float32 token stream, the largest logit error of the
    low-precision model against the float32 one: with HF eager, and with
    turbine_fmha. Comparable even where greedy streams part."""
    ref = teacher_forced(model, seq, prompt_len, mask)
    low = copy.deepcopy(model).to(dtype)
    eager = teacher_forced(low, seq, prompt_len, mask)
    fmha_hf.enable(low)
    ours = teacher_forced(low, seq, prompt_len, mask, fmha_hf.PagedCache(session=session))
    return (eager - ref).abs().max().item(), (ours - ref).abs().max().item()


def prompts_for(args, vocab: int, device):
    """Random prompts [batch, prompt_len] and their attention_mask: None,
    or with --padded row b shortened by 7 * b tokens (wrapping at half the
    length), left-padded with token 0."""
    n = args.prompt_len
    prompts = torch.randint(0, vocab, (args.batch, n), device=device)
    if not args.padded:
        return prompts, None
    mask = torch.ones_like(prompts)
    for b in range(args.batch):
        pad = (7 * b) % max(n // 2, 1)
        prompts[b, :pad] = 0
        mask[b, :pad] = 0
    return prompts, mask


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--padded", action="store_true", help="prompts of different lengths, left-padded")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the model, the session and the cache's pools are",
    )
    ap.add_argument(
        "--artifacts",
        help="built artifacts to use when present (default: artifacts, or artifacts-cuda with --device cuda)",
    )
    ap.add_argument(
        "--cache-dir", default=str(ROOT / "build" / "hf-example-cache"), help="where missing kernels are compiled"
    )
    args = ap.parse_args()
    artifacts = args.artifacts or str(ROOT / ("artifacts" if args.device == "cpu" else "artifacts-cuda"))
    session = turbine_fmha.Session(args.device, artifact_dir=artifacts, compile_missing=True, cache_dir=args.cache_dir)
    model = small_llama(getattr(torch, args.dtype), args.seed).to(args.device)
    n = args.prompt_len
    prompts, mask = prompts_for(args, model.config.vocab_size, args.device)
    kw = dict(
        max_new_tokens=args.new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=mask,
    )
    with torch.no_grad():
        hf = model.generate(prompts, **kw)
        ours = fmha_hf.generate(model, prompts, session=session, **kw)
    print(
        f"{args.device}: pools {'on the device' if args.device != 'cpu' else 'in host memory'}; prompt "
        f"lengths {[n] * args.batch if mask is None else mask.sum(1).tolist()}"
    )
    for b in range(args.batch):
        print(f"sequence {b}, HF eager:     {hf.sequences[b, n:].tolist()}")
        print(f"sequence {b}, turbine_fmha: {ours.sequences[b, n:].tolist()}")
    same = torch.equal(hf.sequences, ours.sequences)
    diff, steps = logit_difference(hf, ours, n)
    scale = max(a.float().abs().max().item() for a in hf.logits)
    print(
        f"{args.dtype}: tokens {'identical' if same else 'differ'}; largest logit difference {diff:.3g} "
        f"(logits up to {scale:.3g}) over the {steps} (sequence, step) pairs where both saw the same tokens"
    )
    if args.dtype != "float32":
        with torch.no_grad():
            f32 = small_llama(torch.float32, args.seed).to(args.device)
            seq = f32.generate(prompts, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False)
            err_eager, err_ours = low_precision_errors(f32, seq, n, mask, session, getattr(torch, args.dtype))
        print(
            f"{args.dtype} against the float32 model along its tokens: largest logit error "
            f"{err_eager:.3g} with HF eager, {err_ours:.3g} with turbine_fmha"
        )
    return 0 if same or args.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
