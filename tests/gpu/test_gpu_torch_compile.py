"""The public functions inside torch.compile(fullgraph=True) with torch CUDA
tensors, routed through torch.ops.turbine_fmha (api/torch_ops.py, which
needs torch alone), against the float64 reference and against the same
call run eagerly, bit for bit (the former probe h200_torch_compile.py,
without its timings): a decode layer (caches as buffers) under inductor
and aot_eager; a varlen prefill+decode batch into a NaN-poisoned out=
(rows that min_seqlen_q skips stay NaN); flash_attn_with_kvcache over paged
caches (causal, ALiBi) and over a non-paged cache (cache_batch_idx, an int
cache_seqlens); a q requiring grad, refused; the in-call append and
reshape_and_cache compiled."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha import flash_attn_with_kvcache
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import HK, HQ, MASK, PAGE, D, check, host, queries, seqstart

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _recording(backend: str, graphs: list):
    from torch._dynamo.backends.registry import lookup_backend

    def compile_fn(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    return compile_fn


def _ops(graphs) -> set:
    return {
        str(n.target)
        for g in graphs
        for n in g.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("turbine_fmha.")
    }


def _paged(gpu, rng, lens_k):
    """Host k, v, table, lengths and the same on the device: pages shuffled
    across sequences, unused table slots -1, spare pages NaN."""
    need = [-(-n // PAGE) for n in lens_k]
    pages = sum(need) + 4
    k = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((pages, PAGE, HK, D), dtype=np.float32).astype(np.float16)
    perm = rng.permutation(pages)
    bt = np.full((len(lens_k), max(need) + 2), -1, np.int32)
    at = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[at : at + n]
        at += n
    k[perm[at:]] = np.nan
    v[perm[at:]] = np.nan
    h = (k, v, bt, np.array(lens_k, np.int32))
    return h, tuple(gpu.tensor(a) for a in h)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_decode_layer(gpu, backend):
    class Decode(torch.nn.Module):
        def __init__(self, k_cache, v_cache):
            super().__init__()
            self.register_buffer("k_cache", k_cache)
            self.register_buffer("v_cache", v_cache)

        def forward(self, q, block_table, seqlen_k):
            out, lse = turbine_fmha.fmha_fwd_paged(
                q,
                self.k_cache,
                self.v_cache,
                block_table,
                seqlen_k,
                causal=True,
                return_lse=True,
                session=gpu.session,
                device=gpu.device,
            )
            return out.float(), lse  # torch work after the op, compiled with it

    rng = np.random.default_rng(0)
    lens = [int(x) for x in rng.integers(1, 600, 8)]
    (k, v, bt, sk), (tk, tv, tbt, tsk) = _paged(gpu, rng, lens)
    layer = Decode(tk, tv)
    graphs = []
    compiled = torch.compile(layer, fullgraph=True, backend=_recording(backend, graphs))
    q = queries(rng, 1, batch=8)
    tq = gpu.tensor(q)
    out, lse = compiled(tq, tbt, tsk)
    want, want_lse = layer(tq, tbt, tsk)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **MASK)
    check(out, ref, "f16", lse, ref_lse)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "compiled differs from eager"
    assert out.device == tq.device
    assert len(graphs) == 1 and _ops(graphs) == {"turbine_fmha.fmha_fwd_paged.default"}, _ops(graphs)


def test_varlen_into_out(gpu):
    rng = np.random.default_rng(1)
    lens_q, lens_k = [37, 1, 20, 1], [300, 900, 77, 17]
    (k, v, bt, sk), (tk, tv, tbt, tsk) = _paged(gpu, rng, lens_k)
    q = queries(rng, sum(lens_q))
    starts = seqstart(lens_q)
    graphs = []

    @torch.compile(fullgraph=True, backend=_recording("inductor", graphs))
    def attend(q, k, v, bt, sk, starts, out):
        return turbine_fmha.fmha_fwd_paged(
            q,
            k,
            v,
            bt,
            sk,
            seqstart_q=starts,
            min_seqlen_q=1,
            out=out,
            window_size=(64, 0),
            return_lse=True,
            session=gpu.session,
            device=gpu.device,
        )

    out = torch.full((sum(lens_q), HQ, D), float("nan"), dtype=torch.float16, device=gpu.torch_device)
    got, lse = attend(gpu.tensor(q), tk, tv, tbt, tsk, gpu.tensor(starts), out)
    ref, ref_lse = fmha_fwd_paged_ref(
        q, k, v, bt, sk, seqstart_q=starts, mask_type="bottom_right", window_size_left=64, window_size_right=0
    )
    kept = np.repeat(np.array(lens_q) > 1, lens_q)  # min_seqlen_q=1 skips the one-row sequences
    assert got is out
    check(host(out)[kept], ref[kept], "f16", host(lse)[:, kept], ref_lse[:, kept])
    assert torch.isnan(out[torch.from_numpy(~kept).to(out.device)]).all(), "skipped rows written"
    assert "turbine_fmha.fmha_fwd_paged_out.default" in _ops(graphs), _ops(graphs)


def test_flash_attn_paged_alibi(gpu):
    rng = np.random.default_rng(2)
    (k, v, bt, sk), (tk, tv, tbt, tsk) = _paged(gpu, rng, [700, 64, 333])
    q = queries(rng, 16, batch=3)
    slopes = (2.0 ** (-8.0 * np.arange(1, HQ + 1) / HQ)).astype(np.float32)

    def flash(q, k, v, bt, sk, slopes):
        return flash_attn_with_kvcache(
            q,
            k,
            v,
            cache_seqlens=sk,
            block_table=bt,
            causal=True,
            alibi_slopes=slopes,
            return_softmax_lse=True,
            session=gpu.session,
            device=gpu.device,
        )

    args = (gpu.tensor(q), tk, tv, tbt, tsk, gpu.tensor(slopes))
    out, lse = torch.compile(flash, fullgraph=True)(*args)
    want, want_lse = flash(*args)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, alibi_slopes=slopes, **MASK)
    check(out, ref, "f16", lse, ref_lse)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "compiled differs from eager"


def test_flash_attn_non_paged(gpu):
    rng = np.random.default_rng(3)
    # 80 rows: viewed as pages of 16 on every target (the largest size dividing it).
    k = rng.standard_normal((6, 80, HK, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((6, 80, HK, D), dtype=np.float32).astype(np.float16)
    q = queries(rng, 1, batch=4)
    rows = np.array([5, 0, 3, 1], np.int32)

    def flash(q, k, v, rows):
        return flash_attn_with_kvcache(
            q, k, v, cache_seqlens=61, cache_batch_idx=rows, causal=True, session=gpu.session, device=gpu.device
        )

    args = tuple(gpu.tensor(a) for a in (q, k, v, rows))
    out = torch.compile(flash, fullgraph=True)(*args)
    ref, _ = fmha_fwd_paged_ref(q, k, v, rows[:, None], np.full(4, 61, np.int32), **MASK)
    check(out, ref)
    assert torch.equal(out, flash(*args)), "compiled differs from eager"


def test_q_requiring_grad_refused(gpu):
    rng = np.random.default_rng(4)
    _, (tk, tv, tbt, tsk) = _paged(gpu, rng, [40, 9])
    q = torch.randn((2, 1, HQ, D), dtype=torch.float16, device=gpu.torch_device, requires_grad=True)
    fn = torch.compile(
        lambda q: turbine_fmha.fmha_fwd_paged(q, tk, tv, tbt, tsk, session=gpu.session, device=gpu.device),
        fullgraph=True,
    )
    # Raised while dynamo traces the call: torch 2.11 and 2.13 report the
    # ValueError as an Unsupported ("Observed exception") carrying its text.
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match="q requires grad"):
        fn(q)


def test_kv_writes_compiled(gpu):
    """In-call appends (flash_attn_with_kvcache with k/v) and
    reshape_and_cache inside torch.compile through their ops: outputs and
    caches equal to the eager calls'."""
    rng = np.random.default_rng(5)
    (k, v, bt, sk), (_, _, tbt, tsk) = _paged(gpu, rng, [40, 9])
    k[np.isnan(k)], v[np.isnan(v)] = 0, 0  # appends read no spare page; keep the comparison exact
    tk, tv = gpu.tensor(k), gpu.tensor(v)
    q = gpu.tensor(queries(rng, 1, batch=2))
    new_k, new_v = (gpu.tensor(rng.standard_normal((2, 1, HK, D), dtype=np.float32).astype(np.float16)) for _ in "kv")
    slots = gpu.tensor(np.array([[bt[0, 2] * PAGE + 9], [bt[1, 0] * PAGE + 12]]))

    def step(q, kc, vc, nk, nv):
        out = flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k=nk,
            v=nv,
            cache_seqlens=tsk,
            block_table=tbt,
            causal=True,
            session=gpu.session,
            device=gpu.device,
        )
        turbine_fmha.reshape_and_cache(
            nk[:, 0], nv[:, 0], kc, vc, slots.reshape(-1), session=gpu.session, device=gpu.device
        )
        return out * 1

    ek, ev = tk.clone(), tv.clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, tk, tv, new_k, new_v)
    want = step(q, ek, ev, new_k, new_v)
    assert torch.equal(got, want), "output differs from eager"
    assert torch.equal(tk, ek) and torch.equal(tv, ev), "caches differ from eager"
