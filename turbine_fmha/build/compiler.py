"""Running iree-compile for one artifact: reproducibly (in a temporary
directory, on relative paths), stoppably (every running compiler is known,
so an interrupt terminates them), and failing on any `error:` IREE prints
even when it exits 0."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from . import tuning
from .isa import cuda_isa_report, rocm_isa_report
from .targets import Target


def compiler_version() -> str:
    from iree.compiler.version import VERSION

    return VERSION


def iree_compile_path() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-compile")


def source_hash(mlir: str, target: Target, version: str) -> str:
    h = hashlib.sha256()
    tuned = f"tuning {tuning.VERSION}" if target.kind in tuning.KINDS else ""
    for part in (mlir, "\0".join(target.flags), version, tuned):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class Cancelled(Exception):
    """The build was interrupted: no new compile starts."""


class Compilers:
    """The running iree-compile processes of one build, so that an interrupt
    can stop them at once instead of waiting for each (a SIGINT sent to the
    Python process alone never reaches them)."""

    def __init__(self, threaded: bool = True):
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self.cancelled = False
        # Flags for every compile of the build (the same artifacts either
        # way). Where the build's own compiles fill the cores, each
        # compiler's pass threads only contend with the others: single
        # threaded, a kernel took less CPU and the same artifacts came out
        # (docs/devlog/perf-notes.md, "Building the default sets faster",
        # item "Compiles that fill the cores run single threaded").
        self.flags = () if threaded else ("--mlir-disable-threading",)

    def run(self, cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
        with self._lock:
            # Checked under the lock that cancel() takes: a compile starts
            # either before the cancel (and is terminated) or not at all.
            if self.cancelled:
                raise Cancelled()
            proc = subprocess.Popen(
                cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
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


def _run_compile(
    compilers: Compilers, cwd: Path, source: str, target: Target, extra: list[str], out: Path
) -> tuple[float, str]:
    # `source` and any path in `extra` are relative to `cwd`: IREE records
    # the paths it is given (source locations, dumped files) in the vmfb.
    cmd = [iree_compile_path(), source, *target.flags, *extra, *compilers.flags, "-o", str(out)]
    t0 = time.perf_counter()
    proc = compilers.run(cmd, cwd)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or "error:" in proc.stderr:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"iree-compile failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return seconds, proc.stderr


def compile_one(
    mlir: str, name: str, partial: Path, target: Target, compilers: Compilers | None = None
) -> tuple[float, dict, str]:
    """Compiles `mlir` into `partial` (an absolute path; IREE does not record
    the output's path). Returns (seconds, ISA report, stderr)."""
    compilers = compilers or Compilers()
    with tempfile.TemporaryDirectory(prefix="turbine-fmha-dump-") as tmp:
        tmp = Path(tmp)
        # The source under the name it has in the artifact directory, so
        # that compiler messages point at the .mlir kept next to the vmfb.
        source = f"{name}.mlir"
        (tmp / source).write_text(mlir)
        dump_flag = "--iree-hal-dump-executable-files-to=files"
        attention_config = "IREE default"
        if target.kind in tuning.KINDS:
            seconds, stderr, attention_config = _compile_tuned(compilers, tmp, source, target, dump_flag, partial)
        else:
            seconds, stderr = _run_compile(compilers, tmp, source, target, [dump_flag], partial)
        report: dict = {}
        if target.kind == "rocm":
            report = rocm_isa_report(tmp / "files", target.name)
        elif target.kind == "cuda":
            report = cuda_isa_report(tmp / "files")
        if target.kind != "cpu":
            report["attention_config"] = attention_config
        return seconds, report, stderr


def _compile_tuned(
    compilers: Compilers, tmp: Path, source: str, target: Target, dump_flag: str, partial: Path
) -> tuple[float, str, str]:
    """One compile in two halves: up to IREE's own executable
    configurations, then on from them with the attention's edited
    (turbine_fmha.tuning), or unedited where the edit does not compile
    (slower, but a kernel). The configured module keeps its source
    locations and the source's name, so the vmfb reads as a one-pass
    compile's. Returns (seconds, stderr, the attention configuration)."""
    configured = f"configured/{source}"
    (tmp / "configured").mkdir()
    seconds, _ = _run_compile(
        compilers,
        tmp,
        source,
        target,
        ["--compile-to=executable-configurations", "--mlir-print-debuginfo"],
        tmp / configured,
    )
    resume = ["--compile-from=executable-configurations", dump_flag]
    tuned = tuning.tune_configured((tmp / configured).read_text())
    if tuned is not None:
        (tmp / "tuned").mkdir()
        (tmp / "tuned" / source).write_text(tuned)
        try:
            t, stderr = _run_compile(compilers, tmp, f"tuned/{source}", target, resume, partial)
            return seconds + t, stderr, f"tuned v{tuning.VERSION}: head dim untiled"
        except RuntimeError:
            shutil.rmtree(tmp / "files", ignore_errors=True)
            note = "IREE default (tuned configuration failed to compile)"
    else:
        note = "IREE default"
    t, stderr = _run_compile(compilers, tmp, configured, target, resume, partial)
    return seconds + t, stderr, note
