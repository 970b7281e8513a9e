"""Packaging: the wheel's contents and extras, the default
directories, and the wheel installed (not editable) into a fresh virtual
environment, used from a directory outside the repository: the runtime
alone, then with the build extra."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from tolerances import OUT_TOL

import turbine_fmha
from turbine_fmha.kernels.variants import Variant, runtime_heads

REPO = Path(__file__).resolve().parent.parent
# Small decode variants: each compiles in about two seconds.
BUILT = Variant("f32", 32, 32, 2, 1, 16, "none")
FIRST_CALL = Variant("f32", 32, 32, 2, 2, 16, "none")
# What a default session compiles for it: the kernel of its GQA group.
COMPILED = Variant(**runtime_heads(FIRST_CALL.problem))
# pip's output when it could not reach an index (then the test is skipped).
OFFLINE = re.compile(
    r"NewConnectionError|Failed to establish|Temporary failure in name resolution|"
    r"Network is unreachable|ConnectTimeout|ProxyError"
)


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*(\S+)\s*", line.split("#")[0])
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def test_build_extra_pins_are_requirements_pins():
    """The build extra brings what building imports (torch included:
    iree-turbine needs it but does not require it), at the exact versions
    that the test environment pins."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    build = project["optional-dependencies"]["build"]
    pins = _pins(build)
    assert len(pins) == len(build), f"every build requirement is pinned exactly: {build}"
    assert {"torch", "iree-base-compiler", "iree-turbine", "jinja2"} <= set(pins)
    required = _pins((REPO / "requirements.txt").read_text().splitlines())
    assert {n: required.get(n) for n in pins} == pins
    assert _pins(project["dependencies"])["iree-base-runtime"] == pins["iree-base-compiler"]


def _not_source(directory: str, names: list[str]) -> set[str]:
    # What the top level holds besides the source (checked-out state, built
    # artifacts, caches); at every level, Python's caches.
    top = {".git", ".venv", "build", ".pytest_cache", ".hypothesis", ".device", ".whl"}
    return {
        n
        for n in names
        if n in ("__pycache__",)
        or n.endswith(".egg-info")
        or (Path(directory) == REPO and (n in top or n.startswith("artifacts")))
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the source tree (a build in place would
    leave build/ and egg-info in the shared checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_not_source)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    (whl,) = (tmp / "dist").glob("turbine_fmha-*.whl")
    return whl


def test_wheel_ships_every_module_and_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package, templates = REPO / "turbine_fmha", REPO / "mlir"
    expected = {f"turbine_fmha/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    # The templates: the repository's mlir/, inside the package (pyproject's package-dir).
    expected |= {f"turbine_fmha/mlir/{p.relative_to(templates).as_posix()}" for p in templates.rglob("*.mlir.jinja")}
    assert any(n.startswith("turbine_fmha/mlir/terms/") for n in expected)
    assert expected <= names, sorted(expected - names)


def test_default_directories_follow_one_rule(monkeypatch, tmp_path):
    """$TURBINE_FMHA_ARTIFACTS, else the user cache: for Python, the CLI
    and the missing-artifact hint alike; never inside the package."""
    from turbine_fmha.cli.main import main
    from turbine_fmha.runtime import paths

    for env in ("TURBINE_FMHA_ARTIFACTS", "TURBINE_FMHA_CACHE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "turbine-fmha"
    assert (paths.default_artifact_dir(), paths.default_cache_dir()) == (root / "artifacts", root / "compiled")
    session = turbine_fmha.Session("cpu")
    assert (session.artifact_dir, session.cache_dir) == (root / "artifacts", root / "compiled")
    q = np.zeros((1, 1, 2, 32), np.float32)
    kv = np.zeros((1, 16, 1, 32), np.float32)
    with pytest.raises(turbine_fmha.ArtifactError, match=re.escape(str(root / "artifacts"))):
        turbine_fmha.fmha_fwd_paged(q, kv, kv, np.zeros((1, 1), np.int32), np.ones(1, np.int32), session=session)
    assert main(["list"]) == 2  # the CLI reads the same default directory, which does not exist
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.default_artifact_dir() == tmp_path / "home" / ".cache" / "turbine-fmha" / "artifacts"
    monkeypatch.setenv("TURBINE_FMHA_ARTIFACTS", str(tmp_path / "mine"))
    assert turbine_fmha.Session("cpu").artifact_dir == tmp_path / "mine"


def test_compile_missing_without_the_build_extra_names_it(monkeypatch, tmp_path):
    import turbine_fmha.build.aot as tfb

    monkeypatch.setattr(tfb, "missing_build_modules", lambda: ["torch"])
    session = turbine_fmha.Session("cpu", artifact_dir=tmp_path, cache_dir=tmp_path / "c", compile_missing=True)
    q = np.zeros((1, 1, 2, 32), np.float32)
    kv = np.zeros((1, 16, 1, 32), np.float32)
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'turbine-fmha[build]'")):
        turbine_fmha.fmha_fwd_paged(q, kv, kv, np.zeros((1, 1), np.int32), np.ones(1, np.int32), session=session)
    with pytest.raises(ModuleNotFoundError, match=r"torch not installed"):
        tfb.build(tmp_path / "out", ["host"], [BUILT])


class Venv:
    """A fresh virtual environment, used from a directory outside the
    repository with every turbine-fmha directory pointed into tmp."""

    def __init__(self, root: Path, wheel: Path):
        self.root, self.wheel = root, wheel
        self.bin = root / "venv" / "bin"
        self.cwd = root / "elsewhere"
        self.cwd.mkdir(parents=True)
        self.xdg = root / "xdg"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("TURBINE_FMHA_", "PYTHON", "VIRTUAL_ENV"))}
        self.env.update(XDG_CACHE_HOME=str(self.xdg), TURBINE_FMHA_CPU_THREADS="2")
        subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, capture_output=True)

    def pip_install(self, requirement: str) -> None:
        # pip keeps its cache under $XDG_CACHE_HOME too: the user's, where
        # scripts/setup_env.sh left the pinned wheels, not the test's.
        env = dict(self.env, XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME", ""))
        if not env["XDG_CACHE_HOME"]:
            del env["XDG_CACHE_HOME"]
        p = self.run([str(self.bin / "python"), "-m", "pip", "install", "-q", requirement], env=env)
        if p.returncode and OFFLINE.search(p.stdout + p.stderr):
            pytest.skip(
                f"pip could not reach a package index for {requirement}, and its cache lacks the "
                f"wheels:\n{p.stderr[-2000:]}"
            )
        assert p.returncode == 0, p.stdout + p.stderr

    def run(self, argv, env=None) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=self.cwd, env=env or self.env, capture_output=True, text=True, timeout=600)

    def python(self, code: str) -> subprocess.CompletedProcess:
        return self.run([str(self.bin / "python"), "-c", code])

    def cli(self, *argv) -> subprocess.CompletedProcess:
        return self.run([str(self.bin / "turbine-fmha"), *argv])


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Venv:
    """The wheel installed with its runtime dependencies only."""
    v = Venv(tmp_path_factory.mktemp("installed"), wheel)
    v.pip_install(str(wheel))
    return v


# A paged call on the shape of `variant` (random data, verified against the
# float64 reference); prints OK. {session} is the session argument.
CALL = """
import numpy as np, turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref
assert "site-packages" in turbine_fmha.__file__, turbine_fmha.__file__
rng = np.random.default_rng(0)
hq, hk, d = {hq}, {hk}, {d}
q = rng.standard_normal((2, 1, hq, d), dtype=np.float32)
k, v = (rng.standard_normal((5, 16, hk, d), dtype=np.float32) for _ in range(2))
bt, sk = np.array([[0, 1], [2, 3]], np.int32), np.array([20, 9], np.int32)
out = turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, session={session})
np.testing.assert_allclose(out, fmha_fwd_paged_ref(q, k, v, bt, sk)[0], atol={atol})
print("OK")
"""


def _call(variant: Variant, session: str) -> str:
    return CALL.format(hq=variant.nhead_q, hk=variant.nhead_k, d=variant.hdim_q, session=session, atol=OUT_TOL["f32"])


def test_installed_runtime_alone_names_the_build_extra(venv):
    hint = "pip install 'turbine-fmha[build]'"
    p = venv.python(
        "import turbine_fmha, importlib.util; print(importlib.util.find_spec('torch'))\n"
        + _call(FIRST_CALL, "turbine_fmha.Session('cpu', compile_missing=True)")
    )
    assert p.stdout.startswith("None") and "ModuleNotFoundError" in p.stderr and hint in p.stderr, p.stderr
    p = venv.cli("build", "--variants", BUILT.name)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and hint in p.stderr, p.stderr


@pytest.fixture(scope="module")
def with_build_extra(venv) -> Venv:
    venv.pip_install(f"{venv.wheel}[build]")
    return venv


def test_installed_build_list_and_session_call(with_build_extra):
    venv = with_build_extra
    p = venv.cli("build", "--targets", "host", "--variants", BUILT.name)
    assert p.returncode == 0, p.stderr
    p = venv.cli("list", "--json")
    assert p.returncode == 0 and [a["variant"] for a in json.loads(p.stdout)] == [BUILT.name], p.stderr
    assert (venv.xdg / "turbine-fmha" / "artifacts" / "manifest.json").is_file()
    p = venv.python(_call(BUILT, "turbine_fmha.Session('cpu')"))
    assert p.stdout == "OK\n", p.stderr


def test_installed_first_call_compiles_into_the_user_cache(with_build_extra):
    """No session and no artifact for the call: the default session
    compiles the variant into the user cache, saying so in one line."""
    venv = with_build_extra
    p = venv.python(_call(FIRST_CALL, "None"))
    assert p.stdout == "OK\n", p.stderr
    assert [line for line in p.stderr.splitlines() if "compiling" in line] == [
        f"turbine-fmha: compiling {COMPILED.name} for host into {venv.xdg / 'turbine-fmha' / 'compiled'} (first use)"
    ]
    manifest = json.loads((venv.xdg / "turbine-fmha" / "compiled" / "manifest.json").read_text())
    assert [a["variant"] for a in manifest["artifacts"]] == [COMPILED.name]


def test_installed_version(with_build_extra):
    p = with_build_extra.python("import turbine_fmha; print(turbine_fmha.__version__)")
    version = p.stdout.strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version), p.stderr
    assert with_build_extra.cli("--version").stdout == f"turbine-fmha {version}\n"
