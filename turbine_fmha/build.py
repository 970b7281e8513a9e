"""Ahead-of-time build: variants x targets -> vmfb files + manifest.json.

Layout of an artifact directory:
    <out>/manifest.json
    <out>/<target>/<variant>.vmfb
    <out>/<target>/<variant>.mlir          (the rendered kernel, for inspection)

A (variant, target) pair is rebuilt only when its source hash changes: the
hash covers the rendered MLIR, the flags and the compiler version. Compiles
run in parallel (iree-compile subprocesses), are written atomically, and any
`error:` on the compiler's stderr fails the build even when it exits 0 (IREE
can print an error and still emit a broken kernel).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import tuning
from .targets import Target, get_target
from .variants import (
    KERNEL_ABI,
    AppendKernel,
    Variant,
    default_append_kernels,
    gpu_default_set,
    host_default_set,
    target_unsupported,
)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def compiler_version() -> str:
    from iree.compiler.version import VERSION

    return VERSION


def iree_compile_path() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-compile")


def default_variants(target: Target) -> list[Variant | AppendKernel]:
    gpu = target.formulation != "explicit"
    return (gpu_default_set() if gpu else host_default_set()) + default_append_kernels(gpu)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# --- ISA reports ----------------------------------------------------------

_AMDHSA_FIELDS = {
    "vgpr_count": r"\.vgpr_count:\s+(\d+)",
    "agpr_count": r"\.agpr_count:\s+(\d+)",
    "sgpr_count": r"\.sgpr_count:\s+(\d+)",
    "vgpr_spill_count": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spill_count": r"\.sgpr_spill_count:\s+(\d+)",
    "lds_bytes": r"\.group_segment_fixed_size:\s+(\d+)",
    "scratch_bytes": r"\.private_segment_fixed_size:\s+(\d+)",
}


def _waves_per_simd(vgprs: int, agprs: int, arch: str) -> int:
    # CDNA: 512 unified VGPRs per lane per SIMD (gfx90a+), allocated in
    # granules of 8; at most 8 waves per SIMD.
    regs = max(1, vgprs + agprs)
    regs = (regs + 7) // 8 * 8
    return max(0, min(8, 512 // regs))


def rocm_isa_report(dump_dir: Path, arch: str) -> dict:
    """Per-kernel register/LDS/scratch/MFMA figures read from the .rocmasm."""
    asm_files = sorted(dump_dir.glob("*.rocmasm"))
    kernels = []
    for asm in asm_files:
        text = asm.read_text(errors="replace")
        # Kernel bodies: split on '.amdhsa_kernel'-free symbol markers; the
        # metadata block lists each kernel with its figures in order.
        meta = text[text.find("amdhsa.kernels:") :]
        for block in re.split(r"\n\s+- \.", meta)[1:]:
            name = re.search(r"\.name:\s+(\S+)", "." + block)
            if not name:
                continue
            k = {"name": name.group(1)}
            for key, pat in _AMDHSA_FIELDS.items():
                m = re.search(pat, "." + block)
                k[key] = int(m.group(1)) if m else 0
            kernels.append(k)
        # MFMA instructions per kernel, counted between its label and the
        # next kernel's label.
        labels = sorted(
            (m.start(), m.group(1))
            for m in re.finditer(r"^([A-Za-z_][\w.$]*):\s*$", text, re.M)
            if any(k["name"] == m.group(1) for k in kernels)
        )
        for (start, name), nxt in zip(labels, labels[1:] + [(len(text), None)]):
            body = text[start : nxt[0]]
            for k in kernels:
                if k["name"] == name:
                    k["mfma_count"] = len(re.findall(r"\bv_mfma_", body))
    for k in kernels:
        k.setdefault("mfma_count", 0)
        k["waves_per_simd"] = _waves_per_simd(k["vgpr_count"], k["agpr_count"], arch)
    return {
        "kernels": kernels,
        "mfma_count": sum(k["mfma_count"] for k in kernels),
        "spills": sum(k["vgpr_spill_count"] + k["sgpr_spill_count"] for k in kernels),
        "scratch_bytes": max([k["scratch_bytes"] for k in kernels] or [0]),
    }


def cuda_isa_report(dump_dir: Path) -> dict:
    ptx = "".join(p.read_text(errors="replace") for p in dump_dir.glob("*.ptx"))
    return {
        "mma_count": len(re.findall(r"\bmma\.sync\b", ptx)),
        "local_memory_bytes": sum(int(x) for x in re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]", ptx)),
    }


# --- building -------------------------------------------------------------


@dataclasses.dataclass
class BuildResult:
    variant: str
    target: str
    entry: dict | None
    rebuilt: bool
    error: str | None = None


def source_hash(mlir: str, target: Target, version: str) -> str:
    h = hashlib.sha256()
    tuned = f"tuning {tuning.VERSION}" if target.kind in tuning.KINDS else ""
    for part in (mlir, "\0".join(target.flags), version, tuned):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _run_compile(mlir_path: Path, target: Target, extra: list[str], out: Path) -> tuple[float, str]:
    cmd = [iree_compile_path(), str(mlir_path), *target.flags, *extra, "-o", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or "error:" in proc.stderr:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"iree-compile failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return seconds, proc.stderr


def _compile_one(mlir_path: Path, vmfb_path: Path, target: Target) -> tuple[float, dict, str]:
    partial = Path(str(vmfb_path) + ".partial")
    with tempfile.TemporaryDirectory(prefix="turbine-fmha-dump-") as tmp:
        tmp = Path(tmp)
        dump = tmp / "files"
        extra: list[str] = []
        seconds = 0.0
        attention_config = "IREE default"
        if target.kind in tuning.KINDS:
            # Pass 1: IREE's own configurations, then the tuned attention
            # configuration substituted in pass 2 (turbine_fmha.tuning).
            configs, edited = tmp / "configs", tmp / "edited"
            edited.mkdir()
            seconds, _ = _run_compile(
                mlir_path, target,
                ["--compile-to=executable-configurations", f"--iree-hal-dump-executable-configurations-to={configs}"],
                tmp / "configured.mlir",
            )
            extra = tuning.substitution_flags(configs, edited)
        dump_flag = f"--iree-hal-dump-executable-files-to={dump}"
        try:
            t, stderr = _run_compile(mlir_path, target, [*extra, dump_flag], partial)
            if extra:
                attention_config = f"tuned v{tuning.VERSION}: head dim untiled"
        except RuntimeError:
            if not extra:
                raise
            # The tuned configuration did not compile for this variant: keep
            # IREE's own (slower, but a kernel).
            t, stderr = _run_compile(mlir_path, target, [dump_flag], partial)
            attention_config = "IREE default (tuned configuration failed to compile)"
        seconds += t
        report: dict = {}
        if target.kind == "rocm":
            report = rocm_isa_report(dump, target.name)
        elif target.kind == "cuda":
            report = cuda_isa_report(dump)
        if target.kind != "cpu":
            report["attention_config"] = attention_config
        os.replace(partial, vmfb_path)
        return seconds, report, stderr


def load_manifest(out: Path) -> dict:
    path = out / MANIFEST
    if path.exists():
        return json.loads(path.read_text())
    return {"manifest_version": MANIFEST_VERSION, "artifacts": []}


def build(
    out: Path,
    targets: list[str],
    variants: dict[str, list[Variant]] | list[Variant] | None = None,
    *,
    jobs: int | None = None,
    progress=None,
    force: bool = False,
) -> list[BuildResult]:
    """Builds every (variant, target); returns one result per pair.

    `variants` is a list used for every target, a dict target -> list, or
    None for each target's default set. Raises RuntimeError listing every
    failed compile after the others finished and the manifest was written.
    """
    from .kernels import render_variant

    out = Path(out)
    version = compiler_version()
    manifest = load_manifest(out)
    by_key = {(a["target"], a["variant"]): a for a in manifest["artifacts"]}
    plan: list[tuple[Variant, Target]] = []
    for tname in targets:
        target = get_target(tname)
        if variants is None:
            vs = default_variants(target)
        elif isinstance(variants, dict):
            vs = variants.get(tname, [])
        else:
            vs = variants
        for v in vs:
            reason = target_unsupported(v, target.kind)
            if reason:
                raise ValueError(f"cannot build {v.name} for {target.name}: {reason}")
        plan.extend((v, target) for v in vs)

    rendered: dict[Variant, str] = {}
    for v, _ in plan:
        if v not in rendered:
            rendered[v] = render_variant(v)

    def work(item: tuple[Variant, Target]) -> BuildResult:
        v, target = item
        mlir = rendered[v]
        shash = source_hash(mlir, target, version)
        vmfb = out / target.name / f"{v.name}.vmfb"
        mlir_path = out / target.name / f"{v.name}.mlir"
        prev = by_key.get((target.name, v.name))
        if (
            not force
            and prev is not None
            and prev.get("source_sha256") == shash
            and prev.get("kernel_abi") == KERNEL_ABI
            and vmfb.exists()
            and sha256_file(vmfb) == prev.get("sha256")
        ):
            return BuildResult(v.name, target.name, prev, rebuilt=False)
        atomic_write(mlir_path, mlir)
        try:
            seconds, report, _ = _compile_one(mlir_path, vmfb, target)
        except RuntimeError as e:
            return BuildResult(v.name, target.name, None, rebuilt=True, error=str(e))
        entry = {
            "variant": v.name,
            "target": target.name,
            "driver": target.driver,
            "path": f"{target.name}/{v.name}.vmfb",
            "mlir": f"{target.name}/{v.name}.mlir",
            "sha256": sha256_file(vmfb),
            "size": vmfb.stat().st_size,
            "source_sha256": shash,
            "kernel_abi": KERNEL_ABI,
            "compiler_version": version,
            "flags": list(target.flags),
            "compile_seconds": round(seconds, 3),
            "isa": report,
        }
        return BuildResult(v.name, target.name, entry, rebuilt=True)

    results: list[BuildResult] = []
    jobs = jobs or os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(work, item) for item in plan]
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            r = fut.result()
            results.append(r)
            if progress:
                progress(i, len(plan), r)
            if r.entry is not None:
                by_key[(r.target, r.variant)] = r.entry

    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "compiler_version": version,
        "artifacts": sorted(by_key.values(), key=lambda a: (a["target"], a["variant"])),
    }
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=1))
    failed = [r for r in results if r.error]
    if failed:
        msg = "\n\n".join(f"{r.target}/{r.variant}:\n{r.error}" for r in failed)
        raise RuntimeError(f"{len(failed)} of {len(results)} compiles failed:\n{msg}")
    return results


class ProgressBar:
    """build(progress=...) for a terminal: one line redrawn in place, with
    a bar, the count, the elapsed time, an estimate of the time left and the
    latest artifact; failures are printed on lines of their own. Where
    stderr is not a terminal (CI logs), print_progress's line per artifact."""

    WIDTH = 30

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, i: int, n: int, r: BuildResult) -> None:
        if not self.tty:
            print_progress(i, n, r, file=self.stream)
            return
        if r.error:
            print(f"\r\033[KFAILED {r.target}/{r.variant}", file=self.stream)
        elapsed = time.perf_counter() - self.t0
        left = elapsed / i * (n - i)
        done = self.WIDTH * i // max(1, n)
        bar = "#" * done + "-" * (self.WIDTH - done)
        line = f"[{bar}] {i}/{n} {elapsed:.0f}s, ~{left:.0f}s left  {r.target}/{r.variant}"
        print(f"\r\033[K{line}", end="\n" if i == n else "", file=self.stream, flush=True)


def print_progress(i: int, n: int, r: BuildResult, file=None) -> None:
    if r.error:
        status = "FAILED"
    elif not r.rebuilt:
        status = "cached"
    else:
        status = f"{r.entry['compile_seconds']:.2f}s"
        isa = r.entry.get("isa") or {}
        if "mfma_count" in isa:
            status += f" mfma={isa['mfma_count']} spills={isa['spills']}"
        if "mma_count" in isa:
            status += f" mma.sync={isa['mma_count']}"
    print(f"[{i:>4}/{n}] {r.target:<7} {r.variant}  {status}", file=file or sys.stderr, flush=True)
