"""Ahead-of-time build: variants x targets -> vmfb files + manifest.json.

Layout of an artifact directory:
    <out>/manifest.json
    <out>/<target>/<variant>.<sha256[:16]>.vmfb
    <out>/<target>/<variant>.mlir          (the rendered kernel, for inspection)
    <out>/.lock                            (serialises the writers of the manifest)

A (variant, target) pair is rebuilt only when its source hash changes: the
hash covers the rendered MLIR, the flags and the compiler version. Compiles
run in parallel (iree-compile subprocesses), and any `error:` on the
compiler's stderr fails the build even when it exits 0 (IREE can print an
error and still emit a broken kernel).

Builds are reproducible: the same inputs and compiler give byte-identical
vmfbs, with no path of the build host in them (iree-compile runs in a
temporary directory on relative paths). So an artifact can be checked by
rebuilding it.

The directory is consistent at every moment, whatever happens to the build
(an error, Ctrl-C, SIGKILL, another build into the same directory): each
finished artifact is recorded as it completes, under an exclusive lock on
<out>/.lock, by re-reading the manifest, renaming the vmfb into place under
a name of its own (its content hash) and replacing the manifest atomically;
only then is the file it replaces removed. Files are created with the
process's umask, as open() does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import tuning
from .artifacts import MANIFEST, MANIFEST_VERSION, manifest_digest, read_manifest  # noqa: F401 (re-exported)
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

LOCK = ".lock"


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


def _temp_name(path: Path, suffix: str = ".tmp") -> Path:
    # Unique per writer (process and call), hidden, next to its destination
    # so that the rename into place is atomic.
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}{suffix}")


def atomic_write(path: Path, data: bytes | str) -> None:
    """Writes `path` whole or not at all, with mode 0o666 & ~umask (mkstemp
    would give 0600: files another user could not read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    tmp = _temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(out: Path):
    """Exclusive lock on <out>/.lock: one writer of the manifest at a time,
    across threads and processes (flock locks are per open file)."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


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


class Cancelled(Exception):
    """The build was interrupted: no new compile starts."""


class _Compilers:
    """The running iree-compile processes of one build, so that an interrupt
    can stop them at once instead of waiting for each (a SIGINT sent to the
    Python process alone never reaches them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self.cancelled = False

    def run(self, cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
        with self._lock:
            # Checked under the lock that cancel() takes: a compile starts
            # either before the cancel (and is terminated) or not at all.
            if self.cancelled:
                raise Cancelled()
            proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            self._procs.add(proc)
        try:
            stdout, stderr = proc.communicate()
        finally:
            with self._lock:
                self._procs.discard(proc)
        if self.cancelled and proc.returncode != 0:
            raise Cancelled()  # terminated by cancel(), not a compile error
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            procs = list(self._procs)
        for p in procs:
            with contextlib.suppress(OSError):
                p.terminate()

    def kill(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            with contextlib.suppress(OSError):
                p.kill()


def _run_compile(compilers: _Compilers, cwd: Path, source: str, target: Target, extra: list[str],
                 out: Path) -> tuple[float, str]:
    # `source` and any path in `extra` are relative to `cwd`: IREE records
    # the paths it is given (source locations, dumped files) in the vmfb.
    cmd = [iree_compile_path(), source, *target.flags, *extra, "-o", str(out)]
    t0 = time.perf_counter()
    proc = compilers.run(cmd, cwd)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or "error:" in proc.stderr:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"iree-compile failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return seconds, proc.stderr


def _compile_one(mlir: str, name: str, partial: Path, target: Target,
                 compilers: _Compilers | None = None) -> tuple[float, dict, str]:
    """Compiles `mlir` into `partial` (an absolute path; IREE does not record
    the output's path). Returns (seconds, ISA report, stderr)."""
    compilers = compilers or _Compilers()
    with tempfile.TemporaryDirectory(prefix="turbine-fmha-dump-") as tmp:
        tmp = Path(tmp)
        # The source under the name it has in the artifact directory, so
        # that compiler messages point at the .mlir kept next to the vmfb.
        source = f"{name}.mlir"
        (tmp / source).write_text(mlir)
        dump = "files"
        extra: list[str] = []
        seconds = 0.0
        attention_config = "IREE default"
        if target.kind in tuning.KINDS:
            # Pass 1: IREE's own configurations, then the tuned attention
            # configuration substituted in pass 2 (turbine_fmha.tuning).
            (tmp / "edited").mkdir()
            seconds, _ = _run_compile(
                compilers, tmp, source, target,
                ["--compile-to=executable-configurations", "--iree-hal-dump-executable-configurations-to=configs"],
                tmp / "configured.mlir",
            )
            extra = tuning.substitution_flags(tmp / "configs", tmp / "edited", flag_dir="edited")
        dump_flag = f"--iree-hal-dump-executable-files-to={dump}"
        try:
            t, stderr = _run_compile(compilers, tmp, source, target, [*extra, dump_flag], partial)
            if extra:
                attention_config = f"tuned v{tuning.VERSION}: head dim untiled"
        except RuntimeError:
            if not extra:
                raise
            # The tuned configuration did not compile for this variant: keep
            # IREE's own (slower, but a kernel).
            t, stderr = _run_compile(compilers, tmp, source, target, [dump_flag], partial)
            attention_config = "IREE default (tuned configuration failed to compile)"
        seconds += t
        report: dict = {}
        if target.kind == "rocm":
            report = rocm_isa_report(tmp / dump, target.name)
        elif target.kind == "cuda":
            report = cuda_isa_report(tmp / dump)
        if target.kind != "cpu":
            report["attention_config"] = attention_config
        return seconds, report, stderr


def load_manifest(out: Path) -> dict:
    """The validated manifest of `out` (an empty one where there is none).
    Raises turbine_fmha.ArtifactError naming the file and field of a broken
    one: merging into it could lose artifacts."""
    m = read_manifest(Path(out))
    if m is None:
        return {"manifest_version": MANIFEST_VERSION, "artifacts": []}
    return m.data


def _vmfb_name(variant: str, sha256: str) -> str:
    # Named by content: a rebuilt artifact never overwrites the file that
    # the manifest lists until the manifest lists the new one.
    return f"{variant}.{sha256[:16]}.vmfb"


def _remove_inside(out: Path, rel: str) -> None:
    path = (out / rel).resolve()
    if out.resolve() in path.parents:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _record(out: Path, entry: dict, partial: Path, version: str) -> None:
    """Moves a finished vmfb into place and records it in the manifest, as
    one step under the lock. Other writers' entries are kept (the manifest is
    re-read under the lock). A SIGKILL at any point leaves a manifest whose
    every entry names a file with its hash: the old file is removed only
    after the manifest stops listing it."""
    with _locked(out):
        manifest = load_manifest(out)
        by_key = {(a["target"], a["variant"]): a for a in manifest["artifacts"]}
        key = (entry["target"], entry["variant"])
        old = by_key.get(key)
        os.replace(partial, out / entry["path"])
        by_key[key] = entry
        _write_manifest(out, by_key, version)
        listed = {a["path"] for a in by_key.values()}
        if old is not None and old["path"] not in listed:
            _remove_inside(out, old["path"])
        # Files of this variant that no entry lists: left by a writer killed
        # between its rename and its manifest write. Safe to remove under the
        # lock, since renames into these names happen only under it.
        tdir = out / entry["target"]
        for f in tdir.glob(f"{entry['variant']}.*.vmfb"):
            if re.fullmatch(re.escape(entry["variant"]) + r"\.[0-9a-f]{16}\.vmfb", f.name) \
                    and f"{entry['target']}/{f.name}" not in listed:
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()


def _write_manifest(out: Path, by_key: dict, version: str) -> None:
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "compiler_version": version,
        "artifacts": sorted(by_key.values(), key=lambda a: (a["target"], a["variant"])),
    }
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=1))


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
    failed compile after the others finished. Each finished artifact is in
    the manifest as soon as it completes; on KeyboardInterrupt (or any
    exception in the caller's thread, e.g. from `progress`) the running
    compiles are terminated, the pending ones dropped, and the exception
    re-raised once the workers have stopped.
    """
    from .kernels import render_variant

    # Absolute: iree-compile runs in a temporary directory (reproducible
    # builds), so a relative output path would point there.
    out = Path(out).absolute()
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

    compilers = _Compilers()

    def work(item: tuple[Variant, Target]) -> BuildResult:
        v, target = item
        if compilers.cancelled:
            raise Cancelled()
        mlir = rendered[v]
        shash = source_hash(mlir, target, version)
        mlir_path = out / target.name / f"{v.name}.mlir"
        prev = by_key.get((target.name, v.name))
        if (
            not force
            and prev is not None
            and prev.get("source_sha256") == shash
            and prev.get("kernel_abi") == KERNEL_ABI
            and (out / prev["path"]).is_file()
            and sha256_file(out / prev["path"]) == prev.get("sha256")
        ):
            return BuildResult(v.name, target.name, prev, rebuilt=False)
        atomic_write(mlir_path, mlir)
        partial = _temp_name(out / target.name / f"{v.name}.vmfb", ".partial")
        try:
            try:
                seconds, report, _ = _compile_one(mlir, v.name, partial, target, compilers)
            except RuntimeError as e:
                return BuildResult(v.name, target.name, None, rebuilt=True, error=str(e))
            sha = sha256_file(partial)
            entry = {
                "variant": v.name,
                "target": target.name,
                "driver": target.driver,
                "path": f"{target.name}/{_vmfb_name(v.name, sha)}",
                "mlir": f"{target.name}/{v.name}.mlir",
                "sha256": sha,
                "size": partial.stat().st_size,
                "source_sha256": shash,
                "kernel_abi": KERNEL_ABI,
                "compiler_version": version,
                "flags": list(target.flags),
                "compile_seconds": round(seconds, 3),
                "isa": report,
            }
            # Recorded by the worker, not the caller's thread, which an
            # interrupt may leave at any point: an artifact that finished is
            # kept whatever happens next.
            _record(out, entry, partial, version)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return BuildResult(v.name, target.name, entry, rebuilt=True)

    results: list[BuildResult] = []
    jobs = jobs or os.cpu_count() or 1
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    futures = [pool.submit(work, item) for item in plan]
    try:
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            r = fut.result()
            results.append(r)
            if progress:
                progress(i, len(plan), r)
    except BaseException:
        # Leaving the pool's `with` would wait for every queued compile.
        compilers.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        # wait() never counts a future cancelled in the queue as done.
        started = [f for f in futures if not f.cancelled()]
        _, running = concurrent.futures.wait(started, timeout=2.0)
        if running:
            compilers.kill()
            concurrent.futures.wait(running, timeout=2.0)
        raise
    pool.shutdown()
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
