#!/usr/bin/env python3
"""A whole decoder step as one IREE program.

Builds a small Llama (random weights, nothing downloaded) and a torch
module that runs its forward over a paged KV cache: for each layer the
projections and rotary embedding (HF's own modules), the cache write
(`turbine_fmha.reshape_and_cache` into the layer's pages, which the
export keeps as mutable globals of the program), `turbine_fmha.fmha_fwd_paged` (the paged kernel,
inside the program) and the MLP. `iree.turbine.aot.export` exports it
once, with dynamic batch, rows and table width, so one program serves
both phases: a prefill of the prompts' rows and a decode of one row per
sequence. It is compiled for the host CPU and driven with iree.runtime
and numpy alone (the host keeps only the block table and the slots).
Greedy generation must give HF eager's tokens in float32 (exit status 1
otherwise).

--formulation online exports two functions of one module instead, for a
static --batch: `prefill`, a bucket of --prompt-len rows, and `decode`,
both on the GPUs' online kernel (turbine_fmha.export_options); they
share the caches. (compile_program without prompt_rows keeps an explicit
`prefill` of any row count.)

--model bench --dtype f16 is the Llama shape of benchmarks/as_called.py
--hf (32/8 heads of 128, hidden 4096); a half-precision run is checked by
its prompt logits against HF eager in float32, beside HF's own error in
that precision, rather than by identical tokens.

--time also times a decode step and the prompt's forward as called: the
exported program, HF with turbine_fmha's per-layer path (PagedCache), and
HF's own `sdpa` attention, in the same process. Every HF decode step has
a new key length, as in generation.

    .venv/bin/python examples/export_decoder.py
    .venv/bin/python examples/export_decoder.py --batch 4 --new-tokens 16 --time
    python3 examples/export_decoder.py --device cuda --model bench --dtype f16 --layers 4 --batch 8 \
        --prompt-len 512 --new-tokens 32 --formulation online --save build/h200-export/b8.vmfb
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import turbine_fmha  # noqa: E402

PAGE = 16


def small_llama(seed: int, layers: int = 2) -> LlamaForCausalLM:
    # initializer_range 0.2 (HF's default is 0.02): a random model with
    # the default repeats one token, and equal streams would say little.
    return llama(seed, layers, **MODELS["small"])


# The model shapes --model picks. "bench" is the model of benchmarks/as_called.py
# --hf (the as-called Hugging Face rows): 32/8 heads of 128, hidden 4096.
MODELS = {
    "small": dict(vocab=256, hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=32, init=0.2),
    "bench": dict(vocab=1024, hidden=4096, intermediate=1024, heads=32, kv_heads=8, head_dim=128, init=0.02),
}


def llama(seed, layers, *, vocab, hidden, intermediate, heads, kv_heads, head_dim, init, dtype=torch.float32):
    """A random LlamaForCausalLM (nothing downloaded), eager attention, in `dtype`."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("eager")
    return model


class PagedDecoder(torch.nn.Module):
    """`model`'s forward over paged caches held as buffers (one K and one V
    pool per layer, [num_pages, PAGE, nhead_k, head_dim]).

    forward(tokens [B, S], positions [B, S], slots [B, S], block_table
    [B, W], seqlen_k [B]) -> logits [B, S, vocab]: the S new tokens of
    each sequence at `positions`, their K/V written at `slots` (page *
    PAGE + row), attending causally to the sequence's seqlen_k keys
    (those new rows included) through its block table."""

    def __init__(self, model: LlamaForCausalLM, num_pages: int):
        super().__init__()
        cfg = model.config
        self.model = model
        self.hq, self.hk, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        shape = (num_pages, PAGE, self.hk, self.d)
        dtype = model.lm_head.weight.dtype  # the caches hold K/V in the model's dtype
        for i in range(cfg.num_hidden_layers):
            self.register_buffer(f"k_cache{i}", torch.zeros(shape, dtype=dtype))
            self.register_buffer(f"v_cache{i}", torch.zeros(shape, dtype=dtype))

    def forward(self, tokens, positions, slots, block_table, seqlen_k):
        inner = self.model.model
        b, s = tokens.shape
        h = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(h, positions)
        flat = slots.reshape(-1)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, s, self.hq, self.d).transpose(1, 2)
            k = attn.k_proj(x).view(b, s, self.hk, self.d).transpose(1, 2)
            v = attn.v_proj(x).view(b, s, self.hk, self.d)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_cache, v_cache = getattr(self, f"k_cache{i}"), getattr(self, f"v_cache{i}")
            turbine_fmha.reshape_and_cache(k.transpose(1, 2), v, k_cache, v_cache, flat)
            out = turbine_fmha.fmha_fwd_paged(
                q.transpose(1, 2).contiguous(), k_cache, v_cache, block_table, seqlen_k, causal=True
            )
            h = h + attn.o_proj(out.reshape(b, s, self.hq * self.d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h))


# The compiler flags of each place the program can run (the kernels'
# own table, build/targets.py, holds the same for the artifacts).
TARGETS = {
    "cpu": (
        "local-task",
        [
            "--iree-hal-target-device=local",
            "--iree-hal-local-target-device-backends=llvm-cpu",
            "--iree-llvmcpu-target-cpu=host",
        ],
    ),
    "cuda": ("cuda", ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"]),
}


def _example(batch: int, rows: int) -> tuple:
    # Distinct tensors: torch.export ties inputs that are one tensor.
    return (
        torch.zeros(batch, rows, dtype=torch.int64),
        torch.zeros(batch, rows, dtype=torch.int64),
        torch.zeros(batch, rows, dtype=torch.int64),
        torch.zeros(batch, 4, dtype=torch.int32),
        torch.ones(batch, dtype=torch.int32),
    )


def compile_program(
    model: LlamaForCausalLM,
    num_pages: int,
    device: str = "cpu",
    formulation: str = "explicit",
    batch: int = 0,
    prompt_rows: int = 0,
    num_splits: int | None = None,
) -> bytes:
    """The decoder step exported with iree-turbine and compiled for
    `device`. With the explicit formulation: a vmfb whose `main(tokens,
    positions, slots, block_table, seqlen_k)` returns the logits, for any
    batch and row count. With "online": two functions of one module that
    share its caches, `prefill` (any row count, the explicit kernel) and
    `decode` (one row, the GPUs' online kernel), both for `batch`
    sequences; with `prompt_rows`, `prefill` is a bucket of that many rows
    on the online kernel too (then the only row count it takes), and with
    `num_splits` the decode's keys in that many merged splits. The
    weights and caches are the program's parameters (scope
    "model"), named as in the module's state_dict: the vmfb holds no
    weights, and whoever loads it supplies them (load_program)."""
    import iree.compiler as ic
    from iree.turbine import aot

    module = PagedDecoder(model, num_pages)
    aot.externalize_module_parameters(module, external_scope="model")
    rows, width = torch.export.Dim("rows"), torch.export.Dim("width")
    with torch.no_grad():
        if formulation == "explicit":
            b = torch.export.Dim("batch")
            dims = [{0: b, 1: rows}, {0: b, 1: rows}, {0: b, 1: rows}, {0: b, 1: width}, {0: b}]
            exported = aot.export(module, args=_example(2, 3), dynamic_shapes=dims)
        else:
            fxb = aot.FxProgramsBuilder(module)
            names = ("tokens", "positions", "slots", "block_table", "seqlen_k")

            def step(m, tokens, positions, slots, block_table, seqlen_k):
                return m.forward(tokens, positions, slots, block_table, seqlen_k)

            one = dict(zip(names, [None, None, None, {1: width}, None]))
            if prompt_rows:
                with turbine_fmha.export_options(formulation=formulation):
                    fxb.export_program(
                        step, name="prefill", args=_example(batch, prompt_rows), dynamic_shapes=one, strict=False
                    )
            else:
                many = dict(zip(names, [{1: rows}, {1: rows}, {1: rows}, {1: width}, None]))
                fxb.export_program(step, name="prefill", args=_example(batch, 3), dynamic_shapes=many, strict=False)
            with turbine_fmha.export_options(formulation=formulation, num_splits=num_splits):
                fxb.export_program(step, name="decode", args=_example(batch, 1), dynamic_shapes=one, strict=False)
            exported = aot.export(fxb)
    return ic.compile_str(str(exported.mlir_module), extra_args=TARGETS[device][1])


def load_program(vmfb: bytes, model: LlamaForCausalLM, num_pages: int, device: str = "cpu"):
    """`vmfb` loaded on `device` with `model`'s weights as its parameters and
    zeroed caches: a function of numpy arrays (tokens, positions, slots,
    block_table, seqlen_k) -> logits (numpy)."""
    import iree.runtime as rt

    config = rt.Config(TARGETS[device][0])
    index = rt.ParameterIndex()
    weights = []  # the index reads these arrays' memory: keep them alive
    for name, tensor in PagedDecoder(model, num_pages).state_dict().items():
        array = tensor.detach().cpu().contiguous().numpy()
        if name.startswith(("k_cache", "v_cache")):
            index.add_splat(name, np.zeros(1, array.dtype).tobytes(), array.nbytes)
        else:
            weights.append(array)
            index.add_buffer(name, array)
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model")))
    vm_module = rt.VmModule.copy_buffer(config.vm_instance, vmfb)
    ctx.add_vm_module(vm_module)
    module = ctx.modules.module
    two = "decode" in vm_module.function_names

    def program(*arrays):
        # main serves every call; a two-function program, decode its
        # one-row calls and prefill the rest.
        if not two:
            return module["main"](*arrays).to_host()
        return module["decode" if arrays[0].shape[1] == 1 else "prefill"](*arrays).to_host()

    program.weights = weights
    return program


def export_program(
    model: LlamaForCausalLM, num_pages: int, device: str = "cpu", formulation="explicit", batch=0, prompt_rows=0
):
    """compile_program then load_program, in one process."""
    vmfb = compile_program(model, num_pages, device, formulation, batch, prompt_rows)
    return load_program(vmfb, model, num_pages, device)


class Pages:
    """The host's side of the program's caches: each sequence's pages and
    length (the caches themselves live in the program)."""

    def __init__(self, batch: int, max_len: int):
        self.per = -(-max_len // PAGE)
        # Pages interleaved across sequences, not in order: the kernel
        # gathers through the table, whatever the order.
        self.table = np.arange(batch * self.per, dtype=np.int32).reshape(self.per, batch).T.copy()
        self.length = np.zeros(batch, np.int32)

    def step(self, n: int):
        """positions, slots, block_table, seqlen_k for n new rows each."""
        pos = self.length[:, None] + np.arange(n)[None, :]
        page = np.take_along_axis(self.table, pos // PAGE, 1)
        slots = page.astype(np.int64) * PAGE + pos % PAGE
        self.length = self.length + n
        return pos.astype(np.int64), slots, self.table, self.length.copy()


def generate_exported(program, prompts: np.ndarray, new_tokens: int, times: list | None = None) -> np.ndarray:
    """Greedy tokens [batch, prompt + new_tokens] from the program: one
    prefill call over the prompts, then one decode call per token."""
    pages = Pages(prompts.shape[0], prompts.shape[1] + new_tokens)
    seq = prompts
    logits = program(prompts, *pages.step(prompts.shape[1]))
    for i in range(new_tokens):
        nxt = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        seq = np.concatenate([seq, nxt], 1)
        if i + 1 < new_tokens:
            t0 = time.perf_counter()
            logits = program(nxt, *pages.step(1))
            if times is not None:
                times.append(time.perf_counter() - t0)
    return seq


def generate_hf(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompts, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)


def _hf_step_ms(model, prompts, new_tokens, cache_factory) -> float:
    """Median wall time of a decode step of HF's own loop (one forward of
    one row per sequence, its cache carried), greedy, back to back, each
    step's token ready on the device before the next (as the exported
    program's logits are on the host)."""
    sync = torch.cuda.synchronize if prompts.is_cuda else lambda: None
    with torch.no_grad():
        cache = cache_factory()
        out = model(prompts, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        sync()
        times = []
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _hf_prompt_ms(model, prompts, reps: int, cache_factory) -> float:
    """Median wall time of the prompt's forward (a fresh cache each)."""
    sync = torch.cuda.synchronize if prompts.is_cuda else lambda: None
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):  # the first warms up
            t0 = time.perf_counter()
            model(prompts, past_key_values=cache_factory(), use_cache=True)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _program_prompt_ms(program, prompts: np.ndarray, new_tokens: int, reps: int) -> float:
    """Median wall time of the program's prompt call (fresh pages each:
    the same slots written again), its logits back on the host."""
    times = []
    for _ in range(reps + 1):
        pages = Pages(prompts.shape[0], prompts.shape[1] + new_tokens)
        t0 = time.perf_counter()
        program(prompts, *pages.step(prompts.shape[1]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _prompt_logits_errors(program, model, prompts: torch.Tensor, new_tokens: int, where: str) -> tuple:
    """(program, HF eager in the model's dtype on `where`), each as max
    |logits - HF eager in float32| / max |HF eager in float32| over the
    prompt: a half-precision program's accuracy beside HF's own at that
    precision (their tokens may differ where two logits nearly tie)."""
    pages = Pages(prompts.shape[0], prompts.shape[1] + new_tokens)
    ours = program(prompts.numpy(), *pages.step(prompts.shape[1])).astype(np.float64)
    ref_model = LlamaForCausalLM(model.config).eval()
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref_model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = ref_model(prompts.cpu()).logits.double().numpy()
        half = model.to(where)(prompts.to(where)).logits.double().cpu().numpy()
    model.to("cpu")
    scale = np.abs(ref).max()
    return float(np.abs(ours - ref).max() / scale), float(np.abs(half - ref).max() / scale)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="small",
        help="bench: the Llama shape of benchmarks/as_called.py --hf (32/8 heads of 128, hidden 4096)",
    )
    ap.add_argument(
        "--dtype",
        choices=["f32", "f16"],
        default="f32",
        help="the model's dtype; f16 is checked by its prompt logits against float32 HF, not by identical tokens",
    )
    ap.add_argument("--device", choices=sorted(TARGETS), default="cpu", help="where the program runs")
    ap.add_argument(
        "--formulation",
        choices=["explicit", "online"],
        default="explicit",
        help="online: a prefill (of --prompt-len rows) and a decode function for --batch, both on the GPUs' "
        "online kernel",
    )
    ap.add_argument(
        "--num-splits",
        type=int,
        default=0,
        help="--formulation online: the decode's keys in this many splits, merged in the kernel",
    )
    ap.add_argument("--save", metavar="VMFB", help="compile for --device, write the program here and stop")
    ap.add_argument("--vmfb", help="run this program (from --save with the same model flags) instead of exporting")
    ap.add_argument("--artifacts", help="--time on cuda: the per-layer path's kernels (turbine-fmha build)")
    ap.add_argument("--time", action="store_true", help="time a decode step against HF's paths, as called")
    ap.add_argument("--json", help="--time: also write the figures here")
    args = ap.parse_args()
    dtype = {"f32": torch.float32, "f16": torch.float16}[args.dtype]

    def make_model():
        return llama(args.seed, args.layers, **MODELS[args.model], dtype=dtype)

    model = make_model()
    torch.manual_seed(args.seed + 1)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len))
    num_pages = args.batch * -(-(args.prompt_len + args.new_tokens) // PAGE)
    t0 = time.perf_counter()
    if args.vmfb:
        vmfb = Path(args.vmfb).read_bytes()
    else:
        bucket = args.prompt_len if args.formulation == "online" else 0
        vmfb = compile_program(
            model, num_pages, args.device, args.formulation, args.batch, bucket, args.num_splits or None
        )
        print(f"exported and compiled for {args.device} in {time.perf_counter() - t0:.1f} s")
    if args.save:
        Path(args.save).write_bytes(vmfb)
        print(f"wrote {args.save} ({len(vmfb)} bytes)")
        return 0
    program = load_program(vmfb, model, num_pages, args.device)
    times: list = []
    ours = generate_exported(program, prompts.numpy(), args.new_tokens, times)
    if dtype == torch.float32:
        hf = generate_hf(model, prompts, args.new_tokens).numpy()
        print("HF eager :", hf[:, args.prompt_len :].tolist())
        print("exported :", ours[:, args.prompt_len :].tolist())
        same = np.array_equal(hf, ours)
        print("tokens identical" if same else "TOKENS DIFFER")
    else:
        # Both round their activations to f16 at every op; the program's
        # ops are fused differently, so its error is not HF's, but a
        # wrong attention (a missed key, a wrong page) would be of the
        # logits' own size, far past twice HF's rounding.
        where = "cuda" if args.device == "cuda" else "cpu"
        err, err_hf = _prompt_logits_errors(program, model, prompts, args.new_tokens, where)
        same = err <= 2 * err_hf
        print(
            f"prompt logits against HF eager in float32 (max error over the largest logit): "
            f"exported {err:.2e}, HF eager in {args.dtype} {err_hf:.2e}"
        )
    print(f"exported program ({args.formulation}): decode step median {statistics.median(times) * 1e3:.2f} ms")
    if args.time:
        from transformers import DynamicCache

        from turbine_fmha.integrations import transformers as fmha_hf

        where = "cuda" if args.device == "cuda" else "cpu"
        on = prompts.to(where)
        reps = 5
        sdpa = make_model().to(where)
        sdpa.set_attn_implementation("sdpa")
        fig = dict(
            batch=args.batch,
            prompt=args.prompt_len,
            new_tokens=args.new_tokens,
            model=args.model,
            layers=args.layers,
            dtype=args.dtype,
            formulation=args.formulation,
            num_splits=args.num_splits,
            device=args.device,
            decode_exported_ms=statistics.median(times) * 1e3,
            decode_hf_sdpa_ms=_hf_step_ms(sdpa, on, args.new_tokens, DynamicCache),
            prompt_exported_ms=_program_prompt_ms(program, prompts.numpy(), args.new_tokens, reps),
            prompt_hf_sdpa_ms=_hf_prompt_ms(sdpa, on, reps, DynamicCache),
        )
        if where == "cuda":
            # torch's cuDNN attention builds a plan per new key length
            # (docs/devlog/benchmarks-history.md, h200_sdpa_lengths): HF sdpa without it
            # is HF at its best in generation.
            torch.backends.cuda.enable_cudnn_sdp(False)
            fig["decode_hf_sdpa_no_cudnn_ms"] = _hf_step_ms(sdpa, on, args.new_tokens, DynamicCache)
            fig["prompt_hf_sdpa_no_cudnn_ms"] = _hf_prompt_ms(sdpa, on, reps, DynamicCache)
            torch.backends.cuda.enable_cudnn_sdp(True)
        del sdpa
        if args.artifacts or where == "cpu":
            paged = make_model().to(where)
            fmha_hf.enable(paged)
            session = turbine_fmha.Session(where, artifact_dir=args.artifacts, compile_missing=where == "cpu")
            fig["decode_per_layer_ms"] = _hf_step_ms(
                paged, on, args.new_tokens, lambda: fmha_hf.PagedCache(session=session)
            )
            fig["prompt_per_layer_ms"] = _hf_prompt_ms(paged, on, reps, lambda: fmha_hf.PagedCache(session=session))
        print(
            f"on {args.device}, batch {args.batch}, prompt {args.prompt_len}, {args.model} model "
            f"({args.layers} layers, {args.dtype}); medians, as called:"
        )
        for what in ("decode", "prompt"):
            line = (
                f"  {what:<6}: exported program ({args.formulation}) {fig[f'{what}_exported_ms']:.2f} ms, "
                f"HF sdpa {fig[f'{what}_hf_sdpa_ms']:.2f} ms ({fig[f'{what}_hf_sdpa_ms'] / fig[f'{what}_exported_ms']:.2f}x)"
            )
            if f"{what}_hf_sdpa_no_cudnn_ms" in fig:
                best = fig[f"{what}_hf_sdpa_no_cudnn_ms"]
                line += f", HF sdpa without cuDNN {best:.2f} ms ({best / fig[f'{what}_exported_ms']:.2f}x)"
            if f"{what}_per_layer_ms" in fig:
                line += f", HF + turbine_fmha per layer {fig[f'{what}_per_layer_ms']:.2f} ms"
            print(line)
        if args.json:
            Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
