"""The running CPU: its architecture and ISA features, as Linux's
/proc/cpuinfo names them (x86 "flags", AArch64 "Features"). What a CPU
artifact needs is stated in the same names (build/targets.py for the named
targets; the build machine's own features for `host` ones), so a session
can tell whether it may run an artifact before mapping it: code for
missing instructions dies of SIGILL, with no error to report."""

from __future__ import annotations

import dataclasses
import functools
import platform
import re

_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}

# The x86 flags that name instruction sets (the rest of the line is
# hypervisor, power and errata bits, which no code depends on).
_X86_ISA = re.compile(
    r"(sse.*|ssse3|avx.*|amx.*|fma|fma4|f16c|bmi1|bmi2|abm|movbe|popcnt|adx|sha_ni|gfni|vaes|"
    r"vpclmulqdq|aes|pclmulqdq|xsave|cx16|lahf_lm|xop|tbm)"
)


@dataclasses.dataclass(frozen=True)
class Cpu:
    arch: str  # "x86_64", "aarch64", or platform.machine() as it is
    features: frozenset[str]  # empty where they could not be read

    def lacks(self, arch: str | None, requires) -> list[str]:
        """What this CPU lacks to run code for `arch` needing `requires`:
        ["arch aarch64"] for another architecture, else the missing
        features; [] if nothing."""
        if arch is not None and arch != self.arch:
            return [f"arch {arch}"]
        return sorted(set(requires) - self.features)


def parse_cpuinfo(text: str, machine: str) -> Cpu:
    arch = _ARCH.get(machine.lower(), machine.lower())
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words = value.split()
            if arch == "x86_64":
                words = [w for w in words if _X86_ISA.fullmatch(w)]
            return Cpu(arch, frozenset(words))
    return Cpu(arch, frozenset())


@functools.cache
def this_cpu() -> Cpu:
    """The CPU this process runs on (its first core's features: Linux
    reports every core's, and they agree on the machines served)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:  # not Linux: no features known, so only `host` artifacts built here run
        text = ""
    return parse_cpuinfo(text, platform.machine())
