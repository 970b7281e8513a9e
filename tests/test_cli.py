"""`turbine-fmha run` and `bench` (issue 6) on small problems, compiling
what they need into the test cache."""

from __future__ import annotations

from conftest import CACHE
from turbine_fmha.cli import main

SMALL = ["--compile-missing", "--artifacts", str(CACHE / "none"), "--nhead-q", "4", "--nhead-k", "2",
         "--hdim", "64", "--page", "16"]


def test_run_verifies(monkeypatch, capsys):
    monkeypatch.setenv("TURBINE_FMHA_CACHE", str(CACHE))
    assert main(["run", *SMALL, "--batch", "3", "--seqlen-q", "7", "--seqlen-k", "40,1,90",
                 "--mask", "bottom_right"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "pagedkv_fwd_f16_d64x64_h4x2_pg16_mbr" in out


def test_run_split_kv_and_bench(monkeypatch, capsys):
    monkeypatch.setenv("TURBINE_FMHA_CACHE", str(CACHE))
    assert main(["run", *SMALL, "--batch", "2", "--seqlen-k", "600", "--num-splits", "3"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["bench", *SMALL, "--batch", "2", "--seqlen-k", "300", "--repeat", "2"]) == 0
    assert "median" in capsys.readouterr().out
