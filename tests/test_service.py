"""The example service loop (examples/serve_decode.py) on a small
model: every step verified against the float64 reference inside the loop,
and every page back in the pool at the end."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import pytest
from serve_decode import run_service


@pytest.mark.parametrize("torch_q", [False, True])
def test_service_loop(explicit_session, torch_q):
    if torch_q:
        pytest.importorskip("torch")
    stats = run_service(
        explicit_session,
        requests=8,
        max_batch=3,
        nhead_q=8,
        nhead_k=2,
        hdim=64,
        page=16,
        num_pages=40,
        prompt_range=(5, 60),
        generate_range=(2, 9),
        verify_every=1,
        log=lambda *a: None,
        torch_q=torch_q,
    )
    assert stats["verified_steps"] == stats["steps"] > 0
    assert stats["free_pages_after"] == 40
