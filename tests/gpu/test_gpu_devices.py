"""GPU ordinals as a tensor-parallel worker uses them, against the float64
reference (the checks of the former probes h200_devices.py and
gpu_contract.py's sessions, and of benchmarks/probes/h200_two_gpus.py
without its timings):

- each GPU torch sees: Session("cuda:N") runs a decode and a causal
  prefill on torch tensors on cuda:N, its results made on cuda:N;
- the first ordinal past the machine's GPUs, and a CPU target for a GPU,
  are refused at Session() by name;
- with two GPUs or more: a tensor of one GPU given to another's session is
  refused by name; the sessions' calls interleaved and from one thread
  each; the other GPU's free memory unmoved while one session runs; one
  worker process per GPU (torch.cuda.set_device(rank), Session("cuda:rank"))
  on the same artifacts. With one GPU these are skipped.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import HK, HQ, MASK, OUT_TOL, PAGE, D, rel_err

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def problem(rng, kind: str, batch: int = 3, keys: int = 256):
    """numpy f16 q and caches (pages shuffled, spare pages), int32 tables:
    a decode (one row per sequence) or a causal prefill of `keys` rows."""
    rows = 1 if kind == "decode" else keys
    width = keys // PAGE
    pages = batch * width + 3
    k = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    table = rng.permutation(pages)[: batch * width].reshape(batch, width).astype(np.int32)
    seqlen = np.full(batch, keys, np.int32)
    q = rng.standard_normal((batch, rows, HQ, D), dtype=np.float32).astype(np.float16)
    return q, k, v, table, seqlen


def checked_call(session, rng, kind: str) -> tuple[float, str]:
    """One public call on torch tensors on the session's device: (rel err
    against the float64 reference, the result's device)."""
    q, k, v, table, seqlen = problem(rng, kind)
    dev = session.torch_device
    out = turbine_fmha.fmha_fwd_paged(
        *(torch.from_numpy(a).to(dev) for a in (q, k, v)), table, seqlen, session=session, causal=kind == "prefill"
    )
    ref = fmha_fwd_paged_ref(q, k, v, table, seqlen, **(MASK if kind == "prefill" else {}))[0]
    return rel_err(out, ref), str(out.device)


@pytest.fixture(scope="module")
def sessions(gpu):
    """A session per GPU torch sees (the tests' own on the CPU dry run)."""
    if gpu.dry_run:
        return [gpu.session]
    return [gpu.new_session(f"cuda:{i}") for i in range(gpu.gpus)]


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_each_gpu_on_its_own_tensors(gpu, sessions, kind):
    rng = np.random.default_rng(0)
    for s in sessions:
        err, dev = checked_call(s, rng, kind)
        assert err <= OUT_TOL["f16"], f"{s.device_name}: rel err {err:.2e}"
        assert dev == s.torch_device


def test_ordinal_past_the_machine_refused(gpu):
    gpu.skip_on_cpu("GPU ordinals")
    with pytest.raises(ValueError, match=f"'cuda:{gpu.gpus}'"):
        gpu.new_session(f"cuda:{gpu.gpus}")


def test_cpu_target_refused_for_a_gpu(gpu):
    gpu.skip_on_cpu("a GPU session")
    with pytest.raises(ValueError, match="cannot run target 'host'"):
        turbine_fmha.Session("cuda", artifact_dir=gpu.artifacts, target="host")


@pytest.fixture
def two(gpu, sessions):
    gpu.skip_on_cpu("two GPUs")
    if gpu.gpus < 2:
        pytest.skip(f"needs two GPUs, this machine has {gpu.gpus}")
    return sessions[:2]


@pytest.mark.parametrize("name", ["q", "k_cache"])
def test_tensor_of_another_gpu_refused(two, name):
    s0 = two[0]
    q, k, v, table, seqlen = problem(np.random.default_rng(1), "decode", 2, 64)
    args = {n: torch.from_numpy(a).to("cuda:0") for n, a in (("q", q), ("k_cache", k), ("v_cache", v))}
    args[name] = args[name].to("cuda:1")
    with pytest.raises(ValueError, match=f"{name}.*cuda:1|cuda:1.*{name}"):
        turbine_fmha.fmha_fwd_paged(args["q"], args["k_cache"], args["v_cache"], table, seqlen, session=s0)


def test_sessions_interleaved(two):
    rng = np.random.default_rng(2)
    for i in range(4):
        s = two[i % 2]
        err, dev = checked_call(s, rng, ("decode", "prefill")[(i // 2) % 2])
        assert err <= OUT_TOL["f16"] and dev == s.torch_device, (s.device_name, err, dev)


def test_sessions_from_two_threads(two):
    results: dict = {}

    def rounds(s, seed):
        r = np.random.default_rng(seed)
        results[s.device_name] = [checked_call(s, r, kind) for _ in range(3) for kind in ("decode", "prefill")]

    threads = [threading.Thread(target=rounds, args=(s, 10 + i)) for i, s in enumerate(two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in two:
        got = results.get(s.device_name, [])
        assert len(got) == 6 and all(e <= OUT_TOL["f16"] and d == s.torch_device for e, d in got), got


def test_other_gpu_memory_unmoved(two):
    """While one session runs, the other GPU's free memory does not move
    (torch.cuda.mem_get_info sees IREE's allocations too; they come in
    pages of at least 2 MiB)."""
    for i, s in enumerate(two):
        other = 1 - i
        q, k, v, table, seqlen = problem(np.random.default_rng(3), "decode", 32, 1024)
        dev = s.torch_device
        qt, kt, vt = (torch.from_numpy(a).to(dev) for a in (q, k, v))
        torch.cuda.synchronize(other)
        free_before = torch.cuda.mem_get_info(other)[0]
        for _ in range(20):
            turbine_fmha.fmha_fwd_paged(qt, kt, vt, table, seqlen, session=s, kv_rows_finite=True)
        torch.cuda.synchronize(i)
        moved = free_before - torch.cuda.mem_get_info(other)[0]
        assert abs(moved) < 2 << 20, f"cuda:{other} free memory moved by {moved} bytes while cuda:{i} ran"


WORKER = """
import sys
import numpy as np
import torch
sys.path.insert(0, {root!r})
import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref
rank = int(sys.argv[1])
torch.cuda.set_device(rank)
session = turbine_fmha.Session(f"cuda:{{rank}}", artifact_dir={artifacts!r})
rng = np.random.default_rng(100 + rank)
for causal, rows in ((False, 1), (True, 256)):
    q = rng.standard_normal((3, rows, 32, 128), dtype=np.float32).astype(np.float16)
    k, v = (rng.standard_normal((51, 16, 8, 128), dtype=np.float32).astype(np.float16) for _ in "kv")
    table = rng.permutation(51)[:48].reshape(3, 16).astype(np.int32)
    seqlen = np.full(3, 256, np.int32)
    out = turbine_fmha.fmha_fwd_paged(
        *(torch.from_numpy(a).to(f"cuda:{{rank}}") for a in (q, k, v)), table, seqlen, session=session, causal=causal
    )
    kw = dict(mask_type="bottom_right", window_size_right=0) if causal else dict()
    ref = fmha_fwd_paged_ref(q, k, v, table, seqlen, **kw)[0]
    err = float(np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max())
    print("causal" if causal else "decode", err, out.device, flush=True)
    assert err <= {tol} and str(out.device) == f"cuda:{{rank}}", (causal, err, out.device)
"""


def test_one_worker_process_per_gpu(two, gpu):
    root = str(Path(__file__).resolve().parents[2])
    code = WORKER.format(root=root, artifacts=str(gpu.artifacts), tol=OUT_TOL["f16"])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(procs):
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"worker {rank}:\n{text[-3000:]}"
