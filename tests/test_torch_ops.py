"""Issue 15 item 2: torch.ops.turbine_fmha, and the public functions
compiled with torch.compile(fullgraph=True) on the CPU (where they route
through the ops), against the float64 reference on fresh random inputs
with garbage in unused block-table slots and NaN-poisoned outputs.
scripts/h200_torch_compile.py runs the same on CUDA."""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import turbine_fmha  # noqa: E402
from conftest import CACHE, LSE_TOL, OUT_TOL, make_problem  # noqa: E402
from test_validation import _TrapSession  # noqa: E402
from turbine_fmha import torch_ops  # noqa: E402
from turbine_fmha.flash_attn import flash_attn_with_kvcache  # noqa: E402
from turbine_fmha.reference import fmha_fwd_paged_ref  # noqa: E402

OPS = torch.ops.turbine_fmha


@pytest.fixture(scope="module")
def trap(tmp_path_factory):
    return _TrapSession("cpu", artifact_dir=tmp_path_factory.mktemp("empty"))


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
        out, lse = turbine_fmha.fmha_fwd_paged(q, self.k_cache, self.v_cache, block_table, seqlen_k, causal=True,
                                               return_lse=True, session=self.session)
        return out * 2, lse  # torch work around the op, compiled with it


def test_compiled_module_fullgraph_inductor(explicit_session, rng):
    """The default backend (inductor), one graph holding the op; fresh q
    each call; compiled results are the eager ones bit for bit."""
    q, k, v, bt, sk = make_problem(rng, dtype="f16", batch=3, seqlen_q=5, seqlens_k=[40, 9, 0], nhead_q=4,
                                   nhead_k=2, hdim=64, page=16)
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
        return turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, seqstart_q=starts, min_seqlen_q=1, out=out,
                                           window_size=(7, 0), return_lse=True, session=explicit_session)

    frames = []
    # total_q 12 then 13, never the pool's 11 pages (equal sizes would share one symbol).
    for lens_q in ([4, 1, 7], [2, 9, 2]):
        q4, k, v, bt, sk = make_problem(rng, dtype="f16", batch=3, seqlen_q=max(lens_q), seqlens_k=[50, 17, 30],
                                        nhead_q=4, nhead_k=2, hdim=64, page=16)
        q = np.concatenate([q4[b, :n] for b, n in enumerate(lens_q)])
        starts = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
        out = torch.full((q.shape[0], 4, 64), float("nan"), dtype=torch.float16)
        got, lse = attend(*_tensors(q, k, v, bt, sk, starts), out)
        assert got is out and lse.shape == (4, q.shape[0])
        ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, seqstart_q=starts, mask_type="bottom_right",
                                          window_size_left=7, window_size_right=0)
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
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=30, cache_batch_idx=rows, causal=True,
                                       return_softmax_lse=True, session=explicit_session)

    def kvcache_out(q, k, v, rows, out):
        return turbine_fmha.fmha_fwd_kvcache(q, k, v, cache_seqlens=30, cache_batch_idx=rows, causal=True,
                                             out=out, session=explicit_session)

    graphs = []
    out, lse = torch.compile(flash, fullgraph=True, backend=_recording("aot_eager", graphs))(tq, tk, tv, trows)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, rows[:, None], np.full(3, 30, np.int32), mask_type="bottom_right",
                                      window_size_right=0)
    _check(out, ref, lse, ref_lse)
    want, want_lse = flash(tq, tk, tv, trows)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    poisoned = torch.full_like(tq, float("nan"))
    got = torch.compile(kvcache_out, fullgraph=True, backend=_recording("aot_eager", graphs))(tq, tk, tv, trows,
                                                                                               poisoned)
    assert got is poisoned and torch.equal(poisoned, want)
    assert {"turbine_fmha.fmha_fwd_kvcache.default", "turbine_fmha.fmha_fwd_kvcache_out.default"} <= _ops_in(graphs)


def _op_args(rng, kind):
    if kind == "paged":
        q, k, v, bt, sk = make_problem(rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4,
                                       nhead_k=2, hdim=64, page=16)
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
    torch.library.opcheck(op, args, dict(session=torch_ops.session_handle(explicit_session), mask_type="bottom_right",
                                         window_size_right=0))


@pytest.mark.parametrize("arg", ["q", "k_cache", "v_cache"])
def test_requires_grad_is_refused(trap, explicit_session, rng, arg):
    """No backward exists: an input that requires grad raises by name,
    eager and compiled before any kernel (the trap session), and through
    the op itself (its autograd setup); with grad mode off the call runs."""
    q, k, v, bt, sk = _tensors(*make_problem(rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4,
                                             nhead_k=2, hdim=64, page=16))
    args = dict(q=q, k_cache=k, v_cache=v, block_table=bt, seqlen_k=sk)
    args[arg] = args[arg].clone().requires_grad_(True)
    words = f"{arg} requires grad"
    with pytest.raises(ValueError, match=words):
        turbine_fmha.fmha_fwd_paged(**args, session=trap)
    with pytest.raises(ValueError, match=words):
        OPS.fmha_fwd_paged(*args.values(), session=torch_ops.session_handle(explicit_session))
    with pytest.raises(Exception, match=words):  # dynamo reports it as the traced code's exception
        torch.compile(lambda a: turbine_fmha.fmha_fwd_paged(**a, session=trap), fullgraph=True,
                      backend="aot_eager")(args)
    with torch.no_grad():
        out = turbine_fmha.fmha_fwd_paged(**args, session=explicit_session)
    assert not out.requires_grad
    assert torch.equal(out, turbine_fmha.fmha_fwd_paged(**{n: a.detach() for n, a in args.items()},
                                                        session=explicit_session))


def test_compiled_call_takes_torch_tensors_only(trap, rng):
    q, k, v, bt, sk = make_problem(rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2,
                                   hdim=64, page=16)
    tq, tk, tv = _tensors(q, k, v)
    with pytest.raises(Exception, match="block_table must be a torch tensor"):
        torch.compile(lambda q: turbine_fmha.fmha_fwd_paged(q, tk, tv, bt, sk, session=trap), fullgraph=True,
                      backend="aot_eager")(tq)


def test_session_met_first_in_a_graph(explicit_session, trap, rng):
    """A session that compiled code meets before any eager call: tracing
    keeps only its id (dynamo folds id() into a constant and guards on the
    object; torch 2.11 refuses a Session to assume_constant_result), and
    the op finds the session among the live ones (runtime.LIVE_SESSIONS).
    Another session is another graph that runs on it: the trap session
    refuses, rather than the first graph's session running."""
    fresh = turbine_fmha.Session("cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none")
    q, k, v, bt, sk = _tensors(*make_problem(rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4,
                                             nhead_k=2, hdim=64, page=16))
    attend = torch.compile(lambda q, s: turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, causal=True, session=s),
                           fullgraph=True, backend="aot_eager")
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
