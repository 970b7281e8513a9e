"""`turbine-fmha run` and `bench`: one random paged problem, verified
against the float64 reference or timed against torch's gather + SDPA."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..core.devices import parse_device, torch_device_of
from .common import CliError, artifact_dir, device_arg, emit_json, int_list, non_negative_int, positive_int

# Output rel. error bounds of `run` (tests/conftest.py explains them).
OUT_TOL = {"f16": 5e-3, "bf16": 2e-2, "f32": 1e-5}
LSE_TOL = 3e-2
BASELINE = "torch gather+SDPA"


def add_problem_commands(sub, artifacts_option) -> None:
    r = sub.add_parser("run", help="one call on random data, verified against the float64 reference")
    _problem_args(r, artifacts_option)
    r.add_argument("--json", action="store_true", help="the result as a JSON object")
    r.set_defaults(fn=_cmd_run)
    be = sub.add_parser(
        "bench", help=f"median time of the public API on one random problem, and of {BASELINE} on the same data"
    )
    _problem_args(be, artifacts_option)
    be.add_argument("--repeat", type=positive_int, default=10)
    be.add_argument("--no-baseline", action="store_true", help=f"skip the {BASELINE} baseline")
    be.add_argument("--json", action="store_true", help="the timings as a JSON object")
    be.set_defaults(fn=_cmd_bench)


def _problem_args(sp, artifacts_option) -> None:
    sp.add_argument("--device", default="cpu", type=device_arg, help="cpu, cuda, cuda:N, hip or hip:N (default: cpu)")
    artifacts_option(sp, "; must exist unless --compile-missing is given without it")
    sp.add_argument(
        "--compile-missing",
        action="store_true",
        help="compile variants that have no artifact into the user cache (needs the build extra)",
    )
    sp.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    sp.add_argument("--batch", type=positive_int, default=4)
    sp.add_argument("--seqlen-q", type=positive_int, default=1)
    sp.add_argument("--seqlen-k", type=int_list(0), default=[512], help="one value, or one per sequence (comma list)")
    sp.add_argument("--nhead-q", type=positive_int, default=32)
    sp.add_argument("--nhead-k", type=positive_int, default=8)
    sp.add_argument("--hdim", type=positive_int, default=128)
    sp.add_argument("--page", type=positive_int, default=16)
    sp.add_argument(
        "--mask",
        default="none",
        choices=["none", "top_left", "bottom_right"],
        help="a masked call is causal (window (-1, 0))",
    )
    sp.add_argument("--num-splits", type=positive_int, default=None)
    sp.add_argument("--seed", type=non_negative_int, default=None)


def _random_problem(args, rng):
    """A paged problem as the arguments describe it: pages shuffled over the
    pool, unused table slots holding -1."""
    from ..core.arrays import np_dtype

    lens = args.seqlen_k * args.batch if len(args.seqlen_k) == 1 else args.seqlen_k
    if len(lens) != args.batch:
        raise CliError(f"--seqlen-k: {len(lens)} values for --batch {args.batch} (give one, or one per sequence)")
    if args.nhead_q % args.nhead_k:
        raise CliError(f"--nhead-q ({args.nhead_q}) must be a multiple of --nhead-k ({args.nhead_k})")
    dt, page = np_dtype(args.dtype), args.page
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
    kw = dict(
        mask_type=args.mask,
        window_size_right=0 if args.mask != "none" else -1,
        num_splits=args.num_splits,
        device=args.device,
    )
    return (q, k, v, bt, np.array(lens, np.int32)), kw


def _session(args):
    from ..runtime.session import Session

    d = artifact_dir(args, may_be_missing=args.compile_missing)
    return Session(args.device, artifact_dir=d, compile_missing=args.compile_missing)


def _cmd_run(args) -> int:
    """One call on random data, checked against the float64 reference."""
    from ..api.public import fmha_fwd_paged
    from ..testing.reference import fmha_fwd_paged_ref

    session = _session(args)
    prob, kw = _random_problem(args, np.random.default_rng(args.seed))
    t0 = time.perf_counter()
    out, lse = fmha_fwd_paged(*prob, return_lse=True, session=session, **kw)
    ms = (time.perf_counter() - t0) * 1e3
    ref, ref_lse = fmha_fwd_paged_ref(*prob, mask_type=kw["mask_type"], window_size_right=kw["window_size_right"])
    err = float(np.abs(out.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
    fin = np.isfinite(ref_lse)
    lerr = float(np.abs(lse[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
    tol = OUT_TOL[args.dtype]
    ok = bool(err <= tol and lerr <= LSE_TOL and np.array_equal(np.isneginf(lse), ~fin))
    if args.json:
        emit_json(
            dict(
                variant=session.last_variant.name,
                ms=ms,
                output_rel_err=err,
                output_bound=tol,
                lse_abs_err=lerr,
                lse_bound=LSE_TOL,
                passed=ok,
            )
        )
    else:
        print(f"variant {session.last_variant.name}")
        print(
            f"{ms:.2f} ms (first call: includes loading), output rel err {err:.2e} (bound {tol:g}), "
            f"LSE abs err {lerr:.2e} -> {'PASS' if ok else 'FAIL'}"
        )
    return 0 if ok else 1


def _median_ms(fn, repeat: int) -> tuple[float, float]:
    fn()  # load, warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def _cmd_bench(args) -> int:
    """Median time of repeated calls of the public API on one problem, and
    of the torch baseline on the same arrays: decode in GB/s of KV read,
    prefill in TFLOP/s over the visible (unmasked) scores."""
    from ..api.public import fmha_fwd_paged

    session = _session(args)
    prob, kw = _random_problem(args, np.random.default_rng(args.seed))
    med, low = _median_ms(lambda: fmha_fwd_paged(*prob, session=session, **kw), args.repeat)
    rate, unit = _throughput(args, prob)
    result = dict(
        variant=session.last_variant.name,
        kind="decode" if args.seqlen_q == 1 else "prefill",
        repeat=args.repeat,
        median_ms=med,
        min_ms=low,
        unit=unit,
        rate=rate / med,
        baseline=None,
    )
    skipped = "--no-baseline" if args.no_baseline else None
    if not skipped:
        base, skipped = _torch_baseline(args, prob, args.repeat)
        if base is not None:
            result["baseline"] = dict(name=BASELINE, median_ms=base, rate=rate / base, speedup=base / med)
    if args.json:
        emit_json(dict(result, baseline_skipped=skipped))
        return 0
    print(f"variant {result['variant']}")
    print(
        f"turbine-fmha: median {med:.2f} ms, min {low:.2f} ms over {args.repeat} calls, {rate / med:.3g} {unit} "
        f"(public API on host arrays: validation and copies included)"
    )
    b = result["baseline"]
    if b:
        print(
            f"{BASELINE}: median {b['median_ms']:.2f} ms, {b['rate']:.3g} {unit} (same arrays and mask); "
            f"speedup of turbine-fmha over it {b['speedup']:.2f}x"
        )
    else:
        print(f"{BASELINE}: skipped ({skipped})")
    return 0


def _visible(args, seqlen_k: np.ndarray) -> np.ndarray:
    """[batch, seqlen_q]: how many keys each query row sees (the runtime's
    mask rule, MaskSpec; a masked call is causal)."""
    from ..calls.mask import MaskSpec

    mask = MaskSpec.from_args(args.mask, -1, 0 if args.mask != "none" else -1)
    sq = np.full(seqlen_k.shape, args.seqlen_q, np.int64)
    rows_end = np.arange(1, args.seqlen_q + 1)[:, None]  # row i sees the keys rows < i + 1 reach
    return np.broadcast_to(mask.keys_reachable(rows_end, sq, seqlen_k), (args.seqlen_q, seqlen_k.size)).T


def _throughput(args, prob) -> tuple[float, str]:
    """(amount x 1 ms, unit): divided by a median in ms, the rate."""
    q, k, _, _, seqlen_k = prob
    if args.seqlen_q == 1:  # decode reads the KV cache once: bandwidth-bound
        kv_bytes = 2 * int(seqlen_k.sum()) * args.nhead_k * args.hdim * k.itemsize
        return kv_bytes / 1e6, "GB/s"
    flops = 4 * args.nhead_q * args.hdim * float(_visible(args, seqlen_k.astype(np.int64)).sum())
    return flops / 1e9, "TFLOP/s"


def _torch_baseline(args, prob, repeat: int) -> tuple[float | None, str | None]:
    """(median ms, None) of torch_gather_sdpa on the session's device, or
    (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    dev = torch_device_of(*parse_device(args.device))  # ROCm torch names its GPUs cuda too
    if dev != "cpu" and torch.cuda.device_count() <= torch.device(dev).index:
        return None, f"torch sees no {dev}"
    call = torch_gather_sdpa(args, prob, dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev != "cpu" else (lambda: None)
    with torch.no_grad():
        return _median_ms(lambda: (call(), sync()), repeat)[0], None


def torch_gather_sdpa(args, prob, dev: str = "cpu"):
    """The baseline as a function of no arguments returning out [batch,
    nhead_q, seqlen_q, hdim]: torch gathers each sequence's pages through
    the block table, then scaled_dot_product_attention (GQA) runs on them
    with the same mask. The arrays are moved to `dev` once, outside it."""
    import torch
    import torch.nn.functional as F

    from ..core.arrays import numpy_to_torch

    q, k, v, bt, seqlen_k = prob
    b, keys = bt.shape[0], bt.shape[1] * args.page
    qh, kc, vc = (numpy_to_torch(a).to(dev) for a in (q, k, v))
    qh = qh.transpose(1, 2)
    pages = torch.from_numpy(np.maximum(bt, 0).astype(np.int64).reshape(-1)).to(dev)
    visible = np.arange(keys)[None, None, :] < _visible(args, seqlen_k.astype(np.int64))[:, :, None]
    mask = torch.from_numpy(visible[:, None]).to(dev)

    def call():
        kk = kc.index_select(0, pages).reshape(b, keys, args.nhead_k, args.hdim).transpose(1, 2)
        vv = vc.index_select(0, pages).reshape(b, keys, args.nhead_k, args.hdim).transpose(1, 2)
        return F.scaled_dot_product_attention(qh, kk, vv, attn_mask=mask, enable_gqa=args.nhead_q != args.nhead_k)

    return call
