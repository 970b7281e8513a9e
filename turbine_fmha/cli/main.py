"""`turbine-fmha` command line: build, list, inspect, run, bench.

Every command takes --artifacts DIR (--out is an alias). The default is
$TURBINE_FMHA_ARTIFACTS, else $XDG_CACHE_HOME/turbine-fmha/artifacts, else
~/.cache/turbine-fmha/artifacts, as for Python's Session. Errors are one
line on stderr with exit code 2; list, inspect, run and bench print JSON
with --json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..build.targets import TARGETS
from ..core.env import ARTIFACTS as ENV_ARTIFACTS
from ..core.version import VERSION
from ..runtime.paths import default_artifact_dir
from .common import PLAIN_ERRORS, CliError, Parser, artifact_dir, emit_json, int_list, positive_int
from .problem import add_problem_commands


def _manifest(args) -> dict:
    from ..build.artifacts import read_manifest

    d = artifact_dir(args)
    m = read_manifest(d)
    if m is None:
        raise CliError(f"no manifest.json in {d}; build into it with `turbine-fmha build --artifacts {d}`")
    return m.data


def _cmd_list(args) -> int:
    m = _manifest(args)
    hits = [a for a in m["artifacts"] if not args.target or a["target"] == args.target]
    if args.json:
        emit_json(hits)
        return 0
    print(f"{artifact_dir(args)}: compiler {m.get('compiler_version')}, {len(hits)} artifact{'s' * (len(hits) != 1)}")
    for a in hits:
        isa = a.get("isa") or {}
        extra = ""
        if "mfma_count" in isa:
            extra = f" mfma={isa['mfma_count']} spills={isa['spills']}"
        elif "mma_count" in isa:
            extra = f" mma.sync={isa['mma_count']}"
        size, secs = a.get("size", 0), a.get("compile_seconds", 0.0)
        print(f"{a['target']:<7} {a['variant']:<70} {size:>9} B {secs:>6.2f}s{extra}")
    return 0


def _cmd_inspect(args) -> int:
    if args.abi:
        return _inspect_abi(args)
    if args.from_name:
        raise CliError("--from-name describes a name's ABI: give it with --abi")
    m = _manifest(args)
    hits = _entries(args, m)
    if args.json:
        # One object for one match; several (one per target) as a list.
        emit_json(hits[0] if len(hits) == 1 else hits)
        return 0
    for a in hits:
        print(f"{a['target']}/{a['variant']}")
        for k, v in a.items():
            if isinstance(v, dict):
                v = " ".join(f"{ik}={iv}" for ik, iv in v.items())
            elif isinstance(v, list):
                v = " ".join(map(str, v))
            print(f"  {k:<17} {v}")
    return 0


def _entries(args, m: dict, hint: str = "") -> list[dict]:
    """The manifest entries of args.variant (on args.target where given);
    the error says what the artifact directory lacks."""
    named = [a for a in m["artifacts"] if a["variant"] == args.variant]
    hits = [a for a in named if not args.target or a["target"] == args.target]
    if not hits:
        held = f" (only for {', '.join(sorted({a['target'] for a in named}))})" if named else ""
        raise CliError(
            f"no artifact {args.variant}{' for ' + args.target if args.target else ''} in {artifact_dir(args)}"
            f"{held}{hint}"
        )
    return hits


def _inspect_abi(args) -> int:
    """The ABI of `args.variant`: as the artifact directory's manifest
    records it, which must hold the variant (on --target where given): an
    ABI printed for an artifact that is not there would read as if it
    were. --from-name describes the name alone, reading no directory (the
    same description: kernels/abi.py)."""
    from ..kernels import abi

    if args.from_name:
        if args.artifacts is not None or args.target:
            raise CliError(
                "--from-name reads no artifact directory: it cannot be combined with --artifacts or --target"
            )
        described = _abi_of_name(args.variant)
    else:
        m = _manifest(args)
        entry = _entries(args, m, "; `inspect --abi --from-name` describes a name without its artifact")[0]
        if "abi" in entry and "abi" in m:
            described = abi.join(entry["abi"], m["abi"])
        else:  # a manifest written before the ABI was recorded in it
            print(f"{args.variant}: the manifest records no ABI; derived from the name", file=sys.stderr)
            described = _abi_of_name(args.variant)
    if args.json:
        emit_json(described)
    else:
        print(abi.as_text(described))
    return 0


def _abi_of_name(name: str) -> dict:
    from ..kernels import abi
    from ..kernels.variants import parse_kernel

    try:
        return abi.describe(parse_kernel(name))
    except ValueError as e:
        raise CliError(f"{name}: {e}") from None


def _cmd_build(args) -> int:
    from ..build.aot import ProgressBar, build
    from ..build.artifacts import manifest_digest

    # A repeated target or variant would be built, and counted, twice for
    # one manifest entry.
    targets = _unique(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise CliError(
            f"--targets: unknown target {', '.join(map(repr, unknown)) or '(none given)'}; known: {', '.join(TARGETS)}"
        )
    variants = _model_set(args, targets) if _model_given(args) else _named_variants(args)
    out = Path(args.artifacts) if args.artifacts else default_artifact_dir()
    t0 = time.perf_counter()
    try:
        results = build(out, targets, variants, jobs=args.jobs, progress=ProgressBar(), force=args.force)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the artifacts that finished are in {out / 'manifest.json'}", file=sys.stderr)
        return 130
    except RuntimeError as e:
        head, _, details = str(e).partition("\n")
        if not details:
            raise
        # Failed compiles: the compiler's messages, then the one-line error.
        print(details, file=sys.stderr)
        raise CliError(head.rstrip(":")) from None
    rebuilt = sum(r.rebuilt for r in results)
    print(
        f"{len(results)} artifacts in {out} ({rebuilt} compiled, {len(results) - rebuilt} unchanged) "
        f"in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    # What a service pins (Session(manifest_sha256=...)) to load exactly
    # these artifacts; stdout, so that scripts can capture it.
    print(f"manifest sha256 {manifest_digest(out)}")
    return 0


def _named_variants(args):
    from ..kernels.variants import parse_kernel

    if not args.variants:
        return None  # each target's default set
    try:
        return _unique(parse_kernel(n.strip()) for n in args.variants.split(",") if n.strip())
    except ValueError as e:
        raise CliError(f"--variants: {e}") from None


def _unique(items) -> list:
    """items in their order, each once."""
    return list(dict.fromkeys(items))


_MODEL_FLAGS = ("model_config", "nhead_q", "nhead_k", "hdim", "hdim_v", "dtype", "page", "kv_layout")


def _model_given(args) -> bool:
    return any(getattr(args, f) is not None for f in _MODEL_FLAGS)


def _model_set(args, targets) -> dict:
    """Target -> the model's variant set (model_set.model_variants)."""
    from ..build.model_set import model_variants, read_config, shape_from_config

    if args.variants:
        raise CliError("--variants cannot be combined with --model-config or the model's shape flags")
    shape = dict(
        nhead_q=args.nhead_q,
        nhead_k=args.nhead_k,
        hdim_q=args.hdim,
        hdim_v=args.hdim_v,
        dtype=args.dtype,
        pages=args.page,
        kv_layout=args.kv_layout,
    )
    if args.model_config:
        model = shape_from_config(read_config(args.model_config), source=args.model_config, **shape)
    else:
        for flag, name in (("--nhead-q", "nhead_q"), ("--hdim", "hdim_q")):
            if shape[name] is None:
                raise CliError(f"{flag} is required without --model-config")
        # The flags as a config of their own: the same defaults (MHA, hdim_v = hdim, page 16).
        model = shape_from_config({}, source="flags", **dict(shape, dtype=args.dtype or "f16"))
    sets = {t: model_variants(model, t) for t in targets}
    print(
        f"model set: {model.nhead_q}/{model.nhead_k} heads, head dims {model.hdim_q}/{model.hdim_v}, "
        f"{model.dtype}, {model.kv_layout} pages {','.join(map(str, model.pages))}: "
        + ", ".join(f"{len(v)} kernels for {t}" for t, v in sets.items()),
        file=sys.stderr,
    )
    return sets


def _artifacts_option(sp, note: str = "") -> None:
    sp.add_argument(
        "--artifacts",
        "--out",
        dest="artifacts",
        default=None,
        metavar="DIR",
        help=f"artifact directory (default: ${ENV_ARTIFACTS}, else {default_artifact_dir()}){note}",
    )


def _build_parser(sub) -> None:
    from ..kernels.variants import KV_LAYOUTS

    b = sub.add_parser("build", help="compile variants ahead of time")
    b.add_argument("--targets", default="host", help=f"comma list of: {', '.join(TARGETS)} (repeats count once)")
    _artifacts_option(b, "; created if missing")
    b.add_argument(
        "--variants",
        default="",
        help="comma list of variant names (default: each target's default set; repeats count once)",
    )
    b.add_argument("--jobs", type=positive_int, default=None)
    b.add_argument("--force", action="store_true", help="rebuild even when unchanged")
    m = b.add_argument_group(
        "a model's variant set",
        "every variant a model's calls select (decode and prefill "
        "tiles, masks, split-KV) and its cache's append kernels; flags win over the config",
    )
    m.add_argument(
        "--model-config",
        default=None,
        metavar="JSON",
        help="HF-style config.json: num_attention_heads, num_key_value_heads, head_dim or hidden_size, torch_dtype",
    )
    m.add_argument("--nhead-q", type=positive_int, default=None)
    m.add_argument("--nhead-k", type=positive_int, default=None, help="default: --nhead-q (MHA)")
    m.add_argument("--hdim", type=positive_int, default=None)
    m.add_argument("--hdim-v", type=positive_int, default=None, help="default: --hdim")
    m.add_argument("--dtype", default=None, choices=["f16", "bf16", "f32"], help="default: the config's, else f16")
    m.add_argument(
        "--page", type=int_list(1), default=None, help="comma list of page sizes (default 16; repeats count once)"
    )
    m.add_argument(
        "--kv-layout",
        default=None,
        choices=KV_LAYOUTS,
        help="the caches' pages: NHD [pages, page, nhead_k, hdim] (default) or HND [pages, nhead_k, page, hdim]",
    )
    b.set_defaults(fn=_cmd_build)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="turbine-fmha", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"turbine-fmha {VERSION}")
    sub = p.add_subparsers(dest="cmd", required=True)
    _build_parser(sub)
    ls = sub.add_parser("list", help="artifacts in a manifest")
    _artifacts_option(ls)
    ls.add_argument("--target", default=None)
    ls.add_argument("--json", action="store_true", help="a JSON list of the manifest entries")
    ls.set_defaults(fn=_cmd_list)
    ins = sub.add_parser("inspect", help="one artifact: flags, size, hash, ISA report")
    ins.add_argument("variant")
    _artifacts_option(ins)
    ins.add_argument("--target", default=None)
    ins.add_argument("--json", action="store_true", help="the manifest entry (a list when several targets match)")
    ins.add_argument(
        "--abi",
        action="store_true",
        help="the function's ABI: arguments, results, packed scalars, preconditions, planning (docs/abi.md), "
        "as the manifest records it; the artifact directory must hold the variant (for --target where given)",
    )
    ins.add_argument(
        "--from-name",
        action="store_true",
        help="with --abi: the ABI the variant's name describes, for a kernel not built; reads no artifact directory",
    )
    ins.set_defaults(fn=_cmd_inspect)
    add_problem_commands(sub, _artifacts_option)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # a broken pipe shows here, not in Python's flush at exit
        return rc
    except BrokenPipeError:
        # The reader left (`turbine-fmha list | head`): the rest of the
        # output has nowhere to go, and Python's flush at exit would report
        # the same broken pipe again.
        _detach_stdout()
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        kind = "" if isinstance(e, (CliError, *PLAIN_ERRORS)) else f"{type(e).__name__}: "
        print(f"{p.prog} {args.cmd}: error: {kind}{' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _detach_stdout() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (captured in tests)
        pass
