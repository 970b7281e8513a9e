"""torch.ops.turbine_fmha, and the public functions
compiled with torch.compile(fullgraph=True) on the CPU (where they route
through the ops), against the float64 reference on fresh random inputs
with garbage in unused block-table slots and NaN-poisoned outputs.
tests/gpu/test_gpu_torch_compile.py runs the same on CUDA."""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import CACHE, make_problem  # noqa: E402
from tolerances import LSE_TOL, OUT_TOL  # noqa: E402

import turbine_fmha  # noqa: E402
from turbine_fmha import flash_attn_with_kvcache  # noqa: E402
from turbine_fmha.api import torch_ops  # noqa: E402
from turbine_fmha.testing.reference import fmha_fwd_paged_ref  # noqa: E402

OPS = torch.ops.turbine_fmha


def _tensors(*arrays):
    return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)


def _recording(backend: str, graphs: list):
    """A torch.compile backend that keeps each graph, then compiles it
    with `backend`."""
    from torch._dynamo.backends.registry import lookup_backend

    def compile_fn(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    return compile_fn


def _ops_in(graphs) -> set:
    return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


def _check(out, ref, lse=None, ref_lse=None):
    # f16 through the kernels run_and_check covers: conftest's bounds (derived there).
    o = out.double().numpy()
    assert np.isfinite(o).all()
    err = np.abs(o - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= OUT_TOL["f16"], f"output rel err {err:.3e}"
    if lse is not None:
        lse = lse.numpy()
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        assert np.abs(lse[finite] - ref_lse[finite]).max(initial=0) <= LSE_TOL["f16"]


class _Layer(torch.nn.Module):
    """A decode/prefill attention layer over a paged cache held as buffers."""

    def __init__(self, k_cache, v_cache, session):
        super().__init__()
        self.register_buffer("k_cache", k_cache)
        self.register_buffer("v_cache", v_cache)
        self.session = session

    def forward(self, q, block_table, seqlen_k):
        out, lse = turbine_fmha.fmha_fwd_paged(
            q, self.k_cache, self.v_cache, block_table, seqlen_k, causal=True, return_lse=True, session=self.session
        )
        return out * 2, lse  # torch work around the op, compiled with it


def test_compiled_module_fullgraph_inductor(explicit_session, rng):
    """The default backend (inductor), one graph holding the op; fresh q
    each call; compiled results are the eager ones bit for bit."""
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=3, seqlen_q=5, seqlens_k=[40, 9, 0], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    layer = _Layer(*_tensors(k, v), explicit_session)
    graphs = []
    compiled = torch.compile(layer, fullgraph=True, backend=_recording("inductor", graphs))
    for _ in range(2):
        tq, tbt, tsk = _tensors(q, bt, sk)
        out, lse = compiled(tq, tbt, tsk)
        ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, mask_type="bottom_right", window_size_right=0)
        _check(out / 2, ref, lse, ref_lse)
        want, want_lse = layer(tq, tbt, tsk)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        q = rng.standard_normal(q.shape).astype(np.float16)
    assert len(graphs) == 1, "recompiled for a new q of the same shape"
    assert "turbine_fmha.fmha_fwd_paged.default" in _ops_in(graphs)


def test_out_form_compiled_group_mode(explicit_session, rng):
    """out= through fmha_fwd_paged_out: rows of sequences skipped by
    min_seqlen_q keep the caller's values (NaN here), every other row is
    written. With dynamic shapes, a new total_q reuses the graph (the fake
    keeps sizes symbolic)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, dynamic=True, backend=counter)
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
            window_size=(7, 0),
            return_lse=True,
            session=explicit_session,
        )

    frames = []
    # total_q 12 then 13, never the pool's 11 pages (equal sizes would share one symbol).
    for lens_q in ([4, 1, 7], [2, 9, 2]):
        q4, k, v, bt, sk = make_problem(
            rng,
            dtype="f16",
            batch=3,
            seqlen_q=max(lens_q),
            seqlens_k=[50, 17, 30],
            nhead_q=4,
            nhead_k=2,
            hdim=64,
            page=16,
        )
        q = np.concatenate([q4[b, :n] for b, n in enumerate(lens_q)])
        starts = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
        out = torch.full((q.shape[0], 4, 64), float("nan"), dtype=torch.float16)
        got, lse = attend(*_tensors(q, k, v, bt, sk, starts), out)
        assert got is out and lse.shape == (4, q.shape[0])
        ref, ref_lse = fmha_fwd_paged_ref(
            q, k, v, bt, sk, seqstart_q=starts, mask_type="bottom_right", window_size_left=7, window_size_right=0
        )
        kept = np.repeat(np.array(lens_q) > 1, lens_q)
        assert torch.isnan(out[torch.from_numpy(~kept)]).all()
        _check(out[torch.from_numpy(kept)], ref[kept], lse[:, torch.from_numpy(kept)], ref_lse[:, kept])
        frames.append(counter.frame_count)
    assert frames[0] == frames[1], "recompiled for a new total_q"


def test_kvcache_and_flash_attn_compiled(explicit_session, rng):
    """fmha_fwd_kvcache (out= form too) and flash_attn_with_kvcache
    compiled: an int cache_seqlens becomes a tensor in the graph, and
    the results are the eager ones bit for bit."""
    k = rng.standard_normal((4, 48, 2, 64)).astype(np.float16)
    v = rng.standard_normal((4, 48, 2, 64)).astype(np.float16)
    q = rng.standard_normal((3, 2, 4, 64)).astype(np.float16)
    rows = np.array([3, 0, 2], np.int32)
    tq, tk, tv, trows = _tensors(q, k, v, rows)

    def flash(q, k, v, rows):
        return flash_attn_with_kvcache(
            q,
            k,
            v,
            cache_seqlens=30,
            cache_batch_idx=rows,
            causal=True,
            return_softmax_lse=True,
            session=explicit_session,
        )

    def kvcache_out(q, k, v, rows, out):
        return turbine_fmha.fmha_fwd_kvcache(
            q, k, v, cache_seqlens=30, cache_batch_idx=rows, causal=True, out=out, session=explicit_session
        )

    graphs = []
    out, lse = torch.compile(flash, fullgraph=True, backend=_recording("aot_eager", graphs))(tq, tk, tv, trows)
    ref, ref_lse = fmha_fwd_paged_ref(
        q, k, v, rows[:, None], np.full(3, 30, np.int32), mask_type="bottom_right", window_size_right=0
    )
    _check(out, ref, lse, ref_lse)
    want, want_lse = flash(tq, tk, tv, trows)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    poisoned = torch.full_like(tq, float("nan"))
    got = torch.compile(kvcache_out, fullgraph=True, backend=_recording("aot_eager", graphs))(
        tq, tk, tv, trows, poisoned
    )
    assert got is poisoned and torch.equal(poisoned, want)
    assert {"turbine_fmha.fmha_fwd_kvcache.default", "turbine_fmha.fmha_fwd_kvcache_out.default"} <= _ops_in(graphs)


def _op_args(rng, kind):
    if kind == "paged":
        q, k, v, bt, sk = make_problem(
            rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16
        )
        return _tensors(q, k, v, bt, sk), q.shape
    k = rng.standard_normal((3, 32, 2, 64)).astype(np.float16)
    q = rng.standard_normal((2, 3, 4, 64)).astype(np.float16)
    return _tensors(q, k, k.copy(), np.array([17, 32], np.int32), np.array([2, 0], np.int32)), q.shape


@pytest.mark.parametrize("kind", ["paged", "kvcache"])
@pytest.mark.parametrize("out_form", [False, True])
def test_opcheck(explicit_session, rng, kind, out_form):
    """torch's own checks of each op: schema (mutation declared), fake
    implementation against the real one, autograd registration, and AOT
    dispatch with dynamic shapes."""
    args, q_shape = _op_args(rng, kind)
    if out_form:
        # After the required tensors: the schema's position of out.
        n = 5 if kind == "paged" else 4
        args = args[:n] + (torch.full(q_shape, float("nan"), dtype=torch.float16),) + args[n:]
    op = getattr(OPS, f"fmha_fwd_{kind}" + ("_out" if out_form else "")).default
    torch.library.opcheck(
        op,
        args,
        dict(session=torch_ops.session_handle(explicit_session), mask_type="bottom_right", window_size_right=0),
    )


@pytest.mark.parametrize("arg", ["q", "k_cache", "v_cache"])
def test_requires_grad_is_refused(trap, explicit_session, rng, arg):
    """No backward exists: an input that requires grad raises by name,
    eager and compiled before any kernel (the trap session), and through
    the op itself (its autograd setup); with grad mode off the call runs."""
    q, k, v, bt, sk = _tensors(
        *make_problem(rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16)
    )
    args = dict(q=q, k_cache=k, v_cache=v, block_table=bt, seqlen_k=sk)
    args[arg] = args[arg].clone().requires_grad_(True)
    words = f"{arg} requires grad"
    with pytest.raises(ValueError, match=words):
        turbine_fmha.fmha_fwd_paged(**args, session=trap)
    with pytest.raises(ValueError, match=words):
        OPS.fmha_fwd_paged(*args.values(), session=torch_ops.session_handle(explicit_session))
    with pytest.raises(Exception, match=words):  # dynamo reports it as the traced code's exception
        torch.compile(lambda a: turbine_fmha.fmha_fwd_paged(**a, session=trap), fullgraph=True, backend="aot_eager")(
            args
        )
    with torch.no_grad():
        out = turbine_fmha.fmha_fwd_paged(**args, session=explicit_session)
    assert not out.requires_grad
    assert torch.equal(
        out, turbine_fmha.fmha_fwd_paged(**{n: a.detach() for n, a in args.items()}, session=explicit_session)
    )


def test_compiled_call_takes_torch_tensors_only(trap, rng):
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    tq, tk, tv = _tensors(q, k, v)
    with pytest.raises(Exception, match="block_table must be a torch tensor"):
        torch.compile(
            lambda q: turbine_fmha.fmha_fwd_paged(q, tk, tv, bt, sk, session=trap), fullgraph=True, backend="aot_eager"
        )(tq)


def test_session_met_first_in_a_graph(explicit_session, trap, rng):
    """A session that compiled code meets before any eager call: tracing
    keeps only its id (dynamo folds id() into a constant and guards on the
    object; torch 2.11 refuses a Session to assume_constant_result), and
    the op finds the session among the live ones (runtime.LIVE_SESSIONS).
    Another session is another graph that runs on it: the trap session
    refuses, rather than the first graph's session running."""
    fresh = turbine_fmha.Session("cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none")
    q, k, v, bt, sk = _tensors(
        *make_problem(rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16)
    )
    attend = torch.compile(
        lambda q, s: turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, causal=True, session=s),
        fullgraph=True,
        backend="aot_eager",
    )
    out = attend(q, fresh)
    assert torch.equal(out, turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, causal=True, session=explicit_session))
    with pytest.raises(AssertionError, match="variant selected"):
        attend(q, trap)


def test_session_handles(tmp_path, rng):
    """One handle per live session, 0 for the default one; a handle whose
    session was collected (and whose address no new Session took) is
    refused by the op."""
    a, b = (turbine_fmha.Session("cpu", artifact_dir=tmp_path) for _ in range(2))
    ha, hb = torch_ops.session_handle(a), torch_ops.session_handle(b)
    assert ha != hb and ha == torch_ops.session_handle(a) and torch_ops.session_handle(None) == 0
    with pytest.raises(TypeError, match="session must be a turbine_fmha.Session"):
        torch_ops.session_handle("cpu")
    del a
    gc.collect()
    args, _ = _op_args(rng, "paged")
    with pytest.raises(RuntimeError, match=f"session handle {ha} names no live"):
        OPS.fmha_fwd_paged(*args, session=ha)
    assert torch_ops._session(hb) is b


# -- KV writes, errors and recompiles under torch.compile --------------------


def _dense_caches(rng, batch_cache, rows, heads, hdim):
    """Caches in torch's own (64-byte aligned) memory, which KV writes need."""
    k = rng.standard_normal((batch_cache, rows, heads, hdim)).astype(np.float16)
    v = rng.standard_normal((batch_cache, rows, heads, hdim)).astype(np.float16)
    return tuple(t.clone() for t in _tensors(k, v))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_kv_writes_build_their_kernels_on_first_use(tmp_path, rng, caplog, fullgraph):
    """A compiled function whose KV writes need an append kernel the
    session has not built yet builds it when it first runs (outside what
    dynamo traces: tracing into the build crashed) and then does exactly
    what the eager calls do: results and caches bit for bit. Two kernels
    are compiled on demand in the compiled region: the plain append of the
    in-call append, and reshape_and_cache's rotary one. The session's cache
    is fresh (tmp_path) and the kernels' shape is this test's own (3 KV
    heads of 64), so both compiles happen here."""
    import logging

    session = turbine_fmha.Session("cpu", compile_missing=True, cache_dir=tmp_path, artifact_dir=CACHE)
    kc, vc = _dense_caches(rng, 4, 16, 3, 64)
    q = torch.from_numpy(rng.standard_normal((2, 1, 6, 64)).astype(np.float16))
    k_new, v_new = (torch.from_numpy(rng.standard_normal((2, 1, 3, 64)).astype(np.float16)) for _ in range(2))
    rows = torch.tensor([3, 1], dtype=torch.int32)
    theta = rng.uniform(0, 2 * np.pi, (8, 8))
    cos, sin = (torch.from_numpy(f(theta).astype(np.float32)) for f in (np.cos, np.sin))
    slots = torch.tensor([[0 * 16 + 6], [2 * 16 + 7]])  # cache rows 0 and 2, positions 6 and 7

    def step(q, kc, vc, k_new, v_new):
        out, lse = flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k=k_new,
            v=v_new,
            cache_seqlens=5,
            cache_batch_idx=rows,
            causal=True,
            return_softmax_lse=True,
            session=session,
        )
        q_rot = turbine_fmha.reshape_and_cache(
            k_new,
            v_new,
            kc,
            vc,
            slots,
            q=q,
            rotary_cos=cos,
            rotary_sin=sin,
            seqlen_k=torch.tensor([6, 7]),
            session=session,
        )
        return out * 1, lse, q_rot

    eager_kc, eager_vc = kc.clone(), vc.clone()
    with caplog.at_level(logging.WARNING, logger="turbine_fmha.runtime"):
        got = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(q, kc, vc, k_new, v_new)
    built = [r.getMessage() for r in caplog.records if "compiling pagedkv_append" in r.getMessage()]
    assert len(built) == 2, built
    want = step(q, eager_kc, eager_vc, k_new, v_new)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(kc.view(torch.int16), eager_kc.view(torch.int16))
    assert torch.equal(vc.view(torch.int16), eager_vc.view(torch.int16))
    # Attention saw cache rows 3 and 1 with their new key 5; the later
    # writes went to rows 0 and 2.
    ref, ref_lse = fmha_fwd_paged_ref(
        q.numpy(),
        kc.numpy(),
        vc.numpy(),
        rows.numpy()[:, None],
        np.full(2, 6, np.int32),
        mask_type="bottom_right",
        window_size_right=0,
    )
    _check(got[0], ref, got[1], ref_lse)


def test_compiled_in_call_append_errors_keep_their_type(trap, rng):
    """Argument errors of a compiled in-call append are raised when the op
    runs, as in eager code, so they keep their type under fullgraph=True
    (an error raised while dynamo traces reaches the caller as
    torch._dynamo.exc.Unsupported)."""
    kc, vc = _dense_caches(rng, 2, 16, 2, 64)
    q = torch.zeros(2, 1, 4, 64, dtype=torch.float16)
    cos = torch.ones(8, 8)
    compiled = torch.compile(
        lambda q, kc, vc: flash_attn_with_kvcache(
            q, kc, vc, rotary_cos=cos, rotary_sin=cos, cache_seqlens=3, session=trap
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(NotImplementedError, match="rotary_cos/rotary_sin without k/v"):
        compiled(q, kc, vc)
    k_new = torch.zeros(2, 1, 2, 64, dtype=torch.float16)
    compiled = torch.compile(
        lambda q, kc, vc, k: flash_attn_with_kvcache(q, kc, vc, k=k, v=k, session=trap),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(ValueError, match="cache_seqlens is required with k/v"):
        compiled(q, kc, vc, k_new)


def test_dynamic_shapes_one_graph_across_pools_and_batches(explicit_session, rng):
    """dynamic=True: new batches and new pool sizes reuse the graph (the
    fake implementation pinned every size it read with int(), so each new
    pool size recompiled). Sizes equal at the first call share one symbol
    under dynamo's duck sizing (a batch of 8 with 8 KV heads): caches
    marked static (torch._dynamo.mark_static, or module buffers) keep such
    a batch apart, as the user guide says."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def attend(q, k, v, bt, sk):
        return turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, causal=True, session=explicit_session)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=counter)
    # Pools of 4 + 3, 6 + 3 and 8 + 3 pages, tables 3 wide: no size equals
    # another (duck sizing would tie them).
    for batch in (4, 6, 8):
        p = make_problem(
            rng, dtype="f16", batch=batch, seqlen_q=1, seqlens_k=[20] * batch, nhead_q=10, nhead_k=5, hdim=64, page=32
        )
        out = compiled(*_tensors(*p))
        ref, _ = fmha_fwd_paged_ref(*p, mask_type="bottom_right", window_size_right=0)
        _check(out, ref)
    assert counter.frame_count == 1, "recompiled for a new batch or pool size"

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=counter)
    p = make_problem(
        rng, dtype="f16", batch=11, seqlen_q=1, seqlens_k=[20] * 11, nhead_q=16, nhead_k=8, hdim=64, page=32
    )
    q, k, v, bt, sk = _tensors(*p)
    torch._dynamo.mark_static(k)
    torch._dynamo.mark_static(v)
    for batch in (8, 9, 10, 11):
        out = compiled(q[:batch], k, v, bt[:batch], sk[:batch])
        ref, _ = fmha_fwd_paged_ref(
            p[0][:batch], p[1], p[2], p[3][:batch], p[4][:batch], mask_type="bottom_right", window_size_right=0
        )
        _check(out, ref)
    assert counter.frame_count == 1, "recompiled when the batch left the KV head count"


def _requires_grad_calls(rng, session):
    """Each op called directly with a tensor that requires grad (named),
    and what it must leave untouched."""
    args, q_shape = _op_args(rng, "paged")
    out = torch.full(q_shape, float("nan"), dtype=torch.float16)
    kv_args, _ = _op_args(rng, "kvcache")
    kc, vc = _dense_caches(rng, 2, 16, 2, 64)
    new = torch.zeros(1, 2, 64, dtype=torch.float16)
    h = dict(session=torch_ops.session_handle(session))
    q = args[0].clone().requires_grad_(True)
    return [
        ("q", lambda: OPS.fmha_fwd_paged(q, *args[1:], **h), ()),
        ("q", lambda: OPS.fmha_fwd_paged_out(q, *args[1:5], out, **h), (out,)),
        (
            "q",
            lambda: OPS.fmha_fwd_kvcache_out(
                kv_args[0].clone().requires_grad_(True), *kv_args[1:4], out, kv_args[4], **h
            ),
            (out,),
        ),
        (
            "k",
            lambda: OPS.reshape_and_cache(new.clone().requires_grad_(True), new, kc, vc, torch.tensor([3]), **h),
            (kc, vc),
        ),
        (
            "k",
            lambda: OPS.flash_attn_with_kvcache(
                torch.zeros(2, 1, 4, 64, dtype=torch.float16),
                kc,
                vc,
                new[None].expand(2, 1, 2, 64).clone().requires_grad_(True),
                new[None].expand(2, 1, 2, 64),
                cache_seqlens=torch.tensor([2, 3]),
                **h,
            ),
            (kc, vc),
        ),
    ]


def test_every_op_refuses_requires_grad_before_running(explicit_session, rng):
    """The _out ops and the KV-write ops refuse an input that requires
    grad by name, before anything is written (out keeps its NaN, the
    caches their bits), as the functional ops do; under torch.no_grad()
    the same calls run."""
    for name, call, untouched in _requires_grad_calls(rng, explicit_session):
        before = [t.clone() for t in untouched]
        with pytest.raises(ValueError, match=f"{name} requires grad"):
            call()
        for t, b in zip(untouched, before):
            assert torch.equal(t.view(torch.int16), b.view(torch.int16))
    for _, call, _ in _requires_grad_calls(rng, explicit_session):
        with torch.no_grad():
            result = call()
        results = result if isinstance(result, tuple) else (result,)
        assert not any(r.requires_grad for r in results)


def test_a_compiled_call_is_not_an_export(monkeypatch):
    """torch 2.11's dynamo answers torch.compiler.is_exporting() with True
    under torch.compile (docs/repro/README.md, "is_exporting under
    torch.compile"); made to answer so here, a compiled call must still see
    no export (the flag torch.export sets decides), and an export one."""
    from turbine_fmha.core import tracing

    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)

    def routed(x):
        return x + (1 if tracing.exporting() else 2)

    assert torch.compile(routed, fullgraph=True, backend="eager")(torch.zeros(1)).item() == 2

    class Exported(torch.nn.Module):
        def forward(self, x):
            return routed(x)

    program = torch.export.export(Exported(), (torch.zeros(1),))
    assert program.module()(torch.zeros(1)).item() == 1
