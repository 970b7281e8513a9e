"""The mask rule, once for the runtime: ck_tile's generic mask with sink
tokens (IsOutOfSinkBound).

Query row i (absolute) of a sequence with seqlen_q rows and seqlen_k keys
sees key t when t < seqlen_k and lo <= t <= hi, with lo = i + shift - left,
hi = i + shift + right, shift = seqlen_k - seqlen_q for a bottom-right mask
and 0 otherwise; a side of -1 is unbounded. A sink token t < sink also
stays visible past the window's left edge, up to hi. The kernels evaluate
the same rule (the templates' `mask_visible`); the float64 reference keeps
an implementation of its own, written from ck_tile, because it is the
oracle the two are tested against.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core.checks import check_int
from ..kernels.variants import UNBOUNDED

MASK_TYPES = ("none", "top_left", "bottom_right")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    type: str = "none"
    left: int = -1
    right: int = -1
    sink: int = 0

    @classmethod
    def from_args(cls, mask_type="none", window_size_left=-1, window_size_right=-1, sink_size=0) -> MaskSpec:
        """Validated, with errors naming the argument. Window sides and sink
        counts past every key (2^31 and more included) become UNBOUNDED - 1:
        still a bounded window (ALiBi's causal form is keyed on an unbounded
        left side) that reaches every key, since no sequence has 2^30 keys."""
        if mask_type not in MASK_TYPES:
            raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
        left = min(check_int(window_size_left, "window_size_left", minimum=-1), UNBOUNDED - 1)
        right = min(check_int(window_size_right, "window_size_right", minimum=-1), UNBOUNDED - 1)
        sink = min(check_int(sink_size, "sink_size", minimum=0), UNBOUNDED - 1)
        if mask_type == "none" and (left != -1 or right != -1 or sink):
            raise ValueError(
                "window_size_left/window_size_right/sink_size need mask_type 'top_left' or "
                f"'bottom_right' (got mask_type='none', windows ({left}, {right}), sink_size {sink})"
            )
        return cls(mask_type, left, right, sink)

    @property
    def kernel_sides(self) -> tuple[int, int]:
        """(left, right) as the kernels take them: unbounded is UNBOUNDED."""
        return (UNBOUNDED if self.left < 0 else self.left, UNBOUNDED if self.right < 0 else self.right)

    @property
    def has_right_edge(self) -> bool:
        return self.type != "none" and self.right >= 0

    @property
    def has_left_edge(self) -> bool:
        """A left window side and no sink tokens: keys before the window of
        a row's first query are never visible (sink tokens would be)."""
        return self.type != "none" and self.left >= 0 and not self.sink

    def shift(self, seqlen_q, seqlen_k):
        return seqlen_k - seqlen_q if self.type == "bottom_right" else 0 * seqlen_k

    def keys_reachable(self, row_end: int, seqlen_q: np.ndarray, seqlen_k: np.ndarray) -> np.ndarray:
        """Per sequence, how many leading keys rows below `row_end` can see
        at most: hi + 1 of the last row (sink tokens are bounded by hi too)."""
        sq, sk = seqlen_q.astype(np.int64), seqlen_k.astype(np.int64)
        if not self.has_right_edge:
            return sk
        return np.clip(row_end + self.shift(sq, sk) + self.right, 0, sk)

    def first_key_visible(self, row_start: int, seqlen_q: np.ndarray, seqlen_k: np.ndarray) -> np.ndarray:
        """Per sequence, the first key that rows from `row_start` on can see
        (lo of that row; lo grows with the row), in [0, seqlen_k]. Only for
        masks with a left edge: otherwise key 0 (or a sink token) is."""
        sq, sk = seqlen_q.astype(np.int64), seqlen_k.astype(np.int64)
        if not self.has_left_edge:
            return 0 * sk
        return np.clip(row_start + self.shift(sq, sk) - self.left, 0, sk)

    def decode_needs_mask(self, alibi: bool) -> bool:
        """Whether one-row (decode) queries need the mask: a bottom-right
        mask without a left edge hides nothing from the last row. ALiBi
        keeps it (its causal form differs)."""
        return not (self.type == "bottom_right" and self.left < 0 and not alibi)
