"""CPU artifacts that travel: named CPU targets (x86-64-v3, x86-64-v4,
aarch64) beside `host`, each artifact recording what a CPU needs to run
it, and a CPU session that loads the best its directory holds for the
running CPU, or says why it can load none. Code for instructions a CPU
lacks dies of SIGILL, so every refusal here happens before a module is
mapped. The x86 targets run on this machine where it has their features
(x86-64-v4 needs AVX-512); aarch64 is compile-checked only."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import CACHE, make_problem, run_and_check

import turbine_fmha
import turbine_fmha.core.cpu as cpu_mod
from turbine_fmha.build import aot
from turbine_fmha.build.targets import TARGETS
from turbine_fmha.core.cpu import Cpu, parse_cpuinfo, this_cpu

PROBLEM = dict(dtype="f16", batch=2, seqlen_q=1, seqlens_k=[37, 5], nhead_q=4, nhead_k=2, hdim=64, page=16)
# Where the named targets' kernels are built: beside the suite's host
# cache, content-hashed like it, so reruns compile nothing.
BUILT = CACHE.parent / "test-cache-cpu-targets"


@pytest.fixture(scope="module")
def built(explicit_session):
    """The variant a small decode selects, built for every CPU target."""
    rng = np.random.default_rng(0)
    turbine_fmha.fmha_fwd_paged(*make_problem(rng, **PROBLEM), session=explicit_session)
    variant = explicit_session.last_variant
    aot.build(BUILT, ["x86-64-v3", "x86-64-v4", "aarch64", "host"], [variant])
    return variant


def _dir_with(tmp_path, built, targets) -> str:
    """An artifact directory holding `built` for `targets` only."""
    d = tmp_path / "-".join(targets)
    manifest = json.loads((BUILT / "manifest.json").read_text())
    keep = [a for a in manifest["artifacts"] if a["variant"] == built.name and a["target"] in targets]
    assert sorted(a["target"] for a in keep) == sorted(targets)
    for a in keep:
        (d / a["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(BUILT / a["path"], d / a["path"])
    (d / "manifest.json").write_text(json.dumps(dict(manifest, artifacts=keep)))
    return str(d)


def _without(*features) -> Cpu:
    cpu = this_cpu()
    return Cpu(cpu.arch, cpu.features - set(features))


def test_cpuinfo_parsing():
    x86 = "processor\t: 0\nflags\t\t: fpu avx2 hypervisor avx512f sse4_2 constant_tsc\n"
    assert parse_cpuinfo(x86, "x86_64") == Cpu("x86_64", frozenset({"avx2", "avx512f", "sse4_2"}))
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm sve\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo(arm, "arm64") == Cpu("aarch64", frozenset({"fp", "asimd", "evtstrm", "sve"}))
    assert parse_cpuinfo("", "riscv64") == Cpu("riscv64", frozenset())
    cpu = Cpu("x86_64", frozenset({"avx2"}))
    assert cpu.lacks("aarch64", ()) == ["arch aarch64"]
    assert cpu.lacks("x86_64", ("avx512f", "avx2", "avx512bw")) == ["avx512bw", "avx512f"]


def test_named_targets_are_portable_data():
    v3, v4, arm = TARGETS["x86-64-v3"], TARGETS["x86-64-v4"], TARGETS["aarch64"]
    assert set(v3.cpu_requires) < set(v4.cpu_requires)
    for t in (v3, v4, arm):
        assert t.kind == "cpu" and t.driver == "local-task" and t.cpu_arch
        assert not any("target-cpu=host" in f for f in t.flags)  # nothing of the build machine
        assert any(f.startswith("--iree-llvmcpu-target-triple=") for f in t.flags)


def test_entries_record_what_a_cpu_needs(built):
    entries = {
        a["target"]: a
        for a in json.loads((BUILT / "manifest.json").read_text())["artifacts"]
        if a["variant"] == built.name
    }
    assert entries["x86-64-v3"]["cpu_requires"] == sorted(TARGETS["x86-64-v3"].cpu_requires)
    assert entries["aarch64"]["cpu_arch"] == "aarch64"
    # host: the build machine's own features (LLVM's "host" CPU uses them all)
    assert entries["host"]["cpu_arch"] == this_cpu().arch
    assert entries["host"]["cpu_requires"] == sorted(this_cpu().features)


@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4"])
def test_a_named_target_runs_and_is_chosen(tmp_path, built, rng, target):
    if this_cpu().lacks(TARGETS[target].cpu_arch, TARGETS[target].cpu_requires):
        pytest.skip(f"this CPU cannot run {target}")
    s = turbine_fmha.Session("cpu", artifact_dir=_dir_with(tmp_path, built, ["aarch64", target]))
    assert s.target.name == target
    run_and_check(s, make_problem(rng, **PROBLEM), dtype="f16")


def test_the_best_target_this_cpu_runs_is_chosen(tmp_path, built, monkeypatch):
    d = _dir_with(tmp_path, built, ["aarch64", "x86-64-v3", "x86-64-v4", "host"])
    if this_cpu().arch != "x86_64":
        pytest.skip("the x86 targets")
    assert turbine_fmha.Session("cpu", artifact_dir=d).target.name == "host"
    # Another machine, without the build machine's AMX: not host, the best level it has.
    monkeypatch.setattr(
        cpu_mod, "this_cpu", lambda: _without("amx_tile", "amx_int8", "amx_bf16", "avx512_fp16", "sha_ni")
    )
    assert turbine_fmha.Session("cpu", artifact_dir=d).target.name == "x86-64-v4"
    monkeypatch.setattr(cpu_mod, "this_cpu", lambda: _without("avx512f", "amx_tile", "sha_ni"))
    assert turbine_fmha.Session("cpu", artifact_dir=d).target.name == "x86-64-v3"


def test_nothing_this_cpu_runs_is_refused_at_session(tmp_path, built, monkeypatch):
    d = _dir_with(tmp_path, built, ["aarch64", "x86-64-v4"])
    monkeypatch.setattr(cpu_mod, "this_cpu", lambda: Cpu("x86_64", frozenset(TARGETS["x86-64-v3"].cpu_requires)))
    with pytest.raises(turbine_fmha.ArtifactError) as e:
        turbine_fmha.Session("cpu", artifact_dir=d)
    msg = str(e.value)
    assert "no CPU artifact this CPU (x86_64) can run" in msg and "aarch64 needs arch aarch64" in msg
    assert "x86-64-v4 needs avx512bw, avx512cd, avx512dq, avx512f, avx512vl" in msg
    assert "turbine-fmha build --targets host" in msg
    # compile_missing may build for this CPU instead: host, compiled on demand.
    s = turbine_fmha.Session("cpu", artifact_dir=d, compile_missing=True, cache_dir=tmp_path / "cache")
    assert s.target.name == "host"
    # An explicit target this CPU cannot run: refused by name at Session().
    with pytest.raises(ValueError, match=r"target 'x86-64-v4' needs what this CPU \(x86_64\) lacks: avx512bw"):
        turbine_fmha.Session("cpu", target="x86-64-v4", artifact_dir=d)


def test_host_artifacts_of_another_cpu_are_not_loaded(tmp_path, built, rng, monkeypatch):
    """host artifacts record the build machine's features: a CPU missing
    one of them skips them, and the missing-artifact error says why."""
    d = _dir_with(tmp_path, built, ["host"])
    monkeypatch.setattr(cpu_mod, "this_cpu", lambda: _without(sorted(this_cpu().features)[0]))
    with pytest.raises(turbine_fmha.ArtifactError, match="no CPU artifact this CPU"):
        turbine_fmha.Session("cpu", artifact_dir=d)
    s = turbine_fmha.Session("cpu", target="host", artifact_dir=d)
    with pytest.raises(
        turbine_fmha.ArtifactError, match="holds host artifacts built for a CPU with what this one lacks"
    ):
        turbine_fmha.fmha_fwd_paged(*make_problem(rng, **PROBLEM), session=s)


def test_a_copied_host_directory_is_rebuilt_for_this_cpu(tmp_path, built, monkeypatch):
    d = _dir_with(tmp_path, built, ["host"])
    (res,) = aot.build(d, ["host"], [built])
    assert not res.rebuilt  # built here: unchanged
    monkeypatch.setattr(cpu_mod, "this_cpu", lambda: _without(sorted(this_cpu().features)[0]))
    (res,) = aot.build(d, ["host"], [built])
    assert res.rebuilt and res.entry["cpu_requires"] == sorted(cpu_mod.this_cpu().features)
