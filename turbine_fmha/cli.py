"""`turbine-fmha` command line: build, list, inspect, run, bench."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .targets import TARGETS
from .variants import parse_kernel


def _cmd_build(args) -> int:
    from .artifacts import ArtifactError
    from .build import ProgressBar, build, manifest_digest

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in TARGETS:
            print(f"unknown target {t!r}; known: {', '.join(TARGETS)}", file=sys.stderr)
            return 2
    variants = None
    if args.variants:
        try:
            variants = [parse_kernel(n) for n in args.variants.split(",") if n.strip()]
        except ValueError as e:
            print(f"--variants: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:
        results = build(Path(args.out), targets, variants, jobs=args.jobs, progress=ProgressBar(), force=args.force)
    except (RuntimeError, ArtifactError) as e:
        print(e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted: the artifacts that finished are in {Path(args.out) / 'manifest.json'}",
              file=sys.stderr)
        return 130
    rebuilt = sum(r.rebuilt for r in results)
    print(
        f"{len(results)} artifacts in {args.out} ({rebuilt} compiled, "
        f"{len(results) - rebuilt} unchanged) in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    # What a service pins (Session(manifest_sha256=...)) to load exactly
    # these artifacts; stdout, so that scripts can capture it.
    print(f"manifest sha256 {manifest_digest(Path(args.out))}")
    return 0


def _manifest(out: str) -> dict:
    from .artifacts import ArtifactError, read_manifest

    try:
        m = read_manifest(Path(out))
    except ArtifactError as e:
        raise SystemExit(str(e)) from None
    if m is None:
        raise SystemExit(f"no manifest at {Path(out) / 'manifest.json'}; run `turbine-fmha build` first")
    return m.data


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


def _random_problem(args, rng):
    """A paged problem as the arguments describe it: pages shuffled over the
    pool, unused table slots holding -1."""
    import numpy as np

    from .arrays import np_dtype

    dt = np_dtype(args.dtype)
    lens = [int(x) for x in args.seqlen_k.split(",")]
    if len(lens) == 1:
        lens = lens * args.batch
    if len(lens) != args.batch:
        raise SystemExit(f"--seqlen-k: {len(lens)} values for --batch {args.batch}")
    page = args.page
    used = [-(-n // page) for n in lens]
    num_pages = sum(used) + 1
    k = rng.standard_normal((num_pages, page, args.nhead_k, args.hdim), dtype=np.float32).astype(dt)
    v = rng.standard_normal((num_pages, page, args.nhead_k, args.hdim), dtype=np.float32).astype(dt)
    bt = np.full((args.batch, max(used + [1]) + 1), -1, np.int32)
    perm = rng.permutation(num_pages)
    i = 0
    for b, n in enumerate(used):
        bt[b, :n] = perm[i : i + n]
        i += n
    q = rng.standard_normal((args.batch, args.seqlen_q, args.nhead_q, args.hdim), dtype=np.float32).astype(dt)
    kw = dict(mask_type=args.mask, window_size_right=0 if args.mask != "none" else -1,
              num_splits=args.num_splits, device=args.device)
    return (q, k, v, bt, np.array(lens, np.int32)), kw


def _session(args):
    from .runtime import Session

    return Session(args.device, artifact_dir=args.artifacts, compile_missing=args.compile_missing)


def _cmd_run(args) -> int:
    """One call on random data, checked against the float64 reference."""
    import numpy as np

    from .api import fmha_fwd_paged
    from .reference import fmha_fwd_paged_ref

    session = _session(args)
    prob, kw = _random_problem(args, np.random.default_rng(args.seed))
    t0 = time.perf_counter()
    out, lse = fmha_fwd_paged(*prob, return_lse=True, session=session, **kw)
    ms = (time.perf_counter() - t0) * 1e3
    ref, ref_lse = fmha_fwd_paged_ref(*prob, mask_type=kw["mask_type"], window_size_right=kw["window_size_right"])
    err = float(np.abs(out.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
    fin = np.isfinite(ref_lse)
    lerr = float(np.abs(lse[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
    tol = {"f16": 5e-3, "bf16": 2e-2, "f32": 1e-5}[args.dtype]
    ok = err <= tol and lerr <= 3e-2 and np.array_equal(np.isneginf(lse), ~fin)
    print(f"variant {session.last_variant.name}")
    print(f"{ms:.2f} ms (first call: includes loading), output rel err {err:.2e} (bound {tol:g}), "
          f"LSE abs err {lerr:.2e} -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _cmd_bench(args) -> int:
    """Median time of repeated calls of the public API on one problem."""
    import statistics

    import numpy as np

    from .api import fmha_fwd_paged

    session = _session(args)
    prob, kw = _random_problem(args, np.random.default_rng(args.seed))
    fmha_fwd_paged(*prob, session=session, **kw)  # load, warm up
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        fmha_fwd_paged(*prob, session=session, **kw)
        times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    q, k = prob[0], prob[1]
    kv_bytes = 2 * int(prob[4].sum()) * k.shape[2] * k.shape[3] * k.itemsize
    print(f"variant {session.last_variant.name}")
    print(f"median {med:.2f} ms, min {min(times):.2f} ms over {args.repeat} calls "
          f"(public API on host arrays: validation and copies included); "
          f"{kv_bytes / (med * 1e-3) / 1e9:.2f} GB/s of KV")
    return 0


def _problem_args(sp):
    sp.add_argument("--device", default="cpu", choices=["cpu", "cuda", "hip"])
    sp.add_argument("--artifacts", default=None, help="artifact dir (default $TURBINE_FMHA_ARTIFACTS or ./artifacts)")
    sp.add_argument("--compile-missing", action="store_true", help="compile variants that have no artifact")
    sp.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    sp.add_argument("--batch", type=int, default=4)
    sp.add_argument("--seqlen-q", type=int, default=1)
    sp.add_argument("--seqlen-k", default="512", help="one value, or one per sequence (comma list)")
    sp.add_argument("--nhead-q", type=int, default=32)
    sp.add_argument("--nhead-k", type=int, default=8)
    sp.add_argument("--hdim", type=int, default=128)
    sp.add_argument("--page", type=int, default=16)
    sp.add_argument("--mask", default="none", choices=["none", "top_left", "bottom_right"])
    sp.add_argument("--num-splits", type=int, default=None)
    sp.add_argument("--seed", type=int, default=None)


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
    r = sub.add_parser("run", help="one call on random data, verified against the float64 reference")
    _problem_args(r)
    r.set_defaults(fn=_cmd_run)
    be = sub.add_parser("bench", help="median time of the public API on one random problem")
    _problem_args(be)
    be.add_argument("--repeat", type=int, default=10)
    be.set_defaults(fn=_cmd_bench)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
