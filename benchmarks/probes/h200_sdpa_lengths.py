#!/usr/bin/env python3
"""Does HF `sdpa`'s decode step cost the same when every step has a new
key length, as in generation, as when the same lengths repeat, as the
crop-and-repeat harnesses (as_called.py --hf, h200_hf_timeline.py) time
it? And what does torch's cuDNN attention backend have to do with it?

For the Llama-shaped model of as_called.py --hf (4 layers, 32/8 heads of
128, hidden 4096, fp16), per batch x prompt shape, the median decode step
of:
- growing: a token per step on a filled cache, each step's key length new
  (generation), the host synchronized after each step (as generate's
  stopping check does);
- repeated: the same k steps again after a crop (the lengths seen
  before), synchronized after each step;
for HF `sdpa` with torch's default SDPA backends, HF `sdpa` with the
cuDNN backend off (torch.backends.cuda.enable_cudnn_sdp(False)), and the
turbine_fmha per-layer path (PagedCache). Then torch SDPA alone on one
layer's decode shapes, new lengths against repeated ones, both backends.

    python3 benchmarks/probes/h200_sdpa_lengths.py --artifacts artifacts-cuda [--shapes 1x2048,32x128]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import turbine_fmha
from turbine_fmha.integrations import transformers as fmha_hf

PAGE = 16


def model_for(dev):
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
    return LlamaForCausalLM(cfg).to(torch.float16).to(dev).eval()


def steps_ms(model, cache, tok, k):
    """Per-step wall times (ms) of k one-token steps, synchronized each."""
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        out = model(tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--shapes", default="1x2048,32x128")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda:0"
    model = model_for(dev)
    session = turbine_fmha.Session("cuda", artifact_dir=args.artifacts)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    report = {}
    k = args.steps
    with torch.no_grad():
        for spec in args.shapes.split(","):
            b, n = (int(x) for x in spec.split("x"))
            prompt = torch.randint(0, 1024, (b, n), device=dev)
            row = report[spec] = {}
            for name in ("hf_sdpa", "hf_sdpa_no_cudnn", "ours_per_layer"):
                torch.backends.cuda.enable_cudnn_sdp(name != "hf_sdpa_no_cudnn")
                if name.startswith("hf"):
                    model.set_attn_implementation("sdpa")
                    cache = DynamicCache(config=model.config)
                else:
                    fmha_hf.enable(model)
                    cache = fmha_hf.PagedCache(session=session, num_pages=b * (-(-(n + 2 * k + 64) // PAGE) + 1))
                out = model(prompt, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                grow = steps_ms(model, cache, tok, k)  # lengths n+1 .. n+k, each new
                cache.crop(-k)
                again = steps_ms(model, cache, tok, k)  # the same lengths again
                row[name] = dict(growing_ms=statistics.median(grow), repeated_ms=statistics.median(again))
                print(
                    f"b{b} x {n} {name:<18} growing {row[name]['growing_ms']:7.3f} ms "
                    f"(first steps {[round(t, 2) for t in grow[:3]]}), repeated {row[name]['repeated_ms']:7.3f} ms",
                    flush=True,
                )
                del cache
            torch.backends.cuda.enable_cudnn_sdp(True)
            # torch SDPA alone, one layer's decode shapes: [b, 32, 1, 128]
            # against [b, 32, L, 128] (the KV heads repeated, as HF's sdpa
            # path does without enable_gqa).
            for cudnn in (True, False):
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
                q = torch.randn(b, 32, 1, 128, device=dev, dtype=torch.float16)
                kv = torch.randn(b, 32, n + 2 * k, 128, device=dev, dtype=torch.float16)
                res = {}
                for mode, lengths in (("new", range(n + k, n + 2 * k)), ("repeated", range(n + k, n + 2 * k))):
                    ts = []
                    for L in lengths:
                        t0 = time.perf_counter()
                        torch.nn.functional.scaled_dot_product_attention(q, kv[:, :, :L], kv[:, :, :L])
                        torch.cuda.synchronize()
                        ts.append((time.perf_counter() - t0) * 1e3)
                    res[mode] = statistics.median(ts)
                row[f"sdpa_alone_{'cudnn' if cudnn else 'no_cudnn'}"] = res
                print(
                    f"b{b} x {n} torch SDPA alone, cuDNN {'on ' if cudnn else 'off'}: "
                    f"new lengths {res['new']:.3f} ms, repeated {res['repeated']:.3f} ms",
                    flush=True,
                )
            torch.backends.cuda.enable_cudnn_sdp(True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
