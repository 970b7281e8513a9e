"""KV writes into torch CUDA caches, checked on the host afterwards
(the former probe h200_kv_write.py):

- reshape_and_cache, NHD and HND caches, f16 and bf16, shuffled slots with
  -1 (skipped) tokens: the written rows equal k/v bit for bit and every
  other row is unchanged;
- the same with rotary embedding of K (half-rotated and interleaved) at
  positions seqlen_k + i, against a float64 rotation; and of q in the call
  that writes its keys (q alone is refused by a GPU session);
- PagedKVCache.append from torch CUDA tensors into a device pool without a
  host mirror (NHD and HND pages), then attention on it against the
  float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import HK, PAGE, ROPE_TOL, D, check, host

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

PAGES, TOKENS = 64, 40
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def _rope(x, pos, cos, sin, interleaved):
    """x rotated at positions pos, in float64."""
    x = x.astype(np.float64)
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    rh = cos.shape[1]
    first, second = (slice(0, 2 * rh, 2), slice(1, 2 * rh, 2)) if interleaved else (slice(0, rh), slice(rh, 2 * rh))
    a, b = x[..., first], x[..., second]
    out = x.copy()
    out[..., first], out[..., second] = a * c - b * s, b * c + a * s
    return out


def _rows(cache, layout, slots):
    """[tokens, heads, dim] rows of a cache at the slots."""
    p, r = slots // PAGE, slots % PAGE
    return cache[p, r] if layout == "NHD" else cache[p, :, r]


def _tables(n):
    ang = np.arange(n)[:, None] * (1e-2 * np.arange(1, D // 2 + 1))[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("rotary", [None, "half", "interleaved"], ids=["plain", "rope-half", "rope-interleaved"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_reshape_and_cache(gpu, dtype, layout, rotary):
    dt, dev = DTYPES[dtype], gpu.torch_device
    g = torch.Generator().manual_seed(1)
    shape = (PAGES, PAGE, HK, D) if layout == "NHD" else (PAGES, HK, PAGE, D)
    kc, vc = (torch.randn(shape, generator=g).to(dt).to(dev) for _ in range(2))
    before = kc.cpu(), vc.cpu()
    k, v = (torch.randn((TOKENS, HK, D), generator=g).to(dt).to(dev) for _ in range(2))
    slots = torch.randperm(PAGES * PAGE, generator=g)[:TOKENS]
    slots[::7] = -1
    kw = {}
    seqlen_k = np.array([5], np.int32)
    if rotary:
        cos, sin = _tables(256)
        kw = dict(
            rotary_cos=cos,
            rotary_sin=sin,
            rotary_interleaved=rotary == "interleaved",
            seqlen_k=seqlen_k,
            seqstart=np.array([0, TOKENS], np.int32),  # flat rows: one sequence
        )
    turbine_fmha.reshape_and_cache(k, v, kc, vc, slots.to(dev), kv_layout=layout, session=gpu.session, **kw)
    gpu.sync()
    keep = slots >= 0
    s = slots[keep].numpy()
    got_k, got_v = _rows(kc.cpu(), layout, s), _rows(vc.cpu(), layout, s)
    assert torch.equal(got_v, v.cpu()[keep]), "V rows"
    if rotary:
        pos = (seqlen_k[0] + np.arange(TOKENS))[keep.numpy()]
        want = _rope(k.cpu()[keep].float().numpy(), pos, cos, sin, rotary == "interleaved")
        err = float(np.abs(host(got_k) - want).max() / np.abs(want).max())
        assert err <= ROPE_TOL[dtype], f"rotated K rows: rel err {err:.2e}"
    else:
        assert torch.equal(got_k, k.cpu()[keep]), "K rows"
    untouched = np.ones(PAGES * PAGE, bool)
    untouched[s] = False
    u = np.nonzero(untouched)[0]
    assert torch.equal(_rows(kc.cpu(), layout, u), _rows(before[0], layout, u)), "K rows not written changed"
    assert torch.equal(_rows(vc.cpu(), layout, u), _rows(before[1], layout, u)), "V rows not written changed"


def test_rotary_q_with_its_keys(gpu):
    """q rotated in the call that writes its keys (positions seqlen_k on);
    then q alone, which a GPU session refuses by name, after which the
    device still serves a write."""
    dev = gpu.torch_device
    g = torch.Generator().manual_seed(3)
    kc, vc = (torch.zeros((PAGES, PAGE, HK, D), dtype=torch.float16, device=dev) for _ in range(2))
    k, v = (torch.randn((1, 4, HK, D), generator=g).half().to(dev) for _ in range(2))
    q = torch.randn((1, 4, 32, D), generator=g).half().to(dev)
    cos, sin = _tables(64)
    rot = dict(rotary_cos=cos, rotary_sin=sin, seqlen_k=np.array([7], np.int32), session=gpu.session)
    q_out = turbine_fmha.reshape_and_cache(k, v, kc, vc, torch.arange(4, device=dev)[None], q=q, **rot)
    want = _rope(q.cpu()[0].float().numpy(), np.full(4, 7), cos, sin, False)
    err = float(np.abs(host(q_out)[0] - want).max() / np.abs(want).max())
    assert err <= ROPE_TOL["f16"], f"rotated q: rel err {err:.2e}"
    if not gpu.dry_run:
        with pytest.raises(NotImplementedError):
            turbine_fmha.reshape_and_cache(
                k[:, :0], v[:, :0], kc, vc, torch.zeros((1, 0), dtype=torch.int64, device=dev), q=q, **rot
            )
    slots = torch.arange(8, 12, device=dev)[None]
    turbine_fmha.reshape_and_cache(k, v, kc, vc, slots, session=gpu.session)
    gpu.sync()
    assert torch.equal(vc[0, 8:12].cpu(), v[0].cpu()), "the write after the refusal"


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_paged_kv_cache_append_from_torch(gpu, kv_layout):
    dev = gpu.torch_device
    g = torch.Generator().manual_seed(2)
    cache = turbine_fmha.PagedKVCache(
        PAGES, PAGE, HK, D, "f16", session=gpu.session, host_mirror=False, kv_layout=kv_layout
    )
    seqs, ks, vs = [cache.allocate(), cache.allocate()], [], []
    for n, seq in zip((37, 70), seqs):
        k, v = (torch.randn((n, HK, D), generator=g).half() for _ in range(2))
        cache.append(seq, k.to(dev), v.to(dev))
        ks.append(k.numpy())
        vs.append(v.numpy())
    q = torch.randn((2, 1, 32, D), generator=g).half()
    out = host(cache.attend(q.to(dev) if not gpu.dry_run else q.numpy(), seqs))
    for i in range(2):
        n = ks[i].shape[0]
        pages = -(-n // PAGE)
        kp = np.zeros((pages * PAGE, HK, D), np.float16)
        vp = np.zeros_like(kp)
        kp[:n], vp[:n] = ks[i], vs[i]
        ref, _ = fmha_fwd_paged_ref(
            q.numpy()[i : i + 1],
            kp.reshape(pages, PAGE, HK, D),
            vp.reshape(pages, PAGE, HK, D),
            np.arange(pages, dtype=np.int32)[None],
            np.array([n], np.int32),
        )
        check(out[i : i + 1], ref, what=f"sequence {i}")
