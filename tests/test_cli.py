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


def test_build_progress_bar_redraws_one_line_on_a_terminal():
    import io

    from turbine_fmha.build import BuildResult, ProgressBar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    ok = BuildResult("v_ok", "host", {"compile_seconds": 1.0}, rebuilt=True)
    bad = BuildResult("v_bad", "host", None, rebuilt=False, error="boom")
    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        bar = ProgressBar(stream)
        for i, r in enumerate((ok, bad, ok), 1):
            bar(i, 3, r)
    lines = tty.getvalue().split("\n")
    # One redrawn line, ended once at the last artifact; the failure on its own.
    assert tty.getvalue().endswith("\n") and tty.getvalue().count("\n") == 2
    assert "FAILED host/v_bad" in lines[0]
    assert "[" + "#" * 30 + "] 3/3" in lines[1].split("\r")[-1]
    # Not a terminal (CI logs): one plain line per artifact.
    assert log.getvalue().count("\n") == 3 and "\r" not in log.getvalue()
    assert "FAILED" in log.getvalue().splitlines()[1]
