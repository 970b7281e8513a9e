"""The GPU tests' setup: which device they run on, their prebuilt kernels,
the tolerances every test checks against, and the problems and checks
they share (README.md beside this file has the commands).

Every test here is marked `gpu` and is skipped, not failed, where no CUDA
GPU is: torch.cuda.is_available() is False, or IREE's cuda driver lists
no device (Session("cuda") refuses). A GPU machine without the build
(`--gpu-artifacts`, default build/gpu-tests) skips them too, unless the
directory was named (option or $TURBINE_FMHA_GPU_TESTS): then they fail.

Nothing here compiles: the kernels come from scripts/build_gpu_tests.py,
and these modules import neither iree.compiler nor iree.turbine (the GPU
machine has only the IREE runtime, numpy and torch).

`--gpu-device cpu` (or $TURBINE_FMHA_GPU_DEVICE=cpu) runs the same tests on
this CPU, a dry run of their logic, on the same kernels built for the host
(`build_gpu_tests.py --target host`): the session runs the GPU's online
formulation and plans for the GPU's compute units, so each call selects
what it selects on the GPU; torch tensors live on the CPU, and the checks
that only a GPU can make are skipped there (each says why).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.core.arrays import np_dtype

try:  # tests/tolerances.py: pytest puts tests/ on sys.path (this package's root)
    from tolerances import LSE_TOL, OUT_TOL
except ImportError:  # imported some other way
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tolerances import LSE_TOL, OUT_TOL

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "build" / "gpu-tests"
ENV_DIR, ENV_DEVICE = "TURBINE_FMHA_GPU_TESTS", "TURBINE_FMHA_GPU_DEVICE"

# The shapes the kernels were built for (scripts/build_gpu_tests.py): fp16
# GQA 32/8, head dim 128, pages of 16, unless a test says otherwise.
HQ, HK, D, PAGE = 32, 8, 128, 16
MASK = dict(mask_type="bottom_right", window_size_right=0)  # causal, bottom-right aligned

# -- tolerances ----------------------------------------------------------------
# The GPU tests' bounds, in one place. OUT_TOL (the output, relative to
# max |ref|) and LSE_TOL (the log-sum-exp, absolute) are the suite's,
# derived in tests/tolerances.py: the GPU kernels are the online
# formulation whose rounding it derives (P and the output rounded to the
# input dtype once each; the scores once, scale*log2(e) folded into q).
# The probes these tests come from used the same numbers (5e-3 for f16).
# Against float32 torch SDPA on the same inputs instead of the float64
# reference (test_gpu_rows.py, as benchmarks/as_called.py checks), the
# same OUT_TOL: SDPA's own error in float32, ~1e-6 here, is far below it.
# ROPE_TOL, rotary embedding written into a cache: an f32 rotation, then
# one rounding to the cache dtype (half an ulp relative), checked at twice
# that against a float64 rotation (tests/test_kv_write.py).
ROPE_TOL = {"f16": 2 * (2.0**-11 + 2.0**-21), "bf16": 2 * (2.0**-8 + 2.0**-21)}
# FP8_OUT_TOL, fp8 static quantization: the output is fp8, compared with the
# reference's fp8 value; the fraction of elements that differ at all (one
# fp8 step where the f32 result lies near a rounding boundary), bounded by
# 1% (tests/test_fp8.py).
FP8_OUT_TOL = 0.01
# SINKS_MOVE: a run given other sinks than its plan's must move the output
# by more than this many OUT_TOL["f16"] from the plan's, so that a run that
# used the plan's sinks would fail the check.
SINKS_MOVE = 4


# -- options and the device ---------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("gpu", "GPU tests (tests/gpu)")
    group.addoption(
        "--gpu-artifacts",
        default=None,
        help=f"scripts/build_gpu_tests.py's output (default ${ENV_DIR}, else build/gpu-tests)",
    )
    group.addoption(
        "--gpu-device",
        default=None,
        choices=("cuda", "cpu"),
        help=f"cuda (default, ${ENV_DEVICE}); cpu: a dry run on this CPU with --target host kernels",
    )


class Device:
    """What the tests run on: `session` (a Session of the build's
    artifacts), `device` ("cuda" or "cpu", the public functions' device=),
    `torch_device`, `dry_run` (on the CPU), `gpus` (CUDA GPUs torch sees),
    `build` (the build's directory)."""

    def __init__(self, device: str, build: Path, gpus: int):
        self.device, self.build, self.gpus = device, build, gpus
        self.dry_run = device == "cpu"
        self.artifacts = build / "artifacts"
        self.exported = build / "exported"
        self.session = self.new_session()
        self.torch_device = self.session.torch_device

    def new_session(self, device: str | None = None, **kw):
        """Another Session of the build's artifacts: on `device` (the
        tests' by default); on the CPU with the GPU's formulation and
        compute units."""
        from turbine_fmha.runtime.session import DEFAULT_COMPUTE_UNITS

        if self.dry_run and device in (None, "cpu"):
            kw = dict(dict(formulation="online", compute_units=DEFAULT_COMPUTE_UNITS["cuda"]), **kw)
            return turbine_fmha.Session("cpu", artifact_dir=self.artifacts, **kw)
        return turbine_fmha.Session(device or self.device, artifact_dir=self.artifacts, **kw)

    def tensor(self, a, device=None):
        """A numpy array as a torch tensor on the tests' device (a copy)."""
        import torch

        return torch.from_numpy(np.ascontiguousarray(a)).to(device or self.torch_device)

    def sync(self):
        if not self.dry_run:
            import torch

            torch.cuda.synchronize()

    def skip_on_cpu(self, why: str):
        if self.dry_run:
            pytest.skip(f"GPU only: {why}")


def _option(config, name: str, env: str):
    # The options exist when this conftest is an initial one (pytest run on
    # tests/gpu or a file in it); the environment variables work always.
    return config.getoption(name, default=None) or os.environ.get(env) or None


@pytest.fixture(scope="session")
def gpu(pytestconfig) -> Device:
    """The device the GPU tests run on; skips every test without one."""
    device = _option(pytestconfig, "--gpu-device", ENV_DEVICE) or "cuda"
    named = _option(pytestconfig, "--gpu-artifacts", ENV_DIR)
    build = Path(named) if named else DEFAULT_DIR
    if not build.is_absolute():
        build = Path.cwd() / build
    gpus = 0
    if device == "cuda":
        try:
            import torch
        except ImportError:
            pytest.skip("no CUDA GPU: torch is not installed")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")
        gpus = torch.cuda.device_count()
        try:
            turbine_fmha.Session("cuda", artifact_dir=build / "none")
        except ValueError as e:
            pytest.skip(f"no IREE cuda device: {e}")
    target = "cuda" if device == "cuda" else "host"
    command = f".venv/bin/python scripts/build_gpu_tests.py --out {named or 'build/gpu-tests'}" + (
        " --target host" if target == "host" else ""
    )
    info = build / "gpu-tests.json"
    if not info.is_file():
        (pytest.fail if named else pytest.skip)(
            f"no GPU test build in {build}; on a machine with the compiler: {command}"
        )
    built = json.loads(info.read_text())
    if built.get("target") != target:
        pytest.fail(f"{build} holds {built.get('target')} kernels, not {target}: {command}")
    return Device(device, build, gpus)


@pytest.fixture(autouse=True)
def _on_gpu(gpu):
    """Every test here needs the device (and is skipped without it)."""


# -- problems -----------------------------------------------------------------


def paged(rng, lens_k, *, dtype="f16", hk=HK, d=D, page=PAGE, spare=3, extra_slots=2, kv_layout="NHD"):
    """k_cache, v_cache, block_table, seqlen_k of a random paged problem:
    pages shuffled across sequences, unused table slots full of garbage
    (negative and out-of-range ids), spare pages NaN (any read of them
    would show); HND caches are the NHD ones head-major."""
    dt = np_dtype(dtype)
    used = [-(-int(n) // page) for n in lens_k]
    pages = sum(used) + spare
    k = rng.standard_normal((pages, page, hk, d), dtype=np.float32).astype(dt)
    v = rng.standard_normal((pages, page, hk, d), dtype=np.float32).astype(dt)
    perm = rng.permutation(pages)
    garbage = np.array([-1, -7, pages, pages + 1000, 2**31 - 1], np.int64)
    bt = rng.choice(garbage, size=(len(lens_k), max(used + [1]) + extra_slots)).astype(np.int32)
    at = 0
    for b, n in enumerate(used):
        bt[b, :n] = perm[at : at + n]
        at += n
    k[perm[at:]] = np.nan
    v[perm[at:]] = np.nan
    if kv_layout == "HND":
        k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
    return k, v, bt, np.array(lens_k, np.int32)


def queries(rng, rows, *, dtype="f16", hq=HQ, d=D, batch=None):
    """q [batch, rows, hq, d], or [rows, hq, d] (varlen) without batch."""
    shape = (rows, hq, d) if batch is None else (batch, rows, hq, d)
    return rng.standard_normal(shape, dtype=np.float32).astype(np_dtype(dtype))


def seqstart(rows) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)


def host(x) -> np.ndarray:
    """A result (numpy or torch, any device) as a float64 numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float64)


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref|; inf where out is not finite."""
    o, r = host(out), np.asarray(ref, np.float64)
    if not np.isfinite(o).all():
        return float("inf")
    return float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)) if r.size else 0.0


def check(out, ref, dtype="f16", lse=None, ref_lse=None, what="output"):
    """The output within OUT_TOL of the reference, finite; with `lse`, rows
    with no visible key -inf exactly where the reference's are, the others
    within LSE_TOL."""
    err = rel_err(out, ref)
    assert err <= OUT_TOL[dtype], f"{what}: rel err {err:.3e} > {OUT_TOL[dtype]}"
    if lse is not None:
        got, want = host(lse), np.asarray(ref_lse, np.float64)
        assert got.shape == want.shape, f"lse shape {got.shape} != {want.shape}"
        empty = np.isneginf(want)
        np.testing.assert_array_equal(np.isneginf(got), empty, err_msg=f"{what}: rows with no visible key")
        if (~empty).any():
            lerr = float(np.abs(got[~empty] - want[~empty]).max())
            assert lerr <= LSE_TOL[dtype], f"{what}: lse abs err {lerr:.3e} > {LSE_TOL[dtype]}"
    return err
