"""reshape_and_cache: K/V rows written in place into the
caller's caches (numpy, torch, IREE DeviceArrays; NHD and HND; every cache
dtype) by the AOT append kernel, vLLM's slot mapping with -1 skipping a
token, and ck_tile appendkv's rotary embedding of the new K rows and of q.
Every check compares with a float64 reference computed here, on fresh
random inputs, with garbage (NaN among it) in the slots nothing writes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from turbine_fmha import reshape_and_cache
from turbine_fmha.api.cache import aligned_zeros
from turbine_fmha.kernels.append_kernel import AppendKernel
from turbine_fmha.kernels.variants import parse_kernel

NP, PG, HK, D, DV = 6, 4, 2, 16, 8


def _dt(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.itemsize}")


def _to_torch(a: np.ndarray) -> torch.Tensor:
    """A fresh torch tensor (torch's own allocation) holding a's values."""
    bits = torch.from_numpy(np.ascontiguousarray(a).view(f"i{a.itemsize}"))
    return torch.empty_like(bits).copy_(bits).view(getattr(torch, a.dtype.name))


def _from_torch(t: torch.Tensor, dt: np.dtype) -> np.ndarray:
    return t.view(getattr(torch, f"int{8 * dt.itemsize}")).numpy().view(dt)


def _garbage(rng, shape, dt) -> np.ndarray:
    """An aligned cache full of random values and NaN: what no write
    touches must keep exactly these bits."""
    c = aligned_zeros(shape, dt)
    c[...] = rng.standard_normal(shape).astype(np.float32).astype(dt)
    c.reshape(-1)[::7] = np.nan
    return c


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    c = aligned_zeros(a.shape, a.dtype)
    c[...] = a
    return c


def _cache_shape(layout: str, d: int) -> tuple:
    return (NP, PG, HK, d) if layout == "NHD" else (NP, HK, PG, d)


def _slots(rng, lead: tuple) -> np.ndarray:
    """Distinct random slots, about a third of them -1 (skipped), the first
    one written."""
    n = int(np.prod(lead))
    slots = rng.permutation(NP * PG)[:n].astype(np.int64)
    slots[1:][rng.random(n - 1) < 0.35] = -1
    return slots.reshape(lead)


def _written(cache: np.ndarray, layout: str, slot: int) -> np.ndarray:
    """The [nhead_k, dim] row a slot names, read independently of the
    kernel's view of the memory."""
    page, row = divmod(int(slot), PG)
    return cache[page, row] if layout == "NHD" else cache[page, :, row]


def _expected(cache: np.ndarray, layout: str, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
    want = cache.copy()
    for t, s in enumerate(slots.reshape(-1)):
        if s >= 0:
            _written(want, layout, s)[...] = rows[t]
    return want


@pytest.mark.parametrize(
    "dtype, layout, kind, form",
    [
        ("float16", "NHD", "numpy", "flat"),
        ("bfloat16", "HND", "torch", "batch"),
        ("float32", "HND", "numpy", "batch"),
        ("bfloat16", "NHD", "torch", "flat"),
        ("float8_e4m3fn", "NHD", "torch", "batch"),
        ("float8_e5m2", "HND", "numpy", "flat"),
        ("float16", "HND", "device", "flat"),
    ],
)
def test_rows_land_in_the_callers_caches(explicit_session, rng, dtype, layout, kind, form):
    import iree.runtime as rt

    dt = _dt(dtype)
    kc0, vc0 = _garbage(rng, _cache_shape(layout, D), dt), _garbage(rng, _cache_shape(layout, DV), dt)
    lead = (7,) if form == "flat" else (2, 3)
    k = rng.standard_normal(lead + (HK, D)).astype(np.float32).astype(dt)
    v = rng.standard_normal(lead + (HK, DV)).astype(np.float32).astype(dt)
    slots = _slots(rng, lead)
    if kind == "numpy":
        kc, vc = _aligned_copy(kc0), _aligned_copy(vc0)
        args = (k, v, kc, vc, slots)
    elif kind == "torch":
        kc, vc = _to_torch(kc0), _to_torch(vc0)
        args = (_to_torch(k), _to_torch(v), kc, vc, torch.from_numpy(slots))
    else:
        kc, vc = (rt.asdevicearray(explicit_session.device_of(), c) for c in (kc0, vc0))
        args = (k, v, kc, vc, slots)
    assert reshape_and_cache(*args, kv_layout=layout, session=explicit_session) is None
    got = {"numpy": lambda c: c, "torch": lambda c: _from_torch(c, dt), "device": lambda c: c.to_host()}[kind]
    flat = slots.reshape(-1)
    np.testing.assert_array_equal(_bits(got(kc)), _bits(_expected(kc0, layout, k.reshape(-1, HK, D), flat)))
    np.testing.assert_array_equal(_bits(got(vc)), _bits(_expected(vc0, layout, v.reshape(-1, HK, DV), flat)))


def _rope(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool):
    """x [rows, heads, dim] rotated in float64 at positions pos, and each
    element's scale |x[d] cos| + |x[partner] sin| (what its error is
    relative to)."""
    x = x.astype(np.float64)
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    rh = cos.shape[1]
    first, second = (slice(0, 2 * rh, 2), slice(1, 2 * rh, 2)) if interleaved else (slice(0, rh), slice(rh, 2 * rh))
    a, b = x[..., first], x[..., second]
    out, scale = x.copy(), np.zeros_like(x)
    out[..., first], out[..., second] = a * c - b * s, b * c + a * s
    scale[..., first], scale[..., second] = np.abs(a * c) + np.abs(b * s), np.abs(b * c) + np.abs(a * s)
    return out, scale


# The kernel widens to f32, computes x*cos -+ x'*sin (two products and a
# sum, each rounded in f32: under 3 x 2^-24 of the scale) and rounds the
# result to the cache dtype once (half an ulp: 2^-11 of |result| <= scale
# for f16, 2^-8 for bf16). The tables are given as f32 (or f16) values and
# the reference uses exactly those, so they add no error.
ROPE_TOL = {"float16": 2.0**-11 + 2.0**-21, "bfloat16": 2.0**-8 + 2.0**-21, "float32": 2.0**-21}


def _check_rotated(got, x, pos, cos, sin, interleaved, dtype, what):
    rd = 2 * cos.shape[1]
    ref, scale = _rope(x, pos, cos, sin, interleaved)
    err = np.abs(got[..., :rd].astype(np.float64) - ref[..., :rd]) - ROPE_TOL[dtype] * scale[..., :rd]
    assert err.max() <= 0, f"{what}: rotated values off by {err.max():.3e} past the bound"
    np.testing.assert_array_equal(_bits(got[..., rd:]), _bits(x[..., rd:]), err_msg=f"{what} past rotary_dim")


@pytest.mark.parametrize(
    "dtype, mode, layout, form, has_mask, tables",
    [
        ("float16", "half", "NHD", "batch", True, "float32"),
        ("bfloat16", "interleaved", "HND", "flat", False, "float32"),
        ("float32", "half", "HND", "flat", True, "float32"),
        ("float16", "interleaved", "NHD", "batch", False, "float16"),
    ],
)
def test_rotary_as_ck_tile_appendkv(explicit_session, rng, dtype, mode, layout, form, has_mask, tables):
    dt, interleaved = _dt(dtype), mode == "interleaved"
    seqlen_k = rng.integers(0, 12, 3)
    if form == "batch":
        lead, q_lead, kw = (3, 3), (3, 2), {}
        seq, idx = np.repeat(np.arange(3), 3), np.tile(np.arange(3), 3)
        q_seq, q_idx = np.repeat(np.arange(3), 2), np.tile(np.arange(2), 3)
    else:
        lead, q_lead = (6,), (5,)
        kw = dict(seqstart=np.array([0, 2, 2, 6]), seqstart_q=np.array([0, 1, 4, 5]))
        seq, idx = np.array([0, 0, 2, 2, 2, 2]), np.array([0, 1, 0, 1, 2, 3])
        q_seq, q_idx = np.array([0, 1, 1, 1, 2]), np.array([0, 0, 1, 2, 0])
    k_pos = seqlen_k[seq] + idx
    q_pos = seqlen_k[q_seq] + (q_idx if has_mask else 0)
    rows = int(max(k_pos.max(), q_pos.max())) + 1  # the tables end at the last position used
    theta = rng.uniform(0, 2 * np.pi, (rows, 6))  # rotary_dim 12 < hdim 16
    cos, sin = np.cos(theta).astype(tables), np.sin(theta).astype(tables)
    kc0, vc0 = _garbage(rng, _cache_shape(layout, D), dt), _garbage(rng, _cache_shape(layout, DV), dt)
    kc, vc = _aligned_copy(kc0), _aligned_copy(vc0)
    k = rng.standard_normal(lead + (HK, D)).astype(dt)
    v = rng.standard_normal(lead + (HK, DV)).astype(dt)
    q = rng.standard_normal(q_lead + (4, D)).astype(dt)
    q_given = q.copy()
    slots = _slots(rng, lead)
    q_out = reshape_and_cache(
        k,
        v,
        kc,
        vc,
        slots,
        kv_layout=layout,
        q=q,
        rotary_cos=cos,
        rotary_sin=sin,
        rotary_dim=12,
        rotary_interleaved=interleaved,
        seqlen_k=seqlen_k.astype(np.int32),
        has_mask=has_mask,
        session=explicit_session,
        **kw,
    )
    flat, k_rows = slots.reshape(-1), k.reshape(-1, HK, D)
    kept = np.flatnonzero(flat >= 0)
    got_k = np.stack([_written(kc, layout, s) for s in flat[kept]])
    _check_rotated(got_k, k_rows[kept], k_pos[kept], cos, sin, interleaved, dtype, "k")
    np.testing.assert_array_equal(_bits(vc), _bits(_expected(vc0, layout, v.reshape(-1, HK, DV), flat)))
    untouched = np.ones(kc.shape, bool)
    for slot in flat[kept]:
        _written(untouched, layout, slot)[...] = False
    np.testing.assert_array_equal(_bits(kc)[untouched], _bits(kc0)[untouched])
    assert isinstance(q_out, np.ndarray) and q_out.shape == q.shape and q_out.dtype == dt
    _check_rotated(q_out.reshape(-1, 4, D), q.reshape(-1, 4, D), q_pos, cos, sin, interleaved, dtype, "q")
    np.testing.assert_array_equal(_bits(q), _bits(q_given))  # q itself is left as it was


def test_rotary_of_q_alone_and_torch_q(explicit_session, rng):
    """Every token skipped (-1) writes nothing but still rotates q, and a
    torch q comes back as a torch tensor."""
    kc0 = _garbage(rng, _cache_shape("NHD", D), np.float16)
    vc0 = _garbage(rng, _cache_shape("NHD", DV), np.float16)
    kc, vc = _to_torch(kc0), _to_torch(vc0)
    theta = rng.uniform(0, 2 * np.pi, (9, 8))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    q = rng.standard_normal((2, 1, 4, D)).astype(np.float16)
    k = rng.standard_normal((2, 1, HK, D)).astype(np.float16)
    v = rng.standard_normal((2, 1, HK, DV)).astype(np.float16)
    out = reshape_and_cache(
        _to_torch(k),
        _to_torch(v),
        kc,
        vc,
        torch.full((2, 1), -1),
        q=_to_torch(q),
        rotary_cos=torch.from_numpy(cos),
        rotary_sin=torch.from_numpy(sin),
        seqlen_k=torch.tensor([8, 3]),
        session=explicit_session,
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and tuple(out.shape) == q.shape
    _check_rotated(out.numpy().reshape(2, 4, D), q.reshape(2, 4, D), np.array([8, 3]), cos, sin, False, "float16", "q")
    np.testing.assert_array_equal(_bits(_from_torch(kc, np.dtype(np.float16))), _bits(kc0))
    np.testing.assert_array_equal(_bits(_from_torch(vc, np.dtype(np.float16))), _bits(vc0))


def test_invalid_writes_change_nothing(explicit_session, rng):
    """Each invalid argument is refused by name before anything is
    written; the caches keep every bit."""
    kc, vc = _garbage(rng, (NP, PG, HK, D), np.float16), _garbage(rng, (NP, PG, HK, DV), np.float16)
    before = _bits(kc).copy(), _bits(vc).copy()
    k = rng.standard_normal((3, HK, D)).astype(np.float16)
    v = rng.standard_normal((3, HK, DV)).astype(np.float16)
    slots = np.array([0, 5, -1])
    cos = sin = np.ones((8, 4), np.float32)
    rot = dict(rotary_cos=cos, rotary_sin=sin, seqlen_k=np.array([1]), seqstart=np.array([0, 3]))
    unaligned = np.empty(kc.nbytes + 2, np.uint8)[2:].view(np.float16).reshape(kc.shape)
    readonly = kc.copy()
    readonly.flags.writeable = False
    e4m3 = aligned_zeros(kc.shape, ml_dtypes.float8_e4m3fn), aligned_zeros(vc.shape, ml_dtypes.float8_e4m3fn)
    cases = [
        (TypeError, "^k has dtype float32", dict(k=k.astype(np.float32))),
        (TypeError, "^v has dtype bfloat16", dict(v=_to_torch(v.astype(ml_dtypes.bfloat16)))),
        (TypeError, "^k has dtype float16", dict(k_cache=e4m3[0], v_cache=e4m3[1])),
        (ValueError, "^v must have shape", dict(v=v[:, :, :4])),
        (ValueError, "^slot_mapping must have shape", dict(slot_mapping=slots[:2])),
        (ValueError, r"^slot_mapping\[1\] = 24 is neither", dict(slot_mapping=np.array([0, NP * PG, 1]))),
        (ValueError, r"^slot_mapping\[2\] = -2", dict(slot_mapping=np.array([0, 1, -2]))),
        # Unsigned slots are checked as given: 2**64 - 1 is no -1 (skip).
        (
            ValueError,
            r"^slot_mapping\[1\] = 18446744073709551615 is out of range",
            dict(slot_mapping=np.array([0, 2**64 - 1, 1], np.uint64)),
        ),
        (ValueError, r"^slot_mapping\[0\] = 24 is neither", dict(slot_mapping=np.array([NP * PG, 0, 1], np.uint64))),
        (
            ValueError,
            r"^slot_mapping\[2\] = 4294967295 is neither",
            dict(slot_mapping=np.array([0, 1, 2**32 - 1], np.uint32)),
        ),
        (ValueError, "^slot_mapping writes slot 5 twice", dict(slot_mapping=np.array([5, -1, 5]))),
        (TypeError, "^slot_mapping must be an integer", dict(slot_mapping=slots.astype(np.float32))),
        (ValueError, "^kv_layout", dict(kv_layout="NDH")),
        (ValueError, "^k_cache must be writeable, C-contiguous and 64-byte aligned", dict(k_cache=unaligned)),
        # A CPU torch view at an offset is not 64-byte aligned either.
        (
            ValueError,
            "^v_cache must be writeable, C-contiguous and 64-byte aligned",
            dict(v_cache=torch.from_numpy(np.empty(vc.size + 1, np.float16)[1:].reshape(vc.shape))),
        ),
        (ValueError, "^k_cache must be writeable", dict(k_cache=readonly)),
        (ValueError, "^v_cache must match", dict(v_cache=aligned_zeros((NP, PG, HK + 1, DV), np.float16))),
        (ValueError, "^k_cache overlaps k ", dict(k=kc[0, :3])),
        (ValueError, "^k_cache overlaps v_cache", dict(v_cache=kc, v=k)),
        (ValueError, "^rotary_sin is missing", dict(rotary_cos=cos, seqlen_k=np.array([1]))),
        (
            ValueError,
            "^rotary_cos: the rotary embedding needs",
            dict(rot, k_cache=e4m3[0], v_cache=e4m3[1], k=k.astype(e4m3[0].dtype), v=v.astype(e4m3[0].dtype)),
        ),
        (ValueError, "^rotary_dim = 6, but", dict(rot, rotary_dim=6)),
        (
            ValueError,
            "^rotary_dim = 32",
            dict(rot, rotary_cos=np.ones((8, 16), np.float32), rotary_sin=np.ones((8, 16), np.float32)),
        ),
        (TypeError, "^rotary_sin must be float16", dict(rot, rotary_sin=sin.astype(np.float64))),
        (ValueError, "^rotary_cos has 8 rows", dict(rot, seqlen_k=np.array([7]))),  # token 1 at 8
        (ValueError, "^seqlen_k is needed", dict(rot, seqlen_k=None)),
        (ValueError, "^seqlen_k must hold 1", dict(rot, seqlen_k=np.array([1, 2]))),
        (ValueError, r"^seqstart \[batch \+ 1\] is needed", dict(rot, seqstart=None)),
        (ValueError, "^seqstart must start at 0", dict(rot, seqstart=np.array([0, 2]))),
        (ValueError, "^q is used only by the rotary", dict(q=k)),
        (TypeError, "^q has dtype float32", dict(rot, q=k.astype(np.float32))),
        (TypeError, "^has_mask must be a bool", dict(rot, has_mask=1)),
    ]
    for error, match, change in cases:
        args = dict(k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots) | change
        with pytest.raises(error, match=match):
            reshape_and_cache(session=explicit_session, **args)
        np.testing.assert_array_equal(_bits(kc), before[0], err_msg=match)
        np.testing.assert_array_equal(_bits(vc), before[1], err_msg=match)


def test_rotary_append_kernels_are_named_variants():
    for mode, tag in (("interleaved", "_ropei"), ("half", "_ropeh")):
        a = AppendKernel("bf16", 1, 128, 128, 16, mode)
        assert a.name == f"pagedkv_append_bf16_h1_d128x128_pg16{tag}"
        assert parse_kernel(a.name) == a
    assert parse_kernel("pagedkv_append_f16_h8_d64x64_pg16").rotary == "none"
    with pytest.raises(ValueError, match="rotary embedding needs"):
        AppendKernel("i8", 8, 128, 128, 16, "half")


def test_rotated_q_outlives_later_calls(explicit_session, rng):
    """The rotated q a call returns keeps its values while later calls run
    (it was a view of a result buffer that the next call reused), numpy and
    torch alike."""
    kc, vc = _garbage(rng, (NP, PG, HK, D), np.float16), _garbage(rng, (NP, PG, HK, D), np.float16)
    k = rng.standard_normal((2, HK, D)).astype(np.float16)
    theta = rng.uniform(0, 2 * np.pi, (8, 4))
    rot = dict(
        rotary_cos=np.cos(theta).astype(np.float32),
        rotary_sin=np.sin(theta).astype(np.float32),
        seqlen_k=np.array([1]),
        seqstart=np.array([0, 2]),
    )
    kept = []
    for kind in ("numpy", "torch", "numpy", "torch"):
        q = rng.standard_normal((2, 4, D)).astype(np.float16)
        arg = q if kind == "numpy" else torch.from_numpy(q)
        out = reshape_and_cache(k, k, kc, vc, np.array([0, 5]), q=arg, session=explicit_session, **rot)
        kept.append((out, _host(out).copy()))
    for out, snapshot in kept:
        np.testing.assert_array_equal(_host(out).view(np.uint16), snapshot.view(np.uint16))


def _host(a):
    return a.numpy() if isinstance(a, torch.Tensor) else a
