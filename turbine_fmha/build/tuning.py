"""Per-target tuning of IREE's attention lowering configuration.

IREE 3.13's default configuration for the online_attention dispatch tiles
the workgroup along the output's head dim (V's columns): each workgroup then
recomputes the whole Q.K^T for a quarter of the output. Keeping the head
dim whole roughly halved decode and prefill times on the H200, with
identical results (docs/devlog/perf-notes.md). The remaining fields of IREE's own
configuration are kept.

Applied by compiling twice: once to the executable configurations (which
IREE dumps), then, with the edited attention configuration substituted
(--iree-hal-substitute-executable-configuration), to the vmfb.
"""

from __future__ import annotations

import re
from pathlib import Path

# Bump when the edit changes: artifacts built with another version rebuild.
VERSION = 1
# Target kinds it is applied to (measured on NVIDIA only; see targets).
KINDS = ("cuda",)

_MAP = re.compile(r"affine_map<\(([^)]*)\) -> \(([^)]*)\)>")
_OP = re.compile(r"iree_linalg_ext\.online_attention <indexing_maps = \[(.*?)\]")
_WG = re.compile(r"(\{lowering_config = #iree_gpu\.lowering_config<\{[^}]*?workgroup = \[)([0-9, ]+)(\])")


def untile_head_dim(configured: str) -> str | None:
    """The configured executable with the attention's workgroup tile along
    the output head dim set to 0 (whole), or None if there is nothing to
    change (no online_attention, or already whole)."""
    op = _OP.search(configured)
    if not op:
        return None
    maps = [(dims.split(", "), res.split(", ")) for dims, res in _MAP.findall(op.group(1))]
    if len(maps) < 6:
        return None
    (dims, q), (_, _), (_, v), _, _, (_, o) = maps[:6]
    head = (set(o) & set(v)) - set(q)
    if len(head) != 1:
        return None
    index = dims.index(head.pop())
    wg = _WG.search(configured, op.end())
    if not wg:
        return None
    tiles = [int(t) for t in wg.group(2).split(",")]
    if index >= len(tiles) or tiles[index] == 0:
        return None
    tiles[index] = 0
    return configured[: wg.start(2)] + ", ".join(map(str, tiles)) + configured[wg.end(2) :]


def substitution_flags(config_dir: Path, out_dir: Path, flag_dir: str | None = None) -> list[str]:
    """Edits every dumped configured executable that holds an attention
    dispatch; returns the iree-compile flags that substitute them. The flags
    name the edited files under `flag_dir` (default: out_dir), which is
    how iree-compile, from its working directory, reaches out_dir: a
    relative name keeps the build directory's path out of the vmfb."""
    flags = []
    for path in sorted(Path(config_dir).glob("*.mlir")):
        edited = untile_head_dim(path.read_text())
        if edited is None:
            continue
        name = re.search(r"hal\.executable public @([\w$.]+)", edited)
        if not name:
            continue
        dst = Path(out_dir) / path.name
        dst.write_text(edited)
        shown = Path(flag_dir) / path.name if flag_dir is not None else dst
        flags.append(f"--iree-hal-substitute-executable-configuration={name.group(1)}={shown}")
    return flags
