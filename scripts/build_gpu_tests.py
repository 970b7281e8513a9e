#!/usr/bin/env python3
"""Builds everything tests/gpu needs into one directory, on any machine
with the build extra (no GPU needed):

    .venv/bin/python scripts/build_gpu_tests.py --out build/gpu-tests

writes
    OUT/artifacts/       the attention and append kernels the GPU tests
                         select (attention_kernels(), append_kernels(),
                         tiles_kernels()),
                         an artifact directory Session(artifact_dir=) reads
    OUT/exported/        programs exported through torch.export with
                         the kernels inside (exported_programs()), and
                         their small inputs (inputs.npz)
    OUT/wheels/          the cp312 wheels the GPU machine lacks:
                         iree-base-runtime and ml_dtypes at this
                         environment's versions, pytest and what it needs
    OUT/gpu-tests.json   what was built: target, compiler, commit, counts

Everything the GPU machine then needs is OUT and the repository
(tests/gpu/README.md has the command that runs them). Rebuilding compiles
only what changed (the AOT build's rule) and downloads no wheel already
there.

`--target host` builds the same kernels and programs for this CPU
(llvm-cpu), without wheels, for the dry run on the CPU:

    .venv/bin/python scripts/build_gpu_tests.py --out build/gpu-tests-host --target host
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HQ, HK, D, PAGE = 32, 8, 128, 16

# The exported programs' shapes (tests/gpu/test_gpu_exported.py reads
# them from inputs.npz): a causal decode, 4/2 heads of 32, pages of 16; a
# cache write into 4 pages of 16 rows, 2 heads of 8.
EXPORT_SHAPE = dict(seqlen_q=1, nhead_q=4, nhead_k=2, hdim=32, page=16)
WRITE_SHAPE = (4, 16, 2, 8)

# Pure-Python wheels for the GPU machine, which may lack pytest; the
# versions are this environment's (requirements pin pytest).
TEST_WHEELS = ("pytest", "pluggy", "iniconfig", "pygments", "packaging")
# The runtime wheels (cp312, the GPU machine's Python): the IREE runtime
# must be the compiler's release, so it is this environment's version.
RUNTIME_WHEELS = ("iree-base-runtime", "ml_dtypes")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def attention_kernels() -> list:
    """The attention variants the GPU tests select, out of the default GPU
    set (build/default_sets.gpu_default_set): whole families, so that a
    call selects among them as among the shipped set, not one variant
    per call that another plan could miss.

    - f16, 32/8 heads of 128, page 16, NHD, no score term: every tile
      (decodes, merged splits, prefills, row entries), with and without the
      stale-row guard: the attention rows, torch interop, reliability, the
      deferred check, split counts, devices, torch.compile;
    - bf16, the same with the guard: the rows per dtype;
    - f16 score terms (ALiBi, elementwise bias [1|b, 1|h], soft-cap, sinks,
      ALiBi + sinks) and column-major V: their decode and prefill tiles;
    - fp8 e4m3fn KV caches under f16 q (online decodes, explicit others),
      fp8 e4m3fn static quantization (explicit);
    - run-time head counts (any GQA group), f16, NHD and HND pages: the
      decode tiles and merges, prefills padded to groups of 2 and 8 rows
      (the tests' head counts 16/16, 12/2, 28/4, 8/1), with the guard;
    - the explicit kernels for any head counts, head dim 64, page 16 and
      any page (the GPU's fallback, odd page sizes);
    - the online causal prefill over head dims 128/8 of 8/8 heads (a K pool
      of more than 2^31 elements), with and without the guard.
    """
    from turbine_fmha.build.default_sets import gpu_default_set
    from turbine_fmha.kernels.variants import Variant

    def plain(v, dtype):
        return (
            v.dtype == dtype
            and v.hdim_q == D
            and v.page_block_size == PAGE
            and not v.kv_dtype
            and v.bias == "none"
            and not v.softcap
            and not v.sinks
            and v.v_layout == "row"
        )

    def exact(v):
        return (v.nhead_q, v.nhead_k) == (HQ, HK)

    out = []
    for v in gpu_default_set():
        padded = v.group_rows // max(v.seqlen_q_tile, 1) if v.group_rows else 0
        if (
            (plain(v, "f16") and exact(v) and v.kv_layout == "NHD")
            or (plain(v, "bf16") and exact(v) and v.kv_layout == "NHD" and v.v_guard)
            or (
                v.dtype == "f16"
                and v.hdim_q == D
                and v.page_block_size == PAGE
                and not v.kv_dtype
                and (v.bias != "none" or v.softcap or v.sinks or v.v_layout == "col")
            )
            or (v.dtype == "f16" and v.kv_dtype == "f8e4m3fn")
            or v.dtype == "f8e4m3fn"
            or (
                plain(v, "f16")
                and v.runtime_heads
                and v.formulation == "online"
                and v.v_guard
                and (v.seqlen_q_tile == 1 or padded in (2, 8))
            )
            or (v.formulation == "explicit" and v.runtime_heads and v.dtype == "f16" and v.hdim_q == 64)
        ):
            out.append(v)
    # A [1, 1, sq, sk] bias split in two (num_splits=2) has a batch axis
    # (plan.split_kv): the b1 twins of the 11 bias kernels, which the
    # default set does not hold.
    out += [dataclasses.replace(v, bias_shape="b1") for v in out if v.bias == "elementwise" and v.bias_shape == "11"]
    large = [Variant.parse("pagedkv_fwd_f16_d128x8_h8x8_pg16_mbr_lse_online_b1_q128")]
    large.append(Variant.parse(large[0].name + "_nvguard"))
    return out + large


def append_kernels() -> list:
    """The in-place append kernels of reshape_and_cache and PagedKVCache in
    the tests: f16 and bf16 caches of 8 KV heads of 128, pages of 16, NHD
    (a kernel per head count) and HND (one head per call), each without
    rotary embedding and with both kinds."""
    from turbine_fmha.kernels.append_kernel import AppendKernel

    return [
        AppendKernel(dt, heads, D, D, PAGE, rotary)
        for dt in ("f16", "bf16")
        for heads in (HK, 1)
        for rotary in ("none", "half", "interleaved")
    ]


def tiles_kernels() -> list:
    """The prefill tile kernels of the default GPU set for the tests'
    shapes (f16 and bf16, 32/8 heads of 128, pages of 16) up to 7 classes
    (prefixes below 128 tiles: the tests' longest is 8704 keys): the plain
    prefills of every test run through them (Session's prefill_tiles)."""
    from turbine_fmha.build.default_sets import default_tiles_kernels

    return [k for k in default_tiles_kernels(gpu=True) if k.page_block_size == PAGE and k.classes <= 7]


def exported_programs(out: Path, target: str) -> list[str]:
    """Programs exported through iree.turbine's aot.export with the kernels
    inside, compiled for `target`: a causal decode with dynamic batch,
    pages and width ("explicit"), the online decode of a static batch
    ("online"), and reshape_and_cache into the module's caches with a
    dynamic token count ("write"); their inputs in inputs.npz."""
    import iree.compiler as ic
    import iree.turbine.aot as aot
    import torch

    import turbine_fmha

    class Attention(torch.nn.Module):
        def forward(self, q, k_cache, v_cache, block_table, seqlen_k):
            return turbine_fmha.fmha_fwd_paged(q, k_cache, v_cache, block_table, seqlen_k, return_lse=True, causal=True)

    class Write(torch.nn.Module):
        """reshape_and_cache into the module's caches (buffers the export
        keeps), returning copies of them."""

        def __init__(self, k_cache, v_cache):
            super().__init__()
            self.register_buffer("k_cache", torch.from_numpy(k_cache.copy()))
            self.register_buffer("v_cache", torch.from_numpy(v_cache.copy()))

        def forward(self, k, v, slots):
            turbine_fmha.reshape_and_cache(k, v, self.k_cache, self.v_cache, slots)
            return self.k_cache + 0, self.v_cache + 0

    rng = np.random.default_rng(0)
    s = EXPORT_SHAPE
    seqlens = np.array([40, 50, 17], np.int32)
    used = -(-seqlens // s["page"])
    pages = int(used.sum()) + 3
    q = rng.standard_normal((3, s["seqlen_q"], s["nhead_q"], s["hdim"])).astype(np.float16)
    k = rng.standard_normal((pages, s["page"], s["nhead_k"], s["hdim"])).astype(np.float16)
    v = rng.standard_normal((pages, s["page"], s["nhead_k"], s["hdim"])).astype(np.float16)
    bt = rng.permutation(pages)[: 3 * int(used.max())].reshape(3, -1).astype(np.int32)
    example = tuple(torch.from_numpy(a) for a in (q, k, v, bt, seqlens))
    b, p, w = torch.export.Dim("batch"), torch.export.Dim("pages"), torch.export.Dim("width")
    dims = [{0: b}, {0: p}, {0: p}, {0: b, 1: w}, {0: b}]
    programs = {"explicit": aot.export(Attention(), args=example, dynamic_shapes=dims)}
    with turbine_fmha.export_options(formulation="online"):
        programs["online"] = aot.export(Attention(), args=example)
    k0 = rng.standard_normal(WRITE_SHAPE).astype(np.float16)
    v0 = rng.standard_normal(WRITE_SHAPE).astype(np.float16)
    t = torch.export.Dim("tokens")
    rows = tuple(torch.zeros(3, *WRITE_SHAPE[2:], dtype=torch.float16) for _ in range(2))
    programs["write"] = aot.export(Write(k0, v0), args=(*rows, torch.arange(3)), dynamic_shapes=[{0: t}] * 3)
    if target == "cuda":
        backend, flags = "cuda", ["--iree-cuda-target=sm_80"]
    else:  # a static program's vectors exceed llvm-cpu's default limit (tests/test_export.py)
        backend, flags = "llvm-cpu", ["--iree-llvmcpu-target-cpu=host", "--iree-llvmcpu-fail-on-large-vector=false"]
    out.mkdir(parents=True, exist_ok=True)
    for name, program in programs.items():
        vmfb = ic.compile_str(str(program.mlir_module), target_backends=[backend], extra_args=flags)
        (out / f"{name}.vmfb").write_bytes(vmfb)
    np.savez(out / "inputs.npz", q=q, k=k, v=v, bt=bt, sk=seqlens, k0=k0, v0=v0)
    return sorted(programs)


def fetch_wheels(out: Path) -> list[str]:
    """pip downloads of TEST_WHEELS (any platform) and RUNTIME_WHEELS
    (cp312, manylinux x86-64), each at this environment's version; a wheel
    already in `out` is kept."""
    out.mkdir(parents=True, exist_ok=True)

    def have(name, version):
        stem = f"{name.replace('-', '_')}-{version}-"
        return any(p.name.lower().startswith(stem.lower()) for p in out.glob("*.whl"))

    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(out)]
    for names, extra in (
        (TEST_WHEELS, []),
        (
            RUNTIME_WHEELS,
            ["--python-version", "3.12", "--implementation", "cp"] + [f"--platform={p}" for p in PLATFORMS],
        ),
    ):
        pins = [(n, metadata.version(n)) for n in names]
        missing = [f"{n}=={v}" for n, v in pins if not have(n, v)]
        if missing:
            subprocess.run(pip + extra + missing, check=True)
    return sorted(p.name for p in out.glob("*.whl"))


def _commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("build/gpu-tests"))
    ap.add_argument("--target", default="cuda", choices=("cuda", "host"), help="host: the CPU dry run's kernels")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: every core)")
    ap.add_argument("--no-wheels", action="store_true", help="download no wheel (cuda only)")
    args = ap.parse_args()

    from turbine_fmha.build import aot
    from turbine_fmha.build.compiler import compiler_version

    t0 = time.perf_counter()
    kernels = attention_kernels() + append_kernels() + tiles_kernels()
    results = aot.build(args.out / "artifacts", [args.target], kernels, jobs=args.jobs)
    compiled = sum(r.rebuilt for r in results)
    print(f"{len(results)} kernels for {args.target} ({compiled} compiled) in {time.perf_counter() - t0:.0f} s")
    exported = exported_programs(args.out / "exported", args.target)
    print(f"exported programs: {', '.join(exported)}")
    wheels = [] if args.target != "cuda" or args.no_wheels else fetch_wheels(args.out / "wheels")
    info = dict(
        target=args.target,
        kernels=len(results),
        exported=exported,
        wheels=wheels,
        compiler=compiler_version(),
        commit=_commit(),
        built=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    (args.out / "gpu-tests.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{args.out}: {_size(args.out) / 2**20:.1f} MiB ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
