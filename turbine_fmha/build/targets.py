"""Compile targets: name -> iree-compile flags, runtime driver, formulation.

Pure data, no compiler import: the runtime uses it to map a device to the
artifacts it can load.
"""

from __future__ import annotations

import dataclasses

# Every artifact's entry point takes a wait fence and a signal fence and
# returns once its work is queued: the runtime then waits the way the device
# wants (polling on GPUs, see runtime.Loaded), instead of inside IREE's
# synchronous wrapper.
EXECUTION_MODEL = "--iree-execution-model=async-external"

# IREE's binding alignment when nothing lowers it: what the GPU artifacts,
# and CPU artifacts built before CPU_BINDING_ALIGNMENT, assume.
DEFAULT_BINDING_ALIGNMENT = 64
# CPU artifacts assume 16-byte aligned arguments, the alignment of numpy's
# (malloc's) allocations, so that the runtime reads a user's numpy caches
# in place: at 64 every such cache was copied, aligned, on every call,
# which cost as much as a decode's attention (docs/devlog/perf-notes.md).
CPU_BINDING_ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    flags: tuple[str, ...]
    driver: str
    # The formulation this target ships (see turbine_fmha.variants).
    formulation: str
    kind: str  # "cpu", "rocm" or "cuda"
    # CPU targets: the architecture and the ISA features (core/cpu.py's
    # names) a CPU needs to run the code. None and () for `host`, whose
    # artifacts record the build machine's own (build/aot.py).
    cpu_arch: str | None = None
    cpu_requires: tuple[str, ...] = ()
    # The alignment in bytes the kernels assume of every argument's memory
    # (IREE's default is 64). The manifest records it per artifact
    # ("binding_alignment"); a host hands memory over in place only at it.
    binding_alignment: int = DEFAULT_BINDING_ALIGNMENT


def _rocm(arch: str) -> Target:
    return Target(
        arch,
        (
            "--iree-hal-target-device=hip",
            f"--iree-rocm-target={arch}",
            "--iree-rocm-enable-register-spill-warning",
            EXECUTION_MODEL,
        ),
        "hip",
        "online",
        "rocm",
    )


def _cpu(name: str, triple: str, cpu: str, arch: str | None, requires: tuple[str, ...]) -> Target:
    return Target(
        name,
        (
            "--iree-hal-target-device=local",
            "--iree-hal-local-target-device-backends=llvm-cpu",
            *((f"--iree-llvmcpu-target-triple={triple}",) if triple else ()),
            f"--iree-llvmcpu-target-cpu={cpu}",
            f"--iree-stream-resource-min-offset-alignment={CPU_BINDING_ALIGNMENT}",
            EXECUTION_MODEL,
        ),
        "local-task",
        "explicit",
        "cpu",
        arch,
        requires,
        CPU_BINDING_ALIGNMENT,
    )


# The x86-64 microarchitecture levels (psABI), as /proc/cpuinfo names them.
_X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_X86_64_V3 = (*_X86_64_V2, "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")
_X86_64_V4 = (*_X86_64_V3, "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        # The build machine's CPU: the fastest code, for that machine (and
        # any with its features).
        _cpu("host", "", "host", None, ()),
        # CPU artifacts that travel: a CI machine builds them for servers
        # of another model (docs/user-guide.md, "CPU targets").
        _cpu("x86-64-v3", "x86_64-unknown-linux-gnu", "x86-64-v3", "x86_64", _X86_64_V3),
        _cpu("x86-64-v4", "x86_64-unknown-linux-gnu", "x86-64-v4", "x86_64", _X86_64_V4),
        _cpu("aarch64", "aarch64-unknown-linux-gnu", "generic", "aarch64", ("asimd", "fp")),
        _rocm("gfx942"),
        _rocm("gfx90a"),
        _rocm("gfx950"),
        # sm_90 is rejected by IREE 3.13; sm_80 PTX runs on Hopper (H100/H200).
        Target(
            "cuda",
            ("--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80", EXECUTION_MODEL),
            "cuda",
            "online",
            "cuda",
        ),
    )
}

# Which target a runtime device loads by default. A CPU session takes the
# first of CPU_TARGET_PREFERENCE its artifact directory holds and the CPU
# can run (runtime/session.py), `host` where it holds none.
DEVICE_DEFAULT_TARGET = {"cpu": "host", "cuda": "cuda", "hip": "gfx942"}
CPU_TARGET_PREFERENCE = ("host", "x86-64-v4", "x86-64-v3", "aarch64")


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}") from None
