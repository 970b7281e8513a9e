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
static --batch: `prefill` (the explicit kernel, any row count) and
`decode`, whose attention is the GPUs' online kernel
(turbine_fmha.export_options); they share the caches.

--time also times a decode step as called, back to back: the exported
program, HF with turbine_fmha's per-layer path (PagedCache), and HF's own
`sdpa` attention, in the same process.

    .venv/bin/python examples/export_decoder.py
    .venv/bin/python examples/export_decoder.py --batch 4 --new-tokens 16 --time
"""

from __future__ import annotations

import argparse
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
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
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
        for i in range(cfg.num_hidden_layers):
            self.register_buffer(f"k_cache{i}", torch.zeros(shape))
            self.register_buffer(f"v_cache{i}", torch.zeros(shape))

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
    model: LlamaForCausalLM, num_pages: int, device: str = "cpu", formulation: str = "explicit", batch: int = 0
) -> bytes:
    """The decoder step exported with iree-turbine and compiled for
    `device`. With the explicit formulation: a vmfb whose `main(tokens,
    positions, slots, block_table, seqlen_k)` returns the logits, for any
    batch and row count. With "online": two functions of one module that
    share its caches, `prefill` (any row count, the explicit kernel) and
    `decode` (one row, the GPUs' online kernel), both for `batch`
    sequences. The weights and caches are the program's parameters (scope
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

            many = dict(zip(names, [{1: rows}, {1: rows}, {1: rows}, {1: width}, None]))
            fxb.export_program(step, name="prefill", args=_example(batch, 3), dynamic_shapes=many, strict=False)
            one = dict(zip(names, [None, None, None, {1: width}, None]))
            with turbine_fmha.export_options(formulation=formulation):
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


def export_program(model: LlamaForCausalLM, num_pages: int, device: str = "cpu", formulation="explicit", batch=0):
    """compile_program then load_program, in one process."""
    vmfb = compile_program(model, num_pages, device, formulation, batch)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=sorted(TARGETS), default="cpu", help="where the program runs")
    ap.add_argument(
        "--formulation",
        choices=["explicit", "online"],
        default="explicit",
        help="online: a prefill and a decode function for --batch, the decode on the GPUs' online kernel",
    )
    ap.add_argument("--save", metavar="VMFB", help="compile for --device, write the program here and stop")
    ap.add_argument("--vmfb", help="run this program (from --save with the same model flags) instead of exporting")
    ap.add_argument("--artifacts", help="--time on cuda: the per-layer path's kernels (turbine-fmha build)")
    ap.add_argument("--time", action="store_true", help="time a decode step against HF's paths, as called")
    args = ap.parse_args()
    model = small_llama(args.seed, args.layers)
    torch.manual_seed(args.seed + 1)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len))
    num_pages = args.batch * -(-(args.prompt_len + args.new_tokens) // PAGE)
    t0 = time.perf_counter()
    if args.vmfb:
        vmfb = Path(args.vmfb).read_bytes()
    else:
        vmfb = compile_program(model, num_pages, args.device, args.formulation, args.batch)
        print(f"exported and compiled for {args.device} in {time.perf_counter() - t0:.1f} s")
    if args.save:
        Path(args.save).write_bytes(vmfb)
        print(f"wrote {args.save} ({len(vmfb)} bytes)")
        return 0
    program = load_program(vmfb, model, num_pages, args.device)
    times: list = []
    ours = generate_exported(program, prompts.numpy(), args.new_tokens, times)
    hf = generate_hf(model, prompts, args.new_tokens).numpy()
    print("HF eager :", hf[:, args.prompt_len :].tolist())
    print("exported :", ours[:, args.prompt_len :].tolist())
    same = np.array_equal(hf, ours)
    print("tokens identical" if same else "TOKENS DIFFER")
    print(f"exported program ({args.formulation}): decode step median {statistics.median(times) * 1e3:.2f} ms")
    if args.time:
        from transformers import DynamicCache

        from turbine_fmha.integrations import transformers as fmha_hf

        where = "cuda" if args.device == "cuda" else "cpu"
        on = prompts.to(where)
        sdpa = small_llama(args.seed, args.layers).to(where)
        sdpa.set_attn_implementation("sdpa")
        ms_sdpa = _hf_step_ms(sdpa, on, args.new_tokens, DynamicCache)
        paged = small_llama(args.seed, args.layers).to(where)
        fmha_hf.enable(paged)
        session = turbine_fmha.Session(where, artifact_dir=args.artifacts, compile_missing=where == "cpu")
        ms_paged = _hf_step_ms(paged, on, args.new_tokens, lambda: fmha_hf.PagedCache(session=session))
        ms_ours = statistics.median(times) * 1e3
        print(
            f"decode step on {args.device}, batch {args.batch}, median of {len(times)}: exported program "
            f"({args.formulation}) "
            f"{ms_ours:.2f} ms, HF + turbine_fmha per layer {ms_paged:.2f} ms, HF sdpa {ms_sdpa:.2f} ms"
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
