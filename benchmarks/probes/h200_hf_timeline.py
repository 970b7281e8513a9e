#!/usr/bin/env python3
"""Where a Hugging Face decode step's wall time goes on a GPU, HF `sdpa`
against the turbine_fmha integration, for the Llama-shaped model of
as_called.py --hf (4 layers, 32/8 heads of 128, fp16):

- the step's wall time, steps back to back (the crop that restores the
  length outside the timing, as as_called.py does);
- ours split by phase: timers around the integration's functions (the KV
  write, the plan, the attention call, torch's stream sync, the wait),
  summed per step, unprofiled;
- torch.profiler over a few steps of each: the host calls that block
  (cudaStreamSynchronize, cudaMemcpyAsync, ...) and the GPU's busy time
  over the window (kernels of every context: IREE's too).

    python3 benchmarks/probes/h200_hf_timeline.py --artifacts artifacts-cuda [--shapes 1x2048,32x128] [--trace-dir DIR]
"""

import argparse
import collections
import functools
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import turbine_fmha
from turbine_fmha.api import cache as api_cache
from turbine_fmha.core import arrays as core_arrays
from turbine_fmha.integrations import transformers as fmha_hf
from turbine_fmha.runtime import executor as rt_executor
from turbine_fmha.runtime import invoke
from turbine_fmha.runtime import session as rt_session

PAGE = 16

# (owner, attribute, label): the functions timed in our step.
PHASES = [
    (fmha_hf.PagedLayer, "update", "update (KV write)"),
    (api_cache.PagedKVCache, "append_batch", "  append_batch"),
    (api_cache.PagedKVCache, "_torch_write", "    _torch_write"),
    (api_cache, "_nonfinite_flags", "    _nonfinite_flags"),
    (fmha_hf.PagedLayer, "attend", "attend"),
    (fmha_hf._Planner, "planned", "  planned (plan once a step)"),
    (rt_executor.Executor, "run", "  Executor.run"),
    (rt_executor.Executor, "_arrays", "    _arrays"),
    (core_arrays, "torch_writes_done", "    torch stream sync"),
    (rt_session.Session, "run_variants", "    run_variants"),
    (invoke.Loaded, "enqueue", "      enqueue"),
    (rt_session, "wait_all", "      wait_all"),
]


class Timers:
    def __init__(self):
        self.total = collections.Counter()
        self.count = collections.Counter()
        self.saved = []

    def install(self):
        for owner, name, label in PHASES:
            fn = getattr(owner, name)
            self.saved.append((owner, name, fn))

            def wrap(fn=fn, label=label):
                @functools.wraps(fn)
                def timed(*a, **k):
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        self.total[label] += time.perf_counter() - t0
                        self.count[label] += 1

                return timed

            w = wrap()
            setattr(owner, name, staticmethod(w) if isinstance(owner, type) and _is_static(owner, name) else w)

    def uninstall(self):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)
        self.saved = []


def _is_static(owner, name) -> bool:
    return isinstance(owner.__dict__.get(name), staticmethod)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--shapes", default="1x2048,32x128")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        help="also cProfile each run's steps: the top N functions (all modules, by cumulative and own time)",
    )
    ap.add_argument(
        "--order",
        default="hf,ours",
        help="the runs per shape, in order; a name again (hf,ours,hf) shows whether our run slows HF's after it",
    )
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the probe itself (float32, hidden 256)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=4096 if args.device == "cuda" else 256,
        intermediate_size=1024 if args.device == "cuda" else 256,
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
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    model = LlamaForCausalLM(cfg).to(torch.float16 if dev != "cpu" else torch.float32).to(dev).eval()
    session = turbine_fmha.Session(args.device, artifact_dir=args.artifacts, compile_missing=dev == "cpu")
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    report = {}
    for spec in args.shapes.split(","):
        b, n = (int(x) for x in spec.split("x"))
        prompt = torch.randint(0, 1024, (b, n), device=dev)
        row = report[spec] = {}
        with torch.no_grad():
            seen = collections.Counter()
            for name in args.order.split(","):
                seen[name] += 1
                label = name if seen[name] == 1 else f"{name}_{seen[name]}"
                if name == "hf":
                    model.set_attn_implementation("sdpa")
                    cache = DynamicCache(config=model.config)
                else:
                    fmha_hf.enable(model)
                    cache = fmha_hf.PagedCache(session=session, num_pages=b * (-(-(n + 64) // PAGE) + 1))
                out = model(prompt, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)

                def steps(cache, k, timers=None):
                    """The wall time of k steps in ms a step; the crop that
                    restores the length runs after, untimed."""
                    if timers is not None:
                        timers.install()
                    try:
                        t0 = time.perf_counter()
                        for _ in range(k):
                            model(tok, past_key_values=cache, use_cache=True)
                        sync()
                        wall = (time.perf_counter() - t0) * 1e3 / k
                    finally:
                        if timers is not None:
                            timers.uninstall()
                    cache.crop(-k)
                    return wall

                steps(cache, 3)
                walls = []
                for _ in range(3):
                    walls.append(steps(cache, args.steps))
                row[f"{label}_step_ms"] = sorted(walls)[1]
                print(
                    f"\n== b{b} x {n} {label}: decode step {row[f'{label}_step_ms']:.3f} ms (rounds {walls})",
                    flush=True,
                )
                if label == "ours":
                    timers = Timers()
                    wall = steps(cache, args.steps, timers)
                    print(f"  timed step (timers on): {wall:.3f} ms; per step:")
                    phases = {}
                    for _, _, phase in PHASES:
                        ms = timers.total[phase] * 1e3 / args.steps
                        phases[phase.strip()] = round(ms, 4)
                        print(f"  {phase:<34} {ms:8.3f} ms  ({timers.count[phase] / args.steps:.0f} calls)")
                    row["ours_phases_ms"] = phases
                if args.cprofile:
                    import cProfile
                    import pstats

                    pr = cProfile.Profile()
                    steps(cache, args.steps, types.SimpleNamespace(install=pr.enable, uninstall=pr.disable))
                    for key in ("cumulative", "tottime"):
                        pstats.Stats(pr).sort_stats(key).print_stats(args.cprofile)
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev != "cpu" else [])
                with profile(activities=acts) as prof:
                    t0 = time.perf_counter()
                    for _ in range(args.profile_steps):
                        model(tok, past_key_values=cache, use_cache=True)
                    sync()
                    window = (time.perf_counter() - t0) * 1e6
                cache.crop(-args.profile_steps)
                events = prof.key_averages()
                gpu = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
                print(
                    f"  profiled {args.profile_steps} steps: window {window / args.profile_steps / 1e3:.3f} ms a step, "
                    f"GPU busy (torch's view) {gpu / args.profile_steps / 1e3:.3f} ms a step"
                )
                host = sorted(
                    (e for e in events if e.key.startswith("cuda") or e.key.startswith("cu")),
                    key=lambda e: -e.self_cpu_time_total,
                )[:10]
                for e in host:
                    print(
                        f"    {e.key:<40} {e.count / args.profile_steps:6.1f}/step "
                        f"{e.self_cpu_time_total / args.profile_steps / 1e3:8.3f} ms/step"
                    )
                kernels = sorted(
                    (e for e in events if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total
                )[:8]
                for e in kernels:
                    print(
                        f"    gpu {e.key[:60]:<60} {e.count / args.profile_steps:6.1f}/step "
                        f"{e.self_device_time_total / args.profile_steps / 1e3:8.3f} ms/step"
                    )
                row[f"{label}_profiled"] = dict(
                    window_ms=round(window / args.profile_steps / 1e3, 3),
                    gpu_ms=round(gpu / args.profile_steps / 1e3, 3),
                    host_calls={e.key: round(e.self_cpu_time_total / args.profile_steps / 1e3, 4) for e in host},
                )
                if args.trace_dir:
                    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                    prof.export_chrome_trace(str(Path(args.trace_dir) / f"{label}_b{b}x{n}.json"))
                del cache
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
