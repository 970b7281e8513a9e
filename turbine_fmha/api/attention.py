"""Plan once, run many times: `PagedAttention` (FlashInfer's plan/run).

A serving engine calls attention once per layer per step with the same
tables. `plan` validates the tables and the score terms, chooses the
variants, cuts the work into kernel calls (chunks, tiles, split-KV) and puts
every table on the device once; `run` checks only what may differ between
layers (q, the caches, out) and invokes. `fmha_fwd_paged` is a plan and a
run on the arrays it is given.
"""

from __future__ import annotations

import math

import numpy as np

from ..build.artifacts import ArtifactError
from ..calls.modes import active_sequences, bias_rows, gappy_table, regroup
from ..calls.plan import (
    ENTRIES_GAIN,
    KernelCall,
    combine_splits,
    decode_splits,
    kernel_steps,
    merged_decode_splits,
    modelled_cost,
    num_splits_heuristic,
    repeat_rows,
    row_entries,
    rows_finite,
    rows_sum,
    split_kv,
    stale_rows,
    window_cut,
    window_keys,
)
from ..calls.problem import Problem, layout_of_params, problem, scores, sinks_array, tables
from ..core.arrays import (
    LaterBool,
    _byte_range,
    _cache_array,
    _check_tensor_devices,
    _device_of,
    _DeviceCache,
    _from_numpy,
    _is_torch,
    _Results,
    _TensorInfo,
    _to_numpy,
    _TorchDeviceCache,
    ops_for,
    torch_gpu_memory,
    torch_writes_done,
)
from ..core.checks import check_int, check_out
from ..core.tracing import check_no_grad, untraced_methods
from ..kernels.signature import call_args
from ..kernels.variants import ENTRY_ROWS, bias_shape_of, group_rows_for
from ..runtime.session import Session, resolve_session
from .conventions import conventions

# torch GPU caches a plan keeps bound (two per layer of a large model).
MAX_BINDS = 512

# Run-time sinks a session keeps on the device (Session.sinks_uploads): a
# model's layers' (gpt-oss's 24-36), not a history.
MAX_SINKS_UPLOADS = 256

# V caches (device, byte range) whose stale rows a deferred check last found
# non-finite: run() checks those before it queues anything, so a cache of
# garbage rows (torch.empty) does not run every call twice. Process-wide,
# because a serving engine plans anew each step; forgotten when a check
# finds the rows finite, all at once beyond the bound.
_NONFINITE_SEEN: dict[tuple, bool] = {}
MAX_NONFINITE_SEEN = 4096


@untraced_methods
class PagedAttention:
    """Paged-KV attention planned once per batch step and run per layer.

        attn = turbine_fmha.PagedAttention(session, device="cuda")
        attn.plan(block_table, seqlen_k, num_pages=..., page_block_size=16,
                  nhead_q=32, nhead_k=8, hdim=128, dtype="f16", mask_type="bottom_right")
        for layer in layers:
            out = attn.run(q[layer], k_cache[layer], v_cache[layer])

    plan() takes the tables and every argument of fmha_fwd_paged that is
    not an array of the layer (see there for their meaning), plus the
    layout the caches have: num_pages, page_block_size, nhead_q, nhead_k,
    hdim (hdim_v), dtype (q's: numpy/torch dtype or "f16"/"bf16"/"f32"),
    kv_dtype (an fp8 cache format), kv_layout and v_layout; in batch mode
    seqlen_q (q rows per sequence, default 1), in group mode seqstart_q. Invalid tables
    raise there, naming the argument, before anything runs.

    run(q, k_cache, v_cache, out=None, return_lse=False, sinks=None) takes
    the layer's arrays, which must match the plan (q [batch, seqlen_q,
    nhead_q, hdim] or [total_q, nhead_q, hdim]; caches of the planned
    layout), on the session's device or the host, and returns like
    fmha_fwd_paged. Attention sinks are weights of each layer (gpt-oss):
    a plan made with sinks runs with the plan's, or with a run's own
    `sinks` (float [nhead_q], finite; a host array costs no device wait
    to check), so that every layer of a step shares one plan. With
    kv_rows_finite=None, each run checks its V cache's stale rows (a look at
    one or two pages per sequence; on torch GPU caches behind the unguarded
    kernels, which run again guarded if a row was not finite); True skips
    the check.
    """

    def __init__(self, session: Session | None = None, *, device: str | None = None):
        device = device or (session.device if isinstance(session, Session) else "cpu")
        self.session = resolve_session(session, device)
        self._plan: _Plan | None = None

    def plan(
        self,
        block_table,
        seqlen_k,
        *,
        num_pages,
        page_block_size,
        nhead_q,
        nhead_k,
        hdim,
        hdim_v=None,
        dtype="f16",
        kv_dtype=None,
        v_layout="row",
        kv_layout="NHD",
        seqlen_q=1,
        seqstart_q=None,
        kv_offset=None,
        min_seqlen_q=0,
        num_splits=None,
        kv_rows_finite=None,
        causal=False,
        softmax_scale=None,
        window_size=None,
        **score_terms,
    ) -> PagedAttention:
        score_terms.update(
            conventions(  # flash-attn's spellings (flash_attn.py)
                scale=score_terms.pop("scale", None),
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                mask_type=score_terms.pop("mask_type", "none"),
                window_size_left=score_terms.pop("window_size_left", -1),
                window_size_right=score_terms.pop("window_size_right", -1),
            )
        )
        _check_tensor_devices(
            self.session.device_name,
            block_table=block_table,
            seqlen_k=seqlen_k,
            seqstart_q=seqstart_q,
            kv_offset=kv_offset,
            **{k: v for k, v in score_terms.items() if k in ("alibi_slopes", "bias", "sinks")},
        )
        layout = layout_of_params(
            num_pages=num_pages,
            page_block_size=page_block_size,
            nhead_q=nhead_q,
            nhead_k=nhead_k,
            hdim=hdim,
            hdim_v=hdim_v,
            dtype=dtype,
            kv_dtype=kv_dtype,
            v_layout=v_layout,
            kv_layout=kv_layout,
        )
        if seqstart_q is None:
            rows = np.shape(_to_numpy(block_table, "block_table"))
            q_shape = (rows[0] if rows else 0, check_int(seqlen_q, "seqlen_q", minimum=0))
        else:
            starts = _to_numpy(seqstart_q, "seqstart_q")
            q_shape = (int(starts[-1]) if starts.ndim == 1 and starts.size else 0,)
        t = tables(block_table, seqlen_k, layout, q_shape=q_shape, seqstart_q=seqstart_q, kv_offset=kv_offset)
        s = scores(layout, t, **score_terms)
        p = problem(layout, t, s, min_seqlen_q=min_seqlen_q, num_splits=num_splits, kv_rows_finite=kv_rows_finite)
        self._plan = _Plan(p, self.session)
        return self

    def run(self, q, k_cache, v_cache, *, out=None, return_lse: bool = False, sinks=None):
        if self._plan is None:
            raise RuntimeError("PagedAttention.run() before plan()")
        return self._plan.run(q, k_cache, v_cache, out=out, return_lse=return_lse, sinks=sinks)


def _memory_of(v_cache) -> tuple:
    """Where a V cache's memory is (_NONFINITE_SEEN's key)."""
    a = v_cache.tensor if isinstance(v_cache, _TorchDeviceCache) else v_cache
    return _device_of(a), _byte_range(a)


class _Plan:
    """Everything about a call that does not depend on q or the caches."""

    def __init__(self, p: Problem, session: Session, keep_binds: bool = True, active=None):
        self.p, self.session = p, session
        # Shared plans (plan_cache) keep no caches: they outlive the call.
        self._max_binds = MAX_BINDS if keep_binds else 0
        self._imports = {} if keep_binds else None  # host caches imported (Session.kernel_cache)
        t, lay, s = p.tables, p.layout, p.scores
        self.active = active_sequences(t, p.min_seqlen_q) if active is None else active
        self.rows = int(t.seqlens_q[self.active].max()) if self.active.size else 0
        # A mixed group-mode batch (prefills and decodes, as continuous
        # batching makes) runs as two plans over the same outputs: the
        # decodes are not padded to the prefill rows, and get the decode
        # kernels (group padding, splits).
        lens = t.seqlens_q[self.active]
        mixed = active is None and t.group and (lens == 1).any() and (lens > 1).any()
        self.parts = (
            [_Plan(p, session, keep_binds, self.active[sel]) for sel in (lens == 1, lens > 1)] if mixed else [self]
        )
        self._variants: dict[bool, object] = {}
        self._steps: dict[object, list] = {}
        self._index: dict[object, tuple] = {}
        self._stale_index: dict[str, list] = {}
        self._binds: dict[tuple, tuple] = {}
        self._costs: dict[tuple, tuple] = {}
        self.window_decode = False
        if self.rows == 0 or mixed:
            return
        bt, shift = gappy_table(t, self.active, lay.page_block_size)
        bias = (
            None
            if s.bias is None
            else bias_rows(s.bias, t, self.active, self.rows, shift, bt.shape[1] * lay.page_block_size)
        )
        call = KernelCall(
            rows=self.rows,
            q_itemsize=lay.q_dtype.itemsize,
            nhead_q=lay.nhead_q,
            block_table=bt,
            page=lay.page_block_size,
            seqlen_q=t.seqlens_q[self.active].astype(np.int32),
            seqlen_k=t.seqlen_k[self.active].astype(np.int32),
            kv_shift=shift.astype(np.int32),
            scale=s.scale * s.q_scale * s.k_scale,
            softcap=s.softcap,
            scale_o=s.v_scale / (s.p_scale * s.out_scale) if lay.static_quant else s.v_scale,
            scale_p=s.p_scale,
            mask=s.mask,
            alibi_slopes=None
            if s.alibi_slopes is None
            else np.ascontiguousarray(s.alibi_slopes[self.active], np.float32),
            bias=bias,
            sinks=s.sinks,
        )
        # A windowed decode becomes one over its window's keys, which the
        # mask-free decode tiles serve (_key); any window then reads from
        # the first page it sees.
        windowed = window_keys(call)
        self.window_decode = windowed is not call
        call = window_cut(windowed)
        self.stale = stale_rows(call.block_table, call.seqlen_k, call.kv_shift, lay.page_block_size)
        # merge: the split count that a variant merges in the module (0: the
        # partials are merged here, combine_splits).
        self.splits, self.merge = self._split_count(call)
        self.splits = min(self.splits, call.block_table.shape[1])
        self.merge = self.merge if self.merge == self.splits else 0
        self.call = split_kv(call, self.splits, self.merge > 1) if self.splits > 1 else call
        self.key = self._key(self.splits, bias_shape_of(self.call.bias), self.merge > 1)
        online = session._formulation_for(self.key, self.rows == 1) == "online"
        self.guard_free = online and lay.v_layout == "row" and not lay.kv_dtype
        # Row chunks per sequence when the call runs as row entries
        # (plan.row_entries), 0 when it runs as it is.
        self.entries = 0
        if online and self.splits == 1 and self.rows > 1:
            self._choose_entries()

    def _choose_entries(self) -> None:
        """Runs the call as row entries when a built tile of several entries
        makes it cheaper in the modelled cost (plan.modelled_cost: what the
        launches compute, at their rate, plus a cost per launch) by
        ENTRIES_GAIN than the tile select() picks for it as it is."""
        alt = row_entries(self.call)
        # Each entry's own window: a chunk's rows see less than the whole
        # sequence's rows do, and a launch reads the widest of its entries.
        alt = window_cut(alt) if alt is not None else None
        tiles = self.session.entry_variants(self.key) if alt is not None else []
        if not tiles:
            return
        best = min(tiles, key=lambda v: self._cost(v, alt))
        try:
            here = self.session.select(
                self.key, self.rows, self.call.batch, False, 0, self.p.scores.mask.has_right_edge
            )
        except ArtifactError:  # nothing serves the call as it is: the entries do
            here = None
        if here is None or self._cost(best, alt) <= ENTRIES_GAIN * self._cost(here, self.call):
            self.call, self.entries = alt, -(-self.rows // ENTRY_ROWS)
            # The entries' tables start at their own windows' first pages.
            lay = self.p.layout
            self.stale = stale_rows(alt.block_table, alt.seqlen_k, alt.kv_shift, lay.page_block_size)

    def _cost(self, v, call) -> float:
        """modelled_cost, once per tile geometry and call: the built tiles
        are many variants (guards, head counts) of a few geometries."""
        key = (id(call), v.formulation, v.batch_tile, v.seqlen_q_tile, v.mask, v.merge_splits, v.merge_any)
        hit = self._costs.get(key)
        if hit is None:
            hit = self._costs[key] = (modelled_cost(v, call), call)  # the call kept: its id stays its own
        return hit[0]

    def _key(self, splits: int, bias_shape: str, merged: bool = False) -> dict:
        """The variant key of the call in `splits` splits (`merged` in the
        module, which adds the sinks), its bias (if any) of `bias_shape`."""
        p, s = self.p, self.p.scores
        key = dict(p.key, bias_shape=bias_shape, sinks=p.key["sinks"] and (splits == 1 or merged))
        if (
            self.rows == 1
            and (self.window_decode or not s.mask.decode_needs_mask(s.alibi_slopes is not None))
            and self.session.serves(dict(key, mask="none"), True)
        ):
            key["mask"] = "none"  # GPU default sets have decode tiles only without a mask
        return key

    def _split_count(self, call: KernelCall) -> tuple[int, int]:
        """(splits, the count a decode variant could merge in the module or 0)."""
        # The keys its table reads: a window's (window_cut), not the sequence's.
        lay, keys = self.p.layout, min(int(call.seqlen_k.max()), call.block_table.shape[1] * call.page)
        # A split call's bias has a batch axis (split_kv).
        split_shape = "b" + bias_shape_of(call.bias)[1:] if call.bias is not None else ""
        split_key = self._key(2, split_shape)
        merges = self.session.merge_splits_for(self._key(2, split_shape, True)) if self.rows == 1 else ()
        if self.p.num_splits is not None:
            return self.p.num_splits, self.p.num_splits if self.p.num_splits in merges else 0
        if lay.static_quant:
            return 1, 0
        if (
            self.rows == 1
            and self.session._formulation_for(split_key, True) == "online"
            and group_rows_for(split_key, 1)
        ):
            merge = merged_decode_splits(call.batch * lay.nhead_k, self.session.compute_units, keys, merges)
            if merge > 1:
                return merge, merge
            limit = self.session.decode_batch_limit(split_key)
            return decode_splits(call.batch * lay.nhead_k, self.session.compute_units, keys, call.batch, limit), 0
        # Work items: sequences x query heads x 64-row query blocks, as in
        # ck_tile (docs/devlog/perf-notes.md has the measurements behind it).
        work = call.batch * lay.nhead_q * -(-self.rows // 64)
        return num_splits_heuristic(work, self.session.compute_units, keys), 0

    def _variant(self, rows_finite: bool):
        v = self._variants.get(rows_finite)
        if v is None:
            if self.entries:
                tiles = self.session.entry_variants(self.key, rows_finite)
                v = min(tiles, key=lambda t: (self._cost(t, self.call), t.v_guard))
            else:
                v = self.session.select(
                    self.key, self.rows, self.call.batch, rows_finite, self.merge, self.p.scores.mask.has_right_edge
                )
            self._variants[rows_finite] = v
        return v

    def _device_steps(self, variant, results) -> list:
        """The variant's kernel calls, their tables on the device (once per
        plan): through torch where results are torch tensors on a GPU (an
        IREE upload allocates synchronously: ~0.2 ms each on the H200),
        else IREE's own upload."""
        key = (variant, str(results.torch_device))
        steps = self._steps.get(key)
        if steps is None:
            steps = kernel_steps(variant, self.call)
            uploaded = iter(results.upload([a for st in steps for a in st.args]))
            for st in steps:
                st.args = [next(uploaded) for _ in st.args]
            self._steps[key] = steps
        return steps

    def _rows_finite(self, v_cache, defer: bool = False):
        """Whether the V rows the kernels read past the keys are finite (an
        unguarded variant may then run). With `defer`, a cache that _defers
        and whose stale rows were not last seen non-finite gets a LaterBool
        instead: the check is queued on the device, and read once the
        kernels it chose are queued too."""
        if not self.guard_free:
            return False
        if self.p.kv_rows_finite is not None:
            return self.p.kv_rows_finite
        if self.stale is None:
            return False
        if isinstance(v_cache, _DeviceCache) and not isinstance(v_cache, _TorchDeviceCache):
            return False  # IREE device arrays are not looked at
        cache = v_cache.tensor if isinstance(v_cache, _TorchDeviceCache) else v_cache
        kv_layout = self.p.layout.kv_layout
        key = str(getattr(cache, "device", "host"))
        index = self._stale_index.get(key)
        if index is None:  # uploaded once per plan and device
            index = self._stale_index[key] = [ops_for(cache).like(i, cache) for i in self.stale]
        if defer and self._defers(v_cache) and _memory_of(v_cache) not in _NONFINITE_SEEN:
            return LaterBool(lambda: rows_sum(cache, index, kv_layout), math.isfinite)
        return rows_finite(cache, index, kv_layout)

    @staticmethod
    def _defers(v_cache) -> bool:
        """Whether run() checks this cache's stale rows behind its kernels:
        a torch GPU cache, whose check would otherwise wait for the device
        before anything is queued (a host-side check costs no wait)."""
        return isinstance(v_cache, _TorchDeviceCache)

    def run(self, q, k_cache, v_cache, *, out=None, return_lse=False, sinks=None):
        session = self.session
        _check_tensor_devices(session.device_name, q=q, k_cache=k_cache, v_cache=v_cache, out=out, sinks=sinks)
        check_no_grad(dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out))
        sinks = self._run_sinks(sinks)
        like, kc, vc, torch_results = self._arrays(q, k_cache, v_cache, out)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        results = _Results(session, like if torch_results else None)
        q = like.detach() if torch_results else _to_numpy(like, "q")
        out_tensor = out if _is_torch(out) and not torch_results else None
        if out_tensor is not None:  # a torch CPU out, written through its numpy view
            out = _to_numpy(out_tensor, "out")
        if not torch_results and any(
            isinstance(c, _TorchDeviceCache) or (isinstance(c, _DeviceCache) and torch_gpu_memory(c.array))
            for c in (kc, vc)
        ):
            torch_writes_done()
        v_src = v_cache if not _is_torch(v_cache) else vc
        parts = [pt for pt in self.parts if pt.rows]
        finite = [pt._rows_finite(v_src, defer=True) for pt in parts]
        if _NONFINITE_SEEN and all(f is True for f in finite):
            # Checked before the kernels and finite in every part: deferred
            # from now on. (One part's finite rows say nothing of another's.)
            _NONFINITE_SEEN.pop(_memory_of(v_src), None)
        # A deferred check starts once the kernels are queued, behind them,
        # and its answer is read after their wait; the kernels assume finite
        # rows meanwhile, and run again guarded if they were not. The
        # guarded variants a rerun would take are chosen before anything
        # runs: where the artifacts hold none, that part is checked now
        # instead (finite rows run unguarded, others fail here, with `out`
        # as given).
        fallback = []
        for i, (pt, f) in enumerate(zip(parts, finite)):
            try:
                fallback.append(pt._variant(False) if isinstance(f, LaterBool) else None)
            except ArtifactError:
                finite[i] = f.value()
                fallback.append(None)
        later = [f for f in finite if isinstance(f, LaterBool)]
        if later:
            results.while_queued = lambda: [f.start() for f in later]
        work = [(pt, pt._variant(f if isinstance(f, bool) else True)) for pt, f in zip(parts, finite)]
        given_out = out
        out, lse = self._launch(work, q, kc, vc, results, out, return_lse, sinks=sinks)
        redo = [(pt, g) for pt, f, g in zip(parts, finite, fallback) if isinstance(f, LaterBool) and not f.value()]
        if redo:
            if len(_NONFINITE_SEEN) >= MAX_NONFINITE_SEEN:
                _NONFINITE_SEEN.clear()
            _NONFINITE_SEEN[_memory_of(v_src)] = True
            if len(redo) == len(work):
                out, lse = self._launch(redo, q, kc, vc, results, given_out, return_lse, sinks=sinks)
            else:  # a mixed batch's other part was right: its rows stay
                self._launch(redo, q, kc, vc, results, out, return_lse, lse, sinks)
        if torch_results or not _is_torch(like):
            return (out, lse) if return_lse else out
        out_t = out_tensor if out_tensor is not None else _from_numpy(out, like)
        return (out_t, _from_numpy(lse, like)) if return_lse else out_t

    def _launch(self, work, q, kc, vc, results, out, return_lse, lse=None, sinks=None):
        """(out, lse) of the parts' kernels (`work`: (part, variant)); with
        `lse`, the parts write into the `out` and `lse` of an earlier launch;
        `sinks`: the run's in place of the plan's (_run_sinks)."""
        steps = [pt._device_steps(v, results) for pt, v in work]
        if lse is None and out is None and len(work) == 1 and work[0][0] is self and self._direct(steps[0]):
            # One kernel call computes exactly the output: its results are it.
            qb = self._batch_q(q, results)
            res = self._call(work[0][1], steps[0], qb, kc, vc, results, 1 + return_lse, sinks)[0]
            return res if return_lse else (res[0], None)
        axis = self._join_axis(steps[0]) if lse is None and len(work) == 1 and work[0][0] is self else None
        if axis is not None:
            # The calls' results tile the outputs along one axis: each output
            # is one concatenation of them (one copy, into `out` if given),
            # not an allocation, a fill and a copy per call. Row entries are
            # joined first, then rearranged by that one copy.
            pieces = self._call(work[0][1], steps[0], self._batch_q(q, results), kc, vc, results, 1 + return_lse, sinks)
            cut = [((st.b1 - st.b0) // st.merge, st.e - st.s) for st in steps[0]]
            xp = ops_for(pieces[0][0])
            outs = [r[0][:nb, :nr] for r, (nb, nr) in zip(pieces, cut)]
            lses = [r[1][:nb, :, :nr] for r, (nb, nr) in zip(pieces, cut)] if return_lse else None
            if self.entries:
                o, lse = (None if xs is None else xs[0] if len(xs) == 1 else xp.concat(xs, 0) for xs in (outs, lses))
                o, lse = _from_entries(o, lse, self.entries, self.rows)
                if out is None:  # the rearrangement's own copy where it made one
                    return _dense(o, xp), None if lse is None else _dense(lse, xp)
                outs, lses = [o], [lse]
            if out is None and len(outs) == 1:
                # One padded tile: its rows, a view where they are
                # contiguous (a batch cut), no copy.
                return _dense(outs[0], xp), _dense(lses[0], xp) if return_lse else None
            out = xp.concat(outs, axis, out)
            return out, xp.concat(lses, 2 * axis) if return_lse else None
        if lse is None:
            out, lse = self._allocate(q, out, results)
        for (pt, variant), st in zip(work, steps):
            pt._compute(variant, st, q, kc, vc, results, out, lse, sinks)
        return out, lse

    def _arrays(self, q, k_cache, v_cache, out):
        """Checks the layer's arrays against the plan; returns (q, k and v
        as the kernels take them, whether results stay torch tensors)."""
        lay, t, session = self.p.layout, self.p.tables, self.session
        info = _TensorInfo(q) if _is_torch(q) else _to_numpy(q, "q")
        want = ((t.total_q,) if t.group else (t.batch, t.seqlen_q)) + (lay.nhead_q, lay.hdim_q)
        if tuple(info.shape) != want or info.dtype != lay.q_dtype:
            raise ValueError(
                f"q must have shape {list(want)} and dtype {lay.q_dtype} (as planned), "
                f"got {list(info.shape)} {info.dtype}"
            )
        caches = []
        for name, a, shape in (("k_cache", k_cache, lay.k_shape), ("v_cache", v_cache, lay.v_shape)):
            c = self._bound_cache(name, a)
            if c is None:
                c = _cache_array(a, name)
                if tuple(c.shape) != shape or c.dtype != lay.cache_dtype:
                    raise ValueError(
                        f"{name} must have shape {list(shape)} and dtype {lay.cache_dtype} "
                        f"(as planned), got {list(c.shape)} {c.dtype}"
                    )
            caches.append(c)
        if isinstance(caches[0], _DeviceCache) != isinstance(caches[1], _DeviceCache):
            raise TypeError("k_cache and v_cache must both be host arrays or both IREE device arrays")
        torch_out = (
            _is_torch(q)
            and not lay.static_quant
            and (out is None or _is_torch(out))
            and str(q.device) == session.torch_device
        )
        if out is not None:
            check_out(
                out,
                q,
                torch_out,
                (info.shape[:-1] + (lay.hdim_v,)),
                lay.q_dtype,
                dict(q=q, k_cache=k_cache, v_cache=v_cache),
                session,
            )
        # Torch results only on a GPU: a torch CPU tensor's are arranged in
        # numpy views (core.arrays._Results says why).
        return q, *self._bind_caches(caches), torch_out and q.device.type != "cpu"

    def _bound_cache(self, name: str, a):
        """The torch GPU cache `a` as checked and imported by an earlier run
        of this plan, if its memory and layout are unchanged: a serving step
        runs each layer's caches, and a bind costs ~15 us (an import)."""
        if not (_is_torch(a) and a.is_cuda):
            return None
        hit = self._binds.get((name, id(a)))
        if hit is not None and hit[0] is a and hit[1] == _fingerprint(a):
            return hit[2]
        return None

    def _bind_caches(self, caches):
        """torch GPU caches imported for this run; IREE device arrays must
        be the session's."""
        for name, c in zip(("k_cache", "v_cache"), caches):
            if isinstance(c, _TorchDeviceCache) and c.array is None:  # its device was checked on entry
                c.bind(self.session)
                if len(self._binds) < self._max_binds:
                    t = c.source
                    self._binds[(name, id(t))] = (t, _fingerprint(t), c)
            elif isinstance(c, _DeviceCache) and c.array._device is not self.session.device_of():
                raise ValueError(
                    f"{name} is a DeviceArray of another device than the session's ({self.session.device})"
                )
        return caches

    def _direct(self, steps) -> bool:
        """Whether one kernel call's results are exactly the outputs (no
        regrouping, splitting, chunking or padding)."""
        if (
            len(steps) != 1
            or self.entries
            or self.p.tables.group
            or self.splits > max(1, self.merge)
            or self.p.layout.static_quant
        ):
            return False
        st = steps[0]
        return (st.b0, st.b1, st.s, st.e) == (0, self.call.batch, 0, self.rows) and st.tile in (
            None,
            (self.call.batch, self.rows),
        )

    def _join_axis(self, steps) -> int | None:
        """The axis of out (0: batch, 1: rows) along which the steps'
        results, cut to their rows, tile the outputs exactly and in order
        (for row entries: the entries, whose join is then rearranged; one
        step: its padded tile, cut); None where they do not (a 2-D grid of
        tiles, split-KV partials merged here, varlen rows). A given `out`
        is contiguous (check_out)."""
        if self.p.tables.group or self.splits > max(1, self.merge) or self.p.layout.static_quant:
            return None
        # Batch spans in sequences: a merging variant's steps count split
        # entries (Step.merge per sequence). Row entries: ENTRY_ROWS, entries.
        rows, n = self.call.rows, self.call.batch // max(1, self.merge)
        batch = [(st.b0 // st.merge, st.b1 // st.merge) for st in steps]
        spans = {
            1: (batch, [(st.s, st.e) for st in steps], (0, n), rows),
            0: ([(st.s, st.e) for st in steps], batch, (0, rows), n),
        }
        for axis, (other, along, whole, size) in spans.items():
            if self.entries and axis:
                continue  # entries join along the entries, then are rearranged
            ends = [e for _, e in along]
            if all(o == whole for o in other) and [s for s, _ in along] == [0] + ends[:-1] and ends[-1] == size:
                return axis
        return None

    def _call(self, variant, steps, qb, k_cache, v_cache, results, outputs: int, sinks=None) -> list:
        """Each step's first `outputs` results; the steps are queued back
        to back, with the run's `sinks` where given."""
        as_bytes = bool(self.p.layout.kv_dtype or self.p.layout.static_quant)  # fp8 travels as i8
        align = self.session.binding_alignment(variant)
        kc, vc = (self.session.kernel_cache(c, as_bytes, self._imports, align) for c in (k_cache, v_cache))
        calls = [[st.q(qb), kc, vc, *st.args] for st in steps]
        if sinks is not None and variant.sinks:
            at = call_args(variant).index("sinks")
            on_device = self._sinks_on(sinks, results)
            for c in calls:
                c[at] = on_device
        return results.run(variant, calls, outputs)

    def _run_sinks(self, sinks):
        """A run's sinks, checked (None: the plan's)."""
        if sinks is None:
            return None
        if self.p.scores.sinks is None:
            raise ValueError(
                "sinks given to run() of a plan made without sinks: its kernels take none; "
                "pass sinks to plan() (any of the layers') and each run's own to run()"
            )
        return sinks_array(sinks, self.p.layout.nhead_q)

    def _sinks_on(self, sinks: np.ndarray, results):
        """A run's sinks as a kernel argument, uploaded once per session
        and values (each layer brings its own, every step)."""
        uploads = self.session.sinks_uploads
        key = (sinks.tobytes(), str(results.torch_device))
        hit = uploads.get(key)
        if hit is None:
            if len(uploads) >= MAX_SINKS_UPLOADS:
                uploads.clear()
            hit = uploads[key] = results.upload([sinks])[0]
        return hit

    def _allocate(self, q, out, results):
        lay = self.p.layout
        out_shape, lse_shape = lay.result_shapes(tuple(q.shape), self.p.tables.group)
        if out is None:
            out = results.empty(out_shape, lay.q_dtype, fill=0 if self.p.min_seqlen_q else None)
        return out, results.empty(lse_shape, np.float32, fill=-np.inf)

    def _compute(self, variant, steps, q, k_cache, v_cache, results, out, lse, sinks=None):
        lay, t = self.p.layout, self.p.tables
        qb = self._batch_q(q, results)
        if lay.static_quant:
            qb = qb.view(np.int8)  # fp8 travels as i8
        split = self.splits > max(1, self.merge)  # partials merged here, not in the kernel
        if split:
            qb = repeat_rows(qb, self.splits)
        n, rows = self.call.batch, self.rows
        if t.group:
            out_b = results.empty((self.active.size, rows, lay.nhead_q, lay.hdim_v), lay.q_dtype)
            lse_b = results.empty((self.active.size, lay.nhead_q, rows), np.float32)
        else:
            out_b, lse_b = out, lse
        dst = [out_b.view(np.int8) if lay.static_quant else out_b, lse_b]
        if split or self.entries:
            r = self.call.rows  # ENTRY_ROWS for row entries
            dst = [results.empty((n, r, lay.nhead_q, lay.hdim_v), lay.q_dtype)]
            dst += [results.empty((n, lay.nhead_q, r), np.float32) for _ in range(3 if split else 1)]
            if lay.static_quant:
                dst[0] = dst[0].view(np.int8)
        for st, res in zip(steps, self._call(variant, steps, qb, k_cache, v_cache, results, len(dst), sinks)):
            st.place(dst, res)
        if split:
            o_c, l_c = combine_splits(*dst, self.splits, self.p.scores.sinks if sinks is None else sinks)
            out_b[...] = o_c  # rounded to q's dtype once
            lse_b[...] = l_c
        elif self.entries:
            o_e, l_e = _from_entries(dst[0], dst[1], self.entries, rows)
            (out_b.view(np.int8) if lay.static_quant else out_b)[...] = o_e
            lse_b[...] = l_e
        if t.group:
            src, dst_rows = self._indices(results)
            out[src] = out_b.reshape((self.active.size * rows, lay.nhead_q, lay.hdim_v))[dst_rows]
            lse[:, src] = lse_b.swapaxes(0, 1).reshape((lay.nhead_q, self.active.size * rows))[:, dst_rows]

    def _indices(self, results):
        key = str(results.torch_device)
        idx = self._index.get(key)
        if idx is None:
            src, dst = regroup(self.p.tables, self.active, self.rows)
            idx = self._index[key] = (results.index(src), results.index(dst))
        return idx

    def _batch_q(self, q, results):
        """q as [entries, rows, heads, dim]: varlen rows regrouped by one
        gather (one launch on a GPU, not one per sequence)."""
        if not self.p.tables.group:
            qb = q.contiguous() if _is_torch(q) else np.ascontiguousarray(q)
        else:
            src, dst = self._indices(results)
            qb = results.empty((self.active.size, self.rows) + tuple(q.shape[1:]), self.p.layout.q_dtype, fill=0)
            qb.reshape((self.active.size * self.rows,) + tuple(q.shape[1:]))[dst] = q[src]
        return _to_entries(qb, self.entries, self.p.layout.q_dtype, results) if self.entries else qb


def _to_entries(qb, chunks: int, dtype, results):
    """q [batch, rows, ...] as row entries [chunks * batch, ENTRY_ROWS, ...]
    (entry c * batch + b is rows c * ENTRY_ROWS.. of sequence b; rows past
    the end are zero)."""
    batch, rows = qb.shape[:2]
    padded = results.empty((batch, chunks * ENTRY_ROWS) + tuple(qb.shape[2:]), dtype, fill=0)
    padded[:, :rows] = qb
    view = padded.reshape((batch, chunks, ENTRY_ROWS) + tuple(qb.shape[2:]))
    return _swap01(view).reshape((chunks * batch, ENTRY_ROWS) + tuple(qb.shape[2:]))


def _from_entries(out_e, lse_e, chunks: int, rows: int):
    """The row entries' out [E, ENTRY_ROWS, heads, dv] and LSE [E, heads,
    ENTRY_ROWS] back as [batch, rows, heads, dv] and [batch, heads, rows]
    (the LSE None if given None)."""
    batch = out_e.shape[0] // chunks
    heads, dv = out_e.shape[2:]
    out = _swap01(out_e.reshape((chunks, batch, ENTRY_ROWS, heads, dv))).reshape(
        (batch, chunks * ENTRY_ROWS, heads, dv)
    )
    if lse_e is None:
        return out[:, :rows], None
    lse = lse_e.reshape((chunks, batch, heads, ENTRY_ROWS))
    lse = (lse.permute(1, 2, 0, 3) if _is_torch(lse) else lse.transpose(1, 2, 0, 3)).reshape(
        (batch, heads, chunks * ENTRY_ROWS)
    )
    return out[:, :rows], lse[:, :, :rows]


def _dense(a, xp):
    """a if C-contiguous, else a contiguous copy."""
    return a if (a.is_contiguous() if _is_torch(a) else a.flags.c_contiguous) else xp.concat([a], 0)


def _swap01(a):
    return a.transpose(0, 1) if _is_torch(a) else a.swapaxes(0, 1)


def _fingerprint(t) -> tuple:
    """What a bound torch cache depends on: its memory and layout."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device
