"""Environment variables are checked like arguments:
a value that is set but invalid raises an error naming the variable, in
Python and through the command line, where every error names its flag or
variable; unset or empty means the default."""

from __future__ import annotations

import pytest
from test_cli import cli

import turbine_fmha
from turbine_fmha.core import env
from turbine_fmha.runtime.session import cpu_threads

BAD = {
    # variable: (invalid values, what the error says)
    env.CPU_THREADS: (["abc", "0", "-3", "1.5"], "must be a positive integer"),
    env.CUDA_ASYNC_ALLOCATIONS: (["yes", "2"], "must be 0 or 1"),
    env.MLIR_DIR: (["/nonexistent/templates"], "is not a directory"),
}
READERS = {env.CPU_THREADS: env.positive_int, env.CUDA_ASYNC_ALLOCATIONS: env.switch, env.MLIR_DIR: env.directory}


@pytest.mark.parametrize("name", sorted(BAD))
def test_invalid_values_are_refused_by_name(monkeypatch, name):
    values, words = BAD[name]
    for value in values:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"^\\${name} ") as info:
            READERS[name](name)
        assert words in str(info.value) and repr(value) in str(info.value)
    for unset in ("", "  "):
        monkeypatch.setenv(name, unset)
        assert READERS[name](name) in (None, False)


def test_cpu_threads(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CPU_THREADS, "3")
    assert cpu_threads() == 3
    monkeypatch.setenv(env.CPU_THREADS, "abc")
    with pytest.raises(ValueError, match=r"\$TURBINE_FMHA_CPU_THREADS must be a positive integer, got 'abc'"):
        turbine_fmha.Session("cpu", artifact_dir=tmp_path)


def test_manifest_pin_from_the_environment_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv(env.MANIFEST_SHA256, "not-a-digest")
    with pytest.raises(ValueError, match=r"^\$TURBINE_FMHA_MANIFEST_SHA256: manifest_sha256 must be hex"):
        turbine_fmha.Session("cpu", artifact_dir=tmp_path)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["run", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
        (["run", "--seed", "x"], "argument --seed: expected an integer"),
    ],
)
def test_cli_errors_name_the_flag(capsys, argv, words):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_cli_errors_name_the_variable(monkeypatch, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for value in ("abc", "0", "-3"):
        monkeypatch.setenv(env.CPU_THREADS, value)
        assert cli(["run", "--artifacts", str(tmp_path / "empty"), "--compile-missing"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"$TURBINE_FMHA_CPU_THREADS must be a positive integer, got {value!r}" in err
