"""ISA reports of GPU artifacts, read statically from what IREE dumps:
ROCm register, LDS, scratch and MFMA figures from the .rocmasm, CUDA
mma.sync counts and local memory from the PTX."""

from __future__ import annotations

import re
from pathlib import Path

_AMDHSA_FIELDS = {
    "vgpr_count": r"\.vgpr_count:\s+(\d+)",
    "agpr_count": r"\.agpr_count:\s+(\d+)",
    "sgpr_count": r"\.sgpr_count:\s+(\d+)",
    "vgpr_spill_count": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spill_count": r"\.sgpr_spill_count:\s+(\d+)",
    "lds_bytes": r"\.group_segment_fixed_size:\s+(\d+)",
    "scratch_bytes": r"\.private_segment_fixed_size:\s+(\d+)",
}


def _waves_per_simd(vgprs: int, agprs: int, arch: str) -> int:
    # CDNA: 512 unified VGPRs per lane per SIMD (gfx90a+), allocated in
    # granules of 8; at most 8 waves per SIMD.
    regs = max(1, vgprs + agprs)
    regs = (regs + 7) // 8 * 8
    return max(0, min(8, 512 // regs))


def rocm_isa_report(dump_dir: Path, arch: str) -> dict:
    """Per-kernel register/LDS/scratch/MFMA figures read from the .rocmasm."""
    asm_files = sorted(dump_dir.glob("*.rocmasm"))
    kernels = []
    for asm in asm_files:
        text = asm.read_text(errors="replace")
        # Kernel bodies: split on '.amdhsa_kernel'-free symbol markers; the
        # metadata block lists each kernel with its figures in order.
        meta = text[text.find("amdhsa.kernels:") :]
        for block in re.split(r"\n\s+- \.", meta)[1:]:
            name = re.search(r"\.name:\s+(\S+)", "." + block)
            if not name:
                continue
            k = {"name": name.group(1)}
            for key, pat in _AMDHSA_FIELDS.items():
                m = re.search(pat, "." + block)
                k[key] = int(m.group(1)) if m else 0
            kernels.append(k)
        # MFMA instructions per kernel, counted between its label and the
        # next kernel's label.
        labels = sorted(
            (m.start(), m.group(1))
            for m in re.finditer(r"^([A-Za-z_][\w.$]*):\s*$", text, re.M)
            if any(k["name"] == m.group(1) for k in kernels)
        )
        for (start, name), nxt in zip(labels, labels[1:] + [(len(text), None)]):
            body = text[start : nxt[0]]
            for k in kernels:
                if k["name"] == name:
                    k["mfma_count"] = len(re.findall(r"\bv_mfma_", body))
                    k["loop"] = main_loop(body)
    for k in kernels:
        k.setdefault("mfma_count", 0)
        k.setdefault("loop", None)
        k["waves_per_simd"] = _waves_per_simd(k["vgpr_count"], k["agpr_count"], arch)
    loops = [k for k in kernels if k["loop"]]
    main = max(loops, key=lambda k: (k["loop"]["mfma"], k["loop"]["instructions"]), default=None)
    return {
        "kernels": kernels,
        "mfma_count": sum(k["mfma_count"] for k in kernels),
        "spills": sum(k["vgpr_spill_count"] + k["sgpr_spill_count"] for k in kernels),
        "scratch_bytes": max([k["scratch_bytes"] for k in kernels] or [0]),
        # One iteration of the loop with the most MFMA: the attention's
        # key step (per page, or per key tile).
        "main_loop": None if main is None else dict(main["loop"], kernel=main["name"]),
    }


_OP = re.compile(r"^\s+([a-z_][a-z0-9_]*)", re.M)


def main_loop(body: str) -> dict | None:
    """Instruction counts of one iteration of a kernel's main loop: among
    the regions a backward branch closes (label .. branch), the one with the
    most MFMA instructions, then the shortest (the innermost)."""
    labels = {m.group(1): m.start() for m in re.finditer(r"^(\.LBB\w+):", body, re.M)}
    best = None
    for m in re.finditer(r"^\s+s_c?branch\w*\s+(\.LBB\w+)", body, re.M):
        start = labels.get(m.group(1))
        if start is None or start >= m.start():
            continue
        ops = _OP.findall(body[start : m.end()])
        mfma = sum(op.startswith("v_mfma") for op in ops)
        if best is None or (mfma, -len(ops)) > best[0]:
            best = ((mfma, -len(ops)), ops)
    if best is None:
        return None
    ops = best[1]
    return {
        "instructions": len(ops),
        "mfma": best[0][0],
        "mfma_ops": sorted({op for op in ops if op.startswith("v_mfma")}),
        "valu": sum(op.startswith("v_") and not op.startswith("v_mfma") for op in ops),
        "salu": sum(op.startswith("s_") for op in ops),
        "lds_reads": sum(op.startswith(("ds_read", "ds_load")) for op in ops),
        "lds_writes": sum(op.startswith(("ds_write", "ds_store")) for op in ops),
        "global_loads": sum(op.startswith(("global_load", "buffer_load")) for op in ops),
    }


def cuda_isa_report(dump_dir: Path) -> dict:
    ptx = "".join(p.read_text(errors="replace") for p in dump_dir.glob("*.ptx"))
    return {
        "mma_count": len(re.findall(r"\bmma\.sync\b", ptx)),
        "local_memory_bytes": sum(int(x) for x in re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]", ptx)),
    }


def isa_problems(variant, isa: dict, target: str) -> list[str]:
    """What is wrong with a GPU artifact's ISA report for the way the
    library ships `variant` (empty when nothing is): the CUDA online
    kernels take turbine_fmha's tuned configuration, and prefill tiles use
    the matrix cores (mma.sync / MFMA) unless per-head score terms loop over
    heads (IREE 3.13 configures those with no matrix cores:
    docs/devlog/perf-notes.md); on ROCm, no scratch and no spills (SGPRs
    spilled into VGPR lanes are allowed on gfx90a and in the kernels for
    run-time head counts, where IREE spills 4-18 in the mask producer and
    the bf16 attention dispatch, with no scratch)."""
    problems = []
    prefill = variant.seqlen_q_tile > 1 and not variant.per_head_terms
    if target == "cuda":
        if variant.formulation == "online" and not str(isa.get("attention_config") or "").startswith("tuned"):
            problems.append(f"attention configuration {isa.get('attention_config')!r}, not turbine_fmha's")
        if prefill and not isa.get("mma_count"):
            problems.append("a prefill tile without mma.sync")
        return problems
    if isa.get("scratch_bytes"):
        problems.append(f"{isa['scratch_bytes']} bytes of scratch")
    if target == "gfx90a" or variant.runtime_heads:
        if any(k["vgpr_spill_count"] for k in isa.get("kernels", [])):
            problems.append("VGPR spills")
    elif isa.get("spills"):
        problems.append(f"{isa['spills']} spills")
    if prefill and not isa.get("mfma_count"):
        problems.append("a prefill tile without MFMA")
    return problems
