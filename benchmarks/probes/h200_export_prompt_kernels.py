#!/usr/bin/env python3
"""Where an exported decoder program's prompt call spends its device time:
the GPU kernels of one prompt call of a program from
examples/export_decoder.py (--save), under torch.profiler (CUPTI sees
every kernel of the process, IREE's included), against the call's wall
time.

    python3 benchmarks/probes/h200_export_prompt_kernels.py --vmfb build/h200-export/bench_f16_b1x2048_online.vmfb \\
        --batch 1 --prompt-len 2048 [--model bench --dtype f16 --layers 4 --new-tokens 32]
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import export_decoder  # noqa: E402
import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vmfb", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    dtype = {"f32": torch.float32, "f16": torch.float16}[args.dtype]
    model = export_decoder.llama(0, args.layers, **export_decoder.MODELS[args.model], dtype=dtype)
    num_pages = args.batch * -(-(args.prompt_len + args.new_tokens) // export_decoder.PAGE)
    program = export_decoder.load_program(Path(args.vmfb).read_bytes(), model, num_pages, "cuda")
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len)).numpy()

    def call():
        pages = export_decoder.Pages(args.batch, args.prompt_len + args.new_tokens)
        return program(prompts, *pages.step(args.prompt_len))

    for _ in range(3):
        call()
    t0 = time.perf_counter()
    for _ in range(5):
        call()
    wall = (time.perf_counter() - t0) * 1e3 / 5
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    print(f"b{args.batch} x {args.prompt_len}: prompt call {wall:.2f} ms as called, GPU busy {gpu:.2f} ms profiled")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
        print(f"  {e.count:4d} x {e.self_device_time_total / 1e3 / e.count:8.3f} ms  {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
