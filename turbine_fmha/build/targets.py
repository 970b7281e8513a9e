"""Compile targets: name -> iree-compile flags, runtime driver, formulation.

Pure data, no compiler import: the runtime uses it to map a device to the
artifacts it can load.
"""

from __future__ import annotations

import dataclasses


# Every artifact's entry point takes a wait fence and a signal fence and
# returns once its work is queued: the runtime then waits the way the device
# wants (polling on GPUs, see runtime._Loaded), instead of inside IREE's
# synchronous wrapper.
EXECUTION_MODEL = "--iree-execution-model=async-external"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    flags: tuple[str, ...]
    driver: str
    # The formulation this target ships (see turbine_fmha.variants).
    formulation: str
    kind: str  # "cpu", "rocm" or "cuda"


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


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "host",
            (
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=host",
                EXECUTION_MODEL,
            ),
            "local-task",
            "explicit",
            "cpu",
        ),
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

# Which target a runtime device loads by default.
DEVICE_DEFAULT_TARGET = {"cpu": "host", "cuda": "cuda", "hip": "gfx942"}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(
            f"unknown target {name!r}; known targets: {', '.join(TARGETS)}"
        ) from None
