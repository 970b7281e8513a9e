"""Per-target tuning of IREE's attention lowering configuration.

IREE 3.13's default configuration for the online_attention dispatch tiles
the workgroup along the output's head dim (V's columns): each workgroup then
recomputes the whole Q.K^T for a quarter of the output. Keeping the head
dim whole, each workgroup computes Q.K^T (and reads K) once for all of
its output's head dim, which sped up decode and prefill alike with
identical results (docs/devlog/perf-notes.md,
"GPU speed, round 1: steps taken, predicted and measured", item "The
attention's lowering configuration"). The remaining fields of IREE's own
configuration are kept.

Applied between two halves of one compile: iree-compile stops at the
executable configurations, the attention's is edited in that module's
text, and iree-compile goes on from there to the vmfb (compiler.py).
"""

from __future__ import annotations

import re

# Bump when the edit changes: artifacts built with another version rebuild.
VERSION = 1
# Target kinds it is applied to (measured on NVIDIA only; see targets).
KINDS = ("cuda",)

_MAP = re.compile(r"affine_map<\(([^)]*)\) -> \(([^)]*)\)>")
_OP = re.compile(r"iree_linalg_ext\.online_attention <indexing_maps = \[(.*?)\]")
# Where each executable of a configured module starts: an edit stays
# within its own executable.
_EXECUTABLE = re.compile(r"(?=^[ \t]*hal\.executable (?:private |public )?@)", re.M)
_WG = re.compile(r"(\{lowering_config = #iree_gpu\.lowering_config<\{[^}]*?workgroup = \[)([0-9, ]+)(\])")


def untile_head_dim(configured: str) -> str | None:
    """The configured executable with the attention's workgroup tile along
    the output head dim set to 0 (whole), or None if there is nothing to
    change (no online_attention, or already whole)."""
    op = _OP.search(configured)
    if not op:
        return None
    maps = [(dims.split(", "), res.split(", ")) for dims, res in _MAP.findall(op.group(1))]
    if len(maps) < 7:
        return None
    # Q, K, V, the scale, an optional mask, then acc, max and sum: the
    # output is the third map from the end, with or without a mask.
    (dims, q), (_, v), (_, o) = maps[0], maps[2], maps[-3]
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


def tune_configured(module: str) -> str | None:
    """A module stopped at its executable configurations
    (`--compile-to=executable-configurations`) with untile_head_dim applied
    to each executable, or None if none changed."""
    parts = _EXECUTABLE.split(module)
    edited = [untile_head_dim(part) for part in parts]
    if all(e is None for e in edited):
        return None
    return "".join(part if e is None else e for part, e in zip(parts, edited))
