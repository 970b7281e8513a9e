"""Score-side features of the reference kernel, each alone and in the
combinations ck_tile allows, on both formulations (the online one is the GPU
kernel, executed on the CPU), against the float64 reference.

Fresh random inputs each run (seed printed); unused table slots hold
garbage and spare pages NaN (see conftest.make_problem).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_problem, run_and_check

import turbine_fmha

FORMULATIONS = ["explicit", "online"]


@pytest.fixture
def sessions(explicit_session, online_session):
    return {"explicit": explicit_session, "online": online_session}


def _problem(rng, dtype="f16", batch=None, seqlen_q=None, seqlens=None, nq=8, nk=2, page=16):
    batch = batch or int(rng.integers(1, 4))
    seqlen_q = seqlen_q or int(rng.integers(1, 40))
    seqlens = seqlens or [int(rng.integers(0, 90)) for _ in range(batch)]
    return make_problem(
        rng, dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlens_k=seqlens, nhead_q=nq, nhead_k=nk, hdim=64, page=page
    )


def _slopes(rng, batch, nq, per_batch):
    # ALiBi slopes as models use them (2^(-8 h / n)), jittered per run.
    base = 2.0 ** (-8.0 * np.arange(1, nq + 1) / nq) * rng.uniform(0.5, 1.5)
    return (
        np.tile(base, (batch, 1)).astype(np.float32) * rng.uniform(0.5, 1.5, (batch, 1)).astype(np.float32)
        if per_batch
        else base.astype(np.float32)
    )


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("mask", ["top_left", "bottom_right"])
def test_sliding_window(sessions, rng, formulation, mask):
    for _ in range(2):
        left, right = (int(x) for x in rng.integers(-1, 12, size=2))
        prob = _problem(rng)
        run_and_check(
            sessions[formulation], prob, dtype="f16", mask_type=mask, window_size_left=left, window_size_right=right
        )


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("mask", ["top_left", "bottom_right"])
def test_sink_tokens(sessions, rng, formulation, mask):
    # A small left window slides past the first keys; sink tokens keep them.
    for seqlen_q, seqlens in (
        (int(rng.integers(20, 60)), [70, 25]),
        (int(rng.integers(1, 5)), [90, 33]),
        (30, [12, 0]),
    ):
        prob = _problem(rng, batch=2, seqlen_q=seqlen_q, seqlens=seqlens)
        run_and_check(
            sessions[formulation],
            prob,
            dtype="f16",
            mask_type=mask,
            window_size_left=int(rng.integers(0, 6)),
            window_size_right=int(rng.integers(0, 3)),
            sink_size=int(rng.integers(1, 6)),
        )


def test_sink_tokens_visible_only_within_right_bound(explicit_session, rng):
    from turbine_fmha.testing.reference import visible_mask

    vis = visible_mask(6, 10, "top_left", 1, 0, 3)
    assert vis[0, :3].tolist() == [True, False, False]  # sinks past row 0's right bound stay hidden
    assert vis[5, :3].all() and not vis[5, 3]
    prob = _problem(rng, dtype="f32", batch=1, seqlen_q=6, seqlens=[10], nq=2, nk=2)
    run_and_check(
        explicit_session, prob, dtype="f32", mask_type="top_left", window_size_left=1, window_size_right=0, sink_size=3
    )


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize(
    "mask,left,right",
    [("none", -1, -1), ("bottom_right", -1, 0), ("top_left", -1, 0), ("bottom_right", 9, 2), ("top_left", 4, -1)],
)
def test_alibi(sessions, rng, formulation, mask, left, right):
    prob = _problem(rng, dtype="f32")
    b = prob[0].shape[0]
    slopes = _slopes(rng, b, 8, per_batch=bool(rng.integers(2)))
    run_and_check(
        sessions[formulation],
        prob,
        dtype="f32",
        mask_type=mask,
        window_size_left=left,
        window_size_right=right,
        alibi_slopes=slopes,
    )


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("shape", ["11", "b1", "1h", "bh"])
def test_elementwise_bias(sessions, rng, formulation, shape):
    prob = _problem(rng)
    b, sq = prob[0].shape[:2]
    max_sk = int(prob[4].max())
    extra = int(rng.integers(0, 5))  # bias key axis may be longer than max(seqlen_k)
    bias = rng.standard_normal((b if shape[0] == "b" else 1, 8 if shape[1] == "h" else 1, sq, max_sk + extra)).astype(
        np.float32
    )
    run_and_check(
        sessions[formulation],
        prob,
        dtype="f16",
        mask_type="bottom_right",
        window_size_left=-1,
        window_size_right=0,
        bias=bias,
    )


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_logits_soft_cap(sessions, rng, formulation, dtype):
    prob = _problem(rng, dtype=dtype)
    # Scale up q so the cap actually bends the scores.
    prob = (prob[0] * np.asarray(4, prob[0].dtype),) + prob[1:]
    run_and_check(
        sessions[formulation],
        prob,
        dtype=dtype,
        mask_type="top_left",
        window_size_right=0,
        logits_soft_cap=float(rng.uniform(5, 30)),
    )


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_attention_sinks(sessions, rng, formulation):
    # Includes rows without any visible key (bottom-right, sq > sk): output 0, LSE = sink.
    prob = _problem(rng, batch=3, seqlen_q=12, seqlens=[int(rng.integers(20, 80)), 5, 0])
    sinks = rng.uniform(-2, 3, 8).astype(np.float32)
    out, lse = run_and_check(
        sessions[formulation], prob, dtype="f16", mask_type="bottom_right", window_size_right=0, sinks=sinks
    )
    np.testing.assert_allclose(lse[2], np.broadcast_to(sinks[:, None], (8, 12)), rtol=0, atol=1e-6)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize(
    "combo",
    [
        dict(alibi=True, sinks=True, window=(8, 0), sink_size=2),
        dict(bias="bh", sinks=True, window=(-1, 0)),
        dict(bias="11", window=(5, 5), sink_size=3),
        dict(softcap=True, sinks=True, window=(6, 1), sink_size=2),
        dict(alibi=True, window=(-1, -1)),
    ],
    ids=[
        "alibi+sinks+window+sink_size",
        "bias_bh+sinks+causal",
        "bias_11+window+sink_size",
        "softcap+sinks+window+sink_size",
        "alibi+unbounded_window",
    ],
)
def test_combinations(sessions, rng, formulation, combo):
    prob = _problem(rng, dtype="f32")
    b, sq = prob[0].shape[:2]
    kw = dict(
        mask_type=str(rng.choice(["top_left", "bottom_right"])),
        window_size_left=combo["window"][0],
        window_size_right=combo["window"][1],
        sink_size=combo.get("sink_size", 0),
    )
    if combo.get("alibi"):
        kw["alibi_slopes"] = _slopes(rng, b, 8, per_batch=True)
    if combo.get("bias"):
        s = combo["bias"]
        kw["bias"] = rng.standard_normal(
            (b if s[0] == "b" else 1, 8 if s[1] == "h" else 1, sq, int(prob[4].max()))
        ).astype(np.float32)
    if combo.get("softcap"):
        kw["logits_soft_cap"] = 3.0
    if combo.get("sinks"):
        kw["sinks"] = rng.uniform(-1, 2, 8).astype(np.float32)
    run_and_check(sessions[formulation], prob, dtype="f32", **kw)


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(logits_soft_cap=5.0, bias=np.zeros((1, 1, 3, 20), np.float32)), ["logits_soft_cap", "bias"]),
        (dict(logits_soft_cap=5.0, alibi_slopes=np.ones(4, np.float32)), ["logits_soft_cap", "alibi_slopes"]),
        (dict(alibi_slopes=np.ones(4, np.float32), bias=np.zeros((1, 1, 3, 20), np.float32)), ["alibi_slopes", "bias"]),
        (dict(sink_size=2), ["sink_size", "mask_type"]),
        (dict(logits_soft_cap=-1.0), ["logits_soft_cap", ">= 0"]),
        (dict(sink_size=-1, mask_type="top_left"), ["sink_size"]),
        (dict(alibi_slopes=np.ones(3, np.float32)), ["alibi_slopes", "shape"]),
        (dict(alibi_slopes=np.ones(4, np.int32)), ["alibi_slopes", "float"]),
        (dict(bias=np.zeros((1, 1, 2, 20), np.float32)), ["bias", "shape"]),
        (dict(bias=np.zeros((1, 1, 3, 4), np.float32)), ["bias", "max(seqlen_k)"]),
        (dict(bias=np.zeros((3, 1, 3, 20), np.float32)), ["bias", "shape"]),
        (dict(sinks=np.zeros(3, np.float32)), ["sinks", "shape"]),
        (dict(sinks=[0.0] * 4), ["sinks", "numpy"]),
    ],
)
def test_unsupported_or_bad_feature_arguments(rng, tmp_path, kw, words):
    q, k, v, bt, sk = make_problem(
        rng, dtype="f16", batch=2, seqlen_q=3, seqlens_k=[20, 5], nhead_q=4, nhead_k=2, hdim=64, page=16
    )
    s = turbine_fmha.Session("cpu", artifact_dir=tmp_path)  # nothing loadable: errors must come first
    with pytest.raises((ValueError, TypeError)) as info:
        turbine_fmha.fmha_fwd_paged(q, k, v, bt, sk, session=s, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
