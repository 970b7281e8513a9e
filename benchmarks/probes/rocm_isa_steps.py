#!/usr/bin/env python3
"""Per key step ISA of the ROCm attention kernels, read statically.

No AMD GPU exists here: this compiles the default prefill and decode
artifacts for gfx942 and gfx950 and reads one iteration of each attention
dispatch's main loop from the assembly IREE dumps (turbine_fmha.isa
main_loop): MFMA, VALU, SALU, LDS and global-load instructions, with the
kernel's registers and occupancy. Next to them: the "roof", IREE's own
attention on plain static unpaged tensors (benchmarks/roof.py's module,
32 x 4096 x 4096, head dim 128, f16, no mask), with IREE's configuration
and with the tuning specs IREE ships (--iree-codegen-enable-default-tuning-specs).

    python benchmarks/probes/rocm_isa_steps.py [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: roof

VARIANTS = (
    "pagedkv_fwd_f16_d128x128_h32x8_pg16_mbr_lse_online_b1_q128_nvguard",
    "pagedkv_fwd_f16_d128x128_h32x8_pg16_mbr_lse_online_b1_q4096_nvguard",
    "pagedkv_fwd_f16_d128x128_h32x8_pg64_mbr_lse_online_b1_q128_nvguard",
    "pagedkv_fwd_bf16_d128x128_h32x8_pg16_mbr_lse_online_b1_q128_nvguard",
    "pagedkv_fwd_f16_d128x128_h32x8_pg16_nmask_lse_online_b32_q1_nvguard_m16",
    "pagedkv_fwd_f16_d128x128_h32x8_pg16_nmask_lse_online_b128_q1_nvguard_m16_x4",
    "pagedkv_fwd_f16_d128x128_h32x8_pg64_nmask_lse_online_b128_q1_nvguard_m16_x4",
)
# The prefill tile kernels (kernels.tiles_kernel): each chunk class is an
# attention dispatch of its own, reported one row each.
TILES = (
    "prefill_tiles_f16_h32x8_d128_pg16_t128_c5",
    "prefill_tiles_bf16_h32x8_d128_pg16_t128_c5",
)
TARGETS = ("gfx942", "gfx950")


def _tile_rows(target: str, label: str, report: dict) -> list[dict]:
    """One row per attention dispatch of a tile kernel (a loop with MFMA)."""
    out = []
    for k in report["kernels"]:
        loop = k.get("loop") or {}
        if not loop.get("mfma"):
            continue
        one = dict(report, main_loop=dict(loop, kernel=k["name"]), attention_config="")
        out.append(_row(target, f"{label}: {k['name'].split('_dispatch_')[-1][:40]}", one))
    return out


def _row(target: str, label: str, report: dict) -> dict:
    loop = report.get("main_loop") or {}
    k = next((k for k in report["kernels"] if k["name"] == loop.get("kernel")), None)
    return dict(
        target=target,
        kernel=label,
        config=report.get("attention_config", ""),
        **{
            f: loop.get(f)
            for f in ("mfma", "mfma_ops", "valu", "salu", "lds_reads", "lds_writes", "global_loads", "instructions")
        },
        vgprs=None if k is None else k["vgpr_count"] + k["agpr_count"],
        waves_per_simd=None if k is None else k["waves_per_simd"],
        lds_bytes=None if k is None else k["lds_bytes"],
        spills=report["spills"],
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--tiles-only", action="store_true", help="only the prefill tile kernels (TILES)")
    args = ap.parse_args()
    import tempfile

    import roof

    from turbine_fmha.build import compiler, targets
    from turbine_fmha.kernels import custom_ops as kernels
    from turbine_fmha.kernels.variants import parse_kernel

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "x.vmfb"
        for name in args.targets.split(","):
            target = targets.TARGETS[name]
            first = len(rows)
            for v in TILES:
                _, report, _ = compiler.compile_one(kernels.render_variant(parse_kernel(v)), v, out, target)
                rows += _tile_rows(name, v, report)
            if args.tiles_only:
                for r in rows[first:]:
                    print(json.dumps(r), flush=True)
                continue
            for v in VARIANTS:
                _, report, _ = compiler.compile_one(kernels.render_variant(parse_kernel(v)), v, out, target)
                rows.append(_row(name, v, report))
            for tag, extra in (
                ("IREE config", ()),
                ("IREE tuning specs", ("--iree-codegen-enable-default-tuning-specs",)),
            ):
                t = dataclasses.replace(target, flags=tuple(target.flags) + extra)
                _, report, _ = compiler.compile_one(roof.mlir(), roof.NAME, out, t)
                rows.append(_row(name, f"roof: static attention 32x4096x4096x128 f16 ({tag})", report))
            for r in rows[first:]:
                print(json.dumps(r), flush=True)
    cols = (
        "mfma",
        "mfma_ops",
        "valu",
        "salu",
        "lds_reads",
        "lds_writes",
        "global_loads",
        "instructions",
        "vgprs",
        "waves_per_simd",
        "lds_bytes",
        "spills",
    )
    print()
    print("| target | kernel | attention config | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for r in rows:
        print(
            f"| {r['target']} | {r['kernel']} | {r['config']} | "
            + " | ".join(", ".join(r[c]) if isinstance(r[c], list) else str(r[c]) for c in cols)
            + " |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
