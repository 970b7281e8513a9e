#!/usr/bin/env python3
"""Markdown tables from benchmarks/bench.py --json rows (for docs/benchmarks.md)."""

import json
import sys


def rate(r, key):
    unit = "GB/s" if r["unit"].startswith("GB") else "TFLOP/s"
    return f"{r[key + '_rate']:.3g} {unit}"


def shape(r):
    return f"{r['name']} b{r['batch']} " + (
        f"sk{r['seqlen_k']}" if r["name"] == "decode" else f"{r['seqlen_q']} causal"
    )


def main(path):
    rows = json.load(open(path))
    main_rows = [r for r in rows if "table" not in r]  # split_kv / block_skipping rows print in bench.py
    feat = [r for r in rows if r.get("table") == "features"]
    print(
        "| shape | dtype | variant | ours ms | ours (API) ms | torch gather+SDPA ms | torch SDPA contiguous ms | ours | torch gather+SDPA | speedup vs torch gather+SDPA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in main_rows:
        print(
            f"| {shape(r)} | {r['dtype']} | `{r['variant']}` | {r['ours_ms']:.2f} | {r['ours_api_ms']:.1f} | "
            f"{r['baseline_ms']:.3g} | {r['sdpa_contig_ms']:.3g} | {rate(r, 'ours')} | {rate(r, 'baseline')} | "
            f"{r['baseline_ms'] / r['ours_ms']:.2f}x |"
        )
    if feat:
        print()
        print("| shape | feature | ms | vs causal |")
        print("|---|---|---|---|")
        for r in feat:
            print(
                f"| {r['name']} b{r['batch']} sq{r['seqlen_q']} sk{r['seqlen_k']} | {r['feature']} | {r['ours_ms']:.2f} | {r['vs_causal']:.2f}x |"
            )


if __name__ == "__main__":
    main(sys.argv[1])
