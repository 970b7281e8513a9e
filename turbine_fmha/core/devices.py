"""Device names: "cpu", "cuda", "cuda:N", "hip", "hip:N" (or a torch.device),
parsed in one place. A GPU's ordinal counts the GPUs this process sees
(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES apply), as torch's "cuda:N"
does: IREE opens "cuda://N" with cuDeviceGet(N) (hipDeviceGet for HIP).
ROCm torch calls its GPUs "cuda" too, so a "hip:N" session reads and
makes torch tensors on "cuda:N"."""

from __future__ import annotations

import re

KINDS = ("cpu", "cuda", "hip")

# ASCII digits only: \d also matches other scripts' digits, which int()
# reads, so "cuda:\u0661" would have opened cuda:1.
_NAME = re.compile(r"(cpu|cuda|hip)(?::([0-9]+))?")
# The largest ordinal a GPU runtime takes (cuDeviceGet's int): a larger
# one is refused here rather than overflowing on its way to C.
MAX_ORDINAL = 2**31 - 1


def parse_device(device, name: str = "device") -> tuple[str, int | None]:
    """(kind, ordinal) of a device name; the ordinal is None where the name
    gives none ("cuda": the first GPU unless a session says otherwise).
    Raises ValueError naming `name`."""
    if not isinstance(device, str):
        # torch.device, without importing torch: its str() is "cuda:1".
        if type(device).__name__ == "device" and type(device).__module__ == "torch":
            device = str(device)
        else:
            raise TypeError(f"{name} must be a str such as 'cuda:0' or a torch.device, got {type(device).__name__}")
    match = _NAME.fullmatch(device)
    if match is None:
        raise ValueError(
            f"{name} must be one of {list(KINDS)}, optionally with ':N' for a GPU (e.g. 'cuda:1'), got {device!r}"
        )
    kind, digits = match.group(1), match.group(2)
    if digits is None:
        return kind, None
    significant = digits.lstrip("0")
    if kind == "cpu" and significant:
        raise ValueError(f"{name} {device!r}: the host CPU is one device, 'cpu'")
    # The length first: int() of thousands of digits raises its own
    # ValueError, which would not name the argument.
    if len(significant) > len(str(MAX_ORDINAL)) or int(digits) > MAX_ORDINAL:
        raise ValueError(f"{name} {device!r}: a GPU ordinal is at most {MAX_ORDINAL}")
    return kind, int(digits)


def device_name(kind: str, ordinal: int | None) -> str:
    """The canonical name: "cpu", or "cuda:N" / "hip:N" (N = 0 if None)."""
    return "cpu" if kind == "cpu" else f"{kind}:{ordinal or 0}"


def torch_device_of(kind: str, ordinal: int | None) -> str:
    """The torch device whose memory a session of `kind` and `ordinal` reads."""
    return "cpu" if kind == "cpu" else f"cuda:{ordinal or 0}"
