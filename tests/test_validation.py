"""Bad inputs raise a clear error naming the argument, before any kernel is
loaded or run; the session stays usable afterwards."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem, run_and_check

import turbine_fmha


def _good(rng):
    return make_problem(
        rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16
    )


def _call(session, q, k, v, bt, sk, **kw):
    return turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, session=session, **kw)


BAD = {
    # name: (mutation of (q, k, v, bt, sk, kw), exception, words the message must contain)
    "q_rank": (lambda p: (p[0][0], *p[1:]), ValueError, ["q", "4 dims"]),
    "q_int_dtype": (lambda p: (p[0].astype(np.int32), *p[1:]), TypeError, ["q", "float16"]),
    "k_dtype_mismatch": (lambda p: (p[0], p[1].astype(np.float32), *p[2:]), TypeError, ["k_cache", "dtype"]),
    "v_dtype_mismatch": (lambda p: (p[0], p[1], p[2].astype(np.float32), *p[3:]), TypeError, ["v_cache", "dtype"]),
    "hdim_mismatch": (lambda p: (p[0][..., :32].copy(), *p[1:]), ValueError, ["head dim"]),
    "heads_ratio": (lambda p: (np.concatenate([p[0], p[0][:, :, :1]], 2), *p[1:]), ValueError, ["nhead_q", "multiple"]),
    "v_pages_mismatch": (lambda p: (p[0], p[1], p[2][:-1], *p[3:]), ValueError, ["v_cache"]),
    "bt_rank": (lambda p: (*p[:3], p[3][0], p[4], p[5]), ValueError, ["block_table", "2 dims"]),
    "bt_float": (lambda p: (*p[:3], p[3].astype(np.float32), p[4], p[5]), TypeError, ["block_table", "integer"]),
    "bt_rows": (lambda p: (*p[:3], p[3][:1], p[4], p[5]), ValueError, ["block_table", "rows"]),
    "bt_negative_used": (lambda p: (*p[:3], _set(p[3], (0, 0), -1), p[4], p[5]), ValueError, ["block_table[0, 0]"]),
    "bt_out_of_range_used": (
        lambda p: (*p[:3], _set(p[3], (1, 0), 10**6), p[4], p[5]),
        ValueError,
        ["block_table[1, 0]"],
    ),
    "seqlen_k_negative": (lambda p: (*p[:4], np.array([-1, 5], np.int32), p[5]), ValueError, ["seqlen_k", ">= 0"]),
    "seqlen_k_capacity": (
        lambda p: (*p[:4], np.array([20, 10**6], np.int32), p[5]),
        ValueError,
        ["seqlen_k[1]", "capacity"],
    ),
    "seqlen_k_len": (lambda p: (*p[:4], p[4][:1], p[5]), ValueError, ["seqlen_k", "entries"]),
    "seqlen_k_float": (lambda p: (*p[:4], p[4].astype(np.float32), p[5]), TypeError, ["seqlen_k"]),
    "mask_type": (lambda p: (*p[:5], dict(mask_type="causal")), ValueError, ["mask_type"]),
    "window_without_mask": (lambda p: (*p[:5], dict(window_size_left=4)), ValueError, ["window_size_left"]),
    "window_below_minus_one": (
        lambda p: (*p[:5], dict(mask_type="top_left", window_size_right=-2)),
        ValueError,
        ["window_size_right"],
    ),
    "window_float": (
        lambda p: (*p[:5], dict(mask_type="top_left", window_size_left=1.5)),
        TypeError,
        ["window_size_left"],
    ),
    "scale_str": (lambda p: (*p[:5], dict(scale="0.1")), TypeError, ["scale"]),
    "scale_nan": (lambda p: (*p[:5], dict(scale=float("nan"))), TypeError, ["scale"]),
    "return_lse_int": (lambda p: (*p[:5], dict(return_lse=1)), TypeError, ["return_lse"]),
    "device": (lambda p: (*p[:5], dict(device="tpu")), ValueError, ["device"]),
    "q_list": (lambda p: (p[0].tolist(), *p[1:]), TypeError, ["q", "numpy"]),
    # Each of these used to pass validation and then fail (or
    # give NaN) later.
    "nhead_q_zero": (lambda p: (p[0][:, :, :0], *p[1:]), ValueError, ["nhead_q"]),
    "scale_overflows_f32": (lambda p: (*p[:5], dict(scale=1e39)), ValueError, ["scale", "float32"]),
    "softcap_overflows_f32": (
        lambda p: (*p[:5], dict(logits_soft_cap=1e39)),
        ValueError,
        ["logits_soft_cap", "float32"],
    ),
    "alibi_overflows_f32": (
        lambda p: (*p[:5], dict(alibi_slopes=np.full(4, 1e39))),
        ValueError,
        ["alibi_slopes", "float32"],
    ),
    "alibi_nan": (
        lambda p: (*p[:5], dict(alibi_slopes=np.array([1, np.nan, 1, 1], np.float32))),
        ValueError,
        ["alibi_slopes[1]", "finite"],
    ),
    "alibi_inf": (
        lambda p: (*p[:5], dict(alibi_slopes=np.array([1, 1, 1, np.inf], np.float32))),
        ValueError,
        ["alibi_slopes[3]", "finite"],
    ),
    "alibi_term_overflows": (
        lambda p: (
            *p[:5],
            dict(alibi_slopes=np.full(4, 1e38, np.float32), mask_type="bottom_right", window_size_right=0),
        ),
        ValueError,
        ["alibi_slopes", "overflow"],
    ),
    "sinks_nan": (
        lambda p: (*p[:5], dict(sinks=np.array([0, 0, np.nan, 0], np.float32))),
        ValueError,
        ["sinks[2]", "finite"],
    ),
    "sinks_inf": (
        lambda p: (*p[:5], dict(sinks=np.array([-np.inf, 0, 0, 0], np.float32))),
        ValueError,
        ["sinks[0]", "finite"],
    ),
    "out_is_q": (lambda p: (*p[:5], dict(out=p[0])), ValueError, ["out overlaps q"]),
    "out_in_k_cache": (
        lambda p: (*p[:5], dict(out=p[1].reshape(-1)[: p[0].size].reshape(p[0].shape))),
        ValueError,
        ["out overlaps k_cache"],
    ),
    "out_in_v_cache": (
        lambda p: (*p[:5], dict(out=p[2].reshape(-1)[-p[0].size :].reshape(p[0].shape))),
        ValueError,
        ["out overlaps v_cache"],
    ),
    "out_under_bias": (lambda p: (*p[:5], _out_and_bias(p[0])), ValueError, ["out overlaps bias"]),
}


def _out_and_bias(q):
    """An out whose memory also holds the bias (f32 viewed over f16)."""
    out = np.zeros_like(q)
    bias = out.reshape(-1)[: 2 * 3 * 32].view(np.float32).reshape(1, 1, 3, 32)
    return dict(out=out, bias=bias)


def _set(a, idx, value):
    a = a.copy()
    a[idx] = value
    return a


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input(trap, rng, case):
    mutate, exc, words = BAD[case]
    q, k, v, bt, sk = _good(rng)
    args = mutate((q, k, v, bt, sk, {}))
    *arrays, kw = args
    with pytest.raises(exc) as info:
        _call(trap, *arrays, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value!s}"


WRONG_DEVICE = ["q", "k_cache", "v_cache", "block_table", "seqlen_k", "bias"]


@pytest.mark.parametrize("arg", WRONG_DEVICE)
def test_tensor_on_wrong_device(trap, rng, arg):
    """A torch tensor on a device that is not the session's (here: "meta",
    which holds no data, for a "cpu" session) is refused by name, not
    copied; on a CUDA machine a cuda:0 tensor for a "cpu" session takes the
    same branch (arrays.check_tensor_devices)."""
    torch = pytest.importorskip("torch")
    q, k, v, bt, sk = _good(rng)
    args = dict(q=q, k_cache=k, v_cache=v, block_table=bt, seqlen_k=sk, bias=np.zeros((1, 1, 3, 32), np.float32))
    args[arg] = torch.from_numpy(np.ascontiguousarray(args[arg])).to("meta")
    with pytest.raises(ValueError, match=rf"{arg} is a torch tensor on meta, but the session runs on 'cpu'"):
        turbine_fmha.fmha_fwd_paged(session=trap, **args)


def test_device_array_of_another_device(trap, rng):
    import iree.runtime as rt

    q, k, v, bt, sk = _good(rng)
    other = rt.Config("local-sync").device  # not the session's device
    kd, vd = rt.asdevicearray(other, k), rt.asdevicearray(other, v)
    with pytest.raises(ValueError, match="k_cache is a DeviceArray of another device"):
        _call(trap, q, kd, vd, bt, sk)


def test_session_device_mismatch(trap, rng):
    with pytest.raises(ValueError, match="session is for device"):
        _call(trap, *_good(rng), device="cuda")


def test_missing_artifact_names_build_command(tmp_path, rng):
    s = turbine_fmha.Session("cpu", artifact_dir=tmp_path)
    with pytest.raises(turbine_fmha.ArtifactError, match="turbine-fmha build --targets host"):
        _call(s, *_good(rng))


def test_inputs_untouched_and_session_usable_after_errors(explicit_session, rng):
    prob = _good(rng)
    before = [a.copy() for a in prob]
    with pytest.raises(ValueError):
        _call(explicit_session, *prob[:4], np.array([-3, 5], np.int32))
    for a, b in zip(prob, before):
        np.testing.assert_array_equal(a, b)
    run_and_check(explicit_session, prob, dtype="f16")
    for a, b in zip(prob, before):
        np.testing.assert_array_equal(a, b)


def test_non_contiguous_inputs(explicit_session, rng):
    q, k, v, bt, sk = make_problem(
        rng, dtype="f32", batch=2, seqlen_q=6, seqlens_k=[30, 17], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    q_strided = np.asfortranarray(q)
    bt_strided = np.repeat(bt, 2, axis=1)[:, ::2]
    assert not q_strided.flags.c_contiguous and not bt_strided.flags.c_contiguous
    run_and_check(explicit_session, (q_strided, k, v, bt_strided, sk), dtype="f32")


def test_empty_batch_and_zero_queries(explicit_session, rng):
    q, k, v, bt, sk = _good(rng)
    out = _call(explicit_session, q[:0], k, v, bt[:0], sk[:0])
    assert out.shape == (0, 3, 4, 64)
    out, lse = _call(explicit_session, q[:, :0], k, v, bt, sk, return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)


def test_torch_out_overlapping_a_torch_cache(trap, rng):
    torch = pytest.importorskip("torch")
    q, k, v, bt, sk = _good(rng)
    kt = torch.from_numpy(k)
    out = kt.reshape(-1)[5 : 5 + q.size].reshape(q.shape)
    with pytest.raises(ValueError, match="out overlaps k_cache"):
        _call(trap, torch.from_numpy(q), kt, torch.from_numpy(v), bt, sk, out=out)


def test_windows_and_sinks_past_int32_are_unbounded(explicit_session, rng):
    """Window sides and sink counts of 2^31 and more raised
    OverflowError deep in the planner; they reach past every key, so they
    mean what any window that large means (the reference takes them as
    they are, ALiBi's non-causal form included)."""
    prob = _good(rng)
    slopes = rng.uniform(0.01, 0.5, 4).astype(np.float32)
    for left, right, sink in ((2**31, 2**40, 2**31), (2**40, 0, 2**63), (3, 2**33, 2**31 - 1)):
        run_and_check(
            explicit_session,
            prob,
            dtype="f16",
            mask_type="bottom_right",
            window_size_left=left,
            window_size_right=right,
            sink_size=sink,
            alibi_slopes=slopes,
        )


def test_negative_and_zero_alibi_slopes(explicit_session, rng):
    """Slopes of any sign are accepted and follow the same formula as
    positive ones (ck_tile computes slope * distance whatever the sign)."""
    prob = _good(rng)
    run_and_check(
        explicit_session,
        prob,
        dtype="f16",
        mask_type="bottom_right",
        window_size_right=0,
        alibi_slopes=np.array([-0.3, 0.0, 0.2, -1.0], np.float32),
    )


def test_torch_tensor_subclasses_are_tensors(explicit_session, rng):
    """Subclasses of torch.Tensor were refused ("got
    MyT") because the check compared class names."""
    torch = pytest.importorskip("torch")

    class MyT(torch.Tensor):
        pass

    q, k, v, bt, sk = _good(rng)
    want = _call(explicit_session, torch.from_numpy(q), k, v, bt, sk)
    got = _call(
        explicit_session,
        torch.from_numpy(q).as_subclass(MyT),
        torch.from_numpy(k).as_subclass(MyT),
        v,
        torch.from_numpy(bt).as_subclass(MyT),
        sk,
    )
    assert torch.equal(got.as_subclass(torch.Tensor), want)
