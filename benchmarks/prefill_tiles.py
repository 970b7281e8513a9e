#!/usr/bin/env python3
"""Prefill through contiguous tiles, as standalone modules: how close can
it get to IREE's unmasked roof (roof.py), where today's paged prefill
cannot (one page per reduction step, masked blocks computed)?

Every module is one function, all on the device: the pages the sequence
uses are gathered into contiguous K/V (one dispatch, kept apart from the
attention by an optimization barrier), then static, unpaged-shaped
online_attention over (query tile, key chunk) entries with a reduction
step of 64 keys, then the tiles' partials combined into the output.

The decompositions (causal, one sequence of N rows = keys, query tile T):
- binary (CONFIGS, PROBES): tile i sees the i * T keys before its
  diagonal block plus the block. The prefix is cut by the binary digits of
  i: bit b gives a chunk of 2^b * T keys, so each chunk length is one
  dispatch over the tiles with that bit (static shapes, no mask), and the
  diagonal blocks (T x T, causal) one masked dispatch. Nothing outside the
  diagonal triangles is computed. Partials are merged by log-sum-exp
  through an index table. `hm`: K/V repacked head-major and q transposed
  into head-major tiles first.
- grid (GRID): fixed chunks of C keys, each shared by a contiguous range of
  tiles, plus strided remainder classes; the online-softmax state is
  continued in place (outs), no merge.
- chain (CHAIN): binary, the state continued in place.
- slots (SLOTS): binary, each class's partials written into slot b of a
  [tiles, classes + 1] buffer (strided slices, no gathers), merged by
  structured reductions over the slots.
- static (STATIC): one class's attention on ready-made operands (no
  gathers), per layout: the op's own rate for that shape.
- batches (BATCHES): as_called.py's three prefill shapes (causal 4096, 4 x 1024
  causal, 4 x 512 new rows over 8192 cached keys) as ragged batches of
  bottom-right causal sequences (batch_plan: each sequence's keys in a
  region aligned to its largest chunk), K/V head-major, q read
  token-major, one elementwise merge; checked per sequence against
  float32 SDPA (GPU) and float64 (CPU_BATCHES, --check-cpu).

Shape: GQA 32/8, head dim 128, fp16, page 16 (the benchmark's).

    python benchmarks/prefill_tiles.py --check-cpu --n 512                  # correctness, on the CPU
    python benchmarks/prefill_tiles.py --build build/prefill-tiles          # here (CUDA; --targets gfx942 for ISA)
    python3 benchmarks/prefill_tiles.py --run build/prefill-tiles [--only a,b]   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HQ, HK, D, PAGE, BLOCK = 32, 8, 128, 16, 64
G = HQ // HK
NAME = "prefill_tiles"
MAX_START = "-3.0e+38"


def classes(n: int, t: int) -> list[tuple[int, list[int], list[int]]]:
    """[(chunk keys, tiles, chunk start key per tile)]: the prefix chunks
    by binary digit, then the diagonal (the last, masked)."""
    nt = n // t
    out = []
    for b in range(max(nt - 1, 1).bit_length()):
        tiles = [i for i in range(nt) if i >> b & 1]
        if tiles:
            out.append(((1 << b) * t, tiles, [((i >> (b + 1)) << (b + 1)) * t for i in tiles]))
    out.append((t, list(range(nt)), [i * t for i in range(nt)]))
    return out


def parts(n: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile, the global entry indices of its partials (padded with 0)
    and their count."""
    cls = classes(n, t)
    nt = n // t
    lists = [[] for _ in range(nt)]
    e0 = 0
    for _, tiles, _ in cls:
        for j, i in enumerate(tiles):
            lists[i].append(e0 + j)
        e0 += len(tiles)
    width = max(len(x) for x in lists)
    # Unused slots: the empty entry after the last one.
    idx = np.full((nt, width), sum(len(x) for x in lists), np.int64)
    for i, x in enumerate(lists):
        idx[i, : len(x)] = x
    return idx, np.array([len(x) for x in lists], np.int64)


def mlir(
    n: int, t: int, masked_prefix: bool, dyn_entries: bool, hm: bool = False, probe: str = "", merge: str = "gather"
) -> str:
    """The module; `hm` repacks K/V head-major ([HK, N, D]) and transposes
    q into head-major tiles ([N / T, HK, G, T, D]) once, so that each entry
    reads contiguous blocks ("kv": K/V only); `probe` times a piece alone: "class<c>" (class
    c's attention only, returning its partial accumulators) or "nomerge"
    (every class, returning the partials). `merge`: "gather" (structured
    reductions over gathered partials) or "extract" (one elementwise
    generic reading each tile's partials through the index table), which
    "extract_cfg" gives a hand-set GPU configuration (CUDA builds only:
    MERGE_CONFIG)."""
    nt, np_ = n // t, n // PAGE
    npc = np_ + 64
    cls = classes(n, t)
    # hm True: K/V and q head-major; "kv": K/V only (q's gather and
    # transpose fused into each attention dispatch).
    q_hm = hm is True
    idx, _ = parts(n, t)
    e_tot = sum(len(c[1]) for c in cls)
    maxp = idx.shape[1]
    f16, f32 = "f16", "f32"

    def tt(*dims, et=f16):
        return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"

    params = [f"%q: {tt(n, HQ, D)}", f"%kc: {tt(npc, PAGE, HK, D)}", f"%vc: {tt(npc, PAGE, HK, D)}"]
    params.append(f"%table: {tt(np_, et='i64')}")
    for c, (_, tiles, _) in enumerate(cls):
        e = "?" if dyn_entries else len(tiles)
        params.append(f"%tiles{c}: {tt(e, et='i64')}")
        params.append(f"%chunks{c}: {tt(e, et='i64')}")
    params.append(f"%pidx: {tt(nt, maxp, et='i64')}")
    body = []
    a = body.append
    a("  %c0 = arith.constant 0 : index")
    a("  %zero = arith.constant 0.0 : f32")
    a(f"  %max_start = arith.constant {MAX_START} : f32")
    a(f"  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32")
    # The repack: the sequence's pages, in order, as [blocks, 64, HK, D].
    for x in ("k", "v"):
        a(f"  %{x}g_e = tensor.empty() : {tt(np_, PAGE, HK, D)}")
        a(
            f"  %{x}g = iree_linalg_ext.gather dimension_map = [0] ins(%{x}c, %table : {tt(npc, PAGE, HK, D)}, "
            f"{tt(np_, et='i64')}) outs(%{x}g_e : {tt(np_, PAGE, HK, D)}) -> {tt(np_, PAGE, HK, D)}"
        )
        a(f"  %{x}f = tensor.collapse_shape %{x}g [[0, 1], [2], [3]] : {tt(np_, PAGE, HK, D)} into {tt(n, HK, D)}")
        if hm:
            a(f"  %{x}h_e = tensor.empty() : {tt(HK, n, D)}")
            a(
                f"  %{x}h = linalg.transpose ins(%{x}f : {tt(n, HK, D)}) outs(%{x}h_e : {tt(HK, n, D)}) permutation = [1, 0, 2]"
            )
            a(f"  %{x}b = util.optimization_barrier %{x}h : {tt(HK, n, D)}")
        else:
            a(f"  %{x}b = util.optimization_barrier %{x}f : {tt(n, HK, D)}")
    a(
        f"  %q5 = tensor.expand_shape %q [[0, 1], [2, 3], [4]] output_shape [{nt}, {t}, {HK}, {G}, {D}] : "
        f"{tt(n, HQ, D)} into {tt(nt, t, HK, G, D)}"
    )
    if q_hm:
        a(f"  %qh_e = tensor.empty() : {tt(nt, HK, G, t, D)}")
        a(
            f"  %qh0 = linalg.transpose ins(%q5 : {tt(nt, t, HK, G, D)}) outs(%qh_e : {tt(nt, HK, G, t, D)}) "
            "permutation = [0, 2, 3, 1, 4]"
        )
        a(f"  %qh = util.optimization_barrier %qh0 : {tt(nt, HK, G, t, D)}")
    pacc_t, pr_t = tt(e_tot, HK, G, t, D, et=f32), tt(e_tot, HK, G, t, et=f32)
    a(f"  %pacc_e = tensor.empty() : {pacc_t}")
    a(f"  %pr_e = tensor.empty() : {pr_t}")
    cur = ("%pacc_e", "%pr_e", "%pr_e")
    e0 = 0
    dims = "(b, h, g, m, e, d, n)"
    for c, (length, tiles, _) in enumerate(cls):
        if probe.startswith("class") and c != int(probe[5:]):
            e0 += len(tiles)
            continue
        diag = c == len(cls) - 1
        es = len(tiles)
        e = "?" if dyn_entries else es
        dyn = f"%ne{c}" if dyn_entries else ""
        if dyn_entries:
            a(f"  %ne{c} = tensor.dim %tiles{c}, %c0 : {tt(e, et='i64')}")
        qe_t, qt_t = tt(e, t, HK, G, D), tt(e, HK, G, t, D)
        k_t = tt(e, HK, length, D) if hm else tt(e, length, HK, D)
        acc_t, r_t = tt(e, HK, G, t, D, et=f32), tt(e, HK, G, t, et=f32)
        if q_hm:
            a(f"  %qt{c}_e = tensor.empty({dyn}) : {qt_t}")
            a(
                f"  %qt{c} = iree_linalg_ext.gather dimension_map = [0] ins(%qh, %tiles{c} : {tt(nt, HK, G, t, D)}, "
                f"{tt(e, et='i64')}) outs(%qt{c}_e : {qt_t}) -> {qt_t}"
            )
        else:
            a(f"  %qe{c}_e = tensor.empty({dyn}) : {qe_t}")
            a(
                f"  %qe{c} = iree_linalg_ext.gather dimension_map = [0] ins(%q5, %tiles{c} : {tt(nt, t, HK, G, D)}, "
                f"{tt(e, et='i64')}) outs(%qe{c}_e : {qe_t}) -> {qe_t}"
            )
            a(f"  %qt{c}_e = tensor.empty({dyn}) : {qt_t}")
            a(f"  %qt{c} = linalg.transpose ins(%qe{c} : {qe_t}) outs(%qt{c}_e : {qt_t}) permutation = [0, 2, 3, 1, 4]")
        # The class's chunks start at multiples of their length: each entry
        # gathers one whole chunk, so the keys are one static dim.
        ch_t = tt(n // length, length, HK, D)
        if hm:
            # Head-major: chunk `ch` of head h is row h * (N / C) + ch.
            nch = n // length
            ch_t = tt(HK * nch, length, D)
            ids_t = tt(e, HK, et="i64")
            a(f"  %ids{c}_e = tensor.empty({dyn}) : {ids_t}")
            a(
                f"  %ids{c} = linalg.generic {{indexing_maps = [affine_map<(b, h) -> (b)>, affine_map<(b, h) -> (b, h)>], "
                f'iterator_types = ["parallel", "parallel"]}} ins(%chunks{c} : {tt(e, et="i64")}) outs(%ids{c}_e : {ids_t}) {{'
            )
            a("  ^bb0(%ch: i64, %o: i64):")
            a("    %hh = linalg.index 1 : index")
            a("    %hi = arith.index_cast %hh : index to i64")
            a(f"    %nch = arith.constant {nch} : i64")
            a("    %base = arith.muli %hi, %nch : i64")
            a("    %id = arith.addi %base, %ch : i64")
            a("    linalg.yield %id : i64")
            a(f"  }} -> {ids_t}")
        for x in ("k", "v"):
            if hm:
                a(
                    f"  %{x}ch{c} = tensor.expand_shape %{x}b [[0, 1], [2, 3], [4]] output_shape [{HK}, 1, {nch}, {length}, {D}] : "
                    f"{tt(HK, n, D)} into {tt(HK, 1, nch, length, D)}"
                )
                a(
                    f"  %{x}cc{c} = tensor.collapse_shape %{x}ch{c} [[0, 1, 2], [3], [4]] : "
                    f"{tt(HK, 1, nch, length, D)} into {ch_t}"
                )
                a(f"  %{x}{c}_e = tensor.empty({dyn}) : {k_t}")
                a(
                    f"  %{x}{c} = iree_linalg_ext.gather dimension_map = [0] ins(%{x}cc{c}, %ids{c} : "
                    f"{ch_t}, {ids_t}) outs(%{x}{c}_e : {k_t}) -> {k_t}"
                )
                continue
            a(
                f"  %{x}ch{c} = tensor.expand_shape %{x}b [[0, 1], [2], [3]] output_shape [{n // length}, {length}, "
                f"{HK}, {D}] : {tt(n, HK, D)} into {ch_t}"
            )
            a(f"  %{x}{c}_e = tensor.empty({dyn}) : {k_t}")
            a(
                f"  %{x}{c} = iree_linalg_ext.gather dimension_map = [0] ins(%{x}ch{c}, %chunks{c} : "
                f"{ch_t}, {tt(e, et='i64')}) outs(%{x}{c}_e : {k_t}) -> {k_t}"
            )
        a(f"  %acc{c}_e = tensor.empty({dyn}) : {acc_t}")
        a(f"  %r{c}_e = tensor.empty({dyn}) : {r_t}")
        a(f"  %acc{c}_0 = linalg.fill ins(%zero : f32) outs(%acc{c}_e : {acc_t}) -> {acc_t}")
        a(f"  %max{c}_0 = linalg.fill ins(%max_start : f32) outs(%r{c}_e : {r_t}) -> {r_t}")
        a(f"  %sum{c}_0 = linalg.fill ins(%zero : f32) outs(%r{c}_e : {r_t}) -> {r_t}")
        kv_r = ("b, h, n, d", "b, h, n, e") if hm else ("b, n, h, d", "b, n, h, e")
        maps = [f"affine_map<{dims} -> ({r})>" for r in ("b, h, g, m, d", *kv_r, "")]
        ins, ins_t = [f"%qt{c}", f"%k{c}", f"%v{c}", "%scale"], [qt_t, k_t, k_t, "f32"]
        if diag or masked_prefix:
            mt = _mask(a, f"%mask{c}", t, length, CAUSAL if diag else ALL_TRUE)
            maps.append(f"affine_map<{dims} -> (m, n)>")
            ins.append(f"%mask{c}")
            ins_t.append(mt)
        maps += [f"affine_map<{dims} -> ({r})>" for r in ("b, h, g, m, e", "b, h, g, m", "b, h, g, m")]
        _attention(a, f"%att{c}", maps, ins, ins_t, [f"%acc{c}_0", f"%max{c}_0", f"%sum{c}_0"], [acc_t, r_t, r_t])
        # Into the partials at this class's entries.
        if dyn_entries:
            a(f"  %acc{c}_s = tensor.cast %att{c}#0 : {acc_t} to {tt(es, HK, G, t, D, et=f32)}")
            a(f"  %max{c}_s = tensor.cast %att{c}#1 : {r_t} to {tt(es, HK, G, t, et=f32)}")
            a(f"  %sum{c}_s = tensor.cast %att{c}#2 : {r_t} to {tt(es, HK, G, t, et=f32)}")
            srcs = (f"%acc{c}_s", f"%max{c}_s", f"%sum{c}_s")
        else:
            srcs = (f"%att{c}#0", f"%att{c}#1", f"%att{c}#2")
        new = []
        for k, (src, dst, full) in enumerate(zip(srcs, cur, (pacc_t, pr_t, pr_t))):
            rank = 5 if k == 0 else 4
            sizes = [es, HK, G, t, D][:rank]
            st = tt(*sizes, et=f32)
            name = f"%p{k}_{c}"
            a(
                f"  {name} = tensor.insert_slice {src} into {dst}[{e0}{', 0' * (rank - 1)}] "
                f"[{', '.join(map(str, sizes))}] [{', '.join(['1'] * rank)}] : {st} into {full}"
            )
            new.append(name)
        cur = tuple(new)
        e0 += es
    if probe:
        c = int(probe[5:]) if probe.startswith("class") else None
        res, res_t = (f"%att{c}#0", tt(len(cls[c][1]), HK, G, t, D, et=f32)) if c is not None else (cur[0], pacc_t)
        if c is not None and dyn_entries:
            res = f"%acc{c}_s"
        a(f"  util.return {res} : {res_t}")
        return (
            f"module {{\nutil.func public @{NAME}({', '.join(params)}) -> {res_t} {{\n" + "\n".join(body) + "\n}\n}\n"
        )
    if merge == "loop":
        _merge_loop(a, cur, nt, t, maxp, e_tot, pacc_t, pr_t)
    if merge.startswith("extract"):
        _merge_extract(a, cur, nt, t, maxp, e_tot, pacc_t, pr_t, MERGE_CONFIG if merge == "extract_cfg" else "")
    if merge != "gather":
        a(f"  %out = tensor.collapse_shape %o5 [[0, 1], [2, 3], [4]] : {tt(nt, t, HK, G, D)} into {tt(n, HQ, D)}")
        a(f"  util.return %out : {tt(n, HQ, D)}")
        return (
            f"module {{\nutil.func public @{NAME}({', '.join(params)}) -> {tt(n, HQ, D)} {{\n"
            + "\n".join(body)
            + "\n}\n}\n"
        )
    # The merge, in base 2 (online_attention's running max is base 2), as
    # structured reductions over each tile's partials, gathered through
    # %pidx. A tile's unused slots point at one more entry, appended empty
    # (max at its start, sum and acc 0), which weighs nothing.
    full_acc_t, full_r_t = tt(e_tot + 1, HK, G, t, D, et=f32), tt(e_tot + 1, HK, G, t, et=f32)
    one_acc_t, one_r_t = tt(1, HK, G, t, D, et=f32), tt(1, HK, G, t, et=f32)
    a(f"  %empty_acc_e = tensor.empty() : {one_acc_t}")
    a(f"  %empty_r_e = tensor.empty() : {one_r_t}")
    a(f"  %empty_acc = linalg.fill ins(%zero : f32) outs(%empty_acc_e : {one_acc_t}) -> {one_acc_t}")
    a(f"  %empty_max = linalg.fill ins(%max_start : f32) outs(%empty_r_e : {one_r_t}) -> {one_r_t}")
    a(f"  %empty_sum = linalg.fill ins(%zero : f32) outs(%empty_r_e : {one_r_t}) -> {one_r_t}")
    grown = []
    for k, (src, one, one_t, small_t, big_t, rank) in enumerate(
        (
            (cur[0], "%empty_acc", one_acc_t, pacc_t, full_acc_t, 5),
            (cur[1], "%empty_max", one_r_t, pr_t, full_r_t, 4),
            (cur[2], "%empty_sum", one_r_t, pr_t, full_r_t, 4),
        )
    ):
        sizes = [e_tot, HK, G, t, D][:rank]
        a(f"  %grow{k}_e = tensor.empty() : {big_t}")
        a(
            f"  %grow{k}_a = tensor.insert_slice {src} into %grow{k}_e[{', '.join(['0'] * rank)}] "
            f"[{', '.join(map(str, sizes))}] [{', '.join(['1'] * rank)}] : {small_t} into {big_t}"
        )
        a(
            f"  %grow{k} = tensor.insert_slice {one} into %grow{k}_a[{e_tot}{', 0' * (rank - 1)}] "
            f"[1{''.join(', ' + str(x) for x in sizes[1:])}] [{', '.join(['1'] * rank)}] : {one_t} into {big_t}"
        )
        grown.append(f"%grow{k}")
    gacc_t, gr_t = tt(nt, maxp, HK, G, t, D, et=f32), tt(nt, maxp, HK, G, t, et=f32)
    idx_t = tt(nt, maxp, et="i64")
    for k, (name, src_t, g_t) in enumerate(
        (("gacc", full_acc_t, gacc_t), ("gmax", full_r_t, gr_t), ("gsum", full_r_t, gr_t))
    ):
        a(f"  %{name}_e = tensor.empty() : {g_t}")
        a(
            f"  %{name} = iree_linalg_ext.gather dimension_map = [0] ins({grown[k]}, %pidx : {src_t}, {idx_t}) "
            f"outs(%{name}_e : {g_t}) -> {g_t}"
        )
    top_t = tt(nt, HK, G, t, et=f32)
    red5 = '["parallel", "parallel", "parallel", "parallel", "reduction"]'
    a(f"  %top_e = tensor.empty() : {top_t}")
    a(f"  %top0 = linalg.fill ins(%max_start : f32) outs(%top_e : {top_t}) -> {top_t}")
    a(
        f"  %top = linalg.generic {{indexing_maps = [affine_map<(i, h, g, m, j) -> (i, j, h, g, m)>, "
        f"affine_map<(i, h, g, m, j) -> (i, h, g, m)>], iterator_types = {red5}}} "
        f"ins(%gmax : {gr_t}) outs(%top0 : {top_t}) {{"
    )
    a("  ^bb0(%mj: f32, %tp: f32):")
    a("    %t2 = arith.maximumf %mj, %tp : f32")
    a("    linalg.yield %t2 : f32")
    a(f"  }} -> {top_t}")
    a(f"  %l0 = linalg.fill ins(%zero : f32) outs(%top_e : {top_t}) -> {top_t}")
    a(
        f"  %l = linalg.generic {{indexing_maps = [affine_map<(i, h, g, m, j) -> (i, j, h, g, m)>, "
        f"affine_map<(i, h, g, m, j) -> (i, j, h, g, m)>, affine_map<(i, h, g, m, j) -> (i, h, g, m)>, "
        f"affine_map<(i, h, g, m, j) -> (i, h, g, m)>], iterator_types = {red5}}} "
        f"ins(%gsum, %gmax, %top : {gr_t}, {gr_t}, {top_t}) outs(%l0 : {top_t}) {{"
    )
    a("  ^bb0(%lj: f32, %mj: f32, %tp: f32, %acc_l: f32):")
    a("    %d = arith.subf %mj, %tp : f32")
    a("    %w = math.exp2 %d : f32")
    a("    %lw = arith.mulf %lj, %w : f32")
    a("    %l2 = arith.addf %acc_l, %lw : f32")
    a("    linalg.yield %l2 : f32")
    a(f"  }} -> {top_t}")
    acc_t = tt(nt, HK, G, t, D, et=f32)
    a(f"  %macc_e = tensor.empty() : {acc_t}")
    a(f"  %macc0 = linalg.fill ins(%zero : f32) outs(%macc_e : {acc_t}) -> {acc_t}")
    a(
        f"  %macc = linalg.generic {{indexing_maps = [affine_map<(i, h, g, m, e, j) -> (i, j, h, g, m, e)>, "
        f"affine_map<(i, h, g, m, e, j) -> (i, j, h, g, m)>, affine_map<(i, h, g, m, e, j) -> (i, h, g, m)>, "
        f"affine_map<(i, h, g, m, e, j) -> (i, h, g, m, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction"]}} '
        f"ins(%gacc, %gmax, %top : {gacc_t}, {gr_t}, {top_t}) outs(%macc0 : {acc_t}) {{"
    )
    a("  ^bb0(%aj: f32, %mj: f32, %tp: f32, %acc_a: f32):")
    a("    %d = arith.subf %mj, %tp : f32")
    a("    %w = math.exp2 %d : f32")
    a("    %aw = arith.mulf %aj, %w : f32")
    a("    %a2 = arith.addf %acc_a, %aw : f32")
    a("    linalg.yield %a2 : f32")
    a(f"  }} -> {acc_t}")
    o5_t = tt(nt, t, HK, G, D)
    a(f"  %o5_e = tensor.empty() : {o5_t}")
    a(
        f"  %o5 = linalg.generic {{indexing_maps = [affine_map<(i, m, h, g, e) -> (i, h, g, m, e)>, "
        f"affine_map<(i, m, h, g, e) -> (i, h, g, m)>, affine_map<(i, m, h, g, e) -> (i, m, h, g, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}} '
        f"ins(%macc, %l : {acc_t}, {top_t}) outs(%o5_e : {o5_t}) {{"
    )
    a("  ^bb0(%av: f32, %lv: f32, %o: f16):")
    a("    %res = arith.divf %av, %lv : f32")
    a("    %res16 = arith.truncf %res : f32 to f16")
    a("    linalg.yield %res16 : f16")
    a(f"  }} -> {o5_t}")
    a(f"  %out = tensor.collapse_shape %o5 [[0, 1], [2, 3], [4]] : {o5_t} into {tt(n, HQ, D)}")
    a(f"  util.return %out : {tt(n, HQ, D)}")
    return (
        f"module {{\nutil.func public @{NAME}({', '.join(params)}) -> {tt(n, HQ, D)} {{\n"
        + "\n".join(body)
        + "\n}\n}\n"
    )


def static_mlir(e: int, t: int, c: int, layout: str) -> str:
    """Class-like attention with no gathers: q, k and v are arguments,
    already in place: "ours" keeps the prototype's layouts (q [E, HK, G, T,
    D], K/V [E, C, HK, D]), "hm" has head-major K/V [E, HK, C, D], "roof"
    is roof.py's form, one head per batch row (K/V repeated per query
    head)."""

    def tt(*dims, et="f16"):
        return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"

    if layout == "roof":
        dims = "(b, m, e, d, n)"
        q_t, k_t = tt(e * HQ, t, D), tt(e * HQ, c, D)
        rq, rk, rv, ro, rr = "b, m, d", "b, n, d", "b, n, e", "b, m, e", "b, m"
        acc_t, r_t = tt(e * HQ, t, D, et="f32"), tt(e * HQ, t, et="f32")
    else:
        dims = "(b, h, g, m, e, d, n)"
        q_t = tt(e, HK, G, t, D)
        k_t = tt(e, c, HK, D) if layout == "ours" else tt(e, HK, c, D)
        rq, ro, rr = "b, h, g, m, d", "b, h, g, m, e", "b, h, g, m"
        rk, rv = ("b, n, h, d", "b, n, h, e") if layout == "ours" else ("b, h, n, d", "b, h, n, e")
        acc_t, r_t = tt(e, HK, G, t, D, et="f32"), tt(e, HK, G, t, et="f32")
    maps = ", ".join(f"affine_map<{dims} -> ({r})>" for r in (rq, rk, rv, "", ro, rr, rr))
    return f"""module {{
util.func public @{NAME}(%q: {q_t}, %k: {k_t}, %v: {k_t}) -> {acc_t} {{
  %zero = arith.constant 0.0 : f32
  %max_start = arith.constant {MAX_START} : f32
  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32
  %acc_e = tensor.empty() : {acc_t}
  %r_e = tensor.empty() : {r_t}
  %acc0 = linalg.fill ins(%zero : f32) outs(%acc_e : {acc_t}) -> {acc_t}
  %max0 = linalg.fill ins(%max_start : f32) outs(%r_e : {r_t}) -> {r_t}
  %sum0 = linalg.fill ins(%zero : f32) outs(%r_e : {r_t}) -> {r_t}
  %att:3 = iree_linalg_ext.online_attention <indexing_maps = [{maps}]>
      ins(%q, %k, %v, %scale : {q_t}, {k_t}, {k_t}, f32) outs(%acc0, %max0, %sum0 : {acc_t}, {r_t}, {r_t}) {{
    ^bb0(%s: f32):
      iree_linalg_ext.yield %s : f32
  }} -> {acc_t}, {r_t}, {r_t}
  util.return %att#0 : {acc_t}
}}
}}
"""


def grid_mlir(n: int, t: int, c: int, probe: str = "") -> str:
    """The fixed-grid decomposition, with no merge and no gathers after the
    repack: keys in chunks of C. Chunk j is fully visible to the tiles
    i >= (j + 1) * C / T, a contiguous range, which all read the same K/V
    chunk; each tile's remaining keys (its diagonal block and the part of
    its own chunk before it, (i mod r + 1) * T keys for r = C / T) are r
    masked classes of strided tiles. Every class continues the tiles'
    online-softmax state (acc, max, sum) in place, as online_attention's
    outs; the output is the state normalized. `probe` "full"/"rem" keeps
    only those classes (timing only)."""
    nt, np_, r = n // t, n // PAGE, c // t
    npc = np_ + 64
    nc = n // c

    def tt(*dims, et="f16"):
        return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"

    body = []
    a = body.append
    a("  %zero = arith.constant 0.0 : f32")
    a(f"  %max_start = arith.constant {MAX_START} : f32")
    a(f"  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32")
    for x in ("k", "v"):
        a(f"  %{x}g_e = tensor.empty() : {tt(np_, PAGE, HK, D)}")
        a(
            f"  %{x}g = iree_linalg_ext.gather dimension_map = [0] ins(%{x}c, %table : {tt(npc, PAGE, HK, D)}, "
            f"{tt(np_, et='i64')}) outs(%{x}g_e : {tt(np_, PAGE, HK, D)}) -> {tt(np_, PAGE, HK, D)}"
        )
        a(f"  %{x}f = tensor.collapse_shape %{x}g [[0, 1], [2], [3]] : {tt(np_, PAGE, HK, D)} into {tt(n, HK, D)}")
        a(f"  %{x}h_e = tensor.empty() : {tt(HK, n, D)}")
        a(
            f"  %{x}h = linalg.transpose ins(%{x}f : {tt(n, HK, D)}) outs(%{x}h_e : {tt(HK, n, D)}) permutation = [1, 0, 2]"
        )
        a(f"  %{x}b = util.optimization_barrier %{x}h : {tt(HK, n, D)}")
        a(
            f"  %{x}4 = tensor.expand_shape %{x}b [[0], [1, 2], [3]] output_shape [{HK}, {nc}, {c}, {D}] : "
            f"{tt(HK, n, D)} into {tt(HK, nc, c, D)}"
        )
    a(
        f"  %q5 = tensor.expand_shape %q [[0, 1], [2, 3], [4]] output_shape [{nt}, {t}, {HK}, {G}, {D}] : "
        f"{tt(n, HQ, D)} into {tt(nt, t, HK, G, D)}"
    )
    a(f"  %qh_e = tensor.empty() : {tt(nt, HK, G, t, D)}")
    a(
        f"  %qh0 = linalg.transpose ins(%q5 : {tt(nt, t, HK, G, D)}) outs(%qh_e : {tt(nt, HK, G, t, D)}) "
        "permutation = [0, 2, 3, 1, 4]"
    )
    a(f"  %qh = util.optimization_barrier %qh0 : {tt(nt, HK, G, t, D)}")
    acc_t, r_t = tt(nt, HK, G, t, D, et="f32"), tt(nt, HK, G, t, et="f32")
    a(f"  %acc_e = tensor.empty() : {acc_t}")
    a(f"  %r_e = tensor.empty() : {r_t}")
    a(f"  %acc_s0 = linalg.fill ins(%zero : f32) outs(%acc_e : {acc_t}) -> {acc_t}")
    a(f"  %max_s0 = linalg.fill ins(%max_start : f32) outs(%r_e : {r_t}) -> {r_t}")
    a(f"  %sum_s0 = linalg.fill ins(%zero : f32) outs(%r_e : {r_t}) -> {r_t}")
    state = ["%acc_s0", "%max_s0", "%sum_s0"]
    dims = "(b, h, g, m, e, d, n)"
    # (name, first tile, count, stride, key source, key map, keys, mask rows offset or None)
    work = []
    if probe != "rem":
        for j in range(nc - 1):
            first = (j + 1) * r
            work.append((f"f{j}", first, nt - first, 1, j, c, None))
    if probe != "full":
        for rho in range(r):
            work.append((f"r{rho}", rho, nt // r, r, None, (rho + 1) * t, rho * t))
    for name, first, count, stride, chunk, keys, moff in work:
        q_t = tt(count, HK, G, t, D)
        sacc_t, sr_t = tt(count, HK, G, t, D, et="f32"), tt(count, HK, G, t, et="f32")
        a(
            f"  %q_{name} = tensor.extract_slice %qh[{first}, 0, 0, 0, 0] [{count}, {HK}, {G}, {t}, {D}] "
            f"[{stride}, 1, 1, 1, 1] : {tt(nt, HK, G, t, D)} to {q_t}"
        )
        if chunk is not None:
            kv_t = tt(HK, keys, D)
            for x in ("k", "v"):
                a(
                    f"  %{x}_{name} = tensor.extract_slice %{x}4[0, {chunk}, 0, 0] [{HK}, 1, {keys}, {D}] [1, 1, 1, 1] : "
                    f"{tt(HK, nc, c, D)} to {kv_t}"
                )
            kr, vr = "h, n, d", "h, n, e"
        else:
            kv_t = tt(HK, nc, keys, D)
            for x in ("k", "v"):
                a(
                    f"  %{x}_{name} = tensor.extract_slice %{x}4[0, 0, 0, 0] [{HK}, {nc}, {keys}, {D}] [1, 1, 1, 1] : "
                    f"{tt(HK, nc, c, D)} to {kv_t}"
                )
            kr, vr = "h, b, n, d", "h, b, n, e"
        st = []
        for k, (src, full_t, part_t, rank) in enumerate(
            ((state[0], acc_t, sacc_t, 5), (state[1], r_t, sr_t, 4), (state[2], r_t, sr_t, 4))
        ):
            sizes = [count, HK, G, t, D][:rank]
            a(
                f"  %s{k}_{name} = tensor.extract_slice {src}[{first}{', 0' * (rank - 1)}] [{', '.join(map(str, sizes))}] "
                f"[{stride}{', 1' * (rank - 1)}] : {full_t} to {part_t}"
            )
            # Through a copy: online_attention's outs read from the state
            # buffer itself fail to bufferize (IREE 3.13); a copy producer is
            # fused into the dispatch instead.
            ids = ", ".join("abcde"[:rank])
            par = ", ".join(['"parallel"'] * rank)
            a(f"  %c{k}_{name}_e = tensor.empty() : {part_t}")
            a(
                f"  %c{k}_{name} = linalg.generic {{indexing_maps = [affine_map<({ids}) -> ({ids})>, "
                f"affine_map<({ids}) -> ({ids})>], iterator_types = [{par}]}} "
                f"ins(%s{k}_{name} : {part_t}) outs(%c{k}_{name}_e : {part_t}) {{"
            )
            # Not an identity to the folder (x + 0.0 is not x for x = -0.0;
            # the max never reaches below its start), so the copy stays.
            a("  ^bb0(%x: f32, %y: f32):")
            if k == 1:
                a("    %x2 = arith.maximumf %x, %max_start : f32")
            else:
                a("    %x2 = arith.addf %x, %zero : f32")
            a("    linalg.yield %x2 : f32")
            a(f"  }} -> {part_t}")
            st.append(f"%c{k}_{name}")
        maps = [f"affine_map<{dims} -> ({x})>" for x in ("b, h, g, m, d", kr, vr, "")]
        ins, ins_t = [f"%q_{name}", f"%k_{name}", f"%v_{name}", "%scale"], [q_t, kv_t, kv_t, "f32"]
        if moff is not None:
            mt = _mask(
                a,
                f"%mask_{name}",
                t,
                keys,
                [
                    f"%off = arith.constant {moff} : index",
                    "%lim = arith.addi %i, %off : index",
                    "%ok = arith.cmpi sle, %j, %lim : index",
                ],
            )
            maps.append(f"affine_map<{dims} -> (m, n)>")
            ins.append(f"%mask_{name}")
            ins_t.append(mt)
        maps += [f"affine_map<{dims} -> ({x})>" for x in ("b, h, g, m, e", "b, h, g, m", "b, h, g, m")]
        _attention(a, f"%att_{name}", maps, ins, ins_t, st, [sacc_t, sr_t, sr_t])
        new = []
        for k, (dst, full_t, part_t, rank) in enumerate(
            ((state[0], acc_t, sacc_t, 5), (state[1], r_t, sr_t, 4), (state[2], r_t, sr_t, 4))
        ):
            sizes = [count, HK, G, t, D][:rank]
            a(
                f"  %n{k}_{name} = tensor.insert_slice %att_{name}#{k} into {dst}[{first}{', 0' * (rank - 1)}] "
                f"[{', '.join(map(str, sizes))}] [{stride}{', 1' * (rank - 1)}] : {part_t} into {full_t}"
            )
            new.append(f"%n{k}_{name}")
        state = new
    o5_t = tt(nt, t, HK, G, D)
    a(f"  %o5_e = tensor.empty() : {o5_t}")
    a(
        f"  %o5 = linalg.generic {{indexing_maps = [affine_map<(i, m, h, g, e) -> (i, h, g, m, e)>, "
        f"affine_map<(i, m, h, g, e) -> (i, h, g, m)>, affine_map<(i, m, h, g, e) -> (i, m, h, g, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}} '
        f"ins({state[0]}, {state[2]} : {acc_t}, {r_t}) outs(%o5_e : {o5_t}) {{"
    )
    a("  ^bb0(%av: f32, %lv: f32, %o: f16):")
    a("    %res = arith.divf %av, %lv : f32")
    a("    %res16 = arith.truncf %res : f32 to f16")
    a("    linalg.yield %res16 : f16")
    a(f"  }} -> {o5_t}")
    a(f"  %out = tensor.collapse_shape %o5 [[0, 1], [2, 3], [4]] : {o5_t} into {tt(n, HQ, D)}")
    a(f"  util.return %out : {tt(n, HQ, D)}")
    params = (
        f"%q: {tt(n, HQ, D)}, %kc: {tt(npc, PAGE, HK, D)}, %vc: {tt(npc, PAGE, HK, D)}, %table: {tt(np_, et='i64')}"
    )
    return f"module {{\nutil.func public @{NAME}({params}) -> {tt(n, HQ, D)} {{\n" + "\n".join(body) + "\n}\n}\n"


def _tt(*dims, et="f16"):
    return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"


def _attention(a, res: str, maps: list, ins: list, ins_t: list, outs: list, outs_t: list) -> None:
    """Emits `res`:3 = online_attention of `ins` into `outs` (acc, max,
    sum), its score region passing the score through."""
    a(f"  {res}:3 = iree_linalg_ext.online_attention <indexing_maps = [{', '.join(maps)}]>")
    a(f"      ins({', '.join(ins)} : {', '.join(ins_t)})")
    a(f"      outs({', '.join(outs)} : {', '.join(outs_t)}) {{")
    a("    ^bb0(%s: f32):")
    a("      iree_linalg_ext.yield %s : f32")
    a(f"  }} -> {', '.join(outs_t)}")


def _mask(a, name: str, rows: int, keys: int, keep: list[str]) -> str:
    """Emits `name`, an i1 [rows, keys] mask over (query row %i, key %j)
    whose `keep` lines define %ok; returns its type."""
    mt = _tt(rows, keys, et="i1")
    a(f"  {name}_e = tensor.empty() : {mt}")
    a(
        f"  {name} = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>], "
        f'iterator_types = ["parallel", "parallel"]}} outs({name}_e : {mt}) {{'
    )
    a("  ^bb0(%o: i1):")
    a("    %i = linalg.index 0 : index")
    a("    %j = linalg.index 1 : index")
    for line in keep:
        a(f"    {line}")
    a("    linalg.yield %ok : i1")
    a(f"  }} -> {mt}")
    return mt


CAUSAL = ["%ok = arith.cmpi sle, %j, %i : index"]
ALL_TRUE = ["%ok = arith.constant true"]


def _repack_head_major(a, n: int, t: int) -> None:
    """The pages, in order, as head-major K/V %kb, %vb [HK, N, D], and q as
    head-major tiles %qh [N / T, HK, G, T, D], each in its own dispatch."""
    nt, np_ = n // t, n // PAGE
    npc = np_ + 64
    tt = _tt
    for x in ("k", "v"):
        a(f"  %{x}g_e = tensor.empty() : {tt(np_, PAGE, HK, D)}")
        a(
            f"  %{x}g = iree_linalg_ext.gather dimension_map = [0] ins(%{x}c, %table : {tt(npc, PAGE, HK, D)}, "
            f"{tt(np_, et='i64')}) outs(%{x}g_e : {tt(np_, PAGE, HK, D)}) -> {tt(np_, PAGE, HK, D)}"
        )
        a(f"  %{x}f = tensor.collapse_shape %{x}g [[0, 1], [2], [3]] : {tt(np_, PAGE, HK, D)} into {tt(n, HK, D)}")
        a(f"  %{x}h_e = tensor.empty() : {tt(HK, n, D)}")
        a(
            f"  %{x}h = linalg.transpose ins(%{x}f : {tt(n, HK, D)}) outs(%{x}h_e : {tt(HK, n, D)}) permutation = [1, 0, 2]"
        )
        a(f"  %{x}b = util.optimization_barrier %{x}h : {tt(HK, n, D)}")
    a(
        f"  %q5 = tensor.expand_shape %q [[0, 1], [2, 3], [4]] output_shape [{nt}, {t}, {HK}, {G}, {D}] : "
        f"{tt(n, HQ, D)} into {tt(nt, t, HK, G, D)}"
    )
    a(f"  %qh_e = tensor.empty() : {tt(nt, HK, G, t, D)}")
    a(
        f"  %qh0 = linalg.transpose ins(%q5 : {tt(nt, t, HK, G, D)}) outs(%qh_e : {tt(nt, HK, G, t, D)}) "
        "permutation = [0, 2, 3, 1, 4]"
    )
    a(f"  %qh = util.optimization_barrier %qh0 : {tt(nt, HK, G, t, D)}")


def chain_mlir(n: int, t: int, masked_all: bool = False) -> str:
    """The binary decomposition without partials: every class continues
    the tiles' online-softmax state in place (online_attention's outs), so
    nothing is merged. Class b's tiles are i = k * 2^(b+1) + 2^b + l: the
    state, q and the output viewed as [NT / 2^(b+1), 2, 2^b, ...] and
    sliced at 1 in the middle dim, a plain strided slice; their keys are
    the first 2^b * T of chunk k of 2^(b+1) * T keys, shared by the 2^b
    tiles of the run. Then the diagonal blocks, masked. No gathers after
    the repack. `masked_all` gives every class an (all-true) mask."""
    nt, np_ = n // t, n // PAGE
    npc = np_ + 64

    def tt(*dims, et="f16"):
        return "tensor<" + "x".join(str(d) for d in dims) + f"x{et}>"

    body = []
    a = body.append
    a("  %zero = arith.constant 0.0 : f32")
    a(f"  %max_start = arith.constant {MAX_START} : f32")
    a(f"  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32")
    _repack_head_major(a, n, t)
    acc_t, r_t = tt(nt, HK, G, t, D, et="f32"), tt(nt, HK, G, t, et="f32")
    a(f"  %acc_e = tensor.empty() : {acc_t}")
    a(f"  %r_e = tensor.empty() : {r_t}")
    a(f"  %acc_s0 = linalg.fill ins(%zero : f32) outs(%acc_e : {acc_t}) -> {acc_t}")
    a(f"  %max_s0 = linalg.fill ins(%max_start : f32) outs(%r_e : {r_t}) -> {r_t}")
    a(f"  %sum_s0 = linalg.fill ins(%zero : f32) outs(%r_e : {r_t}) -> {r_t}")
    state = ["%acc_s0", "%max_s0", "%sum_s0"]
    tails = ([HK, G, t, D], [HK, G, t], [HK, G, t])
    classes_ = [(b, nt >> (b + 1), 1 << b) for b in range(max(nt - 1, 1).bit_length()) if nt >> (b + 1)]
    for b, nk, run in [*classes_, ("d", nt, 1)]:
        name = f"c{b}"
        diag = b == "d"
        keys = t if diag else run * t
        span = t if diag else 2 * run * t
        # Views: [NK, 2, run, ...] sliced at 1 (class b), or [NT, 1, 1, ...] (the diagonal).
        pick = 0 if diag else 1
        two = 1 if diag else 2

        def view(src, src_t, tail, et, tag):
            rank = len(tail)
            big_t = tt(nk, two, run, *tail, et=et)
            part_t = tt(nk, run, *tail, et=et)
            reassoc = "[[0, 1, 2]" + "".join(f", [{i + 3}]" for i in range(rank)) + "]"
            a(
                f"  %{tag}_x = tensor.expand_shape {src} {reassoc} output_shape [{nk}, {two}, {run}, "
                f"{', '.join(map(str, tail))}] : {src_t} into {big_t}"
            )
            a(
                f"  %{tag} = tensor.extract_slice %{tag}_x[0, {pick}, 0{', 0' * rank}] [{nk}, 1, {run}, "
                f"{', '.join(map(str, tail))}] [1, 1, 1{', 1' * rank}] : {big_t} to {part_t}"
            )
            return f"%{tag}", f"%{tag}_x", big_t, part_t, reassoc

        q_v, _, _, q_t, _ = view("%qh", tt(nt, HK, G, t, D), [HK, G, t, D], "f16", f"q_{name}")
        kv_t = tt(HK, nk, keys, D)
        for x in ("k", "v"):
            a(
                f"  %{x}_{name}_x = tensor.expand_shape %{x}b [[0], [1, 2], [3]] output_shape [{HK}, {nk}, {span}, {D}] : "
                f"{tt(HK, n, D)} into {tt(HK, nk, span, D)}"
            )
            a(
                f"  %{x}_{name} = tensor.extract_slice %{x}_{name}_x[0, 0, 0, 0] [{HK}, {nk}, {keys}, {D}] [1, 1, 1, 1] : "
                f"{tt(HK, nk, span, D)} to {kv_t}"
            )
        views, inits = [], []
        for k, (src, tail, full_t) in enumerate(zip(state, tails, (acc_t, r_t, r_t))):
            v_name, x_name, big_t, part_t, reassoc = view(src, full_t, tail, "f32", f"s{k}_{name}")
            views.append((x_name, big_t, part_t, reassoc, full_t, tail))
            rank = len(tail) + 2
            ids = ", ".join("abcdefg"[:rank])
            par = ", ".join(['"parallel"'] * rank)
            # A copy the folder keeps (x + 0.0 is not x for -0.0; the max
            # never falls below its start): online_attention's outs read
            # straight from the state buffer fail to bufferize (IREE 3.13).
            a(f"  %i{k}_{name}_e = tensor.empty() : {part_t}")
            a(
                f"  %i{k}_{name} = linalg.generic {{indexing_maps = [affine_map<({ids}) -> ({ids})>, "
                f"affine_map<({ids}) -> ({ids})>], iterator_types = [{par}]}} "
                f"ins({v_name} : {part_t}) outs(%i{k}_{name}_e : {part_t}) {{"
            )
            a("  ^bb0(%x: f32, %y: f32):")
            a(f"    %x2 = arith.{'maximumf' if k == 1 else 'addf'} %x, {'%max_start' if k == 1 else '%zero'} : f32")
            a("    linalg.yield %x2 : f32")
            a(f"  }} -> {part_t}")
            inits.append(f"%i{k}_{name}")
        dims = "(k, l, h, g, m, e, d, n)"
        maps = [f"affine_map<{dims} -> ({x})>" for x in ("k, l, h, g, m, d", "h, k, n, d", "h, k, n, e", "")]
        ins, ins_t = [q_v, f"%k_{name}", f"%v_{name}", "%scale"], [q_t, kv_t, kv_t, "f32"]
        if diag or masked_all:
            mt = _mask(a, f"%mask_{name}", t, keys, CAUSAL if diag else ALL_TRUE)
            maps.append(f"affine_map<{dims} -> (m, n)>")
            ins.append(f"%mask_{name}")
            ins_t.append(mt)
        maps += [f"affine_map<{dims} -> ({x})>" for x in ("k, l, h, g, m, e", "k, l, h, g, m", "k, l, h, g, m")]
        sacc_t, sr_t = views[0][2], views[1][2]
        _attention(a, f"%att_{name}", maps, ins, ins_t, inits, [sacc_t, sr_t, sr_t])
        new = []
        for k, (x_name, big_t, part_t, reassoc, full_t, tail) in enumerate(views):
            rank = len(tail)
            a(
                f"  %u{k}_{name}_x = tensor.insert_slice %att_{name}#{k} into {x_name}[0, {pick}, 0{', 0' * rank}] "
                f"[{nk}, 1, {run}, {', '.join(map(str, tail))}] [1, 1, 1{', 1' * rank}] : {part_t} into {big_t}"
            )
            a(f"  %u{k}_{name} = tensor.collapse_shape %u{k}_{name}_x {reassoc} : {big_t} into {full_t}")
            new.append(f"%u{k}_{name}")
        state = new
    o5_t = tt(nt, t, HK, G, D)
    a(f"  %o5_e = tensor.empty() : {o5_t}")
    a(
        f"  %o5 = linalg.generic {{indexing_maps = [affine_map<(i, m, h, g, e) -> (i, h, g, m, e)>, "
        f"affine_map<(i, m, h, g, e) -> (i, h, g, m)>, affine_map<(i, m, h, g, e) -> (i, m, h, g, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}} '
        f"ins({state[0]}, {state[2]} : {acc_t}, {r_t}) outs(%o5_e : {o5_t}) {{"
    )
    a("  ^bb0(%av: f32, %lv: f32, %o: f16):")
    a("    %res = arith.divf %av, %lv : f32")
    a("    %res16 = arith.truncf %res : f32 to f16")
    a("    linalg.yield %res16 : f16")
    a(f"  }} -> {o5_t}")
    a(f"  %out = tensor.collapse_shape %o5 [[0, 1], [2, 3], [4]] : {o5_t} into {tt(n, HQ, D)}")
    a(f"  util.return %out : {tt(n, HQ, D)}")
    params = (
        f"%q: {tt(n, HQ, D)}, %kc: {tt(npc, PAGE, HK, D)}, %vc: {tt(npc, PAGE, HK, D)}, %table: {tt(np_, et='i64')}"
    )
    return f"module {{\nutil.func public @{NAME}({params}) -> {tt(n, HQ, D)} {{\n" + "\n".join(body) + "\n}\n}\n"


def slots_mlir(n: int, t: int) -> str:
    """The binary decomposition with partials in slots: tile i's partial
    from class b lands at [i, b] of a [NT, classes + 1, ...] buffer (the
    diagonal at the last slot), written as a strided slice of the class's
    own result, never read back into an attention; then one structured
    merge over the slots. A slot a tile does not use keeps its max at the
    start (filled) and is selected away, acc unread."""
    nt = n // t
    tt = _tt
    body = []
    a = body.append
    a("  %zero = arith.constant 0.0 : f32")
    a(f"  %max_start = arith.constant {MAX_START} : f32")
    a(f"  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32")
    _repack_head_major(a, n, t)
    classes_ = [(b, nt >> (b + 1), 1 << b) for b in range(max(nt - 1, 1).bit_length()) if nt >> (b + 1)]
    ns = len(classes_) + 1
    pacc_t, pr_t = tt(nt, ns, HK, G, t, D, et="f32"), tt(nt, ns, HK, G, t, et="f32")
    a(f"  %pacc0 = tensor.empty() : {pacc_t}")
    a(f"  %pr_e = tensor.empty() : {pr_t}")
    a(f"  %pmax0 = linalg.fill ins(%max_start : f32) outs(%pr_e : {pr_t}) -> {pr_t}")
    a(f"  %psum0 = linalg.fill ins(%zero : f32) outs(%pr_e : {pr_t}) -> {pr_t}")
    parts = ["%pacc0", "%pmax0", "%psum0"]
    tails = ([HK, G, t, D], [HK, G, t], [HK, G, t])
    for slot, (b, nk, run) in enumerate([*classes_, ("d", nt, 1)]):
        name = f"c{b}"
        diag = b == "d"
        keys = t if diag else run * t
        span = t if diag else 2 * run * t
        pick, two = (0, 1) if diag else (1, 2)
        q_x_t, q_t = tt(nk, two, run, HK, G, t, D), tt(nk, run, HK, G, t, D)
        a(
            f"  %q_{name}_x = tensor.expand_shape %qh [[0, 1, 2], [3], [4], [5], [6]] output_shape [{nk}, {two}, {run}, "
            f"{HK}, {G}, {t}, {D}] : {tt(nt, HK, G, t, D)} into {q_x_t}"
        )
        a(
            f"  %q_{name} = tensor.extract_slice %q_{name}_x[0, {pick}, 0, 0, 0, 0, 0] [{nk}, 1, {run}, {HK}, {G}, {t}, {D}] "
            f"[1, 1, 1, 1, 1, 1, 1] : {q_x_t} to {q_t}"
        )
        kv_t = tt(HK, nk, keys, D)
        for x in ("k", "v"):
            a(
                f"  %{x}_{name}_x = tensor.expand_shape %{x}b [[0], [1, 2], [3]] output_shape [{HK}, {nk}, {span}, {D}] : "
                f"{tt(HK, n, D)} into {tt(HK, nk, span, D)}"
            )
            a(
                f"  %{x}_{name} = tensor.extract_slice %{x}_{name}_x[0, 0, 0, 0] [{HK}, {nk}, {keys}, {D}] [1, 1, 1, 1] : "
                f"{tt(HK, nk, span, D)} to {kv_t}"
            )
        sacc_t, sr_t = tt(nk, run, HK, G, t, D, et="f32"), tt(nk, run, HK, G, t, et="f32")
        a(f"  %acc_{name}_e = tensor.empty() : {sacc_t}")
        a(f"  %r_{name}_e = tensor.empty() : {sr_t}")
        a(f"  %acc_{name}_0 = linalg.fill ins(%zero : f32) outs(%acc_{name}_e : {sacc_t}) -> {sacc_t}")
        a(f"  %max_{name}_0 = linalg.fill ins(%max_start : f32) outs(%r_{name}_e : {sr_t}) -> {sr_t}")
        a(f"  %sum_{name}_0 = linalg.fill ins(%zero : f32) outs(%r_{name}_e : {sr_t}) -> {sr_t}")
        dims = "(k, l, h, g, m, e, d, n)"
        maps = [f"affine_map<{dims} -> ({x})>" for x in ("k, l, h, g, m, d", "h, k, n, d", "h, k, n, e", "")]
        ins, ins_t = [f"%q_{name}", f"%k_{name}", f"%v_{name}", "%scale"], [q_t, kv_t, kv_t, "f32"]
        if diag:
            mt = _mask(a, f"%mask_{name}", t, keys, CAUSAL)
            maps.append(f"affine_map<{dims} -> (m, n)>")
            ins.append(f"%mask_{name}")
            ins_t.append(mt)
        maps += [f"affine_map<{dims} -> ({x})>" for x in ("k, l, h, g, m, e", "k, l, h, g, m", "k, l, h, g, m")]
        _attention(
            a,
            f"%att_{name}",
            maps,
            ins,
            ins_t,
            [f"%acc_{name}_0", f"%max_{name}_0", f"%sum_{name}_0"],
            [sacc_t, sr_t, sr_t],
        )
        new = []
        for k, (src, tail, full_t) in enumerate(zip(parts, tails, (pacc_t, pr_t, pr_t))):
            rank = len(tail)
            big_t = tt(nk, two, run, ns, *tail, et="f32")
            part_t = sacc_t if k == 0 else sr_t
            reassoc = "[[0, 1, 2], [3]" + "".join(f", [{i + 4}]" for i in range(rank)) + "]"
            a(
                f"  %p{k}_{name}_x = tensor.expand_shape {src} {reassoc} output_shape [{nk}, {two}, {run}, {ns}, "
                f"{', '.join(map(str, tail))}] : {full_t} into {big_t}"
            )
            a(
                f"  %p{k}_{name}_u = tensor.insert_slice %att_{name}#{k} into %p{k}_{name}_x[0, {pick}, 0, {slot}{', 0' * rank}] "
                f"[{nk}, 1, {run}, 1, {', '.join(map(str, tail))}] [1, 1, 1, 1{', 1' * rank}] : {part_t} into {big_t}"
            )
            a(f"  %p{k}_{name} = tensor.collapse_shape %p{k}_{name}_u {reassoc} : {big_t} into {full_t}")
            new.append(f"%p{k}_{name}")
        parts = new
    # The merge over slots, in base 2.
    top_t = tt(nt, HK, G, t, et="f32")
    red = '["parallel", "parallel", "parallel", "parallel", "reduction"]'
    a(f"  %top_e = tensor.empty() : {top_t}")
    a(f"  %top0 = linalg.fill ins(%max_start : f32) outs(%top_e : {top_t}) -> {top_t}")
    a(
        f"  %top = linalg.generic {{indexing_maps = [affine_map<(i, h, g, m, j) -> (i, j, h, g, m)>, "
        f"affine_map<(i, h, g, m, j) -> (i, h, g, m)>], iterator_types = {red}}} ins({parts[1]} : {pr_t}) "
        f"outs(%top0 : {top_t}) {{"
    )
    a("  ^bb0(%mj: f32, %tp: f32):")
    a("    %t2 = arith.maximumf %mj, %tp : f32")
    a("    linalg.yield %t2 : f32")
    a(f"  }} -> {top_t}")
    a(f"  %l0 = linalg.fill ins(%zero : f32) outs(%top_e : {top_t}) -> {top_t}")
    a(
        f"  %l = linalg.generic {{indexing_maps = [affine_map<(i, h, g, m, j) -> (i, j, h, g, m)>, "
        f"affine_map<(i, h, g, m, j) -> (i, j, h, g, m)>, affine_map<(i, h, g, m, j) -> (i, h, g, m)>, "
        f"affine_map<(i, h, g, m, j) -> (i, h, g, m)>], iterator_types = {red}}} "
        f"ins({parts[2]}, {parts[1]}, %top : {pr_t}, {pr_t}, {top_t}) outs(%l0 : {top_t}) {{"
    )
    a("  ^bb0(%lj: f32, %mj: f32, %tp: f32, %acc_l: f32):")
    a("    %d = arith.subf %mj, %tp : f32")
    a("    %w = math.exp2 %d : f32")
    a("    %lw = arith.mulf %lj, %w : f32")
    a("    %l2 = arith.addf %acc_l, %lw : f32")
    a("    linalg.yield %l2 : f32")
    a(f"  }} -> {top_t}")
    o5_t = tt(nt, t, HK, G, D)
    a(f"  %o5_e = tensor.empty() : {o5_t}")
    a(f"  %o5f_e = tensor.empty() : {tt(nt, t, HK, G, D, et='f32')}")
    a(
        f"  %o5_0 = linalg.fill ins(%zero : f32) outs(%o5f_e : {tt(nt, t, HK, G, D, et='f32')}) -> {tt(nt, t, HK, G, D, et='f32')}"
    )
    a(
        f"  %oacc = linalg.generic {{indexing_maps = [affine_map<(i, m, h, g, e, j) -> (i, j, h, g, m, e)>, "
        f"affine_map<(i, m, h, g, e, j) -> (i, j, h, g, m)>, affine_map<(i, m, h, g, e, j) -> (i, h, g, m)>, "
        f"affine_map<(i, m, h, g, e, j) -> (i, m, h, g, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction"]}} '
        f"ins({parts[0]}, {parts[1]}, %top : {pacc_t}, {pr_t}, {top_t}) outs(%o5_0 : {tt(nt, t, HK, G, D, et='f32')}) {{"
    )
    a("  ^bb0(%aj: f32, %mj: f32, %tp: f32, %acc_a: f32):")
    # An unused slot's acc was never written: select it away, never weigh it.
    a("    %used = arith.cmpf ogt, %mj, %max_start : f32")
    a("    %d = arith.subf %mj, %tp : f32")
    a("    %w = math.exp2 %d : f32")
    a("    %aw = arith.mulf %aj, %w : f32")
    a("    %a2 = arith.addf %acc_a, %aw : f32")
    a("    %a3 = arith.select %used, %a2, %acc_a : f32")
    a("    linalg.yield %a3 : f32")
    a(f"  }} -> {tt(nt, t, HK, G, D, et='f32')}")
    a(
        f"  %o5 = linalg.generic {{indexing_maps = [affine_map<(i, m, h, g, e) -> (i, m, h, g, e)>, "
        f"affine_map<(i, m, h, g, e) -> (i, h, g, m)>, affine_map<(i, m, h, g, e) -> (i, m, h, g, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}} '
        f"ins(%oacc, %l : {tt(nt, t, HK, G, D, et='f32')}, {top_t}) outs(%o5_e : {o5_t}) {{"
    )
    a("  ^bb0(%av: f32, %lv: f32, %o: f16):")
    a("    %res = arith.divf %av, %lv : f32")
    a("    %res16 = arith.truncf %res : f32 to f16")
    a("    linalg.yield %res16 : f16")
    a(f"  }} -> {o5_t}")
    np_ = n // PAGE
    npc = np_ + 64
    a(f"  %out = tensor.collapse_shape %o5 [[0, 1], [2, 3], [4]] : {o5_t} into {tt(n, HQ, D)}")
    a(f"  util.return %out : {tt(n, HQ, D)}")
    params = (
        f"%q: {tt(n, HQ, D)}, %kc: {tt(npc, PAGE, HK, D)}, %vc: {tt(npc, PAGE, HK, D)}, %table: {tt(np_, et='i64')}"
    )
    return f"module {{\nutil.func public @{NAME}({params}) -> {tt(n, HQ, D)} {{\n" + "\n".join(body) + "\n}\n}\n"


# The binary decomposition continued in place: (query tile, masked_all).
CHAIN = {"chain_t128": (128, False), "chain_t128_masked": (128, True), "chain_t256": (256, False)}
# The binary decomposition with partials in slots: query tile.
SLOTS = {"slots_t128": 128, "slots_t256": 256}
# The fixed-grid decomposition: (query tile, key chunk, probe).
GRID = {
    "grid_t128_c512": (128, 512, ""),
    "grid_t128_c1024": (128, 1024, ""),
    "grid_t128_c512_full": (128, 512, "full"),
    "grid_t128_c512_rem": (128, 512, "rem"),
}


# Class 4 of "t128" (16 entries x 2048 keys) with no gathers: the
# attention op's own rate for that shape, per layout.
STATIC = {f"static_{lay}": (16, 128, 2048, lay) for lay in ("ours", "hm", "roof")}

# A configuration for the extract merge (over (tile, row, KV head, group,
# value dim)): IREE's own gives it 32-thread workgroups.
MERGE_CONFIG = (
    "compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_gpu.lowering_config<{"
    "workgroup = [1, 2, 1, 4, 128], thread = [1, 1, 1, 1, 4]}>, translation_info = "
    "#iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> workgroup_size = [256, 1, 1] "
    "subgroup_size = 32>>"
)


def _merge_extract(a, cur, nt, t, maxp, e_tot, pacc_t, pr_t, config: str) -> None:
    """%o5 [NT, T, HK, G, D] f16: each tile's partials (the index table's
    entries below e_tot; the rest weigh nothing) merged in base 2, read
    through tensor.extract in one elementwise generic."""
    tt = _tt
    o5_t = tt(nt, t, HK, G, D)
    idx_t = tt(nt, maxp, et="i64")
    a(f"  %o5_e = tensor.empty() : {o5_t}")
    cfg = f", {config}" if config else ""
    a(
        f"  %o5 = linalg.generic {{indexing_maps = [affine_map<(i, m, h, g, e) -> (i, m, h, g, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]{cfg}}} outs(%o5_e : {o5_t}) {{'
    )
    a("  ^bb0(%o: f16):")
    for k, d in enumerate("imhge"):
        a(f"    %x{d} = linalg.index {k} : index")
    a(f"    %top_init = arith.constant {MAX_START} : f32")
    a("    %fz = arith.constant 0.0 : f32")
    a(f"    %etot = arith.constant {e_tot} : i64")
    a("    %i0 = arith.constant 0 : i64")
    top = "%top_init"
    for j in range(maxp):
        a(f"    %cj{j} = arith.constant {j} : index")
        a(f"    %ij{j}r = tensor.extract %pidx[%xi, %cj{j}] : {idx_t}")
        a(f"    %ok{j} = arith.cmpi slt, %ij{j}r, %etot : i64")
        a(f"    %ij{j}c = arith.select %ok{j}, %ij{j}r, %i0 : i64")
        a(f"    %ij{j} = arith.index_cast %ij{j}c : i64 to index")
        a(f"    %mj{j}r = tensor.extract {cur[1]}[%ij{j}, %xh, %xg, %xm] : {pr_t}")
        a(f"    %mj{j} = arith.select %ok{j}, %mj{j}r, %top_init : f32")
        a(f"    %top{j} = arith.maximumf {top}, %mj{j} : f32")
        top = f"%top{j}"
    lsum, asum = "%fz", "%fz"
    for j in range(maxp):
        a(f"    %d{j} = arith.subf %mj{j}, {top} : f32")
        a(f"    %w{j}r = math.exp2 %d{j} : f32")
        a(f"    %w{j} = arith.select %ok{j}, %w{j}r, %fz : f32")
        a(f"    %sj{j} = tensor.extract {cur[2]}[%ij{j}, %xh, %xg, %xm] : {pr_t}")
        a(f"    %aj{j} = tensor.extract {cur[0]}[%ij{j}, %xh, %xg, %xm, %xe] : {pacc_t}")
        a(f"    %lw{j} = arith.mulf %sj{j}, %w{j} : f32")
        a(f"    %l{j} = arith.addf {lsum}, %lw{j} : f32")
        a(f"    %aw{j} = arith.mulf %aj{j}, %w{j} : f32")
        a(f"    %a{j} = arith.addf {asum}, %aw{j} : f32")
        lsum, asum = f"%l{j}", f"%a{j}"
    a(f"    %res = arith.divf {asum}, {lsum} : f32")
    a("    %res16 = arith.truncf %res : f32 to f16")
    a("    linalg.yield %res16 : f16")
    a(f"  }} -> {o5_t}")


def _merge_loop(a, cur, nt, t, maxp, e_tot, pacc_t, pr_t) -> None:
    """As _merge_extract, but each element loops over its tile's used
    partials only (scf.for up to the first unused slot), reading nothing
    for the others."""
    tt = _tt
    o5_t = tt(nt, t, HK, G, D)
    idx_t = tt(nt, maxp, et="i64")
    a(f"  %o5_e = tensor.empty() : {o5_t}")
    a(
        f"  %o5 = linalg.generic {{indexing_maps = [affine_map<(i, m, h, g, e) -> (i, m, h, g, e)>], "
        f'iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}} outs(%o5_e : {o5_t}) {{'
    )
    a("  ^bb0(%o: f16):")
    for k, d in enumerate("imhge"):
        a(f"    %x{d} = linalg.index {k} : index")
    a(f"    %top_init = arith.constant {MAX_START} : f32")
    a("    %fz = arith.constant 0.0 : f32")
    a("    %z0 = arith.constant 0 : index")
    a("    %z1 = arith.constant 1 : index")
    a(f"    %cmax = arith.constant {maxp} : index")
    a(f"    %etot = arith.constant {e_tot} : i64")
    # The used slots come first: count them.
    a("    %cnt = scf.for %j = %z0 to %cmax step %z1 iter_args(%n = %z0) -> (index) {")
    a(f"      %ij = tensor.extract %pidx[%xi, %j] : {idx_t}")
    a("      %ok = arith.cmpi slt, %ij, %etot : i64")
    a("      %n1 = arith.addi %n, %z1 : index")
    a("      %n2 = arith.select %ok, %n1, %n : index")
    a("      scf.yield %n2 : index")
    a("    }")
    a("    %top = scf.for %j = %z0 to %cnt step %z1 iter_args(%tp = %top_init) -> (f32) {")
    a(f"      %ijr = tensor.extract %pidx[%xi, %j] : {idx_t}")
    a("      %ij = arith.index_cast %ijr : i64 to index")
    a(f"      %mj = tensor.extract {cur[1]}[%ij, %xh, %xg, %xm] : {pr_t}")
    a("      %t2 = arith.maximumf %tp, %mj : f32")
    a("      scf.yield %t2 : f32")
    a("    }")
    a("    %la:2 = scf.for %j = %z0 to %cnt step %z1 iter_args(%l = %fz, %acc = %fz) -> (f32, f32) {")
    a(f"      %ijr = tensor.extract %pidx[%xi, %j] : {idx_t}")
    a("      %ij = arith.index_cast %ijr : i64 to index")
    a(f"      %mj = tensor.extract {cur[1]}[%ij, %xh, %xg, %xm] : {pr_t}")
    a(f"      %sj = tensor.extract {cur[2]}[%ij, %xh, %xg, %xm] : {pr_t}")
    a(f"      %aj = tensor.extract {cur[0]}[%ij, %xh, %xg, %xm, %xe] : {pacc_t}")
    a("      %d = arith.subf %mj, %top : f32")
    a("      %w = math.exp2 %d : f32")
    a("      %lw = arith.mulf %sj, %w : f32")
    a("      %l2 = arith.addf %l, %lw : f32")
    a("      %aw = arith.mulf %aj, %w : f32")
    a("      %acc2 = arith.addf %acc, %aw : f32")
    a("      scf.yield %l2, %acc2 : f32, f32")
    a("    }")
    a("    %res = arith.divf %la#1, %la#0 : f32")
    a("    %res16 = arith.truncf %res : f32 to f16")
    a("    linalg.yield %res16 : f16")
    a(f"  }} -> {o5_t}")


CONFIGS = {
    # name: (query tile, masked prefix, dynamic entry counts)
    "t128": (128, False, False),
    "t128_masked": (128, True, False),
    "t128_dyn": (128, False, True),
    "t256": (256, False, False),
    "t128_hm": (128, False, False, True),
    "t128_hm_dyn": (128, False, True, True),
    "t128_hm_x": (128, False, False, True, "", "extract"),
    "t128_hm_xc": (128, False, False, True, "", "extract_cfg"),
    "t128_hm_loop": (128, False, False, True, "", "loop"),
    "t128_hmkv_x": (128, False, False, "kv", "", "extract"),
    "t256_hmkv_x": (256, False, False, "kv", "", "extract"),
}
# The pieces of "t128" alone (timed, not checked).
PROBES = {f"t128_class{c}": (128, False, False, False, f"class{c}") for c in range(6)} | {
    "t128_nomerge": (128, False, False, False, "nomerge"),
    "t128_hm_class4": (128, False, False, True, "class4"),
    "t128_hm_class5": (128, False, False, True, "class5"),
    "t128_hm_nomerge": (128, False, False, True, "nomerge"),
}


def build(out: Path, n: int, targets: list[str], only: list[str]) -> None:
    from turbine_fmha.build import compiler
    from turbine_fmha.build import targets as tg

    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for tag, cfg in (CONFIGS | PROBES).items():
        if only and tag not in only:
            continue
        (out / f"{tag}.mlir").write_text(mlir(n, *cfg))
        for target in targets:
            # The hand-set merge configuration is a GPU one.
            src = mlir(n, *(x if x != "extract_cfg" or target == "cuda" else "extract" for x in cfg))
            seconds, report, _ = compiler.compile_one(
                src, NAME, (out / f"{tag}.{target}.vmfb").resolve(), tg.TARGETS[target]
            )
            reports[f"{tag}.{target}"] = dict(report, seconds=round(seconds, 2))
            print(tag, target, reports[f"{tag}.{target}"], flush=True)
    sources = {tag: (lambda t=t, c=c, probe=probe: grid_mlir(n, t, c, probe)) for tag, (t, c, probe) in GRID.items()}
    sources |= {tag: (lambda t=t, m=m: chain_mlir(n, t, m)) for tag, (t, m) in CHAIN.items()}
    sources |= {tag: (lambda t=t: slots_mlir(n, t)) for tag, t in SLOTS.items()}
    for tag, make in sources.items():
        if only and tag not in only:
            continue
        src = make()
        (out / f"{tag}.mlir").write_text(src)
        for target in targets:
            seconds, report, _ = compiler.compile_one(
                src, NAME, (out / f"{tag}.{target}.vmfb").resolve(), tg.TARGETS[target]
            )
            reports[f"{tag}.{target}"] = dict(report, seconds=round(seconds, 2))
            print(tag, target, reports[f"{tag}.{target}"], flush=True)
    for tag, (seqs, t, *repack) in BATCHES.items():
        if only and tag not in only:
            continue
        src = batch_mlir(seqs, t, batch_npc(seqs), *repack)
        (out / f"{tag}.mlir").write_text(src)
        for target in targets:
            seconds, report, _ = compiler.compile_one(
                src, NAME, (out / f"{tag}.{target}.vmfb").resolve(), tg.TARGETS[target]
            )
            reports[f"{tag}.{target}"] = dict(report, seconds=round(seconds, 2))
            print(tag, target, reports[f"{tag}.{target}"], flush=True)
    for tag, (e, t, c, lay) in STATIC.items():
        if only and tag not in only:
            continue
        src = static_mlir(e, t, c, lay)
        (out / f"{tag}.mlir").write_text(src)
        for target in targets:
            seconds, report, _ = compiler.compile_one(
                src, NAME, (out / f"{tag}.{target}.vmfb").resolve(), tg.TARGETS[target]
            )
            reports[f"{tag}.{target}"] = dict(report, seconds=round(seconds, 2))
            print(tag, target, reports[f"{tag}.{target}"], flush=True)
    (out / "build.json").write_text(json.dumps({"n": n, "reports": reports}, indent=1))


# -- ragged batches and chunked prefill (as_called.py's prefill shapes) -----


def batch_plan(seqs: list[tuple[int, int]], t: int) -> dict:
    """The binary decomposition of a batch: `seqs` is [(new rows, cached
    keys)], both multiples of T, each sequence bottom-right causal (row r
    sees its first cached + r + 1 keys). Tile i of a sequence sees a
    prefix of p * T keys (p = cached / T + i), cut by the binary digits of
    p, then its diagonal block. Each sequence's keys get a region of the
    repacked buffer aligned to its largest chunk, so that every chunk is
    whole in the chunk view of its length (an entry gathers one chunk id).
    Returns the regions, the classes [(chunk keys, [(q tile, chunk id)])]
    with the diagonal last, and each tile's entries."""
    bases, base, q0, tiles = [], 0, 0, []
    for rows, cached in seqs:
        assert rows % t == 0 and cached % t == 0
        pmax = cached // t + rows // t - 1
        align = (1 << max(pmax.bit_length() - 1, 0)) * t
        base = -(-base // align) * align
        bases.append(base)
        tiles += [(len(bases) - 1, q0 // t + i, cached // t + i) for i in range(rows // t)]
        base += cached + rows
        q0 += rows
    top = max(p for _, _, p in tiles)
    biggest = (1 << max(top.bit_length() - 1, 0)) * t
    ntot = -(-base // biggest) * biggest
    classes_ = []
    for b in range(max(top, 1).bit_length()):
        length = (1 << b) * t
        ent = [(qt, (bases[s] + ((p >> (b + 1)) << (b + 1)) * t) // length) for s, qt, p in tiles if p >> b & 1]
        if ent:
            classes_.append((length, ent))
    classes_.append((t, [(qt, (bases[s] + p * t) // t) for s, qt, p in tiles]))
    lists = [[] for _ in tiles]
    e0 = 0
    for _, ent in classes_:
        for j, (qt, _) in enumerate(ent):
            lists[qt].append(e0 + j)
        e0 += len(ent)
    idx = np.full((len(tiles), max(len(x) for x in lists)), e0, np.int64)
    for i, x in enumerate(lists):
        idx[i, : len(x)] = x
    return {"bases": bases, "ntot": ntot, "rows": q0, "classes": classes_, "pidx": idx, "e_tot": e0}


def batch_mlir(seqs: list[tuple[int, int]], t: int, npc: int, repack: str = "gather") -> str:
    """The batch's module: K/V repacked head-major into the regions
    (batch_plan), q read token-major, the classes without a mask and the
    diagonal blocks masked, one elementwise merge (as `t128_hmkv_x`).
    `repack`: "gather" (iree_linalg_ext.gather of whole pages, then a
    transpose: one dispatch at 64-thread workgroups) or "generic" (one
    elementwise generic writing [HK, keys, D], each element read through
    the table with tensor.extract)."""
    plan = batch_plan(seqs, t)
    tt = _tt
    ntot, rows, cls, e_tot = plan["ntot"], plan["rows"], plan["classes"], plan["e_tot"]
    nt, maxp, nps = rows // t, plan["pidx"].shape[1], ntot // PAGE
    params = [f"%q: {tt(rows, HQ, D)}", f"%kc: {tt(npc, PAGE, HK, D)}", f"%vc: {tt(npc, PAGE, HK, D)}"]
    params.append(f"%table: {tt(nps, et='i64')}")
    for c, (_, ent) in enumerate(cls):
        params += [f"%tiles{c}: {tt(len(ent), et='i64')}", f"%ids{c}: {tt(len(ent), HK, et='i64')}"]
    params.append(f"%pidx: {tt(nt, maxp, et='i64')}")
    body = []
    a = body.append
    a("  %zero = arith.constant 0.0 : f32")
    a(f"  %max_start = arith.constant {MAX_START} : f32")
    a(f"  %scale = arith.constant {1 / np.sqrt(D):.8f} : f32")
    for x in ("k", "v"):
        if repack == "generic":
            a(f"  %{x}h_e = tensor.empty() : {tt(HK, ntot, D)}")
            a(
                f"  %{x}h = linalg.generic {{indexing_maps = [affine_map<(h, n, d) -> (h, n, d)>], "
                f'iterator_types = ["parallel", "parallel", "parallel"]}} outs(%{x}h_e : {tt(HK, ntot, D)}) {{'
            )
            a("  ^bb0(%o: f16):")
            a("    %h = linalg.index 0 : index")
            a("    %n = linalg.index 1 : index")
            a("    %d = linalg.index 2 : index")
            a(f"    %pg = arith.constant {PAGE} : index")
            a("    %slot = arith.divui %n, %pg : index")
            a("    %row = arith.remui %n, %pg : index")
            a(f"    %pid = tensor.extract %table[%slot] : {tt(nps, et='i64')}")
            a("    %pgi = arith.index_cast %pid : i64 to index")
            a(f"    %val = tensor.extract %{x}c[%pgi, %row, %h, %d] : {tt(npc, PAGE, HK, D)}")
            a("    linalg.yield %val : f16")
            a(f"  }} -> {tt(HK, ntot, D)}")
            a(f"  %{x}b = util.optimization_barrier %{x}h : {tt(HK, ntot, D)}")
            continue
        a(f"  %{x}g_e = tensor.empty() : {tt(nps, PAGE, HK, D)}")
        a(
            f"  %{x}g = iree_linalg_ext.gather dimension_map = [0] ins(%{x}c, %table : {tt(npc, PAGE, HK, D)}, "
            f"{tt(nps, et='i64')}) outs(%{x}g_e : {tt(nps, PAGE, HK, D)}) -> {tt(nps, PAGE, HK, D)}"
        )
        a(f"  %{x}f = tensor.collapse_shape %{x}g [[0, 1], [2], [3]] : {tt(nps, PAGE, HK, D)} into {tt(ntot, HK, D)}")
        a(f"  %{x}h_e = tensor.empty() : {tt(HK, ntot, D)}")
        a(
            f"  %{x}h = linalg.transpose ins(%{x}f : {tt(ntot, HK, D)}) outs(%{x}h_e : {tt(HK, ntot, D)}) "
            "permutation = [1, 0, 2]"
        )
        a(f"  %{x}b = util.optimization_barrier %{x}h : {tt(HK, ntot, D)}")
    a(
        f"  %q5 = tensor.expand_shape %q [[0, 1], [2, 3], [4]] output_shape [{nt}, {t}, {HK}, {G}, {D}] : "
        f"{tt(rows, HQ, D)} into {tt(nt, t, HK, G, D)}"
    )
    pacc_t, pr_t = tt(e_tot, HK, G, t, D, et="f32"), tt(e_tot, HK, G, t, et="f32")
    a(f"  %pacc_e = tensor.empty() : {pacc_t}")
    a(f"  %pr_e = tensor.empty() : {pr_t}")
    cur = ("%pacc_e", "%pr_e", "%pr_e")
    e0 = 0
    dims = "(b, h, g, m, e, d, n)"
    for c, (length, ent) in enumerate(cls):
        diag = c == len(cls) - 1
        e = len(ent)
        qe_t, qt_t, k_t = tt(e, t, HK, G, D), tt(e, HK, G, t, D), tt(e, HK, length, D)
        acc_t, r_t = tt(e, HK, G, t, D, et="f32"), tt(e, HK, G, t, et="f32")
        a(f"  %qe{c}_e = tensor.empty() : {qe_t}")
        a(
            f"  %qe{c} = iree_linalg_ext.gather dimension_map = [0] ins(%q5, %tiles{c} : {tt(nt, t, HK, G, D)}, "
            f"{tt(e, et='i64')}) outs(%qe{c}_e : {qe_t}) -> {qe_t}"
        )
        a(f"  %qt{c}_e = tensor.empty() : {qt_t}")
        a(f"  %qt{c} = linalg.transpose ins(%qe{c} : {qe_t}) outs(%qt{c}_e : {qt_t}) permutation = [0, 2, 3, 1, 4]")
        ch_t = tt(HK * (ntot // length), length, D)
        for x in ("k", "v"):
            a(
                f"  %{x}ch{c} = tensor.expand_shape %{x}b [[0], [1, 2], [3]] output_shape [{HK}, {ntot // length}, "
                f"{length}, {D}] : {tt(HK, ntot, D)} into {tt(HK, ntot // length, length, D)}"
            )
            a(
                f"  %{x}cc{c} = tensor.collapse_shape %{x}ch{c} [[0, 1], [2], [3]] : "
                f"{tt(HK, ntot // length, length, D)} into {ch_t}"
            )
            a(f"  %{x}{c}_e = tensor.empty() : {k_t}")
            a(
                f"  %{x}{c} = iree_linalg_ext.gather dimension_map = [0] ins(%{x}cc{c}, %ids{c} : {ch_t}, "
                f"{tt(e, HK, et='i64')}) outs(%{x}{c}_e : {k_t}) -> {k_t}"
            )
        a(f"  %acc{c}_e = tensor.empty() : {acc_t}")
        a(f"  %r{c}_e = tensor.empty() : {r_t}")
        a(f"  %acc{c}_0 = linalg.fill ins(%zero : f32) outs(%acc{c}_e : {acc_t}) -> {acc_t}")
        a(f"  %max{c}_0 = linalg.fill ins(%max_start : f32) outs(%r{c}_e : {r_t}) -> {r_t}")
        a(f"  %sum{c}_0 = linalg.fill ins(%zero : f32) outs(%r{c}_e : {r_t}) -> {r_t}")
        maps = [f"affine_map<{dims} -> ({r})>" for r in ("b, h, g, m, d", "b, h, n, d", "b, h, n, e", "")]
        ins, ins_t = [f"%qt{c}", f"%k{c}", f"%v{c}", "%scale"], [qt_t, k_t, k_t, "f32"]
        if diag:
            mt = _mask(a, "%mask", t, t, CAUSAL)
            maps.append(f"affine_map<{dims} -> (m, n)>")
            ins.append("%mask")
            ins_t.append(mt)
        maps += [f"affine_map<{dims} -> ({r})>" for r in ("b, h, g, m, e", "b, h, g, m", "b, h, g, m")]
        _attention(a, f"%att{c}", maps, ins, ins_t, [f"%acc{c}_0", f"%max{c}_0", f"%sum{c}_0"], [acc_t, r_t, r_t])
        new = []
        for k, (dst, full) in enumerate(zip(cur, (pacc_t, pr_t, pr_t))):
            rank = 5 if k == 0 else 4
            sizes = [e, HK, G, t, D][:rank]
            a(
                f"  %p{k}_{c} = tensor.insert_slice %att{c}#{k} into {dst}[{e0}{', 0' * (rank - 1)}] "
                f"[{', '.join(map(str, sizes))}] [{', '.join(['1'] * rank)}] : {tt(*sizes, et='f32')} into {full}"
            )
            new.append(f"%p{k}_{c}")
        cur = tuple(new)
        e0 += e
    _merge_extract(a, cur, nt, t, maxp, e_tot, pacc_t, pr_t, "")
    a(f"  %out = tensor.collapse_shape %o5 [[0, 1], [2, 3], [4]] : {tt(nt, t, HK, G, D)} into {tt(rows, HQ, D)}")
    a(f"  util.return %out : {tt(rows, HQ, D)}")
    return (
        f"module {{\nutil.func public @{NAME}({', '.join(params)}) -> {tt(rows, HQ, D)} {{\n"
        + "\n".join(body)
        + "\n}\n}\n"
    )


def batch_inputs(seqs: list[tuple[int, int]], t: int, npc: int, rng):
    """The batch module's arguments and, per sequence, (q, K, V) for the
    reference (K/V contiguous, cached keys first)."""
    plan = batch_plan(seqs, t)
    ntot = plan["ntot"]
    q = rng.standard_normal((plan["rows"], HQ, D), dtype=np.float32).astype(np.float16)
    kc = rng.standard_normal((npc, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((npc, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    pages = rng.permutation(npc)
    table = np.zeros(ntot // PAGE, np.int64)  # region slots no chunk reads: any page
    refs, used, q0 = [], 0, 0
    for (rows, cached), base in zip(seqs, plan["bases"]):
        n = (rows + cached) // PAGE
        mine = pages[used : used + n]
        used += n
        table[base // PAGE : base // PAGE + n] = mine
        refs.append((q[q0 : q0 + rows], kc[mine].reshape(-1, HK, D), vc[mine].reshape(-1, HK, D)))
        q0 += rows
    args = [q, kc, vc, table]
    for length, ent in plan["classes"]:
        args.append(np.array([qt for qt, _ in ent], np.int64))
        # Head-major chunk ids: chunk c of head h is row h * (keys / C) + c.
        args.append(np.array([[h * (ntot // length) + ch for h in range(HK)] for _, ch in ent], np.int64))
    args.append(plan["pidx"])
    return args, refs


def batch_reference(refs) -> np.ndarray:
    """float64 bottom-right causal attention per sequence, rows concatenated."""
    outs = []
    for q, k, v in refs:
        qd = q.astype(np.float64)
        kd, vd = np.repeat(k.astype(np.float64), G, axis=1), np.repeat(v.astype(np.float64), G, axis=1)
        s = np.einsum("qhd,khd->hqk", qd, kd) / np.sqrt(D)
        rows, keys = q.shape[0], k.shape[0]
        vis = np.arange(keys)[None, :] <= (keys - rows + np.arange(rows))[:, None]
        s = np.where(vis[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        outs.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vd))
    return np.concatenate(outs)


def batch_flops(seqs) -> float:
    return sum(4.0 * HQ * D * (rows * cached + rows * (rows + 1) / 2) for rows, cached in seqs)


# as_called.py's prefill shapes: [(new rows, cached keys)], query tile.
BATCHES = {
    "batch_4096": ([(4096, 0)], 128),
    "batch_4x1024": ([(1024, 0)] * 4, 128),
    "batch_4x512+8192": ([(512, 8192)] * 4, 128),
    "batch_4096_t256": ([(4096, 0)], 256),
    "batch_4x1024_t256": ([(1024, 0)] * 4, 256),
    "batch_4x512+8192_t256": ([(512, 8192)] * 4, 256),
    "batch_4096_rg": ([(4096, 0)], 128, "generic"),
}
# Small batches for --check-cpu: ragged, chunked, one tile.
CPU_BATCHES = {
    "cpu_ragged": ([(256, 0), (128, 0), (384, 0)], 128),
    "cpu_chunked": ([(128, 256), (256, 128)], 128),
    "cpu_one_tile": ([(128, 0)], 128),
    "cpu_ragged_rg": ([(256, 0), (128, 0), (384, 0)], 128, "generic"),
}


def batch_npc(seqs) -> int:
    return sum(rows + cached for rows, cached in seqs) // PAGE + 64


def inputs(n: int, t: int, dyn: bool, rng):
    """The module's arguments (numpy) and contiguous K/V for the reference."""
    np_ = n // PAGE
    npc = np_ + 64
    table = rng.permutation(npc)[:np_].astype(np.int64)
    q = rng.standard_normal((n, HQ, D), dtype=np.float32).astype(np.float16)
    kc = rng.standard_normal((npc, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((npc, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    args = [q, kc, vc, table]
    for length, tiles, starts in classes(n, t):
        args.append(np.array(tiles, np.int64))
        args.append(np.array([s // length for s in starts], np.int64))
    idx, _ = parts(n, t)
    args.append(idx)
    k = kc[table].reshape(n, HK, D)
    v = vc[table].reshape(n, HK, D)
    return args, q, k, v


def run(out: Path, repeat: int, only: list[str]) -> None:
    import iree.runtime as rt
    import torch

    import turbine_fmha
    from turbine_fmha.runtime.invoke import Loaded

    n = json.loads((out / "build.json").read_text())["n"]
    session = turbine_fmha.Session("cuda", artifact_dir="/nonexistent-prefill-tiles")
    cfg, dev = session._iree_config(), session.device_of()
    visible = 4.0 * HQ * n * (n + 1) / 2 * D
    rng = np.random.default_rng(0)
    grid = {tag: (t, False, False, False, probe) for tag, (t, _, probe) in GRID.items()}
    grid |= {tag: (t, False, False, False, "") for tag, (t, _) in CHAIN.items()}
    grid |= {tag: (t, False, False, False, "") for tag, t in SLOTS.items()}
    for tag, (t, _, dyn, *rest) in (CONFIGS | PROBES | grid).items():
        probe = rest[1] if len(rest) > 1 else ""
        path = out / f"{tag}.cuda.vmfb"
        if not path.exists() or (only and tag not in only):
            continue
        args, q, k, v = inputs(n, t, dyn, rng)
        if tag in grid:
            args = args[:4]
        dargs = [rt.asdevicearray(dev, x) for x in args]
        loaded = Loaded(
            type("V", (), {"name": NAME})(), rt.VmModule.copy_buffer(cfg.vm_instance, path.read_bytes()), cfg, spin=True
        )
        last = [None]

        def call():
            last[0] = loaded.enqueue(dargs)

        for _ in range(3):
            call()
        last[0].wait()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeat):
                call()
            last[0].wait()
            times.append((time.perf_counter() - t0) * 1e3 / repeat)
        ms = float(np.median(times))
        if probe:
            print(f"prefill_tiles ({tag}): {ms:.3f} ms device (median of 5 rounds x {repeat})", flush=True)
            continue
        got = torch.from_numpy(last[0].results(1)[0].to_host().astype(np.float32)).cuda()
        qt = torch.from_numpy(q).cuda().float().permute(1, 0, 2)[None]
        kt = torch.from_numpy(k).cuda().float().permute(1, 0, 2).repeat_interleave(G, 0)[None]
        vt = torch.from_numpy(v).cuda().float().permute(1, 0, 2).repeat_interleave(G, 0)[None]
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)[0].permute(1, 0, 2)
        err = float((got - ref).abs().max() / ref.abs().max())
        print(
            f"prefill_tiles ({tag}): {ms:.3f} ms device (median of 5 rounds x {repeat}), "
            f"{visible / (ms * 1e-3) / 1e12:.1f} TFLOP/s visible, max rel err {err:.2e} "
            f"{'ok' if err < 5e-3 else 'FAIL'}",
            flush=True,
        )


def check_cpu(n: int) -> int:
    """Builds every configuration for the host at `n` rows and checks it
    against a float64 causal reference: the decomposition's correctness,
    before any GPU time is spent."""
    import tempfile

    import iree.runtime as rt

    out = Path(tempfile.mkdtemp())
    build(
        out, n, ["host"], [*CONFIGS, *(g for g, (_, c, probe) in GRID.items() if not probe and c < n), *CHAIN, *SLOTS]
    )
    from turbine_fmha.runtime.invoke import Loaded

    cfg = rt.Config("local-task")
    rng = np.random.default_rng(1)
    bad = 0
    grid = {g: (t, False, False) for g, (t, c, probe) in GRID.items() if not probe and c < n}
    grid |= {g: (t, False, False) for g, (t, _) in CHAIN.items()}
    grid |= {g: (t, False, False) for g, t in SLOTS.items()}
    for tag, (t, _, dyn, *_) in (CONFIGS | grid).items():
        args, q, k, v = inputs(n, t, dyn, rng)
        if tag in grid:
            args = args[:4]
        vm = rt.VmModule.copy_buffer(cfg.vm_instance, (out / f"{tag}.host.vmfb").read_bytes())
        loaded = Loaded(type("V", (), {"name": NAME})(), vm, cfg, spin=False)
        got = np.asarray(loaded.invoke([rt.asdevicearray(cfg.device, x) for x in args], 1)[0].to_host(), np.float64)
        qd, kd, vd = (x.astype(np.float64) for x in (q, k, v))
        kd, vd = np.repeat(kd, G, axis=1), np.repeat(vd, G, axis=1)
        s = np.einsum("qhd,khd->hqk", qd, kd) / np.sqrt(D)
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vd)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        print(f"{tag}: max rel err {err:.2e}", flush=True)
        bad += not err < 5e-3
    for tag, (seqs, t, *repack) in CPU_BATCHES.items():
        npc = batch_npc(seqs)
        path = out / f"{tag}.host.vmfb"
        from turbine_fmha.build import compiler
        from turbine_fmha.build import targets as tg

        compiler.compile_one(batch_mlir(seqs, t, npc, *repack), NAME, path.resolve(), tg.TARGETS["host"])
        args, refs = batch_inputs(seqs, t, npc, rng)
        vm = rt.VmModule.copy_buffer(cfg.vm_instance, path.read_bytes())
        loaded = Loaded(type("V", (), {"name": NAME})(), vm, cfg, spin=False)
        got = np.asarray(loaded.invoke([rt.asdevicearray(cfg.device, x) for x in args], 1)[0].to_host(), np.float64)
        ref = batch_reference(refs)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        print(f"{tag}: max rel err {err:.2e}", flush=True)
        bad += not err < 5e-3
    del cfg
    return bad


def run_batches(out: Path, repeat: int, only: list[str]) -> None:
    """The BATCHES modules: device time, TFLOP/s over the visible elements,
    and the output against float32 SDPA per sequence (bottom-right causal)."""
    import iree.runtime as rt
    import torch

    import turbine_fmha
    from turbine_fmha.runtime.invoke import Loaded

    session = turbine_fmha.Session("cuda", artifact_dir="/nonexistent-prefill-tiles")
    cfg, dev = session._iree_config(), session.device_of()
    rng = np.random.default_rng(0)
    for tag, (seqs, t, *_) in BATCHES.items():
        path = out / f"{tag}.cuda.vmfb"
        if not path.exists() or (only and tag not in only):
            continue
        args, refs = batch_inputs(seqs, t, batch_npc(seqs), rng)
        dargs = [rt.asdevicearray(dev, x) for x in args]
        loaded = Loaded(
            type("V", (), {"name": NAME})(), rt.VmModule.copy_buffer(cfg.vm_instance, path.read_bytes()), cfg, spin=True
        )
        last = [None]
        for _ in range(3):
            last[0] = loaded.enqueue(dargs)
        last[0].wait()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeat):
                last[0] = loaded.enqueue(dargs)
            last[0].wait()
            times.append((time.perf_counter() - t0) * 1e3 / repeat)
        ms = float(np.median(times))
        got = torch.from_numpy(last[0].results(1)[0].to_host().astype(np.float32)).cuda()
        ref = []
        for q, k, v in refs:
            rows, keys = q.shape[0], k.shape[0]
            qt = torch.from_numpy(q).cuda().float().permute(1, 0, 2)[None]
            kt = torch.from_numpy(k).cuda().float().permute(1, 0, 2).repeat_interleave(G, 0)[None]
            vt = torch.from_numpy(v).cuda().float().permute(1, 0, 2).repeat_interleave(G, 0)[None]
            vis = (
                torch.arange(keys, device="cuda")[None, :] <= (keys - rows + torch.arange(rows, device="cuda"))[:, None]
            )
            ref.append(torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=vis)[0].permute(1, 0, 2))
        ref = torch.cat(ref)
        err = float((got - ref).abs().max() / ref.abs().max())
        print(
            f"prefill_tiles ({tag}): {ms:.3f} ms device (median of 5 rounds x {repeat}), "
            f"{batch_flops(seqs) / (ms * 1e-3) / 1e12:.1f} TFLOP/s visible, max rel err {err:.2e} "
            f"{'ok' if err < 5e-3 else 'FAIL'}",
            flush=True,
        )


def run_static(out: Path, repeat: int, only: list[str]) -> None:
    import iree.runtime as rt

    import turbine_fmha
    from turbine_fmha.runtime.invoke import Loaded

    session = turbine_fmha.Session("cuda", artifact_dir="/nonexistent-prefill-tiles")
    cfg, dev = session._iree_config(), session.device_of()
    rng = np.random.default_rng(0)
    for tag, (e, t, c, lay) in STATIC.items():
        path = out / f"{tag}.cuda.vmfb"
        if not path.exists() or (only and tag not in only):
            continue
        if lay == "roof":
            shapes = [(e * HQ, t, D), (e * HQ, c, D), (e * HQ, c, D)]
        else:
            kv = (e, c, HK, D) if lay == "ours" else (e, HK, c, D)
            shapes = [(e, HK, G, t, D), kv, kv]
        dargs = [rt.asdevicearray(dev, rng.standard_normal(sh, dtype=np.float32).astype(np.float16)) for sh in shapes]
        loaded = Loaded(
            type("V", (), {"name": NAME})(), rt.VmModule.copy_buffer(cfg.vm_instance, path.read_bytes()), cfg, spin=True
        )
        last = [None]
        for _ in range(3):
            last[0] = loaded.enqueue(dargs)
        last[0].wait()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeat):
                last[0] = loaded.enqueue(dargs)
            last[0].wait()
            times.append((time.perf_counter() - t0) * 1e3 / repeat)
        ms = float(np.median(times))
        flops = 4.0 * e * HQ * t * c * D
        print(f"prefill_tiles ({tag}): {ms:.3f} ms device, {flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s", flush=True)


def cpu_time(rows: int, rounds: int) -> None:
    """The tile module (batch_mlir, one causal sequence of `rows`) against
    today's CPU kernels (PagedAttention.run(), planned once, on numpy
    arrays; cpu_cases.checked_run) and torch's SDPA on contiguous K/V, on
    this CPU, rounds interleaved, both outputs checked."""
    import subprocess
    import tempfile

    import iree.runtime as rt
    import torch

    import turbine_fmha
    from benchmarks import cpu_cases
    from turbine_fmha.build import compiler
    from turbine_fmha.build import targets as tg
    from turbine_fmha.runtime.invoke import Loaded

    model = [
        ln for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines() if "Model name" in ln
    ]
    print(
        model[0].strip() if model else "lscpu: no model name", f"| torch threads {torch.get_num_threads()}", flush=True
    )
    seqs, t = [(rows, 0)], 128
    npc = batch_npc(seqs)
    out = Path(tempfile.mkdtemp()) / "tiles.vmfb"
    compiler.compile_one(batch_mlir(seqs, t, npc), NAME, out.resolve(), tg.TARGETS["host"])
    rng = np.random.default_rng(0)
    args, refs = batch_inputs(seqs, t, npc, rng)
    cfg = rt.Config("local-task")
    loaded = Loaded(
        type("V", (), {"name": NAME})(), rt.VmModule.copy_buffer(cfg.vm_instance, out.read_bytes()), cfg, spin=False
    )
    dargs = [rt.asdevicearray(cfg.device, x) for x in args]
    got = np.asarray(loaded.invoke(dargs, 1)[0].to_host(), np.float64)
    ref = batch_reference(refs)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 5e-3
    problem = cpu_cases._case(rng, PAGE, 1, rows, rows)
    ours = cpu_cases.checked_run(turbine_fmha.Session("cpu", compile_missing=True), problem, True, "run()")
    q, k, v = (torch.from_numpy(x.astype(np.float32)).to(torch.float16) for x in refs[0])
    qt, kt, vt = q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    times = cpu_cases.interleaved(
        {"tiles module": lambda: loaded.invoke(dargs, 1), "run()": ours, "torch SDPA (contiguous K/V)": sdpa},
        rounds,
        3,
    )
    flops = batch_flops(seqs)
    for key, ms in times.items():
        print(f"causal prefill {rows}, {key}: {ms:.1f} ms, {flops / (ms * 1e-3) / 1e9:.1f} GFLOP/s visible", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--targets", default="cuda")
    ap.add_argument("--only", default="")
    ap.add_argument("--print", dest="show", default="")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--check-cpu", action="store_true")
    ap.add_argument("--cpu-time", type=int, default=0, metavar="ROWS")
    args = ap.parse_args()
    if args.check_cpu:
        return check_cpu(args.n)
    if args.cpu_time:
        cpu_time(args.cpu_time, 3)
        return 0
    if args.show:
        print(mlir(args.n, *(CONFIGS | PROBES)[args.show]))
    if args.build:
        build(args.build, args.n, args.targets.split(","), [x for x in args.only.split(",") if x])
    if args.run:
        only = [x for x in args.only.split(",") if x]
        run_static(args.run, args.repeat, only)
        run(args.run, args.repeat, only)
        run_batches(args.run, args.repeat, only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
