"""The public attention inside exported programs (api/exported.py): a
torch module calling turbine_fmha.fmha_fwd_paged, exported with
iree.turbine.aot.export (dynamic batch, page count and table width),
compiled by IREE for the host CPU and run with iree.runtime alone, gives
the float64 reference's results at several sizes, on problems with
garbage in unused table slots and NaN in unused pages. What it does not
take yet is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem
from tolerances import LSE_TOL, OUT_TOL

torch = pytest.importorskip("torch")
aot = pytest.importorskip("iree.turbine.aot")

import turbine_fmha  # noqa: E402
from turbine_fmha.core.arrays import numpy_to_torch  # noqa: E402
from turbine_fmha.testing.reference import fmha_fwd_paged_ref  # noqa: E402


class Attention(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k_cache, v_cache, block_table, seqlen_k, sinks=None):
        kw = self.kw if sinks is None else dict(self.kw, sinks=sinks)
        return turbine_fmha.fmha_fwd_paged(q, k_cache, v_cache, block_table, seqlen_k, return_lse=True, **kw)


def _compiled(module, example, dynamic):
    """The exported module compiled for the host: its `main`. `dynamic`:
    True for dynamic batch, pages and width, or the dynamic_shapes."""
    dims = dynamic if isinstance(dynamic, list) else None
    if dynamic is True:
        b, np_, w = torch.export.Dim("batch"), torch.export.Dim("pages"), torch.export.Dim("width")
        dims = [{0: b}, {0: np_}, {0: np_}, {0: b, 1: w}, {0: b}] + [None] * (len(example) - 5)
    exported = aot.export(module, args=tuple(numpy_to_torch(a) for a in example), dynamic_shapes=dims)
    return _host_main(str(exported.mlir_module))


def _host_main(mlir: str):
    """An exported program's MLIR compiled for the host and loaded: its `main`."""
    import iree.compiler as ic
    import iree.runtime as rt

    # A static-shape program's vectors exceed llvm-cpu's default limit.
    flags = ["--iree-llvmcpu-target-cpu=host", "--iree-llvmcpu-fail-on-large-vector=false"]
    vmfb = ic.compile_str(mlir, target_backends=["llvm-cpu"], extra_args=flags)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return ctx.modules.module["main"]


def _check(main, prob, dtype, extra=(), **kw):
    out, lse = main(*prob, *extra)
    ref, ref_lse = fmha_fwd_paged_ref(*prob, **kw)
    out = out.to_host().astype(np.float64)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= OUT_TOL[dtype], err
    lse = lse.to_host()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = ~np.isneginf(ref_lse)
    assert np.abs(lse[finite] - ref_lse[finite]).max() <= LSE_TOL[dtype]


def test_exported_decode_with_dynamic_batch_pages_and_width(rng):
    shape = dict(dtype="f16", seqlen_q=1, nhead_q=4, nhead_k=2, hdim=64, page=16)
    main = _compiled(Attention(causal=True), make_problem(rng, batch=3, seqlens_k=[40, 9, 17], **shape), True)
    for seqlens in ([40, 9, 17], [1, 100, 33, 64, 70, 2, 16]):
        prob = make_problem(rng, batch=len(seqlens), seqlens_k=seqlens, extra_slots=3, **shape)
        _check(main, prob, "f16", mask_type="bottom_right", window_size_right=0)


def test_exported_prefill_with_terms_and_head_major_pages(rng):
    """A 24-row prefill (static rows), sliding window with sinks tokens,
    soft-cap and attention sinks, bf16, HND pages."""
    shape = dict(dtype="bf16", seqlen_q=24, nhead_q=8, nhead_k=2, hdim=32, page=16)
    terms = dict(mask_type="bottom_right", window_size_left=10, window_size_right=0, sink_size=2, logits_soft_cap=5.0)
    sinks = rng.standard_normal(8).astype(np.float32)

    def hnd(prob):
        q, k, v, bt, sk = prob
        return q, np.ascontiguousarray(k.transpose(0, 2, 1, 3)), np.ascontiguousarray(v.transpose(0, 2, 1, 3)), bt, sk

    example = hnd(make_problem(rng, batch=2, seqlens_k=[30, 50], **shape))
    main = _compiled(Attention(kv_layout="HND", **terms), example + (sinks,), True)
    for seqlens in ([30, 50], [24, 64, 41]):
        prob = hnd(make_problem(rng, batch=len(seqlens), seqlens_k=seqlens, **shape))
        _check(main, prob, "bf16", (sinks,), kv_layout="HND", sinks=sinks, **terms)


def test_exported_prefill_with_dynamic_rows_and_column_major_v(rng):
    shape = dict(dtype="f16", nhead_q=4, nhead_k=2, hdim=32, page=16)

    def col(prob):
        q, k, v, bt, sk = prob
        return q, k, np.ascontiguousarray(v.transpose(0, 2, 3, 1)), bt, sk

    probs = [make_problem(rng, batch=2, seqlen_q=s, seqlens_k=[s + 10, s + 30], **shape) for s in (8, 21)]
    b, s, np_, w = (torch.export.Dim(n) for n in ("batch", "rows", "pages", "width"))
    dims = [{0: b, 1: s}, {0: np_}, {0: np_}, {0: b, 1: w}, {0: b}]
    main = _compiled(Attention(causal=True, v_layout="col"), col(probs[0]), dims)
    for prob in probs:
        out, lse = main(*col(prob))
        ref = fmha_fwd_paged_ref(*prob, mask_type="bottom_right", window_size_right=0)[0]
        assert np.abs(out.to_host().astype(np.float64) - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]


def test_exported_static_shapes(rng):
    shape = dict(dtype="f32", seqlen_q=1, nhead_q=2, nhead_k=2, hdim=16, page=4)
    prob = make_problem(rng, batch=2, seqlens_k=[7, 3], **shape)
    _check(_compiled(Attention(), prob, False), prob, "f32")


def _example():
    q = torch.zeros(2, 1, 4, 64, dtype=torch.float16)
    k = torch.zeros(8, 16, 2, 64, dtype=torch.float16)
    return q, k, torch.zeros_like(k), torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(num_splits=2), "num_splits is not supported inside an exported program"),
        (dict(alibi_slopes=np.ones(4, np.float32)), "alibi_slopes is not supported"),
        (dict(mask_type="diagonal"), "mask_type must be one of"),
        (dict(logits_soft_cap=-1.0), "logits_soft_cap must be >= 0"),
    ],
)
def test_what_an_export_does_not_take_is_refused_by_name(kw, words):
    # Non-strict export raises it as is; strict export (iree-turbine's
    # default) wraps it in torch's Unsupported, which carries it as cause.
    with pytest.raises((NotImplementedError, ValueError), match=words):
        aot.export(Attention(**kw), args=_example(), strict_export=False)
    with pytest.raises(Exception) as strict:  # torch._dynamo.exc.Unsupported
        aot.export(Attention(**kw), args=_example())
    assert words in str(strict.value.__cause__)


class WriteThenAttend(torch.nn.Module):
    """A layer's step: its new K/V rows written into the caches (the
    module's buffers, which the export keeps as mutable globals) by
    reshape_and_cache, then the attention over them."""

    def __init__(self, k_cache, v_cache, kv_layout):
        super().__init__()
        self.register_buffer("k_cache", torch.from_numpy(k_cache))
        self.register_buffer("v_cache", torch.from_numpy(v_cache))
        self.kv_layout = kv_layout

    def forward(self, k, v, slots, q, block_table, seqlen_k):
        turbine_fmha.reshape_and_cache(k, v, self.k_cache, self.v_cache, slots, kv_layout=self.kv_layout)
        return turbine_fmha.fmha_fwd_paged(
            q, self.k_cache, self.v_cache, block_table, seqlen_k, kv_layout=self.kv_layout, causal=True
        )


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_exported_reshape_and_cache_then_attention(rng, kv_layout):
    """Two calls of one program (dynamic token count): each writes new rows
    at fresh slots into caches that start as garbage, and the attention of
    each sees the rows written so far, against the float64 reference over
    caches written the same way in numpy."""
    import iree.compiler as ic
    import iree.runtime as rt

    pages, page, hk, hq, d = 6, 16, 2, 4, 32
    nhd = (pages, page, hk, d)
    k_ref = rng.standard_normal(nhd).astype(np.float32) * 50  # garbage the calls must not read
    v_ref = rng.standard_normal(nhd).astype(np.float32) * 50
    to_layout = (lambda a: a) if kv_layout == "NHD" else (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    table = np.array([[4, 1], [0, 5]], np.int32)  # two sequences of two pages each, out of order
    module = WriteThenAttend(to_layout(k_ref), to_layout(v_ref), kv_layout)
    tokens = torch.export.Dim("tokens")
    rows = torch.export.Dim("rows")

    def step(lengths, new):
        """(k, v, slots, q, table, seqlen_k) writing `new` rows per sequence after `lengths`."""
        pos = np.array(lengths)[:, None] + np.arange(new)[None, :]
        slots = (np.take_along_axis(table, pos // page, 1) * page + pos % page).reshape(-1).astype(np.int64)
        k = rng.standard_normal((2 * new, hk, d)).astype(np.float32)
        v = rng.standard_normal((2 * new, hk, d)).astype(np.float32)
        q = rng.standard_normal((2, new, hq, d)).astype(np.float32)
        return k, v, slots, q, table, (np.array(lengths) + new).astype(np.int32)

    first = step([0, 0], 9)
    dims = [{0: tokens}, {0: tokens}, {0: tokens}, {1: rows}, None, None]
    exported = aot.export(module, args=tuple(torch.from_numpy(a) for a in first), dynamic_shapes=dims)
    vmfb = ic.compile_str(
        str(exported.mlir_module), target_backends=["llvm-cpu"], extra_args=["--iree-llvmcpu-target-cpu=host"]
    )
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    main = ctx.modules.module["main"]
    for args in (first, step([9, 9], 12)):  # the second call's rows cross into each sequence's next page
        k, v, slots, q, bt, seqlen_k = args
        k_ref.reshape(-1, hk, d)[slots] = k
        v_ref.reshape(-1, hk, d)[slots] = v
        out = main(*args).to_host().astype(np.float64)
        ref = fmha_fwd_paged_ref(q, k_ref, v_ref, bt, seqlen_k, mask_type="bottom_right", window_size_right=0)[0]
        assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f32"]


class KVCacheAttention(torch.nn.Module):
    def forward(self, q, k_cache, v_cache, seqlen_k, cache_batch_idx):
        return turbine_fmha.fmha_fwd_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlen_k, cache_batch_idx=cache_batch_idx, causal=True
        )


def test_exported_fmha_fwd_kvcache(rng):
    """Non-paged caches (96 rows: viewed as 32-row pages) with rows picked
    by cache_batch_idx, dynamic batch and cache count; the rows past each
    sequence's length hold NaN."""
    from turbine_fmha.testing.reference import fmha_fwd_paged_ref

    hq, hk, d, rows = 4, 2, 32, 96

    def problem(batch, caches):
        q = rng.standard_normal((batch, 3, hq, d)).astype(np.float16)
        k = rng.standard_normal((caches, rows, hk, d)).astype(np.float16)
        v = rng.standard_normal((caches, rows, hk, d)).astype(np.float16)
        sk = rng.integers(3, rows + 1, batch).astype(np.int32)
        idx = rng.permutation(caches)[:batch].astype(np.int32)
        for b in range(batch):
            k[idx[b], sk[b] :] = np.nan
            v[idx[b], sk[b] :] = np.nan
        return q, k, v, sk, idx

    b, c = torch.export.Dim("batch"), torch.export.Dim("caches")
    example = problem(2, 3)
    dims = [{0: b}, {0: c}, {0: c}, {0: b}, {0: b}]
    main = _compiled(KVCacheAttention(), example, dims)
    for batch, caches in ((2, 3), (4, 7)):
        q, k, v, sk, idx = problem(batch, caches)
        out = main(q, k, v, sk, idx).to_host().astype(np.float64)
        # The reference over the same rows as pages of the whole row.
        ref = fmha_fwd_paged_ref(q, k, v, idx[:, None], sk, mask_type="bottom_right", window_size_right=0)[0]
        assert np.abs(out - ref).max() / np.abs(ref).max() <= OUT_TOL["f16"]


def test_other_public_functions_refuse_export():
    class Flash(torch.nn.Module):
        def forward(self, q, k_cache):
            return turbine_fmha.flash_attn_with_kvcache(q, k_cache, k_cache)

    args = (torch.zeros(2, 1, 2, 64, dtype=torch.float16), torch.zeros(2, 16, 2, 64, dtype=torch.float16))
    with pytest.raises(
        NotImplementedError, match="flash_attn_with_kvcache inside an exported program is not supported"
    ):
        aot.export(Flash(), args=args, strict_export=False)


def test_exported_reshape_and_cache_refuses_what_it_does_not_take():
    class Rotate(torch.nn.Module):
        def forward(self, k, k_cache, slots, cos):
            turbine_fmha.reshape_and_cache(k, k, k_cache, k_cache, slots, rotary_cos=cos, rotary_sin=cos)
            return k_cache

    args = (
        torch.zeros(2, 2, 64, dtype=torch.float16),
        torch.zeros(4, 16, 2, 64, dtype=torch.float16),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(8, 32, dtype=torch.float16),
    )
    with pytest.raises(NotImplementedError, match="rotary_cos is not supported by reshape_and_cache inside an export"):
        aot.export(Rotate(), args=args, strict_export=False)


def test_the_mlir_isinstance_fix():
    """ensure_mlir_isinstance restores the bindings' static isinstance as
    iree-turbine 3.9 calls it: true only for the class's own kind (the
    base Type's would accept anything)."""
    from iree.compiler import ir

    from turbine_fmha.kernels.turbine_compat import ensure_mlir_isinstance

    ensure_mlir_isinstance()
    assert ensure_mlir_isinstance() == 0  # once
    with ir.Context(), ir.Location.unknown():
        i32, f32, tensor = (ir.Type.parse(t) for t in ("i32", "f32", "tensor<4xf16>"))
        assert ir.IntegerType.isinstance(i32) and not ir.IntegerType.isinstance(f32)
        assert ir.RankedTensorType.isinstance(tensor) and not ir.RankedTensorType.isinstance(i32)
        assert ir.F32Type.isinstance(f32) and not ir.F64Type.isinstance(f32)


def test_the_export_knows_every_argument_of_the_eager_call():
    """Each argument of fmha_fwd_paged is taken or refused by name inside
    an export: a new argument cannot reach an export unnoticed."""
    import inspect

    from turbine_fmha.api import eager, exported

    taken = set(inspect.signature(exported.call_paged).parameters) - {"others"}
    assert set(inspect.signature(eager.fmha_fwd_paged).parameters) == taken | set(exported._UNSUPPORTED)


@pytest.mark.parametrize("batch", [3, 9, 130])
def test_exported_online_decode_with_static_batch(rng, batch):
    """export_options(formulation="online"): a static-batch decode runs the
    online kernel of the runtime's batch tile (3 -> one launch of tile 8,
    9 -> tile 32, 130 -> launches of 128 and 128), the batch padded in the
    program; kv_rows_finite=True picks the guard-free kernel; a causal
    decode runs the mask-free kernel (its row sees every key), as the
    runtime does. Against the float64 reference, garbage in unused slots;
    NaN in unused pages where the guard runs."""
    from turbine_fmha.kernels.variants import decode_batch_tile

    shape = dict(dtype="f16", seqlen_q=1, nhead_q=4, nhead_k=2, hdim=32, page=16)
    seqlens = rng.integers(1, 70, batch).tolist()
    for finite in (None, True):
        prob = make_problem(rng, batch=batch, seqlens_k=seqlens, extra_slots=2, **shape)
        if finite:  # the guard-free kernel's precondition: every page finite
            prob = (prob[0], np.nan_to_num(prob[1]), np.nan_to_num(prob[2]), *prob[3:])
        module = Attention(kv_rows_finite=finite, causal=not finite)
        with turbine_fmha.export_options(formulation="online"):
            exported = aot.export(module, args=tuple(numpy_to_torch(a) for a in prob))
        text = str(exported.mlir_module)
        tile = decode_batch_tile(batch)
        assert f"_nmask_lse_online_b{tile}_q1_{'nvguard_' if finite else ''}m" in text
        assert "_explicit" not in text

        main = _host_main(text)
        causal = {} if finite else dict(mask_type="bottom_right", window_size_right=0)
        _check(main, prob, "f16", **causal)


@pytest.mark.parametrize("batch, splits, tile", [(3, 4, 32), (9, 4, 64), (2, 2, 32), (40, 4, 128)])
def test_exported_online_decode_in_merged_splits(rng, batch, splits, tile):
    """export_options(formulation="online", num_splits=n): each sequence's
    keys as n entries over runs of its table's columns (absolute key
    positions through kv_shift, the table padded with its first page),
    merged inside the kernel: the merged variant of the runtime's tile for
    batch x n entries, the smallest merged tile that n divides and that
    holds them (3 x 4 -> tile 32, 9 x 4 -> 64, 2 x 2 -> 32; 40 x 4 -> two
    launches of 128), the table width and page count dynamic (widths that
    n divides and that it does not; sequences shorter than a split). Against the float64
    reference, garbage in unused slots, NaN in unused pages."""

    shape = dict(dtype="f16", seqlen_q=1, nhead_q=4, nhead_k=2, hdim=32, page=16)
    seqlens = rng.integers(1, 200, batch).tolist()
    prob = make_problem(rng, batch=batch, seqlens_k=seqlens, extra_slots=2, **shape)
    pages, width = torch.export.Dim("pages"), torch.export.Dim("width")
    dims = [None, {0: pages}, {0: pages}, {1: width}, None]
    with turbine_fmha.export_options(formulation="online", num_splits=splits):
        exported = aot.export(Attention(causal=True), args=tuple(numpy_to_torch(a) for a in prob), dynamic_shapes=dims)
    text = str(exported.mlir_module)
    assert f"_nmask_lse_online_b{tile}_q1_m16_x{splits}" in text and "_explicit" not in text
    main = _host_main(text)
    for lens in (seqlens, [int(x) for x in rng.integers(1, 300, batch)], [1] * batch):
        prob = make_problem(rng, batch=batch, seqlens_k=lens, extra_slots=int(rng.integers(0, 4)), **shape)
        _check(main, prob, "f16", mask_type="bottom_right", window_size_right=0)


@pytest.mark.parametrize("rows, seqlens, tile", [(5, [5, 40, 17], 128), (200, [200, 260], 128)])
def test_exported_online_prefill_bucket(rng, rows, seqlens, tile):
    """export_options(formulation="online") on a prefill of a static batch
    and row count (a bucket): per sequence, chunks of the one-sequence
    prefill tile the planner picks, as for the eager call (the least
    padding: 5 rows are one padded chunk of 128; 200 rows two chunks, the
    last padded, each starting at its first row and reading the table's
    columns up to its diagonal), causal with the bottom-right diagonal,
    sequences with keys cached before the rows among them. Against the
    float64 reference, garbage in unused slots, NaN in unused pages (the
    guarded kernel)."""
    shape = dict(dtype="f16", seqlen_q=rows, nhead_q=4, nhead_k=2, hdim=32, page=16)
    prob = make_problem(rng, batch=len(seqlens), seqlens_k=seqlens, extra_slots=2, **shape)
    with turbine_fmha.export_options(formulation="online"):
        exported = aot.export(Attention(causal=True), args=tuple(numpy_to_torch(a) for a in prob))
    text = str(exported.mlir_module)
    assert f"_mbr_lse_online_b1_q{tile}" in text and "_explicit" not in text
    main = _host_main(text)
    _check(main, prob, "f16", mask_type="bottom_right", window_size_right=0)


def test_online_export_refuses_what_it_does_not_take():
    with turbine_fmha.export_options(formulation="online"):
        b = torch.export.Dim("batch")
        dims = [{0: b}, None, None, {0: b}, {0: b}]
        with pytest.raises(NotImplementedError, match="a static batch and static query rows"):
            aot.export(Attention(), args=_example(), dynamic_shapes=dims, strict_export=False)
    with pytest.raises(ValueError, match="formulation must be one of"):
        with turbine_fmha.export_options(formulation="fast"):
            pass
    with pytest.raises(ValueError, match="num_splits needs formulation='online'"):
        with turbine_fmha.export_options(num_splits=4):
            pass
    for bad in (3, 0, True, 256):
        with pytest.raises(ValueError, match="num_splits must be one of"):
            with turbine_fmha.export_options(formulation="online", num_splits=bad):
                pass
    shape = dict(dtype="f16", seqlen_q=8, nhead_q=4, nhead_k=2, hdim=32, page=16)
    prob = make_problem(np.random.default_rng(0), batch=2, seqlens_k=[8, 20], **shape)
    with turbine_fmha.export_options(formulation="online", num_splits=4):
        with pytest.raises(NotImplementedError, match="splits decodes"):
            aot.export(Attention(causal=True), args=tuple(numpy_to_torch(a) for a in prob), strict_export=False)
    assert "_explicit" in str(aot.export(Attention(), args=_example()).mlir_module)  # the block ended
