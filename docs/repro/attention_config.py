#!/usr/bin/env python3
"""Reproducer: edit one field of IREE's configuration of a variant's
attention dispatch and compile with it substituted.

    .venv/bin/python docs/repro/attention_config.py VARIANT TARGET FIELD "VALUES"

Examples (IREE 3.13, sm_80):
  # more than one 16-key page per reduction step fails to compile:
  ... pagedkv_fwd_f16_d128x128_h32x8_pg16_mbr_lse_online_b1_q4096_nvguard cuda \\
      reduction "0, 0, 0, 0, 0, 4, 16"
  -> error: 'vector.extract_strided_slice' op expected offsets dimension 0 to
     be confined to [0, 4)
  # keeping the head dim whole compiles (what turbine_fmha.tuning ships):
  ... pagedkv_fwd_f16_d128x128_h32x8_pg16_mbr_lse_online_b1_q4096_nvguard cuda \\
      workgroup "1, 1, 64, 0, 0, 0, 0"
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from turbine_fmha.build.compiler import iree_compile_path
from turbine_fmha.build.targets import get_target
from turbine_fmha.kernels.custom_ops import render_variant
from turbine_fmha.kernels.variants import Variant


def main(variant: str, target: str, field: str, values: str) -> int:
    t = get_target(target)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "kernel.mlir"
        src.write_text(render_variant(Variant.parse(variant)))
        cfg = tmp / "configs"
        subprocess.run(
            [
                iree_compile_path(),
                str(src),
                *t.flags,
                "--compile-to=executable-configurations",
                f"--iree-hal-dump-executable-configurations-to={cfg}",
                "-o",
                str(tmp / "c.mlir"),
            ],
            check=True,
        )
        path = next(p for p in sorted(cfg.glob("*.mlir")) if "online_attention" in p.read_text())
        text = path.read_text()
        op = text.index("iree_linalg_ext.online_attention")
        m = re.compile(rf"({field} = \[)([0-9, ]+)(\])").search(text, op)
        print(f"{path.name}: {field} = [{m.group(2)}] -> [{values}]")
        edited = tmp / path.name
        edited.write_text(text[: m.start(2)] + values + text[m.end(2) :])
        name = re.search(r"hal\.executable public @([\w$.]+)", text).group(1)
        proc = subprocess.run(
            [
                iree_compile_path(),
                str(src),
                *t.flags,
                f"--iree-hal-substitute-executable-configuration={name}={edited}",
                "-o",
                str(tmp / "k.vmfb"),
            ],
            capture_output=True,
            text=True,
        )
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        print("\n".join(errors[:3]) if errors else "compiled")
        return 1 if errors or proc.returncode else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
