"""The attention as a user calls it on the GPU, every output against
float32 torch SDPA of the same inputs (no timing): benchmarks/as_called.py's
rows (its default CUDA shapes and the sliding windows), the mixed
continuous-batching step of benchmarks/mixed_step.py, and long decodes at
each merged split count (benchmarks/probes/h200_split_count.py). Each row
runs three ways: run() of a plan made with kv_rows_finite=True, run() of
the default plan (its stale-row check), and the one-shot fmha_fwd_paged.

torch CUDA tensors throughout (q and the caches on the GPU, the tables as
host int32); fp16, head dim 128, pages of 16. The CPU dry run takes
smaller shapes of the same kinds (the second spec of each row)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import turbine_fmha

from .conftest import OUT_TOL, PAGE, D, rel_err

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


@dataclasses.dataclass(frozen=True)
class Row:
    """as_called.py's spec KIND:BxN[+C][:HQ/HK][:HND][:W<left>]: decode (B
    sequences, N keys), prefill (B x N rows, causal) or chunked (B x N new
    rows over C cached keys, causal)."""

    kind: str
    batch: int
    rows: int
    cached: int = 0
    hq: int = 32
    hk: int = 8
    layout: str = "NHD"
    window: int = -1

    @classmethod
    def parse(cls, spec: str) -> Row:
        kind, size, *rest = spec.split(":")
        m = re.fullmatch(r"(\d+)x(\d+)(?:\+(\d+))?", size)
        kw = dict(kind=kind, batch=int(m[1]), rows=int(m[2]), cached=int(m[3] or 0))
        for part in rest:
            if part == "HND":
                kw["layout"] = "HND"
            elif part.startswith("W"):
                kw["window"] = int(part[1:])
            else:
                kw["hq"], kw["hk"] = (int(x) for x in part.split("/"))
        return cls(**kw)

    @property
    def seqlen_q(self) -> int:
        return 1 if self.kind == "decode" else self.rows

    @property
    def keys(self) -> int:
        return self.rows + self.cached

    @property
    def causal(self) -> bool:
        return self.kind != "decode" or self.window >= 0


# (GPU spec, CPU dry-run spec): as_called.py's default CUDA rows, then the
# windowed rows of benchmarks/probes/h200_verify.sh.
ROWS = [
    ("decode:32x4096", "decode:8x1024"),
    ("decode:4x32768", "decode:2x8192"),
    ("decode:1x32768", "decode:1x8192"),
    ("prefill:1x4096", "prefill:1x2048"),
    ("prefill:4x1024", "prefill:2x512"),
    ("chunked:4x512+8192", "chunked:2x256+1024"),
    ("decode:32x4096:28/4:HND", "decode:8x1024:28/4:HND"),
    ("prefill:1x2048:28/4:HND", "prefill:1x512:28/4:HND"),
    ("prefill:1x4096:W1024", "prefill:1x2048:W512"),
    ("chunked:4x512+8192:W2048", "chunked:2x256+1024:W256"),
    ("decode:32x4096:W1024", "decode:8x1024:W256"),
    ("decode:1x32768:W4096", "decode:1x8192:W1024"),
]


def make(gpu, seed, lens_k, rows, hq=32, hk=8, layout="NHD", varlen=False):
    """q (torch, the tests' device), caches (torch), table and lengths
    (numpy): pages shuffled, one spare page of NaN. rows: per sequence, or
    a list (varlen q, [total, hq, D])."""
    g = torch.Generator(device=gpu.torch_device).manual_seed(seed)
    used = [-(-n // PAGE) for n in lens_k]
    pages = sum(used) + 1
    shape = (pages, PAGE, hk, D) if layout == "NHD" else (pages, hk, PAGE, D)
    k, v = (torch.randn(shape, generator=g, device=gpu.torch_device, dtype=torch.float16) for _ in range(2))
    perm = np.random.default_rng(seed).permutation(pages)
    bt = np.full((len(lens_k), max(used)), -1, np.int32)
    at = 0
    for b, n in enumerate(used):
        bt[b, :n] = perm[at : at + n]
        at += n
    k[int(perm[at])], v[int(perm[at])] = float("nan"), float("nan")
    qshape = (sum(rows), hq, D) if varlen else (len(lens_k), rows, hq, D)
    q = torch.randn(qshape, generator=g, device=gpu.torch_device, dtype=torch.float16)
    return q, k, v, bt, np.array(lens_k, np.int32)


def sdpa(q, k, v, bt, sk, *, causal, window=-1, layout="NHD", starts=None, block=512):
    """float32 torch SDPA of the paged problem on q's device, each sequence
    on its own gathered keys, query rows in blocks (bounded memory), GQA by
    repeat_interleave, an explicit boolean mask: a key j is visible to row i
    of a sequence of n keys and r rows where j <= i + n - r (causal, the
    bottom-right diagonal) and j >= i + n - r - window (a window's left
    side). Returns q's shape, float32."""
    import torch.nn.functional as F

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    hq = q.shape[-2]
    for b, n in enumerate(int(x) for x in sk):
        ids = torch.as_tensor(bt[b, : -(-n // PAGE)], device=q.device).long()
        kk, vv = (c[ids] for c in (k, v))
        if layout == "HND":
            kk, vv = (x.transpose(1, 2) for x in (kk, vv))
        kk, vv = (x.reshape(-1, *x.shape[2:])[:n].float().transpose(0, 1) for x in (kk, vv))
        kk, vv = (x.repeat_interleave(hq // x.shape[0], 0) for x in (kk, vv))
        qb = q[b] if starts is None else q[int(starts[b]) : int(starts[b + 1])]
        r = qb.shape[0]
        for r0 in range(0, r, block):
            qr = qb[r0 : r0 + block].float().transpose(0, 1)
            i = torch.arange(r0, r0 + qr.shape[1], device=q.device)[:, None] + (n - r)
            j = torch.arange(n, device=q.device)[None, :]
            mask = None
            if causal:
                mask = j <= i
                if window >= 0:
                    mask &= j >= i - window
            o = F.scaled_dot_product_attention(qr[None], kk[None], vv[None], attn_mask=mask)[0]
            dst = out[b] if starts is None else out[int(starts[b]) : int(starts[b + 1])]
            dst[r0 : r0 + qr.shape[1]] = o.transpose(0, 1)
    return out


def plan(gpu, bt, sk, k, row: Row, **kw):
    return turbine_fmha.PagedAttention(gpu.session).plan(
        bt,
        sk,
        num_pages=k.shape[0],
        page_block_size=PAGE,
        nhead_q=row.hq,
        nhead_k=row.hk,
        hdim=D,
        dtype="f16",
        kv_layout=row.layout,
        causal=row.causal,
        window_size=(row.window, 0) if row.window >= 0 else None,
        **kw,
    )


@pytest.mark.parametrize("specs", ROWS, ids=[gpu_spec for gpu_spec, _ in ROWS])
def test_row_as_called(gpu, specs):
    row = Row.parse(specs[gpu.dry_run])
    q, k, v, bt, sk = make(gpu, 1, [row.keys] * row.batch, row.seqlen_q, row.hq, row.hk, row.layout)
    ref = sdpa(q, k, v, bt, sk, causal=row.causal, window=row.window, layout=row.layout)
    calls = {
        "run(finite)": lambda: plan(gpu, bt, sk, k, row, seqlen_q=row.seqlen_q, kv_rows_finite=True).run(q, k, v),
        "run()": lambda: plan(gpu, bt, sk, k, row, seqlen_q=row.seqlen_q).run(q, k, v),
        "one-shot": lambda: turbine_fmha.fmha_fwd_paged(
            q,
            k,
            v,
            bt,
            sk,
            causal=row.causal,
            window_size=(row.window, 0) if row.window >= 0 else None,
            kv_layout=row.layout,
            session=gpu.session,
            device=gpu.device,
        ),
    }
    errs = {}
    for name, call in calls.items():
        out = call()
        assert isinstance(out, torch.Tensor) and str(out.device) == gpu.torch_device, name
        assert out.shape == q.shape and out.dtype == torch.float16, name
        errs[name] = rel_err(out, ref.cpu().numpy())
    assert all(e <= OUT_TOL["f16"] for e in errs.values()), f"rel errs against float32 SDPA: {errs}"


# benchmarks/mixed_step.py's CUDA step (decodes BxN, prefills PxR+C), and
# the dry run's.
MIXED = {False: ((32, 4096), (4, 512, 8192)), True: ((4, 256), (2, 64, 256))}


def test_mixed_step(gpu):
    """Decodes and chunked prefills in one varlen call (decodes first in q,
    as vLLM orders them), planned once and one-shot, against SDPA."""
    (b, n), (p, r, c) = MIXED[gpu.dry_run]
    rows = [1] * b + [r] * p
    q, k, v, bt, sk = make(gpu, 2, [n] * b + [r + c] * p, rows, varlen=True)
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    ref = sdpa(q, k, v, bt, sk, causal=True, starts=starts).cpu().numpy()
    attn = turbine_fmha.PagedAttention(gpu.session).plan(
        bt,
        sk,
        num_pages=k.shape[0],
        page_block_size=PAGE,
        nhead_q=32,
        nhead_k=8,
        hdim=D,
        dtype="f16",
        seqstart_q=starts,
        causal=True,
        kv_rows_finite=True,
    )
    planned = attn.run(q, k, v)
    one_shot = turbine_fmha.fmha_fwd_paged(
        q, k, v, bt, sk, seqstart_q=starts, causal=True, session=gpu.session, device=gpu.device
    )
    errs = {"planned": rel_err(planned, ref), "one-shot": rel_err(one_shot, ref)}
    assert all(e <= OUT_TOL["f16"] for e in errs.values()), f"rel errs against float32 SDPA: {errs}"


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_split_counts(gpu, batch):
    """Long decodes split in 16-128 parts (merged in the module where a
    variant merges that count, else on the device), against SDPA."""
    keys = 8192 if gpu.dry_run else 32768
    q, k, v, bt, sk = make(gpu, 3 + batch, [keys] * batch, 1)
    ref = sdpa(q, k, v, bt, sk, causal=False).cpu().numpy()
    errs = {}
    for n in (16, 32, 64, 128):
        row = Row("decode", batch, keys)
        out = plan(gpu, bt, sk, k, row, kv_rows_finite=True, num_splits=n).run(q, k, v)
        errs[n] = rel_err(out, ref)
    assert all(e <= OUT_TOL["f16"] for e in errs.values()), f"rel errs by split count: {errs}"
