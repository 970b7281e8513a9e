"""Exported programs on input outside their contract (api/exported.py,
the guards of signature.GUARD_PAGED and GUARD_WRITE): for any values of
the right dtypes and ranks, a program compiled for the host reads and
writes only inside the tensors it is given, never crashes, and no
sequence's output depends on pages that are not its own.

- Sizes that must agree and do not fail the invocation, naming what
  disagrees, and the program keeps working after it.
- A used table slot outside k_cache (or a seqlen_k past the table) cuts
  that sequence's keys there: its output is the reference's with
  seqlen_k cut, and stays bit-identical when every other page changes.
- A cache_batch_idx outside the caches gives that row no keys.
- reshape_and_cache skips a token whose slot is no row of the caches
  (vLLM's -1 among them) and writes the others.
- One tensor exported as both caches is refused at export."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import make_problem
from tolerances import OUT_TOL

torch = pytest.importorskip("torch")
aot = pytest.importorskip("iree.turbine.aot")

from test_export import Attention, KVCacheAttention, _compiled, _host_main  # noqa: E402

import turbine_fmha  # noqa: E402
from turbine_fmha.core.arrays import numpy_to_torch  # noqa: E402
from turbine_fmha.testing.reference import fmha_fwd_paged_ref  # noqa: E402

SHAPE = dict(dtype="f16", seqlen_q=1, nhead_q=4, nhead_k=2, hdim=32, page=16)
CAUSAL = dict(mask_type="bottom_right", window_size_right=0)


@pytest.fixture(scope="module")
def decode(rng_module):
    """A causal decode exported with one Dim for q's batch, the tables'
    rows and seqlen_k's length, and one for both caches' page counts (as
    a serving host declares them), compiled for the host."""
    return _compiled(Attention(causal=True), make_problem(rng_module, batch=3, seqlens_k=[40, 9, 17], **SHAPE), True)


@pytest.fixture(scope="module")
def rng_module():
    return np.random.default_rng()


def _out(main, *args):
    out, lse = main(*args)
    return out.to_host().astype(np.float64), lse.to_host()


def test_sizes_that_disagree_fail_the_invocation(decode, rng):
    q, k, v, bt, sk = make_problem(rng, batch=3, seqlens_k=[40, 9, 17], **SHAPE)
    big = np.concatenate([k] * 300)  # 1000 pages and more
    cases = {
        "v_cache dim 0 differs from k_cache dim 0 (NP)": (q, big, v[:1], bt, sk),
        "v_cache dim 0 differs from k_cache dim 0": (q, k, v[:4], bt, sk),
        "block_table dim 0 differs from q dim 0 (B)": (np.repeat(q[:1], 1000, 0), k, v, bt[:1], sk[:1]),
        "seqlen_k dim 0 differs from q dim 0 (B)": (q, k, v, bt, sk[:2]),
        "k_cache has no page for the block table's ids": (q, k[:0], v[:0], bt, sk),
    }
    for words, args in cases.items():
        with pytest.raises(RuntimeError, match=re.escape(words)):
            decode(*args)
    # The program still serves a call within its contract.
    out, _ = _out(decode, q, k, v, bt, sk)
    ref = fmha_fwd_paged_ref(q, k, v, bt, sk, **CAUSAL)[0]
    assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]


@pytest.mark.parametrize("bad", [10**9, "pages", -5, 2**31 - 1])
def test_a_bad_used_slot_cuts_its_sequence_and_reads_no_other_page(decode, rng, bad):
    """Sequence 1's second used slot holds an id outside k_cache; sequence
    2's seqlen_k runs past its table (every slot used). Each is the reference with seqlen_k
    cut where its table stops serving it; sequence 1's output is
    bit-identical when every page but its first changes (a clamped id
    would read page 0 or the last page)."""
    page = SHAPE["page"]
    q, k, v, bt, sk = make_problem(rng, batch=3, seqlens_k=[40, 50, 17], extra_slots=0, **SHAPE)
    bt[1, 1] = k.shape[0] if bad == "pages" else bad
    width = bt.shape[1]
    bt[2, 2:] = bt[2, 0]  # sequence 2's table full of its own first page, and its keys beyond it
    sk[2] = width * page + 30
    cut = sk.copy()
    cut[1], cut[2] = page, width * page
    out, lse = _out(decode, q, k, v, bt, sk)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, cut, **CAUSAL)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]

    own = bt[1, 0]
    others = np.ones(k.shape[0], bool)
    others[own] = False
    k2, v2 = k.copy(), v.copy()
    k2[others] = rng.standard_normal(k2[others].shape).astype(k.dtype) * 40
    v2[others] = np.nan
    out2, lse2 = _out(decode, q, k2, v2, bt, sk)
    np.testing.assert_array_equal(out2[1], out[1])
    np.testing.assert_array_equal(lse2[1], lse[1])


def test_a_cache_batch_idx_outside_the_caches_gives_no_keys(rng):
    """fmha_fwd_kvcache exported: a row whose cache_batch_idx is outside
    the caches (the cache count, -1, int32's largest) sees no key (output
    0, as for seqlen_k 0); the other rows are the reference's."""
    hq, hk, d, rows = 4, 2, 32, 64
    b, c = torch.export.Dim("batch"), torch.export.Dim("caches")

    def problem(batch, caches):
        q = rng.standard_normal((batch, 1, hq, d)).astype(np.float16)
        k = rng.standard_normal((caches, rows, hk, d)).astype(np.float16)
        v = rng.standard_normal((caches, rows, hk, d)).astype(np.float16)
        sk = rng.integers(1, rows + 1, batch).astype(np.int32)
        return q, k, v, sk, rng.permutation(caches)[:batch].astype(np.int32)

    main = _compiled(KVCacheAttention(), problem(2, 3), [{0: b}, {0: c}, {0: c}, {0: b}, {0: b}])
    q, k, v, sk, idx = problem(4, 5)
    idx[1], idx[2], idx[3] = 5, -1, 2**31 - 1
    out = main(q, k, v, sk, idx).to_host().astype(np.float64)
    assert not out[1:].any()
    ref = fmha_fwd_paged_ref(q[:1], k, v, idx[:1, None], sk[:1], **CAUSAL)[0]
    assert np.abs(out[:1] - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]


class Write(torch.nn.Module):
    """reshape_and_cache into the module's caches (buffers the export
    keeps), returning copies of them."""

    def __init__(self, k_cache, v_cache, kv_layout):
        super().__init__()
        self.register_buffer("k_cache", torch.from_numpy(k_cache.copy()))
        self.register_buffer("v_cache", torch.from_numpy(v_cache.copy()))
        self.kv_layout = kv_layout

    def forward(self, k, v, slots):
        turbine_fmha.reshape_and_cache(k, v, self.k_cache, self.v_cache, slots, kv_layout=self.kv_layout)
        return self.k_cache + 0, self.v_cache + 0


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_reshape_and_cache_skips_slots_outside_the_caches(rng, kv_layout):
    """Slots -1 (vLLM's padding), the caches' row count, 10^9 and -7 are
    skipped, the others written; with no valid slot nothing changes; token
    counts that disagree fail the invocation."""
    pages, page, hk, d = 4, 16, 2, 8
    rows = pages * page
    k0 = rng.standard_normal((pages, page, hk, d)).astype(np.float32)
    v0 = rng.standard_normal((pages, page, hk, d)).astype(np.float32)
    to_layout = (lambda a: a) if kv_layout == "NHD" else (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    tokens = torch.export.Dim("tokens")
    example = (np.zeros((3, hk, d), np.float32), np.zeros((3, hk, d), np.float32), np.arange(3, dtype=np.int64))
    exported = aot.export(
        Write(to_layout(k0), to_layout(v0), kv_layout),
        args=tuple(torch.from_numpy(a) for a in example),
        dynamic_shapes=[{0: tokens}, {0: tokens}, {0: tokens}],
    )
    main = _host_main(str(exported.mlir_module))

    def call(slots):
        """New rows at `slots`, and the program's caches after writing them."""
        k = rng.standard_normal((len(slots), hk, d)).astype(np.float32)
        v = rng.standard_normal((len(slots), hk, d)).astype(np.float32)
        return k, v, main(k, v, np.array(slots, np.int64))

    k_ref, v_ref = k0.copy(), v0.copy()
    for slots in ([-1, 5, rows, 37, 10**9, -7, 0], [-1, -1, rows], [rows + 1, 63]):
        k, v, (k_out, v_out) = call(slots)
        for i, s in enumerate(slots):
            if 0 <= s < rows:
                k_ref.reshape(-1, hk, d)[s] = k[i]
                v_ref.reshape(-1, hk, d)[s] = v[i]
        np.testing.assert_array_equal(k_out.to_host(), to_layout(k_ref))
        np.testing.assert_array_equal(v_out.to_host(), to_layout(v_ref))
    with pytest.raises(RuntimeError, match=r"v dim 0 differs from k dim 0 \(T\)"):
        main(np.zeros((2, hk, d), np.float32), np.zeros((3, hk, d), np.float32), np.arange(2, dtype=np.int64))


def test_caches_of_other_page_sizes_are_refused_at_export():
    """A slot names a row of both caches as page * page_block_size + row:
    with V's pages shorter than K's, a slot valid in K's rows wrote past
    V's pages."""
    k_cache = torch.zeros(4, 2, 16, 8, dtype=torch.float16)
    v_cache = torch.zeros(8, 2, 8, 8, dtype=torch.float16)

    class WriteHND(torch.nn.Module):
        def forward(self, k_new, v_new, slots, k_cache, v_cache):
            turbine_fmha.reshape_and_cache(k_new, v_new, k_cache, v_cache, slots, kv_layout="HND")
            return k_cache + 0

    rows = torch.zeros(3, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"v_cache's page size \(8\) must equal k_cache's \(16\)"):
        aot.export(WriteHND(), args=(rows, rows.clone(), torch.arange(3), k_cache, v_cache), strict_export=False)


def test_one_tensor_as_both_caches_is_refused_at_export():
    q = torch.zeros(2, 1, 4, 64, dtype=torch.float16)
    k = torch.zeros(8, 16, 2, 64, dtype=torch.float16)
    bt, sk = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(Exception, match="k_cache and v_cache are one tensor") as e:
        aot.export(Attention(), args=(q, k, k, bt, sk), strict_export=False)
    assert "v_cache" in str(e.value)

    class WriteArgs(torch.nn.Module):
        def forward(self, k_new, slots, cache):
            turbine_fmha.reshape_and_cache(k_new, k_new, cache, cache, slots)
            return cache + 0

    with pytest.raises(Exception, match="k_cache and v_cache are one tensor"):
        aot.export(WriteArgs(), args=(torch.zeros(3, 2, 64, dtype=torch.float16), torch.arange(3), k))


def test_online_decode_cuts_a_bad_slot_too(rng):
    """The online formulation's decode takes the guard's lengths: a bad
    used slot cuts its sequence as in the explicit one."""
    q, k, v, bt, sk = make_problem(rng, batch=3, seqlens_k=[40, 50, 17], extra_slots=0, **SHAPE)
    with turbine_fmha.export_options(formulation="online"):
        exported = aot.export(Attention(causal=True), args=tuple(numpy_to_torch(a) for a in (q, k, v, bt, sk)))
    main = _host_main(str(exported.mlir_module))
    bt[1, 1] = -5
    cut = sk.copy()
    cut[1] = SHAPE["page"]
    out, _ = _out(main, q, k, v, bt, sk)
    ref = fmha_fwd_paged_ref(q, k, v, bt, cut, **CAUSAL)[0]
    assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]


def test_int64_ids_and_lengths_never_wrap_into_range(rng):
    """int64 tables and lengths are cast to the kernels' int32 in the
    program: an id of 2**32 + p (p a page of another sequence) is out of
    range, not page p, and a length past int32 is the table's width."""
    q, k, v, bt, sk = make_problem(rng, batch=2, seqlens_k=[40, 50], extra_slots=0, **SHAPE)
    bt, sk = bt.astype(np.int64), sk.astype(np.int64)
    main = _compiled(Attention(causal=True), (q, k, v, bt, sk), True)
    bt[1, 1] = 2**32 + bt[0, 0]
    cut = sk.copy()
    cut[1] = SHAPE["page"]
    out, _ = _out(main, q, k, v, bt, sk)
    ref = fmha_fwd_paged_ref(q, k, v, bt.astype(np.int32), cut.astype(np.int32), **CAUSAL)[0]
    assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]
    bt[1, 1] = bt[0, 0]
    sk[1] = 2**40
    out, _ = _out(main, q, k, v, bt, sk)
    cut[1] = bt.shape[1] * SHAPE["page"]
    ref = fmha_fwd_paged_ref(q, k, v, bt.astype(np.int32), cut.astype(np.int32), **CAUSAL)[0]
    assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]


@pytest.mark.parametrize("backend, flag", [("cuda", "--iree-cuda-target=sm_80"), ("rocm", "--iree-rocm-target=gfx942")])
def test_guarded_programs_compile_for_the_gpus(rng, backend, flag):
    """The guards' checks and reductions compile on every GPU target
    (compile-only here: an i64 min over tokens failed to distribute on
    CUDA): a cache write, the explicit decode with dynamic sizes and the
    online decode."""
    import iree.compiler as ic

    k0 = np.zeros((4, 16, 2, 8), np.float16)
    t = torch.export.Dim("tokens")
    rows = tuple(torch.zeros(3, 2, 8, dtype=torch.float16) for _ in range(2))
    write = aot.export(Write(k0, k0, "NHD"), args=(*rows, torch.arange(3)), dynamic_shapes=[{0: t}, {0: t}, {0: t}])
    prob = tuple(numpy_to_torch(a) for a in make_problem(rng, batch=3, seqlens_k=[40, 9, 17], **SHAPE))
    b, p, w = torch.export.Dim("batch"), torch.export.Dim("pages"), torch.export.Dim("width")
    explicit = aot.export(
        Attention(causal=True), args=prob, dynamic_shapes=[{0: b}, {0: p}, {0: p}, {0: b, 1: w}, {0: b}]
    )
    with turbine_fmha.export_options(formulation="online"):
        online = aot.export(Attention(causal=True), args=prob)
    for program in (write, explicit, online):
        ic.compile_str(str(program.mlir_module), target_backends=[backend], extra_args=[flag])
