#!/usr/bin/env python3
"""Decode kernel experiments for the H200 (issue 14): the shipped decode
module against edited copies of it, compiled here, verified against the
shipped module's output and timed there in one run.

    python benchmarks/probes/decode_search.py --build build/decode-search        # here
    PYTHONPATH=<site with iree-base-runtime> python3 benchmarks/probes/decode_search.py --run build/decode-search

Shape: bench.py's decode (batch 32 x 4096 keys, GQA 32/8, hdim 128, page 16,
fp16). Edits are textual on the rendered module so that each experiment
differs from the shipped kernel in exactly one thing:

  base       the shipped variant, rebuilt (head dim untiled: tuning.py)
  gpad16     the GQA group padded from 4 to 16 query rows inside the module
             (zero rows, sliced off before the epilogue): the M dims'
             product passes IREE's skinny threshold (4) and gets mma.sync,
             and each K/V page is read once per KV head
  gpad16_default   the same with IREE's own configuration (no head-dim edit)
  gpad8      padded to 8 rows
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

B, KEYS, HQ, HK, D, PAGE = 32, 4096, 32, 8, 128, 16
G = HQ // HK


def name_of(bt: int, page: int = PAGE) -> str:
    return f"pagedkv_fwd_f16_d128x128_h32x8_pg{page}_nmask_lse_online_b{bt}_q1_nvguard"


def base_mlir(bt: int = B, page: int = PAGE) -> str:
    from turbine_fmha.kernels import custom_ops as kernels
    from turbine_fmha.kernels.variants import parse_kernel

    return kernels.render_variant(parse_kernel(name_of(bt, page)))


def pad_group(mlir: str, gp: int, dt: str = "f16", B: int = B) -> str:
    """The module with the online_attention's GQA group padded to `gp` rows."""
    pre = f"{B}x{HK}x{G}x1"
    padded = f"{B}x{HK}x{gp}x1"
    lines = mlir.split("\n")
    out, after_op, in_op = [], False, False
    for line in lines:
        if "linalg.transpose" in line and f"tensor<{pre}x{D}x{dt}>" in line:
            out.append(line)
            var = line.split("=")[0].strip()
            out.append(f"    %qpad_zero = arith.constant 0.0 : {dt}")
            out.append(
                f"    %qpad = tensor.pad {var} low[0, 0, 0, 0, 0] high[0, 0, {gp - G}, 0, 0] {{\n"
                f"    ^bb0(%p0: index, %p1: index, %p2: index, %p3: index, %p4: index):\n"
                f"      tensor.yield %qpad_zero : {dt}\n"
                f"    }} : tensor<{pre}x{D}x{dt}> to tensor<{padded}x{D}x{dt}>"
            )
            out.append(f"    %accp_e = tensor.empty() : tensor<{padded}x{D}xf32>")
            out.append(f"    %rp_e = tensor.empty() : tensor<{padded}xf32>")
            qvar = var
            continue
        if "linalg.fill" in line and f"tensor<{pre}" in line and not after_op:
            line = re.sub(
                r"outs\((%\w+) : tensor<" + pre + r"x128xf32>\)", f"outs(%accp_e : tensor<{padded}x{D}xf32>)", line
            )
            line = re.sub(r"outs\((%\w+) : tensor<" + pre + r"xf32>\)", f"outs(%rp_e : tensor<{padded}xf32>)", line)
            line = line.replace(f"tensor<{pre}", f"tensor<{padded}")
            out.append(line)
            continue
        if "iree_linalg_ext.online_attention" in line:
            in_op = True
            res = line.split("=")[0].strip().split(":")[0]
            line = line.replace(f"ins({qvar},", "ins(%qpad,").replace(f"tensor<{pre}", f"tensor<{padded}")
            line = line.replace(f"{res}:3 =", "%attp:3 =")
            out.append(line)
            continue
        if in_op and line.strip().startswith("} ->"):
            in_op, after_op = False, True
            out.append(line.replace(f"tensor<{pre}", f"tensor<{padded}"))
            out.append(
                f"    %attp0 = tensor.extract_slice %attp#0[0, 0, 0, 0, 0] [{B}, {HK}, {G}, 1, {D}] [1, 1, 1, 1, 1]"
                f" : tensor<{padded}x{D}xf32> to tensor<{pre}x{D}xf32>"
            )
            for i in (1, 2):
                out.append(
                    f"    %attp{i} = tensor.extract_slice %attp#{i}[0, 0, 0, 0] [{B}, {HK}, {G}, 1] [1, 1, 1, 1]"
                    f" : tensor<{padded}xf32> to tensor<{pre}xf32>"
                )
            continue
        if after_op:
            for i in (0, 1, 2):
                line = line.replace(f"{res}#{i}", f"%attp{i}")
        out.append(line)
    assert after_op, "online_attention not found"
    return "\n".join(out)


def subgroups_on_head_dim(n: int):
    """A configuration edit: on top of tuning.py's (head dim whole), `n`
    subgroups per workgroup, each computing 128 / n of the output's head
    dim (PV) while sharing the scores (QK, replicated)."""

    def edit(configured: str, untile):
        text = untile(configured) or (configured if "online_attention" in configured else None)
        if text is None or n == 1:
            return text
        text = re.sub(r"(pipeline<VectorDistribute> workgroup_size = \[)32(, 1, 1\])", rf"\g<1>{32 * n}\2", text)
        return text.replace(
            "subgroup_basis = [[1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 5, 6]]",
            f"subgroup_basis = [[1, 1, 1, {n}, 1, 1, 1], [0, 1, 2, 3, 5, 6]]",
        ).replace(
            "subgroup_basis = [[1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 4, 5, 6]]",
            f"subgroup_basis = [[1, 1, 1, {n}, 1, 1, 1], [0, 1, 2, 4, 5, 6]]",
        )

    return edit


# tag: (group padded to, splits, page, configuration edit or None for
# tuning.py's, False for IREE's own)
EXPERIMENTS = {
    "base": (0, 1, 16, None),
    "base_s4": (0, 4, 16, None),
    "gpad16": (16, 1, 16, None),
    "gpad16_s4": (16, 4, 16, None),
    "gpad16_s8": (16, 8, 16, None),
    "gpad16_s4_sg2": (16, 4, 16, subgroups_on_head_dim(2)),
    "gpad16_s4_sg4": (16, 4, 16, subgroups_on_head_dim(4)),
    "gpad16_s2_sg4": (16, 2, 16, subgroups_on_head_dim(4)),
    "gpad16_s8_sg4": (16, 8, 16, subgroups_on_head_dim(4)),
    "base_pg64": (0, 1, 64, None),
    "gpad16_pg64": (16, 1, 64, None),
    "gpad16_s4_pg64": (16, 4, 64, None),
    "gpad16_s4_pg64_sg4": (16, 4, 64, subgroups_on_head_dim(4)),
}


def _parse_tag(tag: str) -> tuple[int, int]:
    """(splits, page) of an experiment's tag."""
    splits = re.search(r"_s(\d+)", tag)
    page = re.search(r"_pg(\d+)", tag)
    return int(splits.group(1)) if splits else 1, int(page.group(1)) if page else PAGE


def build(out: Path, target: str = "cuda", only: str | None = None) -> None:
    from turbine_fmha.build import compiler, targets, tuning

    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    untile = tuning.untile_head_dim
    for tag, (gp, splits, page, edit) in EXPERIMENTS.items():
        if only and not re.fullmatch(only, tag):
            continue
        bt = B * splits
        mlir = base_mlir(bt, page)
        if gp:
            mlir = pad_group(mlir, gp, B=bt)
        (out / f"{tag}.mlir").write_text(mlir)
        kinds = tuning.KINDS
        if edit is False:
            tuning.KINDS = ()
        elif edit is not None:
            tuning.untile_head_dim = lambda text, edit=edit: edit(text, untile)
        try:
            seconds, report, _ = compiler._compile_one(
                mlir, name_of(bt, page), (out / f"{tag}.vmfb").resolve(), targets.TARGETS[target]
            )
        except RuntimeError as e:
            print(f"{tag}: FAILED {str(e)[-600:]}", flush=True)
            continue
        finally:
            tuning.KINDS, tuning.untile_head_dim = kinds, untile
        reports[tag] = dict(report, seconds=round(seconds, 1))
        print(tag, reports[tag], flush=True)
    (out / "reports.json").write_text(json.dumps(reports, indent=1))


def _logical(rng):
    """q and each sequence's K and V rows in order (what the reference reads)."""
    q = rng.standard_normal((B, 1, HQ, D), dtype=np.float32).astype(np.float16)
    k, v = (rng.standard_normal((B, KEYS, HK, D), dtype=np.float32).astype(np.float16) for _ in range(2))
    return q, k, v


def _inputs(dev, logical, rng, splits: int, page: int):
    """Device arguments for the decode shape in pages of `page` rows
    scattered through the pool, the keys split in `splits` runs (sequence
    b, split s reads pages [s * w, (s + 1) * w) of b's table row)."""
    import iree.runtime as rt

    q, k, v = logical
    pages = B * KEYS // page
    perm = rng.permutation(pages)
    pool_k, pool_v = (np.empty((pages, page, HK, D), np.float16) for _ in range(2))
    pool_k[perm] = k.reshape(pages, page, HK, D)
    pool_v[perm] = v.reshape(pages, page, HK, D)
    table = perm.reshape(B, KEYS // page).astype(np.int32)
    n = B * splits
    args = [
        np.repeat(q, splits, axis=0),
        pool_k,
        pool_v,
        table.reshape(n, -1),
        np.ones(n, np.int32),
        np.full(n, KEYS // splits, np.int32),
        np.zeros(n, np.int32),
        np.array([D**-0.5, 0.0, 1.0, 1.0], np.float32),
        np.array([0, -1, -1, 0], np.int32),
    ]
    return [rt.asdevicearray(dev, a) for a in args]


def _merged(o, lse, splits):
    """Output and LSE of the whole key range from per-split ones."""
    o = o.reshape(B, splits, HQ, D)
    lse = lse.reshape(B, splits, HQ)
    m = lse.max(axis=1, keepdims=True)
    w = np.exp(lse - m)
    out = (o * w[..., None]).sum(axis=1) / w.sum(axis=1)[..., None]
    return out.reshape(B, 1, HQ, D), (m[:, 0] + np.log(w.sum(axis=1))).reshape(B, HQ, 1)


def _reference(q, k, v):
    """float64 output and LSE of the decode (every key visible)."""
    kk, vv = k.astype(np.float64), v.astype(np.float64)
    qq = q.astype(np.float64).reshape(B, HK, G, D)
    s = np.einsum("bhgd,bnhd->bhgn", qq, kk) * D**-0.5
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    o = np.einsum("bhgn,bnhd->bhgd", p, vv) / p.sum(-1)[..., None]
    return o.reshape(B, 1, HQ, D), (m[..., 0] + np.log(p.sum(-1))).reshape(B, HQ, 1)


def run(out: Path, repeat: int, rounds: int, target: str = "cuda", profile=()) -> None:
    import iree.runtime as rt

    import turbine_fmha
    from turbine_fmha.runtime.invoke import _Loaded

    session = turbine_fmha.Session("cpu" if target == "host" else target, artifact_dir="/nonexistent-decode-search")
    cfg, dev = session._iree_config(), session.device_of()
    logical = _logical(np.random.default_rng(0))
    ref = _reference(*logical)
    loaded, inputs = {}, {}
    for path in sorted(out.glob("*.vmfb")):
        splits, page = _parse_tag(path.stem)
        if (splits, page) not in inputs:
            inputs[splits, page] = _inputs(dev, logical, np.random.default_rng(1), splits, page)
        loaded[path.stem] = (
            _Loaded(
                type("V", (), {"name": name_of(B * splits, page)})(),
                rt.VmModule.copy_buffer(cfg.vm_instance, path.read_bytes()),
                cfg,
                spin=target != "host",
            ),
            (splits, page),
        )
    results = {}
    for tag, (lo, (splits, page)) in loaded.items():
        o, lse = (r.to_host().astype(np.float64) for r in lo.invoke(list(inputs[splits, page]), 2))
        o, lse = _merged(o, lse, splits)
        err = (float(np.abs(o - ref[0]).max()), float(np.abs(lse - ref[1]).max()))
        results[tag] = {"max_abs_err_out": err[0], "max_abs_err_lse": err[1], "ms": []}
    kv_bytes = 2 * B * KEYS * HK * D * 2
    for _ in range(rounds):
        for tag, (lo, key) in loaded.items():
            args = inputs[key]
            last = [None]
            for _ in range(3):
                last[0] = lo.enqueue(list(args), after=last[0])
            last[0].wait()
            t0 = time.perf_counter()
            for _ in range(repeat):
                last[0] = lo.enqueue(list(args), after=last[0])
            last[0].wait()
            results[tag]["ms"].append((time.perf_counter() - t0) * 1e3 / repeat)
    for tag, r in results.items():
        ms = statistics.median(r["ms"])
        r["median_ms"] = round(ms, 4)
        r["TB_s"] = round(kv_bytes / (ms * 1e-3) / 1e12, 3)
        print(
            f"{tag:16s} {ms:.3f} ms  {r['TB_s']:.2f} TB/s of KV  rounds {[round(x, 3) for x in r['ms']]}  "
            f"err out {r['max_abs_err_out']:.2e} lse {r['max_abs_err_lse']:.2e}",
            flush=True,
        )
    (out / "run.json").write_text(json.dumps(results, indent=1))
    for tag in profile:
        if tag in loaded:
            _profile(tag, lambda lo=loaded[tag][0], a=inputs[loaded[tag][1]], last=[None]: _enqueue(lo, a, last))
    if target == "cuda":
        _torch_baseline(logical, repeat, rounds)


def _enqueue(lo, args, last):
    last[0] = lo.enqueue(list(args), after=last[0])
    return last[0]


def _torch_baseline(logical, repeat: int, rounds: int) -> None:
    """bench.py's baseline on the same data: gather the pages through the
    block table, then SDPA (4-D, GQA), back to back with one synchronize."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(a).cuda() for a in logical)
    pages = B * KEYS // PAGE
    perm = torch.randperm(pages, device="cuda")
    pool_k, pool_v = (torch.empty((pages, PAGE, HK, D), dtype=torch.float16, device="cuda") for _ in range(2))
    pool_k[perm], pool_v[perm] = k.reshape(pages, PAGE, HK, D), v.reshape(pages, PAGE, HK, D)
    table = perm.reshape(B, KEYS // PAGE)
    qt = q.transpose(1, 2)

    def call():
        kk = pool_k[table].reshape(B, KEYS, HK, D).transpose(1, 2)
        vv = pool_v[table].reshape(B, KEYS, HK, D).transpose(1, 2)
        return F.scaled_dot_product_attention(qt, kk, vv, enable_gqa=True)

    ms = []
    for _ in range(rounds):
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            call()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3 / repeat)
    print(f"{'torch gather+SDPA':16s} {statistics.median(ms):.3f} ms  rounds {[round(x, 3) for x in ms]}", flush=True)
    _profile("torch gather+SDPA", call)


def _profile(tag, call, calls: int = 20) -> None:
    """Per-dispatch device times of `call` (torch's profiler records every
    kernel launched in the process, IREE's included, through CUPTI)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def calls_done(n):
        for _ in range(n):
            last = call()
        if hasattr(last, "wait"):
            last.wait()
        torch.cuda.synchronize()

    calls_done(3)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        calls_done(calls)
    print(f"--- {tag}: per-dispatch device time over {calls} calls")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"  {e.key[:90]:90s} {e.count:4d} x {e.device_time_total / max(e.count, 1):8.1f} us")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", default="cuda", help="host: a smoke test of this script on the CPU")
    ap.add_argument("--profile", nargs="*", default=[], help="tags to profile per dispatch (CUDA)")
    ap.add_argument("--only", help="build only the experiments whose tag matches this regex")
    args = ap.parse_args()
    if args.build:
        build(args.build, args.target, args.only)
    if args.run:
        run(args.run, args.repeat, args.rounds, args.target, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
