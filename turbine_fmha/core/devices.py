"""Device names: "cpu", "cuda", "cuda:N", "hip", "hip:N" (or a torch.device),
parsed in one place. A GPU's ordinal counts the GPUs this process sees
(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES apply), as torch's "cuda:N"
does: IREE opens "cuda://N" with cuDeviceGet(N) (hipDeviceGet for HIP).
ROCm torch calls its GPUs "cuda" too, so a "hip:N" session reads and
makes torch tensors on "cuda:N"."""

from __future__ import annotations

import re

KINDS = ("cpu", "cuda", "hip")

_NAME = re.compile(r"(cpu|cuda|hip)(?::(\d+))?")


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
    kind, ordinal = match.group(1), match.group(2)
    ordinal = None if ordinal is None else int(ordinal)
    if kind == "cpu" and ordinal not in (None, 0):
        raise ValueError(f"{name} {device!r}: the host CPU is one device, 'cpu'")
    return kind, ordinal


def device_name(kind: str, ordinal: int | None) -> str:
    """The canonical name: "cpu", or "cuda:N" / "hip:N" (N = 0 if None)."""
    return "cpu" if kind == "cpu" else f"{kind}:{ordinal or 0}"


def torch_device_of(kind: str, ordinal: int | None) -> str:
    """The torch device whose memory a session of `kind` and `ordinal` reads."""
    return "cpu" if kind == "cpu" else f"cuda:{ordinal or 0}"
