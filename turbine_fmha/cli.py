"""`turbine-fmha` command line: build, list, inspect."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .targets import TARGETS
from .variants import Variant


def _cmd_build(args) -> int:
    from .build import build, print_progress

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in TARGETS:
            print(f"unknown target {t!r}; known: {', '.join(TARGETS)}", file=sys.stderr)
            return 2
    variants = None
    if args.variants:
        try:
            variants = [Variant.parse(n) for n in args.variants.split(",") if n.strip()]
        except ValueError as e:
            print(f"--variants: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:
        results = build(Path(args.out), targets, variants, jobs=args.jobs, progress=print_progress, force=args.force)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    rebuilt = sum(r.rebuilt for r in results)
    print(
        f"{len(results)} artifacts in {args.out} ({rebuilt} compiled, "
        f"{len(results) - rebuilt} unchanged) in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    return 0


def _manifest(out: str) -> dict:
    path = Path(out) / "manifest.json"
    if not path.exists():
        raise SystemExit(f"no manifest at {path}; run `turbine-fmha build` first")
    return json.loads(path.read_text())


def _cmd_list(args) -> int:
    m = _manifest(args.out)
    print(f"compiler {m.get('compiler_version')}")
    for a in m["artifacts"]:
        if args.target and a["target"] != args.target:
            continue
        isa = a.get("isa") or {}
        extra = ""
        if "mfma_count" in isa:
            extra = f" mfma={isa['mfma_count']} spills={isa['spills']}"
        elif "mma_count" in isa:
            extra = f" mma.sync={isa['mma_count']}"
        print(f"{a['target']:<7} {a['variant']:<70} {a['size']:>9} B {a['compile_seconds']:>6.2f}s{extra}")
    return 0


def _cmd_inspect(args) -> int:
    m = _manifest(args.out)
    hits = [a for a in m["artifacts"] if a["variant"] == args.variant and (not args.target or a["target"] == args.target)]
    if not hits:
        print(f"no artifact {args.variant} in {args.out}", file=sys.stderr)
        return 1
    for a in hits:
        print(json.dumps(a, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="turbine-fmha", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile variants ahead of time")
    b.add_argument("--targets", default="host", help=f"comma list of: {', '.join(TARGETS)}")
    b.add_argument("--out", default="artifacts")
    b.add_argument("--variants", default="", help="comma list of variant names (default: each target's default set)")
    b.add_argument("--jobs", type=int, default=None)
    b.add_argument("--force", action="store_true", help="rebuild even when unchanged")
    b.set_defaults(fn=_cmd_build)
    ls = sub.add_parser("list", help="artifacts in a manifest")
    ls.add_argument("--out", default="artifacts")
    ls.add_argument("--target", default=None)
    ls.set_defaults(fn=_cmd_list)
    ins = sub.add_parser("inspect", help="one artifact: flags, size, hash, ISA report")
    ins.add_argument("variant")
    ins.add_argument("--out", default="artifacts")
    ins.add_argument("--target", default=None)
    ins.set_defaults(fn=_cmd_inspect)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
