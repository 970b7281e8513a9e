"""Kernel-call planning: one validated batch-mode call -> kernel calls.

Explicit (CPU) variants chunk query rows to bound the materialized score
tile; static (online) variants pad the batch and the query rows up to the
variant's tiles. The caches are not part of the plan: they are passed as is.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .variants import Variant

# The explicit (CPU) kernel materializes [batch, heads, rows, keys] f32 scores
# plus probabilities; query rows are chunked to keep that under this size.
SCORE_BYTES_BUDGET = 256 << 20


@dataclasses.dataclass
class KernelCall:
    """One validated call, in the form the kernels take."""

    q: np.ndarray  # [batch, rows, nhead_q, hdim_q]
    block_table: np.ndarray  # [batch, width] int32
    seqlen_q: np.ndarray  # [batch] int32, query rows of each sequence (<= rows)
    seqlen_k: np.ndarray  # [batch] int32
    kv_shift: np.ndarray  # [batch] int32, key t is gathered row kv_shift + t
    scale: float  # scale_s: softmax scale times the fp8 descales of Q and K
    softcap: float
    scale_o: float  # output multiplier: fp8 V descale; static quant: ck's scale_o
    scale_p: float  # static quant: probabilities are quantized as fp8(p * scale_p)
    left: int
    right: int
    sink_size: int
    alibi_slopes: np.ndarray | None
    bias: np.ndarray | None
    sinks: np.ndarray | None


def plan_calls(variant: Variant, c: KernelCall):
    """Splits one validated call into kernel calls.

    Yields (args, place): args are the kernel arguments without the caches
    (q, block_table, seqlen_q, seqlen_k, kv_shift, fparams, iparams, then
    alibi_slopes / bias / sinks where the variant has them), and place(out, lse, o, l) copies a
    call's results into the full outputs. Explicit variants chunk query rows
    to bound the score tile; static (online) variants pad the batch (seqlen_k
    0, page 0) and query rows (zeros; their outputs are dropped) up to the
    variant's tiles.
    """
    q, bt, sq, sk, ks = c.q, c.block_table, c.seqlen_q, c.seqlen_k, c.kv_shift
    batch, rows = q.shape[0], q.shape[1]
    nk = bt.shape[1] * variant.page_block_size
    fparams = np.array([c.scale, c.softcap, c.scale_o, c.scale_p], np.float32)
    bias = c.bias
    if bias is not None and bias.shape[3] != nk:
        # The kernel reads keys up to the table width; keys past seqlen_k are
        # masked, so the padding value does not matter.
        padded = np.zeros(bias.shape[:3] + (nk,), np.float32)
        n = min(nk, bias.shape[3])
        padded[..., :n] = bias[..., :n]
        bias = padded

    def iparams(s):
        return np.array([s, c.left, c.right, c.sink_size], np.int32)

    def extras(b0, b1, s, e, bt_pad=None, mq=None):
        out = []
        if c.alibi_slopes is not None:
            a = c.alibi_slopes[b0:b1]
            if bt_pad:
                a = _pad_rows(a, bt_pad)
            out.append(np.ascontiguousarray(a))
        if bias is not None:
            bb = bias[b0:b1] if bias.shape[0] != 1 else bias
            bb = bb[:, :, s:e]
            if bt_pad:
                if bias.shape[0] != 1:
                    bb = _pad_rows(bb, bt_pad)
                bb = _pad_axis(bb, 2, mq)
            out.append(np.ascontiguousarray(bb))
        if c.sinks is not None:
            out.append(c.sinks)
        return out

    if variant.formulation == "explicit":
        # f32 scores plus probabilities in q's type (f16 for fp8 q).
        per_row = batch * q.shape[2] * nk * (4 + max(2, q.itemsize))
        chunk = max(1, SCORE_BYTES_BUDGET // max(1, per_row))
        for s in range(0, rows, chunk):
            e = min(rows, s + chunk)

            def place(out, lse, o, l, s=s, e=e):
                out[:, s:e] = o
                lse[:, :, s:e] = l

            args = [np.ascontiguousarray(q[:, s:e]), bt, sq, sk, ks, fparams, iparams(s)]
            yield args + extras(0, batch, s, e), place
        return
    bt_t, mq = variant.batch_tile, variant.seqlen_q_tile
    for b0 in range(0, batch, bt_t):
        b1 = min(batch, b0 + bt_t)
        nb = b1 - b0
        bt_pad = _pad_rows(bt[b0:b1], bt_t)
        sq_pad = _pad_rows(sq[b0:b1], bt_t)
        sk_pad = _pad_rows(sk[b0:b1], bt_t)
        ks_pad = _pad_rows(ks[b0:b1], bt_t)
        for s in range(0, rows, mq):
            e = min(rows, s + mq)
            q_pad = _pad_axis(_pad_rows(q[b0:b1, s:e], bt_t), 1, mq)

            def place(out, lse, o, l, b0=b0, b1=b1, nb=nb, s=s, e=e):
                out[b0:b1, s:e] = o[:nb, : e - s]
                lse[b0:b1, :, s:e] = l[:nb, :, : e - s]

            args = [q_pad, bt_pad, sq_pad, sk_pad, ks_pad, fparams, iparams(s)]
            yield args + extras(b0, b1, s, e, bt_t, mq), place


def _pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    return _pad_axis(a, 0, n)


def _pad_axis(a: np.ndarray, axis: int, n: int) -> np.ndarray:
    if a.shape[axis] == n:
        return np.ascontiguousarray(a)
    shape = list(a.shape)
    shape[axis] = n
    out = np.zeros(shape, a.dtype)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(0, a.shape[axis])
    out[tuple(idx)] = a
    return out
