"""Exported programs on the GPU (the former probe gpu_contract.py's
programs, which tests/test_export_contract.py runs on the CPU): programs
exported through torch.export with the kernels inside, compiled for sm_80
by scripts/build_gpu_tests.py (exported/), loaded with the IREE runtime
alone on the session's device:

- a causal decode with dynamic batch, pages and width ("explicit") and the
  online decode of a static batch ("online"): the float64 reference's
  outputs within the contract; a bad used slot cuts its sequence there;
  a v_cache of other pages fails the invocation (the guard's message, or
  IREE's shape check for the static program); a batch past the table
  fails it too;
- reshape_and_cache with a dynamic token count ("write"): slots outside
  the caches (-1, the row count, 10^9, -7) skipped, the others written.
"""

from __future__ import annotations

import numpy as np
import pytest

from turbine_fmha.testing.reference import fmha_fwd_paged_ref

from .conftest import MASK, check

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def programs(gpu):
    import iree.runtime as rt

    config = rt.Config(device=gpu.session.device_of())
    inputs = dict(np.load(gpu.exported / "inputs.npz"))

    def load(name):
        """The program's `main`, loaded once per call of load."""
        ctx = rt.SystemContext(config=config)
        data = (gpu.exported / f"{name}.vmfb").read_bytes()
        ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, data))
        return ctx.modules.module["main"]

    return load, inputs


@pytest.mark.parametrize("name", ["explicit", "online"])
def test_attention_within_the_contract(programs, name):
    load, x = programs
    out = load(name)(x["q"], x["k"], x["v"], x["bt"], x["sk"])[0].to_host()
    check(out, fmha_fwd_paged_ref(x["q"], x["k"], x["v"], x["bt"], x["sk"], **MASK)[0], what=name)


@pytest.mark.parametrize("name", ["explicit", "online"])
def test_bad_used_slot_cuts_its_sequence(programs, name):
    load, x = programs
    bad = x["bt"].copy()
    bad[1, 1] = -5
    cut = x["sk"].copy()
    cut[1] = 16  # the page before the bad slot
    out = load(name)(x["q"], x["k"], x["v"], bad, x["sk"])[0].to_host()
    check(out, fmha_fwd_paged_ref(x["q"], x["k"], x["v"], bad, cut, **MASK)[0], what=name)


@pytest.mark.parametrize(
    "name, words",
    [
        ("explicit", "v_cache dim 0 differs"),
        # The online program's sizes are static: IREE's ABI refuses other
        # shapes before the guard would.
        ("online", "mismatch"),
    ],
)
def test_v_cache_of_other_pages_refused(programs, name, words):
    load, x = programs
    main = load(name)
    with pytest.raises((RuntimeError, ValueError), match=words):
        main(x["q"], x["k"], x["v"][:1], x["bt"], x["sk"])


def test_batch_past_the_table_refused(programs):
    load, x = programs
    explicit = load("explicit")
    with pytest.raises(RuntimeError, match="block_table dim 0 differs"):
        explicit(np.repeat(x["q"][:1], 1000, 0), x["k"], x["v"], x["bt"][:1], x["sk"][:1])


def test_write_skips_slots_outside_the_caches(programs):
    load, x = programs
    write = load("write")
    rng = np.random.default_rng(1)
    rows = x["k0"].shape[0] * x["k0"].shape[1]
    tail = x["k0"].shape[2:]
    slots = np.array([-1, 5, rows, 37, 10**9, -7, 0], np.int64)
    kn = rng.standard_normal((len(slots), *tail)).astype(np.float16)
    vn = rng.standard_normal((len(slots), *tail)).astype(np.float16)
    k_out, v_out = write(kn, vn, slots)
    k_ref, v_ref = x["k0"].copy(), x["v0"].copy()
    for i, s in enumerate(slots):
        if 0 <= s < rows:
            k_ref.reshape(-1, *tail)[s], v_ref.reshape(-1, *tail)[s] = kn[i], vn[i]
    np.testing.assert_array_equal(k_out.to_host(), k_ref)
    np.testing.assert_array_equal(v_out.to_host(), v_ref)
