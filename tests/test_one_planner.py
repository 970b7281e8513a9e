"""One planner for the eager call and the exported program.

An exported program plans the problem of its declared shapes with the
planner the eager call uses (calls/planner.py), on the variants a program
can compile (selection.Catalog), under planner.EXPORTED: its tables are
program inputs, so it cuts no table where only their values tell where
(a window's first pages). Here the eager call is planned on the same
catalog, run by the executor on a CPU session, and the exported program
compiled for the host: over decodes, split decodes, causal and chunked
prefills and windows, both run the same variant over the same launches
(the same batch and row spans, each padded to the same tile, reading at
least the columns the eager step reads and no more than the table holds),
and both agree with the float64 reference and with each other.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CACHE, make_problem
from tolerances import LSE_TOL, OUT_TOL

torch = pytest.importorskip("torch")
aot = pytest.importorskip("iree.turbine.aot")

import turbine_fmha  # noqa: E402
from turbine_fmha.api import exported  # noqa: E402
from turbine_fmha.calls.planner import make_plan  # noqa: E402
from turbine_fmha.calls.problem import from_arrays  # noqa: E402
from turbine_fmha.core.arrays import numpy_to_torch  # noqa: E402
from turbine_fmha.runtime.executor import Executor, Results  # noqa: E402
from turbine_fmha.runtime.selection import Catalog  # noqa: E402
from turbine_fmha.testing.reference import fmha_fwd_paged_ref  # noqa: E402

CAUSAL = dict(mask_type="bottom_right", window_size_right=0)
SHAPE = dict(dtype="f16", nhead_q=4, nhead_k=2, hdim=32, page=16)

# (formulation, num_splits, batch, rows, keys per sequence, mask): a decode
# (its causal mask dropped: the row sees every key), a causal prefill in
# masked chunks each cut at its diagonal, a chunked prefill (rows over keys
# cached before them), a sliding window; on the online kernels a decode in
# the runtime's batch tile, a decode in splits merged in the module, a
# prefill bucket in prefill tiles.
CASES = {
    "explicit_decode": ("explicit", None, 3, 1, [40, 70, 9], CAUSAL),
    "explicit_causal_prefill": ("explicit", None, 2, 150, [150, 190], CAUSAL),
    "explicit_chunked_prefill": ("explicit", None, 2, 40, [200, 120], CAUSAL),
    "explicit_window": ("explicit", None, 2, 100, [100, 180], dict(CAUSAL, window_size_left=24)),
    "online_decode": ("online", None, 3, 1, [40, 70, 9], CAUSAL),
    "online_split_decode": ("online", 4, 3, 1, [200, 70, 9], CAUSAL),
    "online_prefill": ("online", None, 2, 150, [150, 170], CAUSAL),
}


class _Attention(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k_cache, v_cache, block_table, seqlen_k):
        return turbine_fmha.fmha_fwd_paged(q, k_cache, v_cache, block_table, seqlen_k, return_lse=True, **self.kw)


def _spans(steps):
    return [(st.b0, st.b1, st.s, st.e, st.tile, st.merge) for st in steps]


@pytest.mark.parametrize("case", list(CASES))
def test_eager_and_exported_run_one_plan(rng, monkeypatch, case):
    formulation, splits, batch, rows, keys, mask = CASES[case]
    q, k, v, bt, sk = make_problem(rng, batch=batch, seqlen_q=rows, seqlens_k=keys, **SHAPE)
    ref, ref_lse = fmha_fwd_paged_ref(q, k, v, bt, sk, **mask)

    # The eager call, planned on what an exported program can compile. A
    # program cannot look at the stale V rows, so it runs the guarded
    # kernel (unless told kv_rows_finite=True): so does the eager call here.
    catalog = Catalog(formulation)
    arrays = dict(q=q, k_cache=k, v_cache=v, block_table=bt, seqlen_k=sk)
    p = from_arrays(**arrays, num_splits=splits, kv_rows_finite=False, **mask)
    plan = make_plan(p, catalog)
    session = turbine_fmha.Session(
        "cpu", compile_missing=True, cache_dir=CACHE, artifact_dir=CACHE / "none", formulation=formulation
    )
    runner = Executor(plan, session)
    eager_out, eager_lse = runner.run(q, k, v, return_lse=True)
    (part,) = plan.parts
    variant = runner.variant(0, runner._rows_finite(0, v))

    # The exported program of the same shapes, its plan recorded.
    record = []
    monkeypatch.setattr(exported, "_RECORD", record)
    options = dict(formulation=formulation, num_splits=splits) if formulation == "online" else {}
    with turbine_fmha.export_options(**options):
        program = aot.export(_Attention(**mask), args=tuple(numpy_to_torch(a) for a in (q, k, v, bt, sk)))
    ((exported_variant, exported_steps),) = record
    assert exported_variant == variant
    eager_steps = runner.device_steps(0, variant, Results(session))
    assert _spans(exported_steps) == _spans(eager_steps)
    for mine, theirs in zip(exported_steps, eager_steps):
        assert theirs.width <= mine.width <= bt.shape[1], (mine.width, theirs.width)

    main = _host_main(str(program.mlir_module))
    out, lse = (x.to_host() for x in main(q, k, v, bt, sk))
    for o, lse_ in ((eager_out, eager_lse), (out, lse)):
        err = np.abs(o.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert err <= OUT_TOL["f16"], err
        np.testing.assert_array_equal(np.isneginf(lse_), np.isneginf(ref_lse))
        finite = ~np.isneginf(ref_lse)
        assert np.abs(lse_[finite] - ref_lse[finite]).max() <= LSE_TOL["f16"]
    # Same kernels over the same launches: the results agree to the last
    # rounding of the output (the programs' kernels are compiled apart).
    assert np.abs(out.astype(np.float64) - eager_out).max() <= OUT_TOL["f16"] * np.abs(ref).max()


def _host_main(mlir: str):
    import iree.compiler as ic
    import iree.runtime as rt

    flags = ["--iree-llvmcpu-target-cpu=host", "--iree-llvmcpu-fail-on-large-vector=false"]
    vmfb = ic.compile_str(mlir, target_backends=["llvm-cpu"], extra_args=flags)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return ctx.modules.module["main"]
