"""PagedKVCache: allocation, appends across page boundaries,
fork with copy-on-write of a shared last page, free and reuse, running out
of pages without corrupting anything, concurrent appends, and attention
over the cache's block tables against the float64 reference. Every check
compares with an independent record of what each sequence was given."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_modes import _check
from tolerances import OUT_TOL

import turbine_fmha
from turbine_fmha.api.cache import CacheFullError, PagedKVCache
from turbine_fmha.testing.reference import fmha_fwd_paged_ref

HK, D = 2, 16


def _tokens(rng, n):
    return (rng.standard_normal((n, HK, D)).astype(np.float32), rng.standard_normal((n, HK, D)).astype(np.float32))


def _assert_holds(cache, seq, record):
    k, v = cache.gather(seq)
    want_k = np.concatenate([r[0] for r in record]) if record else np.zeros((0, HK, D), np.float32)
    want_v = np.concatenate([r[1] for r in record]) if record else np.zeros((0, HK, D), np.float32)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    assert cache.seqlen(seq) == len(want_k)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_append_across_pages_and_free(rng, kv_layout):
    cache = PagedKVCache(16, 8, HK, D, "f32", kv_layout=kv_layout)
    a, b = cache.allocate(), cache.allocate()
    rec = {a: [], b: []}
    for seq, n in ((a, 5), (b, 8), (a, 20), (b, 1), (a, 0), (a, 7)):
        t = _tokens(rng, n)
        cache.append(seq, *t)
        rec[seq].append(t)
    for s in (a, b):
        _assert_holds(cache, s, rec[s])
    assert len(cache.pages(a)) == 4 and len(cache.pages(b)) == 2  # 32 and 9 tokens
    assert cache.num_free_pages == 10
    assert not set(cache.pages(a)) & set(cache.pages(b))
    cache.free(a)
    assert cache.num_free_pages == 14
    c = cache.allocate()
    t = _tokens(rng, 30)
    cache.append(c, *t)  # reuses a's pages
    _assert_holds(cache, c, [t])
    _assert_holds(cache, b, rec[b])
    with pytest.raises(KeyError, match="no sequence"):
        cache.append(a, *_tokens(rng, 1))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("parent_len", [10, 16])
def test_fork_copies_a_shared_last_page_on_write(rng, parent_len, kv_layout):
    cache = PagedKVCache(12, 8, HK, D, "f32", kv_layout=kv_layout)
    p = cache.allocate()
    prefix = _tokens(rng, parent_len)
    cache.append(p, *prefix)
    c = cache.fork(p)
    assert cache.pages(c) == cache.pages(p)
    free0 = cache.num_free_pages
    tail_c, tail_p = _tokens(rng, 3), _tokens(rng, 4)
    cache.append(c, *tail_c)
    cache.append(p, *tail_p)
    _assert_holds(cache, c, [prefix, tail_c])
    _assert_holds(cache, p, [prefix, tail_p])
    pc, pp = cache.pages(c), cache.pages(p)
    assert pc[0] == pp[0]  # the full first page stays shared
    if parent_len % 8:
        # A partly filled shared page was copied by the first writer; the
        # second then owned the original alone and wrote in place.
        assert pc[1] != pp[1] and cache.num_free_pages == free0 - 1
    else:
        assert pc[2] != pp[2] and cache.num_free_pages == free0 - 2
    cache.free(p)
    _assert_holds(cache, c, [prefix, tail_c])
    cache.free(c)
    assert cache.num_free_pages == 12


def test_out_of_pages_changes_nothing(rng):
    cache = PagedKVCache(3, 4, HK, D, "f32")
    a = cache.allocate()
    first = _tokens(rng, 6)
    cache.append(a, *first)
    b = cache.fork(a)  # shares a's partly filled 2nd page
    before = (cache.k.copy(), cache.v.copy(), cache.num_free_pages)
    with pytest.raises(CacheFullError, match="needs 3 free pages"):
        cache.append(b, *_tokens(rng, 7))  # copy + 2 new pages, 1 free
    np.testing.assert_array_equal(cache.k, before[0])
    np.testing.assert_array_equal(cache.v, before[1])
    assert cache.num_free_pages == before[2] and cache.seqlen(b) == 6
    _assert_holds(cache, a, [first])
    with pytest.raises(ValueError, match="k_new"):
        cache.append(a, np.zeros((2, HK + 1, D), np.float32), np.zeros((2, HK + 1, D), np.float32))


def test_concurrent_appends(rng):
    cache = PagedKVCache(200, 16, HK, D, "f32")
    seqs = [cache.allocate() for _ in range(8)]
    chunks = {s: [_tokens(rng, int(rng.integers(1, 9))) for _ in range(20)] for s in seqs}

    def worker(s):
        for t in chunks[s]:
            cache.append(s, *t)

    threads = [threading.Thread(target=worker, args=(s,)) for s in seqs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for s in seqs:
        _assert_holds(cache, s, chunks[s])
    pages = [p for s in seqs for p in cache.pages(s)]
    assert len(pages) == len(set(pages))


def test_attention_over_the_cache(explicit_session, rng):
    cache = PagedKVCache(64, 16, 2, 64, "f16")
    seqs, rec = [], {}
    for n in (37, 1, 80):
        s = cache.allocate()
        k = rng.standard_normal((n, 2, 64)).astype(np.float16)
        v = rng.standard_normal((n, 2, 64)).astype(np.float16)
        cache.append(s, k, v)
        seqs.append(s)
        rec[s] = (k, v)
    seqs.append(cache.fork(seqs[2]))  # a forked sequence in the same batch
    extra = (rng.standard_normal((5, 2, 64)).astype(np.float16), rng.standard_normal((5, 2, 64)).astype(np.float16))
    cache.append(seqs[3], *extra)
    bt, sk = cache.batch(seqs)
    q = rng.standard_normal((4, 1, 8, 64)).astype(np.float16)
    out, lse = turbine_fmha.fmha_fwd_paged(q, cache.k, cache.v, bt, sk, return_lse=True, session=explicit_session)
    ref, ref_lse = fmha_fwd_paged_ref(q, cache.k, cache.v, bt, sk)
    _check(out, lse, ref, ref_lse, "f16")
    # The reference over the pages equals attention over the recorded K/V.
    k3 = np.concatenate([rec[seqs[2]][0], extra[0]])
    np.testing.assert_array_equal(cache.gather(seqs[3])[0], k3)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["f16", "bf16", "float8_e4m3fn"])
def test_device_resident_pool(explicit_session, rng, dtype, kv_layout):
    """With a session, the pool also lives on the device and is updated in
    place by the append kernel: after any mix of appends, forks (with
    copy-on-write) and frees it equals the host mirror, and attention runs
    on it. An fp8 pool lives on the device as its bytes (the i8 append
    kernel copies bits) and is read by f16 queries with descales. An HND
    pool is written as one-head pages and read with kv_layout="HND"."""
    import ml_dtypes

    fp8 = dtype.startswith("float8")
    cache = PagedKVCache(
        24, 16, 2, 64, getattr(ml_dtypes, dtype) if fp8 else dtype, session=explicit_session, kv_layout=kv_layout
    )
    raw = (lambda a: a.view(np.int8)) if fp8 else (lambda a: a)
    live = [cache.allocate()]
    for _ in range(25):
        op = rng.random()
        if op < 0.15 and len(live) < 6:
            live.append(cache.fork(live[int(rng.integers(len(live)))]))
        elif op < 0.25 and len(live) > 1:
            cache.free(live.pop(int(rng.integers(len(live)))))
        else:
            s = live[int(rng.integers(len(live)))]
            n = int(rng.integers(1, 20))
            try:
                cache.append(
                    s,
                    rng.standard_normal((n, 2, 64)).astype(cache.dtype),
                    rng.standard_normal((n, 2, 64)).astype(cache.dtype),
                )
            except CacheFullError:
                cache.free(live.pop(0)) if len(live) > 1 else None
        np.testing.assert_array_equal(cache.k_dev.to_host(), raw(cache.k))
        np.testing.assert_array_equal(cache.v_dev.to_host(), raw(cache.v))
    seqs = [s for s in live if cache.seqlen(s)]
    q = rng.standard_normal((len(seqs), 3, 8, 64)).astype(np.float16 if fp8 else cache.k.dtype)
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else {}
    out, lse = cache.attend(q, seqs, mask_type="bottom_right", return_lse=True, **scales)
    bt, sk = cache.batch(seqs)
    ref, ref_lse = fmha_fwd_paged_ref(
        q, cache.k, cache.v, bt, sk, mask_type="bottom_right", kv_layout=kv_layout, **scales
    )
    _check(out, lse, ref, ref_lse, "bf16" if dtype == "bf16" else "f16")
    with pytest.raises(TypeError, match="both"):
        turbine_fmha.fmha_fwd_paged(q, cache.k_dev, cache.v, bt, sk, kv_layout=kv_layout, session=explicit_session)
    with pytest.raises(TypeError, match="kv_rows_finite"):
        turbine_fmha.fmha_fwd_paged(
            q, cache.k, cache.v, bt, sk, kv_rows_finite=1, kv_layout=kv_layout, session=explicit_session
        )


def _state(cache, seqs):
    return (
        cache.k.copy(),
        cache.v.copy(),
        cache.num_free_pages,
        {s: (cache.pages(s), cache.seqlen(s)) for s in seqs},
        cache.values_finite,
    )


def _assert_state(cache, seqs, before):
    after = _state(cache, seqs)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2:] == before[2:]


def test_a_freed_request_cannot_poison_the_next(online_session, rng):
    """Request A stores a V row that is +Inf in the f16
    pool (float32 7e4, cast by the caller: appends refuse other dtypes),
    then finishes; request B reuses its page, whose stale rows still hold
    A's +Inf. The cache once judged finiteness from the caller's float32
    array, so B ran on the kernel without the stale-row guard and got an
    all-NaN output."""
    cache = PagedKVCache(4, 16, HK, D, "f16")
    a = cache.allocate()
    k_a, v_a = (t.astype(np.float16) for t in _tokens(rng, 6))
    v_a[4] = np.inf  # what float32 7e4 becomes in float16
    cache.append(a, k_a, v_a)
    assert not cache.values_finite, "the cache claims finite values but stores +Inf"
    page_a = cache.pages(a)[0]
    cache.free(a)
    b = cache.allocate()
    k_b, v_b = _tokens(rng, 3)
    cache.append(b, k_b.astype(np.float16), v_b.astype(np.float16))
    assert cache.pages(b) == [page_a]  # B's rows 3.. are A's, +Inf among them
    q = rng.standard_normal((1, 1, 4, D)).astype(np.float16)
    out = cache.attend(q, [b], session=online_session)
    kb, vb = cache.gather(b)
    ref, _ = fmha_fwd_paged_ref(q, kb[None], vb[None], np.zeros((1, 1), np.int32), np.array([3], np.int32))
    assert np.isfinite(out).all(), "another request's data changed this output"
    assert np.abs(out.astype(np.float64) - ref).max() <= OUT_TOL["f16"] * np.abs(ref).max()
    # Once B's own rows cover A's, the pool is finite again.
    cache.append(b, *(t.astype(np.float16) for t in _tokens(rng, 13)))
    assert cache.values_finite


def test_append_failures_change_nothing(explicit_session, rng):
    """An append that fails (an uncastable K, or the device
    write itself) leaves pages, lengths and both pools as they were."""
    cache = PagedKVCache(6, 4, HK, D, "f32", session=explicit_session)
    a = cache.allocate()
    cache.append(a, *_tokens(rng, 6))
    b = cache.fork(a)  # the next append of b copies the shared last page
    before = _state(cache, [a, b])
    dev_before = cache.k_dev.to_host().copy(), cache.v_dev.to_host().copy()
    k, v = _tokens(rng, 5)
    with pytest.raises(TypeError, match="k_new"):
        cache.append(b, np.full((5, HK, D), "x"), v)
    with pytest.raises(TypeError, match="v_new"):
        cache.append(b, k, v.astype(np.complex64))
    _assert_state(cache, [a, b], before)

    def broken(*args):
        raise RuntimeError("device write failed")

    good, cache._append_fn = cache._append_fn, broken
    with pytest.raises(RuntimeError, match="device write failed"):
        cache.append(b, k, v)
    _assert_state(cache, [a, b], before)
    np.testing.assert_array_equal(cache.k_dev.to_host(), dev_before[0])
    np.testing.assert_array_equal(cache.v_dev.to_host(), dev_before[1])
    cache._append_fn = good
    cache.append(b, k, v)  # and the cache still works
    kb, vb = cache.gather(b)
    np.testing.assert_array_equal(kb[6:], k)
    np.testing.assert_array_equal(cache.k_dev.to_host(), cache.k)


def test_append_takes_torch_and_refuses_other_dtypes(explicit_session, rng):
    """Torch rows (bf16 included) are appended as given;
    a dtype other than the pool's is refused by name instead of being
    cast, and changes nothing."""
    import ml_dtypes
    import torch

    cache = PagedKVCache(6, 4, HK, D, "bf16", session=explicit_session)
    a = cache.allocate()
    k, v = (t.astype(ml_dtypes.bfloat16) for t in _tokens(rng, 6))
    as_torch = [torch.from_numpy(t.view(np.int16)).view(torch.bfloat16) for t in (k, v)]
    cache.append(a, *as_torch)
    before = _state(cache, [a])
    for bad_k, bad_v, name in (
        (k.astype(np.float32), v, "k_new"),
        (k, as_torch[1].half(), "v_new"),
        (as_torch[0].float(), v, "k_new"),
    ):
        with pytest.raises(TypeError, match=f"^{name} has dtype"):
            cache.append(a, bad_k, bad_v)
    _assert_state(cache, [a], before)
    got = cache.gather(a)
    np.testing.assert_array_equal(got[0].view(np.int16), k.view(np.int16))
    np.testing.assert_array_equal(got[1].view(np.int16), v.view(np.int16))
    np.testing.assert_array_equal(cache.k_dev.to_host().view(np.int16), cache.k.view(np.int16))


def test_device_pool_without_host_mirror(explicit_session, rng):
    """host_mirror=False: no host copy of the pool; appends (numpy and
    torch) land on the device pool, values_finite follows the stored V
    rows, attention runs on it, and fork (whose copy-on-write needs the
    mirror) is refused."""
    import torch

    cache = PagedKVCache(8, 4, HK, D, "f32", session=explicit_session, host_mirror=False)
    assert cache.k is None and cache.v is None
    a, b = cache.allocate(), cache.allocate()
    rec = {a: [_tokens(rng, 6)], b: [_tokens(rng, 3)]}
    cache.append(a, *rec[a][0])
    cache.append(b, *(torch.from_numpy(t) for t in rec[b][0]))
    rec[a].append(_tokens(rng, 5))
    rec[a][1][1][2, 1, 3] = np.nan
    cache.append(a, *rec[a][1])
    assert not cache.values_finite
    for s in (a, b):
        _assert_holds(cache, s, rec[s])
    with pytest.raises(ValueError, match="host_mirror"):
        cache.fork(a)
    q = rng.standard_normal((1, 2, 4, D)).astype(np.float32)
    out, lse = cache.attend(q, [b], mask_type="bottom_right", return_lse=True)
    bt, sk = cache.batch([b])
    ref, ref_lse = fmha_fwd_paged_ref(q, cache.k_dev.to_host(), cache.v_dev.to_host(), bt, sk, mask_type="bottom_right")
    _check(out, lse, ref, ref_lse, "f32")
    nan_page = cache.pages(a)[2]
    cache.free(a)
    assert not cache.values_finite  # a freed page keeps its rows until they are overwritten
    c = cache.allocate()
    cache.append(c, *_tokens(rng, 9))  # reuses a's pages; its 9th row overwrites the NaN one
    assert nan_page in cache.pages(c) and cache.values_finite


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["f32", "float8_e4m3fn"])
def test_pool_of_torch_memory_is_written_by_torch(explicit_session, rng, monkeypatch, kv_layout, dtype):
    """A device pool without a mirror is torch memory on a GPU
    (Session.device_zeros): appends of torch rows on its device are then
    torch writes into it, not append-kernel calls (each of which waited for
    torch's stream, then for itself, once per layer of a model's step).
    Here the CPU session's pool is made of torch CPU memory the same way.
    Checked: no append call for torch rows (numpy rows still take the
    kernel), every sequence holds exactly what it was given across page
    boundaries and batch writes, the finiteness marks follow the rows, and
    attention over the pool matches the float64 reference."""
    import ml_dtypes
    import torch

    from turbine_fmha.api import cache as cache_mod
    from turbine_fmha.core.arrays import np_torch_dtype

    s = explicit_session
    monkeypatch.setattr(
        s,
        "device_zeros",
        lambda shape, dt: s.import_torch(torch.zeros(shape, dtype=np_torch_dtype(dt))),
        raising=False,
    )
    calls = []
    real = cache_mod.run_append
    monkeypatch.setattr(cache_mod, "run_append", lambda *a: calls.append(a[2]) or real(*a))
    np_dt = np.dtype(getattr(ml_dtypes, dtype)) if dtype.startswith("float8") else np.dtype(dtype.replace("f", "float"))
    cache = PagedKVCache(10, 4, HK, D, np_dt, session=s, host_mirror=False, kv_layout=kv_layout)
    assert cache._torch_pools is not None

    def rows(shape):
        return rng.standard_normal(shape).astype(np.float32).astype(np_dt)

    def as_torch(a):
        bits = torch.from_numpy(a.view(np.int8) if a.dtype.itemsize == 1 else a)
        return bits.view(np_torch_dtype(a.dtype))

    a, b = cache.allocate(), cache.allocate()
    rec = {a: [], b: []}
    first = rows((6, HK, D)), rows((6, HK, D))
    cache.append(a, *map(as_torch, first))
    rec[a].append(first)
    batch = rows((2, 3, HK, D)), rows((2, 3, HK, D))  # a crosses into its 3rd page, b starts
    batch[1][1, 2, 1, 3] = np.nan  # b's last row
    cache.append_batch([a, b], *map(as_torch, batch))
    for i, seq in enumerate((a, b)):
        rec[seq].append((batch[0][i], batch[1][i]))
    assert calls == [] and not cache.values_finite
    kernel_rows = rows((2, HK, D)), rows((2, HK, D))
    cache.append(b, *kernel_rows)  # numpy rows: the append kernel, into the same memory
    rec[b].append(kernel_rows)
    assert len(calls) == 1
    for seq in (a, b):
        k, v = cache.gather(seq)
        for got, want in zip((k, v), (np.concatenate([r[i] for r in rec[seq]]) for i in (0, 1))):
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(cache.k_dev.to_host().view(np.uint8), cache._torch_pools[0].view(torch.uint8).numpy())
    if dtype == "f32":
        q = rng.standard_normal((1, 1, 4, D)).astype(np.float32)
        bt, sk = cache.batch([a])
        out, lse = cache.attend(q, [a], mask_type="bottom_right", return_lse=True)
        ref, ref_lse = fmha_fwd_paged_ref(
            q, cache.k_dev.to_host(), cache.v_dev.to_host(), bt, sk, mask_type="bottom_right", kv_layout=kv_layout
        )
        _check(out, lse, ref, ref_lse, "f32")
    cache.free(b)
    c = cache.allocate()
    cache.append(c, *map(as_torch, (rows((8, HK, D)), rows((8, HK, D)))))  # reuses b's pages, over the NaN row
    assert len(calls) == 1 and cache.values_finite


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_writes_mark_exactly_the_nonfinite_rows(explicit_session, monkeypatch, kv_layout, dtype):
    """Torch rows written into a pool of torch memory are marked non-finite
    by one reduction each (their largest magnitude): exactly the rows with a
    NaN or an infinity, never a finite row of the dtype's largest values
    (a sum of those would overflow). Two pools written at the same slots,
    as a model's layers are, share one uploaded index and each holds its
    own rows."""
    import torch

    from turbine_fmha.api import cache as cache_mod
    from turbine_fmha.core.arrays import np_torch_dtype, torch_np_dtype

    s = explicit_session
    monkeypatch.setattr(
        s,
        "device_zeros",
        lambda shape, dt: s.import_torch(torch.zeros(shape, dtype=np_torch_dtype(dt))),
        raising=False,
    )
    monkeypatch.setattr(cache_mod, "_INDEX_CACHE", cache_mod.collections.OrderedDict())
    tdt = getattr(torch, dtype)
    big = torch.finfo(tdt).max
    pools = [
        PagedKVCache(6, 4, HK, D, torch_np_dtype(tdt), session=s, host_mirror=False, kv_layout=kv_layout)
        for _ in range(2)
    ]
    seqs = [[p.allocate() for _ in range(2)] for p in pools]
    written = []
    for i, (pool, ss) in enumerate(zip(pools, seqs)):
        k = torch.full((2, 3, HK, D), float(i + 1), dtype=tdt)
        v = torch.full((2, 3, HK, D), big, dtype=tdt)
        v[:, :, 0, 0] = -big
        pool.append_batch(ss, k, v)
        written.append((k, v))
        assert pool.values_finite  # the largest finite values are finite
    assert len(cache_mod._INDEX_CACHE) == 1  # the second pool reused the first one's index
    for pool, ss, (k, v) in zip(pools, seqs, written):
        for j, seq in enumerate(ss):
            got_k, got_v = pool.gather(seq)
            np.testing.assert_array_equal(got_k.astype(np.float32), k[j].float().numpy())
            np.testing.assert_array_equal(got_v.astype(np.float32), v[j].float().numpy())
    for bad in (float("nan"), float("inf"), -float("inf")):
        pool = PagedKVCache(6, 4, HK, D, torch_np_dtype(tdt), session=s, host_mirror=False, kv_layout=kv_layout)
        a, b = pool.allocate(), pool.allocate()
        v = torch.ones((2, 3, HK, D), dtype=tdt)
        v[1, 2, HK - 1, D - 1] = bad  # b's last row
        pool.append_batch([a, b], torch.ones_like(v), v)
        assert not pool.values_finite
        assert pool._n_bad == 1 and pool._v_bad[pool.pages(b)[0], 2]


@pytest.mark.parametrize("host_mirror", [True, False])
def test_device_pools_are_allocated_past_the_call_buffer_pool(explicit_session, rng, host_mirror):
    """A device pool outlives calls, so it must not be counted by the
    caching allocator that recycles the calls' results and transients
    (runtime.DEFAULT_CUDA_ALLOCATORS): that allocator hands exportable
    buffers to the device allocator underneath it, and on the H200 3 GiB
    of held pooled buffers made every decode call 2-3x slower
    (docs/devlog/perf-notes.md). The CPU has no caching allocator, so this checks
    the buffers' usage, which is what routes them."""
    import iree.runtime as rt

    cache = PagedKVCache(8, 4, HK, D, "f16", session=explicit_session, host_mirror=host_mirror)
    export = int(rt.BufferUsage.SHARING_EXPORT)
    for a in (cache.k_dev, cache.v_dev):
        assert a._buffer_view.get_buffer().allowed_usage() & export
    x = rng.standard_normal((3, 5)).astype(np.float32)
    held = explicit_session.device_array(x)
    assert held._buffer_view.get_buffer().allowed_usage() & export
    np.testing.assert_array_equal(held.to_host(), x)
    x[...] = 0  # a copy, not a view of the host array
    assert held.to_host().any()


def _pool_state(cache, seqs):
    """Everything an append changes: both pools, the page accounting (free
    list in order, reference counts), every sequence's pages and length,
    and the finiteness marks."""
    dev = () if cache.k_dev is None else (cache.k_dev.to_host(), cache.v_dev.to_host())
    return dict(
        k=cache.k.copy(),
        v=cache.v.copy(),
        dev=dev,
        free=list(cache._free),
        refs=cache._refs.copy(),
        seqs={s: (cache.pages(s), cache.seqlen(s)) for s in seqs},
        finite=cache.values_finite,
    )


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key in ("k", "v", "refs"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        elif key == "dev":
            for x, y in zip(a[key], b[key]):
                np.testing.assert_array_equal(x, y)
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("where", ["host", "device"])
def test_append_batch_is_appends_one_by_one(explicit_session, rng, where, kv_layout):
    """append_batch(seqs, k, v) leaves the cache exactly as append(seqs[i],
    k[i], v[i]) in order does: the same pages taken in the same order, a
    shared partly filled last page copied by each writer but its last
    holder (forks of forks hold one page three times), the same reference
    counts, rows and finiteness marks (NaN rows come and go); it fails with
    CacheFullError changing nothing where the pages do not suffice for the
    whole batch. Random forks, frees and batches of 0-17 tokens, with
    numpy and torch rows, on a host pool and on a device pool (with its
    mirror)."""
    import torch

    session = explicit_session if where == "device" else None
    one, batched = (PagedKVCache(40, 4, HK, D, "f32", session=session, kv_layout=kv_layout) for _ in range(2))
    live = [one.allocate()]
    assert batched.allocate() == live[0]
    for _ in range(60):
        op = rng.random()
        if op < 0.2 and len(live) < 10:
            parent = live[int(rng.integers(len(live)))]
            live.append(one.fork(parent))
            assert batched.fork(parent) == live[-1]
        elif op < 0.3 and len(live) > 1:
            s = live.pop(int(rng.integers(len(live))))
            one.free(s)
            batched.free(s)
        else:
            seqs = [live[i] for i in rng.permutation(len(live))[: int(rng.integers(1, len(live) + 1))]]
            n = int(rng.choice([0, 1, 1, 2, 5, 17]))
            k, v = (rng.standard_normal((len(seqs), n, HK, D)).astype(np.float32) for _ in range(2))
            if n and rng.random() < 0.3:
                v[int(rng.integers(len(seqs))), int(rng.integers(n)), 1, 3] = np.nan
            before = _pool_state(batched, live)
            rows = (torch.from_numpy(k), torch.from_numpy(v)) if rng.random() < 0.4 else (k, v)
            try:
                batched.append_batch(seqs, *rows)
            except CacheFullError:
                _assert_same_state(_pool_state(batched, live), before)
                continue
            for i, s in enumerate(seqs):
                one.append(s, k[i], v[i])
        _assert_same_state(_pool_state(batched, live), _pool_state(one, live))
    # At least once, whatever the draws (test_append_batch_failures_change_
    # nothing has a batch whose first sequence alone would fit).
    before = _pool_state(batched, live)
    big = np.zeros((len(live), 4 * (batched.num_free_pages + 1), HK, D), np.float32)
    with pytest.raises(CacheFullError, match=f"the {len(live)} sequences need"):
        batched.append_batch(live, big, big)
    _assert_same_state(_pool_state(batched, live), before)


def test_decode_steps_take_the_array_path_and_match_appends(rng, monkeypatch):
    """A decode step's batch (no shared partly filled page) takes
    append_batch's array path (_unshared_slots), a batch with forks the
    sequence-by-sequence one (_slots); both leave the cache exactly as
    appends one by one do: 40 one-token steps of 20 sequences of random
    prompt lengths across page boundaries, with NaN and Inf V rows, then a
    step after two forks. (Smaller batches always take the latter:
    ARRAY_SLOTS_MIN_BATCH.)"""
    paths = []
    real = PagedKVCache._unshared_slots

    def counted(self, *args):
        slots = real(self, *args)
        paths.append(slots is not None)
        return slots

    monkeypatch.setattr(PagedKVCache, "_unshared_slots", counted)
    one, batched = (PagedKVCache(300, 4, HK, D, "f16") for _ in range(2))
    seqs = [one.allocate() for _ in range(20)]
    assert [batched.allocate() for _ in range(20)] == seqs
    for s in seqs:
        n = int(rng.integers(0, 11))
        rows = [rng.standard_normal((n, HK, D)).astype(np.float16) for _ in range(2)]
        one.append(s, *rows)
        batched.append(s, *rows)

    def step(live):
        k, v = (rng.standard_normal((len(live), 1, HK, D)).astype(np.float16) for _ in range(2))
        if rng.random() < 0.2:
            v[int(rng.integers(len(live))), 0, 1, int(rng.integers(D))] = rng.choice([np.nan, np.inf, -np.inf])
        batched.append_batch(live, k, v)
        for i, s in enumerate(live):
            one.append(s, k[i], v[i])
        _assert_same_state(_pool_state(batched, live), _pool_state(one, live))

    for _ in range(40):
        step(seqs)
    assert paths == [True] * 40
    odd = [s for s in seqs if one.seqlen(s) % 4][:2]  # partly filled last pages, then shared
    forks = [one.fork(s) for s in odd]
    assert [batched.fork(s) for s in odd] == forks
    step(seqs + forks)
    assert paths[-1] is False


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_nonfinite_flags_read_on_the_bits(rng, dtype):
    """_nonfinite_flags marks exactly the rows holding a NaN or an Inf,
    whatever else they hold (the largest finite values, subnormals, -0)."""
    from turbine_fmha.api.cache import _nonfinite_flags
    from turbine_fmha.core.arrays import np_dtype

    dt = np_dtype(dtype)
    v = rng.standard_normal((64, HK, D)).astype(np.float32).astype(dt)
    big = float(np.finfo(np.float16).max) if dtype == "f16" else 3.0e38
    v[1, 0, 0], v[2, 1, 5], v[3, 0, 1] = big, -big, -0.0
    v[4, 1, 2] = np.float32(1e-41 if dtype != "f16" else 1e-7)  # subnormal
    for row, value in zip(range(5, 64, 7), [np.nan, np.inf, -np.inf] * 5):
        v[row, int(rng.integers(HK)), int(rng.integers(D))] = value
    want = ~np.isfinite(v.astype(np.float32)).all(axis=(1, 2))
    assert want.sum() == 9
    np.testing.assert_array_equal(_nonfinite_flags(v), want)
    np.testing.assert_array_equal(_nonfinite_flags(v[:0]), want[:0])


def test_append_batch_failures_change_nothing(explicit_session, rng):
    """A batch that fails (bad shapes or dtypes, a sequence named twice or
    unknown, too few pages, or the device write itself) changes nothing."""
    cache = PagedKVCache(6, 4, HK, D, "f32", session=explicit_session)
    a = cache.allocate()
    cache.append(a, *_tokens(rng, 6))
    b = cache.fork(a)  # the next append of b copies the shared last page
    before = _pool_state(cache, [a, b])
    k, v = (rng.standard_normal((2, 3, HK, D)).astype(np.float32) for _ in range(2))
    cases = [
        ((a, b), k[:, :, :1], v, ValueError, r"k_new must have shape \[2, n, 2, 16\]"),
        ((a, b), k, v[:1], ValueError, "v_new must have shape"),
        ((a, b), k, v[:, :2], ValueError, "v_new has 2 rows per sequence"),
        ((a, b), k[0], v[0], ValueError, "k_new must have shape"),
        ((a, b), k.astype(np.float16), v, TypeError, "k_new has dtype"),
        ((a, a), k, v, ValueError, "each sequence once"),
        ((a, 7), k, v, KeyError, "no sequence 7"),
        # a copies the shared page and takes 2 more, then b owns it alone and takes 2
        (
            (a, b),
            *(rng.standard_normal((2, 9, HK, D)).astype(np.float32) for _ in range(2)),
            CacheFullError,
            "need 5 free pages for 9 tokens each, 4 are free",
        ),
    ]
    for seqs, kk, vv, exc, words in cases:
        with pytest.raises(exc, match=words):
            cache.append_batch(seqs, kk, vv)
        _assert_same_state(_pool_state(cache, [a, b]), before)

    def broken(*args):
        raise RuntimeError("device write failed")

    good, cache._append_fn = cache._append_fn, broken
    with pytest.raises(RuntimeError, match="device write failed"):
        cache.append_batch([b, a], k, v)
    _assert_same_state(_pool_state(cache, [a, b]), before)
    cache._append_fn = good
    cache.append_batch([b, a], k, v)  # and the cache still works
    for s, i in ((b, 0), (a, 1)):
        np.testing.assert_array_equal(cache.gather(s)[0][6:], k[i])
    np.testing.assert_array_equal(cache.k_dev.to_host(), cache.k)


def test_append_batch_is_one_device_write(explicit_session, rng, monkeypatch):
    """A device pool writes a whole batch, copied shared pages included,
    with one append-kernel call."""
    from turbine_fmha.api import cache as cache_mod

    cache = PagedKVCache(32, 4, HK, D, "f32", session=explicit_session)
    seqs = [cache.allocate() for _ in range(3)]
    cache.append_batch(seqs, *(rng.standard_normal((3, 6, HK, D)).astype(np.float32) for _ in range(2)))
    seqs += [cache.fork(seqs[0]), cache.fork(seqs[1])]
    calls = []
    real = cache_mod.run_append
    monkeypatch.setattr(cache_mod, "run_append", lambda *a: calls.append(a[4].shape) or real(*a))  # the slots
    k, v = (rng.standard_normal((5, 3, HK, D)).astype(np.float32) for _ in range(2))
    cache.append_batch(seqs, k, v)
    assert calls == [(5 * 3 + 2 * 2, 2)]  # 15 new rows and the 2 rows of each of the 2 copied pages
    np.testing.assert_array_equal(cache.k_dev.to_host(), cache.k)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(cache.gather(s)[1][6:], v[i])


def test_finiteness_checks_are_read_back_lazily(explicit_session, rng, monkeypatch):
    """Appends of torch rows compute their rows' finiteness beside the rows
    and do not read it back (on a GPU that read waited for the device, per
    append); values_finite reads back every pending check at once, and
    all_values_finite those of several pools in one transfer. The marks
    stay exact: a NaN row counts until it is overwritten, freed or not."""
    import torch

    from turbine_fmha.api import cache as cache_mod

    reads = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: reads.append(t.shape) or real_cpu(t, *a, **k))
    caches = [PagedKVCache(8, 4, HK, D, "f32", session=explicit_session, host_mirror=False) for _ in range(2)]
    seqs = [[c.allocate() for _ in range(2)] for c in caches]
    for step in range(3):
        for c, ss in zip(caches, seqs):
            k, v = (torch.from_numpy(rng.standard_normal((2, 2, HK, D)).astype(np.float32)) for _ in range(2))
            if step == 1 and c is caches[1]:
                v[1, 0, 0, 0] = float("nan")  # row 2 of sequence 1's first page
            c.append_batch(ss, k, v)
    assert reads == []
    assert cache_mod.all_values_finite(caches) is False
    assert reads == [(24,)]  # 2 pools x 3 appends x 2 sequences x 2 rows, in one read
    assert caches[0].values_finite and not caches[1].values_finite and len(reads) == 1
    nan_page = caches[1].pages(seqs[1][1])[0]
    caches[1].free(seqs[1][1])
    assert not caches[1].values_finite  # a freed page keeps its rows until they are overwritten
    c = caches[1].allocate()
    caches[1].append(c, *(torch.from_numpy(t) for t in _tokens(rng, 3)))  # overwrites the NaN row
    assert caches[1].pages(c)[0] == nan_page and caches[1].values_finite
    # A pool nobody asks reads its checks back itself, every so many appends.
    monkeypatch.setattr(cache_mod, "MAX_PENDING_CHECKS", 3)
    reads.clear()
    for _ in range(3):
        caches[0].append_batch(seqs[0], *(torch.zeros(2, 1, HK, D) for _ in range(2)))
    assert reads == [(6,)] and not caches[0]._pending
