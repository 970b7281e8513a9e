#!/usr/bin/env python3
"""Where the Hugging Face path's host time goes on a GPU: cProfile of the
prompt forward (a fresh PagedCache each time, as as_called.py --hf times
it) and of decode steps (the crop that restores the length outside), for the Llama-shaped model of as_called.py --hf
(4 layers, 32/8 heads of 128, fp16). Prints the top functions by
cumulative and by own time.

    python3 benchmarks/probes/h200_hf_profile.py --artifacts artifacts-cuda [--batch 1 --context 2048]
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import turbine_fmha
from turbine_fmha.integrations import transformers as fmha_hf


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).to(torch.float16).to("cuda:0").eval()
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    fmha_hf.enable(model)
    b, n = args.batch, args.context
    prompt = torch.randint(0, 1024, (b, n), device="cuda:0")

    def make():
        return fmha_hf.PagedCache(session=session, num_pages=b * (-(-(n + 64) // 16) + 1))

    with torch.no_grad():
        cache = make()
        out = model(prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for name, fn, undo in (
            ("prompt forward", lambda: model(prompt, past_key_values=make(), use_cache=True), lambda k: None),
            # The crop (a copy of the kept rows) restores the length between
            # rounds, outside the timed and profiled steps.
            ("decode step", lambda: model(tok, past_key_values=cache, use_cache=True), lambda k: cache.crop(-k)),
        ):
            fn()
            torch.cuda.synchronize()
            undo(1)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            torch.cuda.synchronize()
            print(f"\n== {name} b{b} x {n}: {(time.perf_counter() - t0) * 1e3 / args.steps:.2f} ms", flush=True)
            undo(args.steps)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.steps):
                fn()
            torch.cuda.synchronize()
            pr.disable()
            undo(args.steps)
            for key in ("cumulative", "tottime"):
                pstats.Stats(pr).sort_stats(key).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
