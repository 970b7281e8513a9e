"""`turbine-fmha` commands: run and bench on small problems (compiling what
they need into the test cache), one-line errors, --json, pipes, --version,
and the build of a model's variant set."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import CACHE

from turbine_fmha.cli.main import main
from turbine_fmha.kernels.signature import KERNEL_ABI

SHAPE = ["--nhead-q", "4", "--nhead-k", "2", "--hdim", "64", "--page", "16"]


@pytest.fixture
def small(monkeypatch, tmp_path):
    """run/bench arguments: an empty artifact directory, variants compiled
    into the test cache."""
    monkeypatch.setenv("TURBINE_FMHA_CACHE", str(CACHE))
    (tmp_path / "empty").mkdir()
    return ["--compile-missing", "--artifacts", str(tmp_path / "empty"), *SHAPE]


def cli(argv) -> int:
    """main() as the console script runs it: argparse's exits become codes."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_run_verifies(small, capsys):
    assert (
        main(["run", *small, "--batch", "3", "--seqlen-q", "7", "--seqlen-k", "40,1,90", "--mask", "bottom_right"]) == 0
    )
    out = capsys.readouterr().out
    # compile_missing compiles the CPU kernel for the call's GQA group (4/2 heads: _g2).
    assert "PASS" in out and "pagedkv_fwd_f16_d64x64_g2_pg16_mbr" in out
    assert main(["run", *small, "--batch", "2", "--seqlen-k", "600", "--num-splits", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] is True and result["output_rel_err"] <= result["output_bound"]


def test_bench_decode_gbs_prefill_tflops_with_baseline(small, capsys):
    assert main(["bench", *small, "--batch", "2", "--seqlen-k", "300", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "TFLOP/s" not in out and "torch gather+SDPA: median" in out
    assert (
        main(
            [
                "bench",
                *small,
                "--batch",
                "1",
                "--seqlen-q",
                "64",
                "--seqlen-k",
                "200",
                "--mask",
                "bottom_right",
                "--repeat",
                "2",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "prefill" and result["unit"] == "TFLOP/s"
    assert result["baseline"]["name"] == "torch gather+SDPA" and result["baseline"]["median_ms"] > 0
    assert main(["bench", *small, "--batch", "1", "--seqlen-k", "20", "--repeat", "1", "--no-baseline"]) == 0
    assert "skipped (--no-baseline)" in capsys.readouterr().out


def test_bench_baseline_computes_the_same_attention():
    """The baseline is only a baseline if it computes what turbine-fmha
    does: the reference's output, masks and ragged lengths included."""
    from turbine_fmha.cli.main import parser
    from turbine_fmha.cli.problem import _random_problem, torch_gather_sdpa
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    for mask, sq in (("none", 1), ("bottom_right", 5), ("top_left", 5)):
        args = parser().parse_args(
            [
                "bench",
                *SHAPE,
                "--dtype",
                "f32",
                "--batch",
                "3",
                "--seqlen-q",
                str(sq),
                "--seqlen-k",
                "40,17,33",
                "--mask",
                mask,
            ]
        )
        prob, kw = _random_problem(args, np.random.default_rng(0))
        out = torch_gather_sdpa(args, prob)().transpose(1, 2).numpy()
        ref, _ = fmha_fwd_paged_ref(*prob, mask_type=mask, window_size_right=kw["window_size_right"])
        # torch's f32 SDPA, not a kernel of this package: f32 rounding only.
        np.testing.assert_allclose(out, ref, atol=1e-4)


def _manifest_dir(tmp_path, targets=("host", "cuda")):
    """An artifact directory whose manifest lists one variant on `targets`
    and a second on host (list and inspect read only the manifest)."""
    d = tmp_path / "arts"
    d.mkdir()
    names = ["pagedkv_fwd_f16_d64x64_h4x2_pg16_nmask_lse_explicit"] * len(targets)
    names.append("pagedkv_fwd_f32_d64x64_h4x2_pg16_nmask_lse_explicit")
    entries = [
        dict(
            variant=v,
            target=t,
            path=f"{t}/{v}.vmfb",
            sha256="0" * 64,
            compiler_version="3.13.0",
            kernel_abi=KERNEL_ABI,
            size=100,
            compile_seconds=1.5,
            flags=["--x"],
            isa={},
        )
        for v, t in zip(names, [*targets, "host"])
    ]
    (d / "manifest.json").write_text(json.dumps(dict(manifest_version=1, compiler_version="3.13.0", artifacts=entries)))
    return d, names[0]


def test_list_and_inspect_json(tmp_path, capsys):
    d, name = _manifest_dir(tmp_path)
    assert main(["list", "--artifacts", str(d), "--json"]) == 0
    assert [a["target"] for a in json.loads(capsys.readouterr().out)] == ["host", "cuda", "host"]
    assert main(["list", "--out", str(d), "--target", "cuda"]) == 0  # --out: the old name
    assert ": compiler 3.13.0, 1 artifact\ncuda " in capsys.readouterr().out
    # Several matches: one JSON list, not concatenated objects.
    assert main(["inspect", name, "--artifacts", str(d), "--json"]) == 0
    assert [a["target"] for a in json.loads(capsys.readouterr().out)] == ["host", "cuda"]
    assert main(["inspect", name, "--artifacts", str(d), "--target", "cuda", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "cuda"
    assert main(["inspect", name, "--artifacts", str(d), "--target", "cuda"]) == 0
    assert capsys.readouterr().out.startswith(f"cuda/{name}\n  variant")


def _error_cases(tmp_path):
    missing = str(tmp_path / "missing")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text('{"artifacts": []}')
    return [
        (["run", "--batch", "0"], "--batch"),
        (["run", "--device", "cuda:x"], "--device"),
        (["bench", "--device", "cpu:1"], "--device"),
        (["bench", "--seqlen-k", "5,-1", "--batch", "2"], "--seqlen-k"),
        (["run", "--seqlen-k", "5,6", "--batch", "3", "--artifacts", str(tmp_path)], "--seqlen-k"),
        (["run", "--nhead-q", "4", "--nhead-k", "3", "--artifacts", str(tmp_path)], "--nhead-q"),
        (["list", "--artifacts", missing], f"--artifacts: {missing} does not exist"),
        (["inspect", "v", "--artifacts", missing], f"--artifacts: {missing} does not exist"),
        (["run", "--artifacts", missing, "--compile-missing"], f"--artifacts: {missing} does not exist"),
        (["bench", "--artifacts", missing], f"--artifacts: {missing} does not exist"),
        (["list", "--artifacts", str(tmp_path)], "no manifest.json in"),
        (["run", "--artifacts", str(broken)], "manifest_version: missing"),
        (["build", "--targets", "host,nope"], "--targets: unknown target 'nope'"),
        (["build", "--variants", "nope"], "--variants"),
        (["build", "--nhead-k", "2"], "--nhead-q is required"),
        (["build", "--model-config", missing], f"cannot read {missing}"),
        (
            ["build", "--nhead-q", "4", "--nhead-k", "3", "--hdim", "64"],
            "nhead_q (4) must be a multiple of nhead_k (3)",
        ),
    ]


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    for argv, words in _error_cases(tmp_path):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, (argv, err)


def test_piped_into_a_closed_reader_exits_quietly(tmp_path):
    """`turbine-fmha list | head`: the reader has gone when the output comes."""
    d, _ = _manifest_dir(tmp_path)
    code = "import sys; from turbine_fmha.cli.main import main; sys.exit(main())"
    p = subprocess.Popen(
        [sys.executable, "-c", code, "list", "--artifacts", str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    p.stdout.close()  # before the child has imported anything, let alone written
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err == ""


def test_version(capsys):
    import importlib.metadata

    assert cli(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"turbine-fmha {importlib.metadata.version('turbine-fmha')}"


def test_build_model_config_builds_the_model_set(tmp_path, monkeypatch, capsys):
    """--model-config: each target gets model_variants of the config's
    shape, flags win over the config, with the progress bar."""
    import turbine_fmha.build.aot as tfb
    import turbine_fmha.build.artifacts as artifacts
    from turbine_fmha.build.model_set import ModelShape, model_variants

    seen = {}

    def fake_build(out, targets, variants, *, jobs, progress, force):
        seen.update(out=out, variants=variants, progress=progress)
        return []

    monkeypatch.setattr(tfb, "build", fake_build)
    monkeypatch.setattr(artifacts, "manifest_digest", lambda out: "0" * 64)
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=768, torch_dtype="bfloat16"))
    )
    assert (
        main(
            [
                "build",
                "--model-config",
                str(cfg),
                "--targets",
                "host,cuda",
                "--page",
                "16,32",
                "--artifacts",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    shape = ModelShape(12, 4, 64, 64, "bf16", (16, 32))
    assert seen["variants"] == {t: model_variants(shape, t) for t in ("host", "cuda")}
    assert isinstance(seen["progress"], tfb.ProgressBar) and seen["out"] == tmp_path / "a"
    assert "model set: 12/4 heads, head dims 64/64, bf16, NHD pages 16,32" in capsys.readouterr().err
    assert main(["build", "--nhead-q", "8", "--hdim", "96", "--dtype", "f32", "--artifacts", str(tmp_path)]) == 0
    assert seen["variants"] == {"host": model_variants(ModelShape(8, 8, 96, 96, "f32"), "host")}
    assert (
        main(
            [
                "build",
                "--nhead-q",
                "8",
                "--nhead-k",
                "2",
                "--hdim",
                "64",
                "--kv-layout",
                "HND",
                "--artifacts",
                str(tmp_path),
            ]
        )
        == 0
    )
    hnd = model_variants(ModelShape(8, 2, 64, 64, "f16", kv_layout="HND"), "host")
    assert seen["variants"] == {"host": hnd} and all("_hnd_" in k.name or "_h1_" in k.name for k in hnd)


def test_build_progress_bar_redraws_one_line_on_a_terminal():
    import io

    from turbine_fmha.build.aot import BuildResult, ProgressBar

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


def test_inspect_abi_needs_the_artifact(tmp_path, monkeypatch, capsys):
    """inspect --abi reads the artifact directory like inspect: a variant
    (or target) it lacks is an error, not an ABI derived from the name as
    if the artifact were there; --from-name asks for the name's ABI."""
    from turbine_fmha.kernels import abi
    from turbine_fmha.kernels.variants import parse_kernel

    d, name = _manifest_dir(tmp_path)
    unbuilt = name.replace("_pg16_", "_pg32_")
    missing = tmp_path / "missing"
    monkeypatch.setenv("TURBINE_FMHA_ARTIFACTS", str(missing))
    for argv, words in (
        ([unbuilt, "--artifacts", str(d)], f"no artifact {unbuilt} in {d}"),
        (
            [name, "--artifacts", str(d), "--target", "gfx942"],
            f"no artifact {name} for gfx942 in {d} (only for cuda, host)",
        ),
        ([name], str(missing)),  # the default directory, not built yet
        ([name, "--from-name", "--artifacts", str(d)], "--from-name reads no artifact directory"),
        ([name, "--from-name", "--target", "host"], "--from-name reads no artifact directory"),
    ):
        assert cli(["inspect", "--abi", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, (argv, err)
    assert cli(["inspect", name, "--from-name", "--artifacts", str(d)]) == 2
    assert "--from-name describes a name's ABI: give it with --abi" in capsys.readouterr().err
    for argv in ([name, "--artifacts", str(d), "--target", "cuda"], [unbuilt, "--from-name"]):
        assert cli(["inspect", "--abi", "--json", *argv]) == 0, argv
        assert json.loads(capsys.readouterr().out) == abi.describe(parse_kernel(argv[0]))


@pytest.mark.parametrize(
    "text, words",
    [
        (
            json.dumps(dict(num_attention_heads=32, num_key_value_heads=6, head_dim=64, torch_dtype="float16")),
            "num_attention_heads (32) must be a multiple of num_key_value_heads (6)",
        ),
        ("[" * 100000 + "]" * 100000, "its JSON is nested too deeply"),
        ('{"a": ' * 100000 + "1" + "}" * 100000, "its JSON is nested too deeply"),
        (json.dumps(dict(num_attention_heads=2**63, head_dim=64)), "num_attention_heads must be a positive integer"),
        (json.dumps(dict(num_attention_heads=-8, head_dim=64)), "num_attention_heads must be a positive integer"),
        (json.dumps(dict(num_attention_heads=8, head_dim=64.0)), "head_dim must be a positive integer"),
        (json.dumps(dict(num_attention_heads=8, head_dim=True)), "head_dim must be a positive integer"),
        (json.dumps(dict(num_attention_heads=8, head_dim="64")), "head_dim must be a positive integer"),
        (json.dumps(dict(num_attention_heads=8, hidden_size=2**70)), "hidden_size must be a positive integer"),
        (json.dumps(dict(num_attention_heads=8, head_dim=64, torch_dtype={})), "torch_dtype {}"),
    ],
)
def test_build_model_config_errors_name_the_file_and_key(tmp_path, monkeypatch, capsys, text, words):
    import turbine_fmha.build.aot as tfb

    def no_build(*a, **k):
        raise AssertionError("a bad config reached the build")

    monkeypatch.setattr(tfb, "build", no_build)
    cfg = tmp_path / "config.json"
    cfg.write_text(text)
    assert cli(["build", "--model-config", str(cfg), "--artifacts", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {cfg}: {words}" in err, err


def test_build_counts_repeated_list_values_once(tmp_path, monkeypatch, capsys):
    """--page 16,16 (or a target or variant given twice) would compile each
    kernel twice and report twice the artifacts the manifest lists."""
    import turbine_fmha.build.aot as tfb
    import turbine_fmha.build.artifacts as artifacts

    plans = []

    def planned_build(out, targets, variants, **kw):
        plan = tfb._build_plan(targets, variants)
        plans.append(plan)
        return [tfb.BuildResult(v.name, t.name, {}, rebuilt=True) for v, t in plan]

    monkeypatch.setattr(tfb, "build", planned_build)
    monkeypatch.setattr(artifacts, "manifest_digest", lambda out: "0" * 64)
    out = ["--artifacts", str(tmp_path / "a")]
    name = "pagedkv_fwd_f32_d32x32_h2x1_pg16_nmask_lse_explicit"
    for argv, count in (
        (["--nhead-q", "4", "--hdim", "64", "--page", "16,16"], 4),
        (["--nhead-q", "4", "--hdim", "64", "--page", "16,32,16", "--targets", "host,host"], 8),
        (["--variants", f"{name},{name}", "--targets", "host,host"], 1),
    ):
        assert cli(["build", *argv, *out]) == 0, argv
        err = capsys.readouterr().err
        plan = plans.pop()
        assert len(plan) == len({(v.name, t.name) for v, t in plan}) == count, argv
        assert f"\n{count} artifacts in " in "\n" + err, err
        if "--page" in argv:
            assert f"pages {argv[argv.index('--page') + 1].split(',')[0]}" in err
