"""docs/abi.md against the artifacts. The page quotes the manifest's rules
after `<!-- abi: KEY -->` marks; these tests read them from the page,
check each against the manifest (kernels/abi.py), and evaluate the
formulas they hold (the Python expressions between backquotes) against
compiled CPU kernels on fresh random inputs: the visibility rules as
predicates, the lengths and slots rules as what a kernel reads and which
keys take part, the convention's argument count, and the page's Python
snippet and bf16 recipe run as written. Edit a rule in one place only and
a test here fails."""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import CACHE, make_problem
from tolerances import LSE_TOL, OUT_TOL

from turbine_fmha.build import aot
from turbine_fmha.calls.mask import MaskSpec
from turbine_fmha.calls.plan import KernelCall, split_kv
from turbine_fmha.kernels import abi
from turbine_fmha.kernels.variants import UNBOUNDED, parse_kernel
from turbine_fmha.testing.reference import fmha_fwd_paged_ref, visible_mask

DOC = Path(__file__).resolve().parent.parent / "docs" / "abi.md"
MARK = re.compile(r"<!-- abi: ([\w.]+) -->\n")
# Prebuilt (tests/kernels.json). f32, so that one key more or less than the
# rule says is far outside the tolerance.
MASKED = {
    "none": "pagedkv_fwd_f32_d64x64_g2_pg16_nmask_lse_explicit",
    "top_left": "pagedkv_fwd_f32_d64x64_g2_pg16_mtl_lse_explicit",
    "bottom_right": "pagedkv_fwd_f32_d64x64_g2_pg16_mbr_lse_explicit",
}
# The online formulation computes the mask in code of its own.
ONLINE = "pagedkv_fwd_f32_d64x64_h4x2_pg16_mtl_lse_online_b1_q128"
BF16 = "pagedkv_fwd_bf16_d64x64_g2_pg16_nmask_lse_explicit"
PAGE, DIM = 16, 64
# The arguments that predicted() reads.
PREDICTED_FROM = ("q", "k_cache", "v_cache", "block_table", "seqlen_q", "seqlen_k", "kv_shift", "iparams")


# --- the rules, as the page writes them ---------------------------------------


def documented() -> dict[str, str]:
    """Each marked rule of the page: the paragraph after its mark, its
    whitespace collapsed, or the body of the fenced block there."""
    text = DOC.read_text()
    rules = {}
    for m in MARK.finditer(text):
        rest = text[m.end() :]
        if rest.startswith("```"):
            body = rest.split("\n", 1)[1]
            rules[m.group(1)] = body[: body.index("```")]
        else:
            rules[m.group(1)] = " ".join(rest.split("\n\n", 1)[0].split())
    return rules


def in_manifest(key: str) -> str:
    """The text of `key` ("convention", "mask.top_left",
    "preconditions.lengths") in the manifest's top-level "abi"."""
    node = abi.abi_docs()
    for part in key.split("."):
        node = node[part]
    return node


def render(text: str) -> str:
    """A rule as the page writes it: wrapped at 76 columns, no line opening
    with what Markdown would take for a list, quote or heading."""
    lines = textwrap.wrap(text, 76, break_long_words=False, break_on_hyphens=False)
    for n in range(1, len(lines)):
        while re.match(r"([-+*>#=]|\d+[.)])( |$)", lines[n]):
            word, _, rest = lines[n].partition(" ")
            lines[n - 1] += " " + word
            lines[n] = rest
    return "\n".join(line for line in lines if line)


class Rule:
    """The formulas of a rule's text: its definitions (`name = expr`) and
    its expressions, in order, evaluated over names the caller binds."""

    def __init__(self, text: str):
        found = re.findall(r"`([^`]+)`", text)
        assert found, f"no formula in the rule: {text!r}"
        trees = [ast.parse(f) for f in found]
        self.definitions = [compile(t, "<rule>", "exec") for t in trees if isinstance(t.body[0], ast.Assign)]
        self.expressions = [
            compile(f, "<rule>", "eval") for f, t in zip(found, trees) if not isinstance(t.body[0], ast.Assign)
        ]

    def __call__(self, which: int = 0, **names):
        scope = dict(names, __builtins__={"max": max, "min": min, "len": len, "any": any, "range": range})
        for d in self.definitions:
            exec(d, scope)
        return eval(self.expressions[which], scope)


def rule(key: str) -> Rule:
    text = documented().get(key)
    assert text is not None, f"docs/abi.md has no <!-- abi: {key} --> mark"
    return Rule(text)


def python_snippet() -> dict:
    """The page's Python caller, run: its names (load, call)."""
    scope: dict = {}
    exec(compile(documented()["python"], "docs/abi.md", "exec"), scope)
    return scope


# --- the page against the manifest --------------------------------------------


RULE_KEYS = [
    "convention",
    "mask.none",
    "mask.top_left",
    "mask.bottom_right",
    "preconditions.lengths",
    "preconditions.slots",
]


def test_each_marked_rule_is_the_manifests():
    rules = documented()
    assert set(RULE_KEYS) | {"python"} <= set(rules), sorted(rules)
    for key in RULE_KEYS:
        want = in_manifest(key)
        assert rules[key] == " ".join(want.split()), f"docs/abi.md, {key}: should read\n\n{render(want)}\n"


# --- kernels against the rules ------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    """name -> (manifest entry, the page's load() of it)."""
    names = [*MASKED.values(), ONLINE, BF16]
    results = aot.build(CACHE, ["host"], [parse_kernel(n) for n in names])
    load = python_snippet()["load"]
    return {r.variant: (r.entry, load(str(CACHE / r.entry["path"]))) for r in results}


def call_kernel(kernels, name: str, inputs: dict) -> list[np.ndarray]:
    """The kernel on `inputs` (by argument name) through the page's call()."""
    entry, loaded = kernels[name]
    call = python_snippet()["call"]
    return call(loaded, entry["abi"], [inputs[a["name"]] for a in entry["abi"]["args"]])


# (mask, seqlen_q, seqlen_k, window_left, window_right, sink_size): the keys
# each row sees. The first is the page's example; in both, the rows from
# seqlen_k on get no sink keys.
SINK_EXAMPLES = [
    (("top_left", 8, 4, 1, 0, 2), [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [3], [], [], []]),
    (("bottom_right", 10, 6, 0, 0, 2), [[], [], [], [], [0], [0, 1], [2], [3], [4], [5]]),
]


@pytest.mark.parametrize("example, keys", SINK_EXAMPLES)
def test_sink_keys_by_the_rule_the_reference_and_the_kernel(kernels, rng, example, keys):
    mask, sq, sk, left, right, sink = example
    visible = rule(f"mask.{mask}")
    names = dict(b=0, seqlen_q=[sq], seqlen_k=[sk], window_left=left, window_right=right, sink_size=sink)
    assert [[t for t in range(sk) if visible(i=i, t=t, **names)] for i in range(sq)] == keys
    assert [list(np.flatnonzero(r)) for r in visible_mask(sq, sk, mask, left, right, sink)] == keys
    fixed = dict(q_start=0, seqlen_q=[sq], seqlen_k=[sk], kv_shift=[0], window_left=left, window_right=right)
    inputs = random_call(rng, batch=1, rows=sq, hq=4, hk=2, mask=mask, sink_size=sink, **fixed)
    out, lse, *_ = call_kernel(kernels, MASKED[mask], inputs)
    assert (np.isneginf(lse[0]) == np.array([not k for k in keys])).all()
    check(out, lse, *predicted(**{n: inputs[n] for n in PREDICTED_FROM}, mask=mask))


def garbage_unused_slots(rng, table, seqlen_k, kv_shift, num_pages):
    """Garbage (out of range, negative) in every slot that the slots rule
    lets hold anything."""
    used = rule("preconditions.slots")
    junk = np.array([-1, -7, num_pages, num_pages + 1000, 2**31 - 1], np.int64)
    for b in range(table.shape[0]):
        for j in range(table.shape[1]):
            if not used(b=b, j=j, PG=PAGE, kv_shift=kv_shift, seqlen_k=seqlen_k):
                table[b, j] = rng.choice(junk)


def predicted(q, k_cache, v_cache, block_table, seqlen_q, seqlen_k, kv_shift, iparams, mask):
    """Float64 attention over exactly the keys the page's rules let take
    part: (out [B, S, HQ, DV], lse [B, HQ, S]), NaN in padding rows (their
    outputs mean nothing)."""
    visible, lengths = rule(f"mask.{mask}"), rule("preconditions.lengths")
    q_start, left, right, sink = (int(x) for x in iparams)
    batch, rows, hq, _ = q.shape
    group, dv, width = hq // k_cache.shape[2], v_cache.shape[3], block_table.shape[1]
    out = np.full((batch, rows, hq, dv), np.nan)
    lse = np.full((batch, hq, rows), np.nan)
    names = dict(seqlen_q=seqlen_q, seqlen_k=seqlen_k, kv_shift=kv_shift, W=width, PG=PAGE)
    names.update(window_left=left, window_right=right, sink_size=sink)
    span = 3 * width * PAGE + abs(int(kv_shift.min())) + int(seqlen_k.max())
    for b in range(batch):
        present = [t for t in range(-span, span) if lengths(1, b=b, t=t, **names)]
        rows_of = kv_shift[b] + np.array(present, np.int64)
        assert ((rows_of >= 0) & (rows_of < width * PAGE)).all(), "the rules let a key outside the table take part"
        for r in range(rows):
            i = q_start + r
            if i >= seqlen_q[b]:
                continue
            n = np.array([kv_shift[b] + t for t in present if visible(b=b, i=i, t=t, **names)], np.int64)
            page, row = block_table[b, n // PAGE], n % PAGE
            k, v = k_cache[page, row].astype(np.float64), v_cache[page, row].astype(np.float64)
            for h in range(hq):
                s = k[:, h // group] @ q[b, r, h].astype(np.float64) / math.sqrt(q.shape[3])
                if not len(s):
                    out[b, r, h], lse[b, h, r] = 0.0, -np.inf
                    continue
                p = np.exp(s - s.max())
                out[b, r, h] = p @ v[:, h // group] / p.sum()
                lse[b, h, r] = s.max() + np.log(p.sum())
    return out, lse


def check(out, lse, want, want_lse, dtype="f32"):
    """The kernel's results against predicted(): rows that see no key
    exactly (out 0, lse -inf), the others within the suite's tolerances."""
    rows = ~np.isnan(want_lse)  # [B, HQ, S]
    empty = rows & np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse)[rows], empty[rows], "rows that see no key")
    live = rows & ~empty
    assert not np.isnan(lse[rows]).any()
    err = np.abs(lse[live] - want_lse[live]).max(initial=0)
    assert err <= LSE_TOL[dtype], f"lse abs err {err:.3e}"
    o, w = out.astype(np.float64), want
    rows, empty = np.transpose(rows, (0, 2, 1)), np.transpose(empty, (0, 2, 1))  # [B, S, HQ]
    assert np.isfinite(o[rows]).all() and (o[empty] == 0).all()
    err = np.abs(o[rows] - w[rows]).max(initial=0) / max(np.abs(w[rows]).max(initial=0), 1e-30)
    assert err <= OUT_TOL[dtype], f"output rel err {err:.3e}"


def random_call(rng, *, batch, rows, hq, hk, mask, width=3, **fixed):
    """A call the rules allow, with what they make interesting: windows and
    sink keys near the rows' and keys' ends, chunked rows (q_start > 0),
    more rows than keys, kv_shift < 0 and keys past the table's end; the
    sizes and iparams entries named in `fixed` as given."""
    q_start = int(rng.integers(0, 6))
    seqlen_q = rng.integers(max(q_start, 1), q_start + rows + 3, batch)
    # Per entry: fewer keys than rows (sink keys against rows past the
    # keys), keys from before the table's start (kv_shift < 0), or keys
    # past its end.
    kind = rng.integers(0, 3, batch)
    seqlen_k = np.where(kind == 0, rng.integers(0, seqlen_q + 2), rng.integers(0, width * PAGE + 12, batch))
    kv_shift = np.select(
        [kind == 0, kind == 1],
        [rng.integers(0, 4, batch), rng.integers(-2 * PAGE, 0, batch)],
        rng.integers(0, PAGE + 4, batch),
    )
    c = dict(
        q_start=q_start,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        kv_shift=kv_shift,
        window_left=int(rng.choice([0, 1, 2, 3, 6, 11, UNBOUNDED])),
        window_right=int(rng.choice([0, 0, 1, 4, UNBOUNDED])),
        sink_size=int(rng.choice([0, 1, 2, 5])),
    )
    if mask == "none":
        c.update(window_left=UNBOUNDED, window_right=UNBOUNDED, sink_size=0)
    c.update(fixed)
    seqlen_q, seqlen_k, kv_shift = (np.asarray(c[n], np.int32) for n in ("seqlen_q", "seqlen_k", "kv_shift"))
    q, k, v, table, _ = make_problem(
        rng,
        dtype="f32",
        batch=batch,
        seqlen_q=rows,
        seqlens_k=[width * PAGE] * batch,
        nhead_q=hq,
        nhead_k=hk,
        hdim=DIM,
        page=PAGE,
        extra_slots=0,
    )
    garbage_unused_slots(rng, table, seqlen_k, kv_shift, k.shape[0])
    # Padding rows, NaN: they must not reach any other row.
    for b in range(batch):
        q[b, max(seqlen_q[b] - c["q_start"], 0) :] = np.nan
    return dict(
        q=q,
        k_cache=k,
        v_cache=v,
        block_table=table,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        kv_shift=kv_shift,
        fparams=np.array([1 / math.sqrt(DIM), 0.0, 1.0, 1.0], np.float32),
        iparams=np.array([c[n] for n in ("q_start", "window_left", "window_right", "sink_size")], np.int32),
    )


def requires(inputs) -> bool:
    """Whether a call meets what the lengths rule requires."""
    lengths = rule("preconditions.lengths")
    names = {n: inputs[n] for n in ("seqlen_q", "seqlen_k", "kv_shift")}
    return all(
        lengths(0, b=b, W=inputs["block_table"].shape[1], PG=PAGE, **names) for b in range(len(names["seqlen_k"]))
    )


@pytest.mark.parametrize("mask", list(MASKED))
def test_explicit_kernels_follow_the_documented_rules(kernels, rng, mask):
    for _ in range(6):
        inputs = random_call(rng, batch=4, rows=6, hq=4, hk=2, mask=mask)
        assert requires(inputs)
        out, lse, *_ = call_kernel(kernels, MASKED[mask], inputs)
        check(out, lse, *predicted(**{n: inputs[n] for n in PREDICTED_FROM}, mask=mask))


def test_an_online_kernel_follows_the_documented_rules(kernels, rng):
    for _ in range(3):
        inputs = random_call(rng, batch=1, rows=128, hq=4, hk=2, mask="top_left")
        out, lse, *_ = call_kernel(kernels, ONLINE, inputs)
        check(out, lse, *predicted(**{n: inputs[n] for n in PREDICTED_FROM}, mask="top_left"))


@pytest.mark.parametrize("mask", ["top_left", "bottom_right"])
def test_the_rules_agree_with_the_reference(rng, mask):
    """The documented visibility is the float64 reference's (ck_tile's),
    row by row, windows and sink keys near every edge."""
    visible = rule(f"mask.{mask}")
    for _ in range(200):
        sq, sk = (int(x) for x in rng.integers(0, 12, 2))
        left, right = (int(rng.choice([0, 1, 2, 3, 7, UNBOUNDED])) for _ in range(2))
        sink = int(rng.integers(0, 4))
        names = dict(b=0, seqlen_q=[sq], seqlen_k=[sk], window_left=left, window_right=right, sink_size=sink)
        got = np.array([[bool(visible(i=i, t=t, **names)) for t in range(sk)] for i in range(sq)], bool)
        want = visible_mask(sq, sk, mask, left, right, sink)
        np.testing.assert_array_equal(got.reshape(want.shape), want, str(names))


def test_split_entries_meet_the_lengths_rule_and_merge_to_the_reference(kernels, rng):
    """split_kv's entries (the sequence's seqlen_k, kv_shift the sequence's
    minus the split's first row) meet the documented precondition, and the
    kernel's results merged as host_merge says are the whole sequence's."""
    batch, rows, hq, hk, splits = 3, 5, 4, 2, 2
    seqlens_k = [70, 33, 5]
    q, k, v, table, seqlen_k = make_problem(
        rng, dtype="f32", batch=batch, seqlen_q=rows, seqlens_k=seqlens_k, nhead_q=hq, nhead_k=hk, hdim=DIM, page=PAGE
    )
    mask = MaskSpec("bottom_right", 20, 0, 3)
    c = KernelCall(
        rows=rows,
        q_itemsize=4,
        nhead_q=hq,
        block_table=table,
        page=PAGE,
        seqlen_q=np.full(batch, rows, np.int32),
        seqlen_k=seqlen_k,
        kv_shift=np.zeros(batch, np.int32),
        scale=1 / math.sqrt(DIM),
        softcap=0.0,
        scale_o=1.0,
        scale_p=1.0,
        mask=mask,
        alibi_slopes=None,
        bias=None,
        sinks=None,
    )
    s = split_kv(c, splits)
    width = s.block_table.shape[1]
    assert (s.seqlen_k[0] > width * PAGE) and (s.kv_shift < 0).any()  # what the old rule forbade
    inputs = dict(
        q=np.repeat(q, splits, axis=0),
        k_cache=k,
        v_cache=v,
        block_table=s.block_table,
        seqlen_q=s.seqlen_q,
        seqlen_k=s.seqlen_k,
        kv_shift=s.kv_shift,
        fparams=np.array([c.scale, 0.0, 1.0, 1.0], np.float32),
        iparams=np.array([0, mask.left, mask.right, mask.sink], np.int32),
    )
    assert requires(inputs)
    out, lse, row_max, row_sum = call_kernel(kernels, MASKED["bottom_right"], inputs)
    check(out, lse, *predicted(**{n: inputs[n] for n in PREDICTED_FROM}, mask="bottom_right"))
    # host_merge: split j weighs row_sum_j * exp(row_max_j - M).
    o = out.reshape(batch, splits, rows, hq, -1).astype(np.float64)
    m = row_max.reshape(batch, splits, hq, rows).astype(np.float64)
    rs = row_sum.reshape(batch, splits, hq, rows).astype(np.float64)
    top = np.where(rs > 0, m, -np.inf).max(axis=1, keepdims=True)
    w = np.where(rs > 0, rs * np.exp(np.where(rs > 0, m, 0) - np.where(np.isfinite(top), top, 0)), 0)
    merged = np.einsum("bjhr,bjrhd->brhd", w / w.sum(axis=1, keepdims=True), o)
    ref, ref_lse = fmha_fwd_paged_ref(
        q, k, v, table, seqlen_k, mask_type="bottom_right", window_size_left=20, window_size_right=0, sink_size=3
    )
    assert np.abs(merged - ref).max() <= OUT_TOL["f32"] * np.abs(ref).max()
    merged_lse = np.log(w.sum(axis=1)) + top[:, 0]
    np.testing.assert_allclose(merged_lse, ref_lse, atol=LSE_TOL["f32"])


# --- the call ------------------------------------------------------------------


def test_the_convention_counts_the_arguments_the_function_takes(kernels, rng):
    """The documented count is what the function takes; the Python
    bindings' FunctionInvoker, which passes no fences, is refused with that
    count, as the convention says; the page's snippet is not."""
    import iree.runtime as rt

    entry, _ = kernels[BF16]
    count = rule("convention")(args=entry["abi"]["args"])
    assert count == len(entry["abi"]["args"]) + 2
    inputs = random_call(rng, batch=2, rows=1, hq=2, hk=1, mask="none")
    for name in ("q", "k_cache", "v_cache"):
        inputs[name] = inputs[name].astype(ml_dtypes.bfloat16)
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    module = rt.VmModule.mmap(config.vm_instance, str(CACHE / entry["path"]))
    context.add_vm_module(module)
    invoker = context.modules[module.name][entry["abi"]["function"]]
    with pytest.raises(ValueError, match=f"expected {count} arguments but passed {count - 2}"):
        invoker(*[inputs[a["name"]] for a in entry["abi"]["args"]])
    out, lse, row_max, row_sum = call_kernel(kernels, BF16, inputs)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (2, 1, 2, DIM)
    assert lse.dtype == row_max.dtype == row_sum.dtype == np.float32 and lse.shape == (2, 2, 1)
    check(out, lse, *predicted(**{n: inputs[n] for n in PREDICTED_FROM}, mask="none"), "bf16")


def test_bf16_through_iree_run_module_as_documented(kernels, rng, tmp_path):
    """bf16 in and out as raw .bin files (shape and type in the input flag),
    read back with ml_dtypes; a bf16 result into .npy fails, as the page
    says."""
    entry, _ = kernels[BF16]
    inputs = random_call(rng, batch=3, rows=2, hq=4, hk=2, mask="none")
    for name in ("q", "k_cache", "v_cache"):
        inputs[name] = inputs[name].astype(ml_dtypes.bfloat16)
    cmd = [
        str(Path(sys.executable).with_name("iree-run-module")),
        f"--module={CACHE / entry['path']}",
        "--device=local-task",
        f"--function={entry['abi']['function']}",
    ]
    for arg in entry["abi"]["args"]:
        a, path = inputs[arg["name"]], tmp_path / arg["name"]
        if arg["dtype"] == "bf16":
            a.tofile(f"{path}.bin")
            cmd.append(f"--input={'x'.join(map(str, a.shape))}xbf16=@{path}.bin")
        else:
            np.save(f"{path}.npy", a)
            cmd.append(f"--input=@{path}.npy")
    results = entry["abi"]["results"]
    outputs = [f"--output=@{tmp_path / r['name']}.{'bin' if r['dtype'] == 'bf16' else 'npy'}" for r in results]
    run = subprocess.run(cmd + outputs, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    q = inputs["q"]
    out = np.fromfile(tmp_path / "out.bin", ml_dtypes.bfloat16).reshape(q.shape[:3] + (DIM,))
    check(out, np.load(tmp_path / "lse.npy"), *predicted(**{n: inputs[n] for n in PREDICTED_FROM}, mask="none"), "bf16")
    npy = [f"--output=@{tmp_path / r['name']}.npy" for r in results]
    run = subprocess.run(cmd + npy, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "unsupported data encoding" in run.stderr
