#!/usr/bin/env python3
"""How torch's OpenMP threads, spinning after torch's own ops, slow the
CPU kernels that run between them: a Hugging Face decode step (a random
Llama config: 8 layers, hidden 512, 32/8 heads of 64, float32, a 128-token
prompt) through the turbine_fmha integration and through HF `sdpa`, each
in a fresh process per environment (libgomp reads GOMP_SPINCOUNT and
OMP_WAIT_POLICY when it loads), rounds alternating the two paths in each.

    .venv/bin/python benchmarks/probes/cpu_torch_spin.py [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENVS = {"default": {}, "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"}, "GOMP_SPINCOUNT=0": {"GOMP_SPINCOUNT": "0"}}


def child(batch: int, steps: int, cache_dir: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    import turbine_fmha
    from turbine_fmha.integrations import transformers as fmha_hf

    session = turbine_fmha.Session("cpu", compile_missing=True, cache_dir=cache_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (batch, 128))
    times: dict = {"turbine_fmha": [], "HF sdpa": []}
    with torch.no_grad():
        for name in ["turbine_fmha", "HF sdpa"] * 3:
            if name == "turbine_fmha":
                fmha_hf.enable(model)
                cache = fmha_hf.PagedCache(session=session, num_pages=batch * 20)
            else:
                model.set_attn_implementation("sdpa")
                cache = transformers.DynamicCache(config=model.config)
            tok = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(3):
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {name: round(statistics.median(ts), 2) for name, ts in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cache-dir", default="build/hf-sinks-step")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.batch, args.steps, args.cache_dir)))
        return 0
    print(f"HF Llama config decode step, batch {args.batch}, ms per step (median of 3 rounds); lower is faster")
    print("| environment | turbine_fmha | HF sdpa |\n|---|---|---|")
    for label, extra in ENVS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--batch", str(args.batch), "--steps", str(args.steps)]
            + ["--cache-dir", args.cache_dir],
            env=dict(env, **extra),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {label} | {r['turbine_fmha']:.1f} | {r['HF sdpa']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
