"""The README's first command runs examples/demo.py over the default host
artifacts; here it runs with the variants it needs compiled into the test
cache, so that a change the demo depends on cannot land broken."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import CACHE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import demo


def test_demo_verifies_every_request(monkeypatch, capsys):
    monkeypatch.setenv("TURBINE_FMHA_CACHE", str(CACHE))
    assert demo.main(["--compile-missing", "--artifacts", str(CACHE / "none")]) == 0
    assert "all requests verified" in capsys.readouterr().out
