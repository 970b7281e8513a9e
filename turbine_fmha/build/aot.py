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
import sys
import time
from pathlib import Path

from ..core import cpu as host_cpu
from ..kernels.abi import abi, abi_docs
from ..kernels.append_kernel import AppendKernel
from ..kernels.signature import KERNEL_ABI
from ..kernels.variants import Variant, target_unsupported
from .artifacts import MANIFEST, MANIFEST_VERSION, read_manifest
from .compiler import Cancelled, Compilers, compile_one, compiler_version, source_hash
from .default_sets import default_append_kernels, default_tiles_kernels, gpu_default_set, host_default_set
from .targets import Target, get_target

LOCK = ".lock"
# What compiling needs beyond the runtime: the `build` extra of pyproject.toml.
BUILD_EXTRA = "pip install 'turbine-fmha[build]'"
BUILD_MODULES = ("iree.compiler", "iree.turbine", "torch", "jinja2")


def missing_build_modules() -> list[str]:
    """The BUILD_MODULES that cannot be imported here (found, not imported:
    importing torch takes seconds)."""
    import importlib.util

    missing = []
    for name in BUILD_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def require_build_extra(what: str = "building artifacts") -> None:
    """Raises ModuleNotFoundError saying which extra to install when a
    module that compiling needs is missing: otherwise the first failed
    import deep inside the build would be all the caller sees."""
    missing = missing_build_modules()
    if missing:
        raise ModuleNotFoundError(
            f"{what} needs the build extra ({', '.join(missing)} not installed): {BUILD_EXTRA}", name=missing[0]
        )


def default_variants(target: Target) -> list[Variant | AppendKernel]:
    gpu = target.formulation != "explicit"
    return (gpu_default_set() if gpu else host_default_set()) + default_append_kernels(gpu) + default_tiles_kernels(gpu)


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


# --- building -------------------------------------------------------------


@dataclasses.dataclass
class BuildResult:
    variant: str
    target: str
    entry: dict | None
    rebuilt: bool
    error: str | None = None


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


def _record(out: Path, entry: dict, partial: Path | None, version: str) -> None:
    """Moves a finished vmfb into place (none: the entry's file is already
    there) and records it in the manifest, as one step under the lock. Other writers' entries are kept (the manifest is
    re-read under the lock). A SIGKILL at any point leaves a manifest whose
    every entry names a file with its hash: the old file is removed only
    after the manifest stops listing it."""
    with _locked(out):
        manifest = load_manifest(out)
        by_key = {(a["target"], a["variant"]): a for a in manifest["artifacts"]}
        key = (entry["target"], entry["variant"])
        old = by_key.get(key)
        if partial is not None:
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
            if (
                re.fullmatch(re.escape(entry["variant"]) + r"\.[0-9a-f]{16}\.vmfb", f.name)
                and f"{entry['target']}/{f.name}" not in listed
            ):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()


def _write_manifest(out: Path, by_key: dict, version: str) -> None:
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "compiler_version": version,
        # What the entries' "abi" names and ids mean (docs/abi.md).
        "abi": abi_docs(),
        "artifacts": sorted(by_key.values(), key=lambda a: (a["target"], a["variant"])),
    }
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=1))


def _refresh_abi_docs(out: Path, version: str) -> None:
    """Rewrites the manifest where its top-level "abi" (what the entries'
    names and ids mean) is not this release's: a build that recompiles
    nothing writes no entry, and would leave an earlier description beside
    entries described by this one."""
    if not (out / MANIFEST).is_file():
        return
    with _locked(out):
        manifest = load_manifest(out)
        if manifest.get("abi") != abi_docs():
            _write_manifest(out, {(a["target"], a["variant"]): a for a in manifest["artifacts"]}, version)


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
    require_build_extra()
    # Absolute: iree-compile runs in a temporary directory (reproducible
    # builds), so a relative output path would point there.
    plan = _build_plan(targets, variants)
    jobs = jobs or os.cpu_count() or 1
    builder = _Builder(Path(out).absolute(), force, parallel=min(jobs, len(plan)))
    builder.render(v for v, _ in plan)
    results = _run_all(builder, plan, jobs, progress)
    _refresh_abi_docs(builder.out, builder.version)
    failed = [r for r in results if r.error]
    if failed:
        msg = "\n\n".join(f"{r.target}/{r.variant}:\n{r.error}" for r in failed)
        raise RuntimeError(f"{len(failed)} of {len(results)} compiles failed:\n{msg}")
    return results


def _build_plan(targets, variants) -> list[tuple[Variant, Target]]:
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
    return plan


class _Builder:
    """Builds one (variant, target) at a time, from any thread, recording
    each finished artifact in the manifest as it completes."""

    def __init__(self, out: Path, force: bool, parallel: int = 1):
        self.out, self.force = out, force
        self.version = compiler_version()
        self.by_key = {(a["target"], a["variant"]): a for a in load_manifest(out)["artifacts"]}
        self.rendered: dict[Variant, str] = {}
        # `parallel` compiles at once: at a core each or more, each
        # compile runs single threaded.
        self.compilers = Compilers(threaded=parallel < (os.cpu_count() or 1))

    def render(self, variants) -> None:
        from ..kernels.custom_ops import render_variant

        for v in variants:
            if v not in self.rendered:
                self.rendered[v] = render_variant(v)

    def _unchanged(self, v, target, shash: str) -> dict | None:
        prev = self.by_key.get((target.name, v.name))
        # A host artifact built on another CPU (a directory copied over) is
        # rebuilt for this one; entries of older builds record no CPU.
        if prev is not None and "cpu_arch" in prev and _cpu_fields(target) != _cpu_fields_of(prev):
            prev = None
        if (
            not self.force
            and prev is not None
            and prev.get("source_sha256") == shash
            and prev.get("kernel_abi") == KERNEL_ABI
            and (self.out / prev["path"]).is_file()
            and sha256_file(self.out / prev["path"]) == prev.get("sha256")
        ):
            return prev
        return None

    def work(self, item: tuple[Variant, Target]) -> BuildResult:
        v, target = item
        if self.compilers.cancelled:
            raise Cancelled()
        mlir = self.rendered[v]
        shash = source_hash(mlir, target, self.version)
        prev = self._unchanged(v, target, shash)
        if prev is not None:
            if prev.get("abi") != abi(v):
                # An entry of an earlier release, or of an earlier ABI
                # description: the same function (KERNEL_ABI matched), its
                # description brought up to date without recompiling.
                prev = dict(prev, abi=abi(v))
                _record(self.out, prev, None, self.version)
            return BuildResult(v.name, target.name, prev, rebuilt=False)
        atomic_write(self.out / target.name / f"{v.name}.mlir", mlir)
        partial = _temp_name(self.out / target.name / f"{v.name}.vmfb", ".partial")
        try:
            try:
                seconds, report, _ = compile_one(mlir, v.name, partial, target, self.compilers)
            except RuntimeError as e:
                return BuildResult(v.name, target.name, None, rebuilt=True, error=str(e))
            entry = self._entry(v, target, partial, shash, seconds, report)
            # Recorded by the worker, not the caller's thread, which an
            # interrupt may leave at any point: an artifact that finished is
            # kept whatever happens next.
            _record(self.out, entry, partial, self.version)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return BuildResult(v.name, target.name, entry, rebuilt=True)

    def _entry(self, v, target, partial: Path, shash: str, seconds: float, report: dict) -> dict:
        sha = sha256_file(partial)
        return {
            "variant": v.name,
            "target": target.name,
            "driver": target.driver,
            "path": f"{target.name}/{_vmfb_name(v.name, sha)}",
            "mlir": f"{target.name}/{v.name}.mlir",
            "sha256": sha,
            "size": partial.stat().st_size,
            "source_sha256": shash,
            "kernel_abi": KERNEL_ABI,
            "compiler_version": self.version,
            "flags": list(target.flags),
            "binding_alignment": target.binding_alignment,
            "compile_seconds": round(seconds, 3),
            "isa": report,
            "abi": abi(v),
            **_cpu_fields(target),
        }


def _cpu_fields(target: Target) -> dict:
    """What a CPU needs to run `target`'s artifacts: the target's own
    requirements, or for `host` the build machine's architecture and ISA
    features (LLVM's "host" CPU uses all of them)."""
    if target.kind != "cpu":
        return {}
    if target.cpu_arch is not None:
        return {"cpu_arch": target.cpu_arch, "cpu_requires": sorted(target.cpu_requires)}
    cpu = host_cpu.this_cpu()
    return {"cpu_arch": cpu.arch, "cpu_requires": sorted(cpu.features)}


def _cpu_fields_of(entry: dict) -> dict:
    return {k: entry[k] for k in ("cpu_arch", "cpu_requires") if k in entry}


def _run_all(builder: _Builder, plan, jobs: int, progress) -> list[BuildResult]:
    results: list[BuildResult] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    futures = [pool.submit(builder.work, item) for item in plan]
    try:
        pending = set(futures)
        while pending:
            # A wait that wakes: a SIGINT that the kernel hands to a thread
            # other than this one (as where this one blocks it) only sets
            # Python's flag, seen when this thread next runs, and an
            # unbounded wait would see it after the running compile.
            done, pending = concurrent.futures.wait(
                pending, timeout=0.1, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for fut in done:
                results.append(fut.result())
                if progress:
                    progress(len(results), len(plan), results[-1])
    except BaseException:
        # Leaving the pool's `with` would wait for every queued compile.
        builder.compilers.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        # wait() never counts a future cancelled in the queue as done.
        started = [f for f in futures if not f.cancelled()]
        _, running = concurrent.futures.wait(started, timeout=2.0)
        if running:
            builder.compilers.kill()
            concurrent.futures.wait(running, timeout=2.0)
        raise
    pool.shutdown()
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
