#!/usr/bin/env python3
"""A gpt-oss-shaped Hugging Face decode step through the integration, with
one plan per kind of layer per step (each layer's run brings its own sinks:
PagedAttention.run(sinks=...)) against one plan per layer (what the
integration did while sinks were a plan argument only, reproduced here by
keying plans on the sinks' values), rounds interleaved, HF eager timed the
same way in the same process. A random model from GptOssConfig (nothing
downloaded): layers alternating sliding (window 128) and full attention,
32/8 heads of 64, per-layer sinks in [0, 3]. Wall time of back-to-back
single-token forwards on a cache filled by the prompt, per step; the
tokens of the two plan keyings are checked equal.

    .venv/bin/python benchmarks/probes/hf_sinks_step.py --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--artifacts", default=None, help="prebuilt artifacts (else compiled into --cache-dir)")
    ap.add_argument("--cache-dir", default="build/hf-sinks-step")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--calls", type=int, default=8, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import GptOssConfig, GptOssForCausalLM

    import turbine_fmha
    from turbine_fmha.integrations import _hf_masks
    from turbine_fmha.integrations import transformers as fmha_hf

    torch.set_num_threads(2 if args.device == "cpu" else torch.get_num_threads())
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.artifacts:
        session = turbine_fmha.Session(args.device, artifact_dir=args.artifacts)
    else:
        session = turbine_fmha.Session(args.device, compile_missing=True, cache_dir=args.cache_dir)
    torch.manual_seed(0)
    layers = ["sliding_attention", "full_attention"] * (args.layers // 2)
    cfg = GptOssConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=len(layers),
        layer_types=layers,
        sliding_window=128,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = GptOssForCausalLM(cfg).to(dtype).to(dev).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.uniform_(0, 3)
    print(
        f"gpt-oss config: {len(layers)} layers (sliding 128 / full), hidden 512, 32/8 heads of 64, {dtype} on {dev}; "
        f"batch {args.batch}, prompt {args.prompt}; transformers {transformers.__version__}, torch {torch.__version__}"
    )

    shared = _hf_masks.Terms.planned

    def per_layer(self):
        return self.window, self.softcap, self.sinks

    plans = {"n": 0}
    real_plan = turbine_fmha.PagedAttention.plan

    def counted(self, *a, **k):
        plans["n"] += 1
        return real_plan(self, *a, **k)

    turbine_fmha.PagedAttention.plan = counted

    def sync():
        if dev != "cpu":
            torch.cuda.synchronize()

    ways = {
        "ours, a plan per kind": ("ours", shared),
        "ours, a plan per layer": ("ours", per_layer),
        "HF eager": ("eager", None),
    }
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device=dev)
    caches, toks, seqs = {}, {}, {}
    with torch.no_grad():
        for name, (impl, key) in ways.items():
            if impl == "ours":
                _hf_masks.Terms.planned = key
                fmha_hf.enable(model)
                pages = args.batch * (-(-(args.prompt + (args.rounds + 1) * args.calls + 16) // 16) + 1)
                caches[name] = fmha_hf.PagedCache(session=session, num_pages=pages)
            else:
                model.set_attn_implementation(impl)
                caches[name] = transformers.DynamicCache(config=model.config)
            out = model(prompt, past_key_values=caches[name], use_cache=True)
            toks[name] = out.logits[:, -1:].argmax(-1)
            seqs[name] = []
        sync()
        times = {name: [] for name in ways}
        per_step = {}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, (impl, key) in list(ways.items())[:: 1 if r % 2 else -1]:
                if impl == "ours":
                    _hf_masks.Terms.planned = key
                    fmha_hf.enable(model)
                else:
                    model.set_attn_implementation(impl)
                before = plans["n"]
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    out = model(toks[name], past_key_values=caches[name], use_cache=True)
                    toks[name] = out.logits[:, -1:].argmax(-1)
                    seqs[name].append(toks[name])
                sync()
                if r:
                    times[name].append((time.perf_counter() - t0) * 1e3 / args.calls)
                per_step[name] = (plans["n"] - before) / args.calls
    _hf_masks.Terms.planned = shared
    same = all(torch.equal(a, b) for a, b in zip(seqs["ours, a plan per kind"], seqs["ours, a plan per layer"]))
    print(f"tokens of the two plan keyings equal: {same}")
    hf = statistics.median(times["HF eager"])
    print(f"{'':26s} {'step ms (median)':>17s} {'rounds':>30s} {'plans/step':>10s} {'x HF eager':>10s}")
    for name in ways:
        med = statistics.median(times[name])
        rounds = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:26s} {med:17.2f} {rounds:>30s} {per_step[name]:10.1f} {hf / med:10.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
