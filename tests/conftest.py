"""Shared fixtures: CPU sessions that compile missing variants into a
content-hashed cache, and a generator of paged problems with poisoned
outputs and garbage in unused block-table slots."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import time
from pathlib import Path

import numpy as np
import pytest
from tolerances import LSE_TOL, OUT_TOL

import turbine_fmha
from turbine_fmha.core.arrays import np_dtype
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

CACHE = Path(os.environ.get("TURBINE_FMHA_TEST_CACHE", Path(__file__).resolve().parent.parent / "build" / "test-cache"))
TESTS = Path(__file__).resolve().parent
# The host kernels the tests' sessions compile on demand into CACHE, built
# together before the first test, in parallel: one by one, as tests meet
# them, they were most of a fresh suite's time. kernels.json holds them per
# test file ("files": path under tests/ -> names) and all together ("all"):
# a run prebuilds the union of its selected files' lists, or "all" if any
# selected file has none. A kernel missing from a list is still compiled
# when a test needs it, and a stale name is skipped: a stale list costs
# time, never a wrong result.
#
# TURBINE_FMHA_RECORD_KERNELS=1 rewrites it from the run (nothing is
# prebuilt then): each file that ran all of its tests gets the kernels they
# had built into CACHE, through aot.build in this process (on-demand
# compiles included, whether the kernel was in CACHE already or not) or
# newly listed in CACHE's manifest while they ran (subprocesses: on a fresh
# cache only). Only a run of every test file rewrites "all" (what a
# whole run needs, and no more). So one file can be recorded alone:
#   TURBINE_FMHA_RECORD_KERNELS=1 pytest tests/test_cli.py
# and everything, best on a fresh cache:
#   TURBINE_FMHA_TEST_CACHE=$(mktemp -d) TURBINE_FMHA_RECORD_KERNELS=1 pytest tests
KERNELS = TESTS / "kernels.json"
RECORD = os.environ.get("TURBINE_FMHA_RECORD_KERNELS") == "1"


def _test_file(path) -> str:
    """A test file's key in kernels.json: its path under tests/."""
    p = Path(path).resolve()
    return p.relative_to(TESTS).as_posix() if p.is_relative_to(TESTS) else str(p)


def _read_kernels() -> dict:
    try:
        table = json.loads(KERNELS.read_text())
    except FileNotFoundError:
        table = {}
    return {"all": table.get("all", []), "files": table.get("files", {})}


def pytest_configure(config):
    if RECORD:
        config.pluginmanager.register(_KernelRecorder(), "turbine_fmha_kernel_recorder")


def pytest_collection_finish(session):
    """Prebuilds the kernels of the selected tests' files (the selection is
    known only once collection is done)."""
    if RECORD or session.config.option.collectonly or not session.items:
        return
    from turbine_fmha.build import aot
    from turbine_fmha.kernels.variants import parse_kernel

    table = _read_kernels()
    files = {_test_file(item.path) for item in session.items}
    if files <= table["files"].keys():
        names = sorted(set().union(*(table["files"][f] for f in files)))
    else:
        names = table["all"]
    kernels = []
    for name in names:
        try:
            kernels.append(parse_kernel(name))
        except ValueError:
            print(f"tests/kernels.json: skipping {name} (no longer a kernel name)")
    if not kernels:
        return
    t0 = time.perf_counter()
    results = aot.build(CACHE, ["host"], kernels, jobs=os.cpu_count())
    compiled = sum(r.rebuilt for r in results)
    if compiled:
        print(
            f"\nprebuilt {len(results)} host kernels into {CACHE} ({compiled} compiled) in "
            f"{time.perf_counter() - t0:.0f} s"
        )


class _KernelRecorder:
    """TURBINE_FMHA_RECORD_KERNELS=1: which test file needs which host
    kernels in CACHE (see KERNELS)."""

    def __init__(self):
        self.current = None  # the test file whose test, or collection, runs
        self.used: dict[str | None, set[str]] = {}
        self.items: dict[str, int] = {}  # collected tests per file, deselected ones included
        self.ran: dict[str, int] = {}
        self.modules: set[str] = set()
        self.manifest = (None, set())  # CACHE's manifest: (stat, host names)
        self._look()
        self.used.clear()  # what CACHE held before the run
        from turbine_fmha.build import aot

        build = aot.build

        @functools.wraps(build)
        def recording_build(out, targets, variants=None, **kw):
            results = build(out, targets, variants, **kw)
            if Path(out).resolve() == CACHE.resolve():
                self.used.setdefault(self.current, set()).update(r.variant for r in results if r.target == "host")
            return results

        aot.build = recording_build

    def _look(self):
        """Attributes host kernels new in CACHE's manifest (e.g. compiled by
        a subprocess) to the current file."""
        path = CACHE / "manifest.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stat == self.manifest[0]:
            return
        try:
            names = {a["variant"] for a in json.loads(path.read_text())["artifacts"] if a["target"] == "host"}
        except (OSError, ValueError, KeyError):
            return
        self.used.setdefault(self.current, set()).update(names - self.manifest[1])
        self.manifest = (stat, names)

    @contextlib.contextmanager
    def _in(self, path):
        self._look()
        self.current = _test_file(path)
        try:
            yield
        finally:
            self._look()
            self.current = None

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        if not isinstance(collector, pytest.Module):
            return (yield)
        self.modules.add(_test_file(collector.path))
        with self._in(collector.path):
            return (yield)

    def pytest_itemcollected(self, item):
        f = _test_file(item.path)
        self.items[f] = self.items.get(f, 0) + 1

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        f = _test_file(item.path)
        self.ran[f] = self.ran.get(f, 0) + 1
        with self._in(item.path):
            return (yield)

    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            return
        self._look()
        table = _read_kernels()
        done = {f for f, n in self.items.items() if self.ran.get(f) == n}
        for f in done:
            table["files"][f] = sorted(self.used.get(f, ()))
        table["files"] = {f: v for f, v in table["files"].items() if (TESTS / f).is_file()}
        every = {_test_file(p) for p in TESTS.rglob("test_*.py")}
        if every <= self.modules and done == set(self.items):
            table["all"] = sorted(set().union(*self.used.values()))
        KERNELS.write_text(
            json.dumps({"all": table["all"], "files": dict(sorted(table["files"].items()))}, indent=1) + "\n"
        )


class _TrapSession(turbine_fmha.Session):
    """A session whose kernels must never be reached: validation tests
    pass it to show that a bad call is refused before any kernel is chosen
    or run."""

    def run_variants(self, *a, **k):  # pragma: no cover - reaching it fails the test
        raise AssertionError("kernel ran on invalid input")

    run_variant = run_variants

    def select(self, *a, **k):
        raise AssertionError("variant selected for invalid input")


@pytest.fixture(scope="module")
def trap(tmp_path_factory):
    return _TrapSession("cpu", artifact_dir=tmp_path_factory.mktemp("empty"))


@pytest.fixture(scope="session")
def explicit_session():
    return turbine_fmha.Session("cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none")


@pytest.fixture(scope="session")
def online_session():
    return turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", formulation="online"
    )


@pytest.fixture
def allocations(monkeypatch):
    """The shapes of the arrays the runtime allocates for a call's results
    (executor.Results.empty), recorded while the test runs."""
    from turbine_fmha.runtime.executor import Results as _Results

    made = []
    empty = _Results.empty
    monkeypatch.setattr(
        _Results, "empty", lambda self, shape, dtype, **kw: made.append(tuple(shape)) or empty(self, shape, dtype, **kw)
    )
    return made


@pytest.fixture
def rng(request):
    # Fresh inputs every run; the seed is printed so a failure can be replayed.
    seed = int(os.environ.get("TURBINE_FMHA_SEED", secrets.randbits(32)))
    print(f"TURBINE_FMHA_SEED={seed}")
    return np.random.default_rng(seed)


def make_problem(
    rng, *, dtype, batch, seqlen_q, seqlens_k, nhead_q, nhead_k, hdim, page, hdim_v=None, spare_pages=3, extra_slots=2
):
    """Random paged problem: pages shuffled across sequences, unused table
    slots full of garbage (negative and out-of-range ids), spare pages in the
    pool full of NaN so that any read of them would show."""
    hdim_v = hdim_v or hdim
    dt = np_dtype(dtype)
    used = [-(-s // page) for s in seqlens_k]
    num_pages = sum(used) + spare_pages
    k_cache = rng.standard_normal((num_pages, page, nhead_k, hdim)).astype(dt)
    v_cache = rng.standard_normal((num_pages, page, nhead_k, hdim_v)).astype(dt)
    perm = rng.permutation(num_pages)
    width = max(used + [1]) + extra_slots
    garbage = np.array([-1, -7, num_pages, num_pages + 1000, 2**31 - 1], np.int64)
    block_table = rng.choice(garbage, size=(batch, width)).astype(np.int32)
    i = 0
    for b, n in enumerate(used):
        block_table[b, :n] = perm[i : i + n]
        i += n
    spare = perm[i:]
    k_cache[spare] = np.nan
    v_cache[spare] = np.nan
    q = rng.standard_normal((batch, seqlen_q, nhead_q, hdim)).astype(dt)
    return q, k_cache, v_cache, block_table, np.array(seqlens_k, np.int32)


def run_and_check(session, problem, *, dtype, **kw):
    q, k_cache, v_cache, block_table, seqlen_k = problem
    out, lse = turbine_fmha.fmha_fwd_paged(
        q, k_cache, v_cache, block_table, seqlen_k, return_lse=True, session=session, **kw
    )
    ref, ref_lse = fmha_fwd_paged_ref(q, k_cache, v_cache, block_table, seqlen_k, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == np.float32
    out64 = out.astype(np.float64)
    assert np.isfinite(out64).all(), "non-finite output"
    denom = max(np.abs(ref).max(), 1e-30)
    err = np.abs(out64 - ref).max() / denom if ref.size else 0.0
    assert err <= OUT_TOL[dtype], f"output rel err {err:.3e} > {OUT_TOL[dtype]}"
    # Rows with no visible key: output exactly 0 and LSE exactly -inf.
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert not np.isnan(lse).any()
    finite = ~empty
    if finite.any():
        lerr = np.abs(lse[finite] - ref_lse[finite]).max()
        assert lerr <= LSE_TOL[dtype], f"lse abs err {lerr:.3e} > {LSE_TOL[dtype]}"
    empty_rows = np.transpose(empty, (0, 2, 1))  # [b, sq, hq]
    assert (out64[empty_rows] == 0).all()
    return out, lse
