"""The executor: runs a plan (calls/planner.py) on a session.

Per run it checks the layer's arrays against the plan (q, the caches,
out), binds the caches (host caches read in place, torch GPU caches
imported through DLPack and kept bound per plan), checks whether the V
rows the kernels read past the keys are finite (at once, or deferred behind
the kernels on a torch GPU cache, with a guarded rerun where they were
not), queues every step of every part back to back, and assembles the
outputs as the plan says (one call's results as they are, joined along
one axis, or placed into allocated outputs; split-KV partials merged on
the host; row entries rearranged; varlen rows regrouped).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ..build.artifacts import ArtifactError
from ..calls.modes import regroup
from ..calls.plan import combine_splits, repeat_rows, rows_finite, rows_sum
from ..calls.planner import Part, Plan, direct, join_axis, part_steps, part_variant
from ..calls.problem import sinks_array
from ..core.arrays import (
    DeviceCache,
    TensorInfo,
    TorchDeviceCache,
    array_device,
    byte_range,
    cache_array,
    check_tensor_devices,
    from_numpy,
    is_device_array,
    is_torch,
    np_torch_dtype,
    numpy_to_torch,
    ops_for,
    to_numpy,
    torch_gpu_memory,
    torch_writes_done,
)
from ..core.checks import check_out
from ..core.tracing import check_no_grad
from ..kernels.signature import call_args
from ..kernels.variants import ENTRY_ROWS
from . import hip_handoff

# torch GPU caches an executor keeps bound (two per layer of a large model).
MAX_BINDS = 512

# Run-time sinks a session keeps on the device (Session.sinks_uploads): a
# model's layers' (gpt-oss's 24-36), not a history.
MAX_SINKS_UPLOADS = 256

# V caches (device, byte range) whose stale rows a deferred check last found
# non-finite: run() checks those before it queues anything, so a cache of
# garbage rows (torch.empty) does not run every call twice. Process-wide,
# because a serving engine plans anew each step; forgotten when a check
# finds the rows finite, all at once beyond the bound.
NONFINITE_SEEN: dict[tuple, bool] = {}
MAX_NONFINITE_SEEN = 4096


class Results:
    """Where a call's results live: numpy arrays, or, when q is a torch
    tensor on the session's GPU, torch tensors there (a torch CPU tensor's
    results are numpy arrays, turned into torch views of them by the
    caller: torch's own CPU ops here woke its thread pool, which then spun
    against IREE's workers on the same cores). Kernel results
    then reach them without a host round trip (Session.to_torch: DLPack
    views, or device copies where the driver does not export), and
    padding, chunks, splits and varlen rows are all arranged by torch on
    that device."""

    def __init__(self, session, like=None):
        self.session = session
        self.torch_device = None if like is None or like.device.type == "cpu" else like.device
        # Host work for the wait of the next run() (Session.run_variants'
        # while_queued), taken by that run.
        self.while_queued = None

    def empty(self, shape, dtype, fill=None):
        if self.torch_device is None:
            a = np.empty(shape, dtype)
        else:
            import torch

            a = torch.empty(shape, dtype=np_torch_dtype(dtype), device=self.torch_device)
        if fill is not None:
            a[...] = fill
        return a

    def run(self, variant, arg_lists, outputs: int = 2) -> list:
        """Session.run_variants' results, as this object's kind of arrays."""
        hook, self.while_queued = self.while_queued, None
        if self.torch_device is None:
            return self.session.run_variants(variant, arg_lists, outputs=outputs, while_queued=hook)
        # On the GPU every argument goes in as torch memory imported through
        # DLPack: q as padded on the device, the small host arrays after one
        # copy each. IREE's own per-call uploads allocated device memory
        # for each, which cost more than the kernel (benchmarks/api_profile.py).
        arg_lists = [
            [
                a
                if is_device_array(a)
                else self.session.import_torch(
                    a if is_torch(a) else numpy_to_torch(a).to(self.torch_device, non_blocking=True)
                )
                for a in args
            ]
            for args in arg_lists
        ]
        # On ROCm the calls and torch order each other on the device
        # (hip_handoff); elsewhere torch's stream is waited for here and
        # the calls on the host.
        handoff = hip_handoff.begin(self.session, self.torch_device)
        if handoff is None:
            torch_writes_done(self.torch_device)
        return [
            self.session.to_torch(*r)
            for r in self.session.run_variants(
                variant, arg_lists, on_device=True, outputs=outputs, while_queued=hook, handoff=handoff
            )
        ]

    def upload(self, arrays: list) -> list:
        """Small host arrays as kernel arguments on the session's device: IREE
        buffers, or on a GPU torch path one torch upload of them all (each
        upload has a fixed host cost, so one beats one per array:
        docs/devlog/perf-notes.md, "Round 2: how the kernel is called")
        whose aligned slices are imported through DLPack."""
        if self.torch_device is None:
            import iree.runtime as rt

            return [rt.asdevicearray(self.session.device_of(), np.ascontiguousarray(a)) for a in arrays]
        import torch

        align = 256  # a binding offset every device accepts
        offsets = np.cumsum([0] + [-(-a.nbytes // align) * align for a in arrays])
        packed = np.zeros(int(offsets[-1]), np.uint8)
        for a, o in zip(arrays, offsets):
            packed[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = torch.from_numpy(packed).to(self.torch_device)
        return [
            self.session.import_torch(dev[o : o + a.nbytes].view(np_torch_dtype(a.dtype)).view(a.shape))
            for a, o in zip(arrays, offsets)
        ]

    def index(self, a: np.ndarray):
        """An integer index array where this call's arrays live."""
        if self.torch_device is None:
            return a
        import torch

        return torch.as_tensor(a, device=self.torch_device)


def _memory_of(v_cache) -> tuple:
    """Where a V cache's memory is (NONFINITE_SEEN's key), for a cache
    whose check is deferred (Executor._defers): IREE device arrays have no
    byte range."""
    a = v_cache.tensor if isinstance(v_cache, TorchDeviceCache) else v_cache
    return array_device(a), byte_range(a)


class Executor:
    """Runs one plan on a session, any number of times. It keeps what runs
    share: the variants chosen, the steps' tables on each device, the
    imported caches (`keep_binds`: not for a plan the session's PlanCache
    shares, which outlives the call)."""

    def __init__(self, plan: Plan, session, keep_binds: bool = True):
        self.plan, self.session = plan, session
        self.p = plan.problem
        self._max_binds = MAX_BINDS if keep_binds else 0
        self._imports = {} if keep_binds else None  # host caches imported (Session.kernel_cache)
        self._binds: dict[tuple, tuple] = {}
        self._variants: dict[tuple, object] = {}
        self._steps: dict[tuple, list] = {}
        self._index: dict[tuple, tuple] = {}
        self._stale_index: dict[tuple, list] = {}

    @property
    def parts(self) -> tuple[Part, ...]:
        return self.plan.parts

    def variant(self, i: int, rows_finite: bool):
        """Part i's variant (planner.part_variant), chosen once."""
        key = (i, bool(rows_finite))
        v = self._variants.get(key)
        if v is None:
            v = self._variants[key] = part_variant(self.p, self.parts[i], self.session, rows_finite)
        return v

    def device_steps(self, i: int, variant, results) -> list:
        """Part i's kernel calls for `variant`, their tables on the device
        (once per executor): through torch where results are torch tensors
        on a GPU (an IREE upload allocates synchronously), else IREE's own
        upload."""
        key = (i, variant, str(results.torch_device))
        steps = self._steps.get(key)
        if steps is None:
            steps = part_steps(self.parts[i], variant)
            uploaded = iter(results.upload([a for st in steps for a in st.args]))
            for st in steps:
                st.args = [next(uploaded) for _ in st.args]
            self._steps[key] = steps
        return steps

    def _rows_finite(self, i: int, v_cache, defer: bool = False):
        """Whether the V rows part i's kernels read past the keys are finite
        (an unguarded variant may then run). With `defer`, a cache that
        _defers and whose stale rows were not last seen non-finite gets a
        LaterBool instead: the check is queued on the device, and read once
        the kernels it chose are queued too."""
        part = self.parts[i]
        if not part.guard_free:
            return False
        if self.p.kv_rows_finite is not None:
            return self.p.kv_rows_finite
        if part.stale is None:
            return False
        if isinstance(v_cache, DeviceCache) and not isinstance(v_cache, TorchDeviceCache):
            return False  # IREE device arrays are not looked at
        cache = v_cache.tensor if isinstance(v_cache, TorchDeviceCache) else v_cache
        kv_layout = self.p.layout.kv_layout
        key = (i, str(getattr(cache, "device", "host")))
        index = self._stale_index.get(key)
        if index is None:  # uploaded once per executor and device
            index = self._stale_index[key] = [ops_for(cache).like(x, cache) for x in part.stale]
        if defer and self._defers(v_cache) and _memory_of(v_cache) not in NONFINITE_SEEN:
            return LaterBool(lambda: rows_sum(cache, index, kv_layout), math.isfinite)
        return rows_finite(cache, index, kv_layout)

    @staticmethod
    def _defers(v_cache) -> bool:
        """Whether run() checks this cache's stale rows behind its kernels:
        a torch GPU cache, whose check would otherwise wait for the device
        before anything is queued (a host-side check costs no wait)."""
        return isinstance(v_cache, TorchDeviceCache)

    def run(self, q, k_cache, v_cache, *, out=None, return_lse=False, sinks=None):
        session = self.session
        check_tensor_devices(session.device_name, q=q, k_cache=k_cache, v_cache=v_cache, out=out, sinks=sinks)
        check_no_grad(dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out))
        sinks = self._run_sinks(sinks)
        like, kc, vc, torch_results = self._arrays(q, k_cache, v_cache, out)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        results = Results(session, like if torch_results else None)
        q = like.detach() if torch_results else to_numpy(like, "q")
        out_tensor = out if is_torch(out) and not torch_results else None
        if out_tensor is not None:  # a torch CPU out, written through its numpy view
            out = to_numpy(out_tensor, "out")
        if not torch_results and any(
            isinstance(c, TorchDeviceCache) or (isinstance(c, DeviceCache) and torch_gpu_memory(c.array))
            for c in (kc, vc)
        ):
            torch_writes_done()
        if self.plan.tiles is not None and not self.plan.mixed:
            out, lse = self._run_tiles(q, kc, vc, results, out, return_lse)
        else:
            out, lse = self._run_parts(q, v_cache, kc, vc, results, out, return_lse, sinks)
            if self.plan.tiles is not None:  # the prefills of a mixed batch
                o, lse_t = self._run_tiles(q, kc, vc, results, None, return_lse)
                rows = self._tiles_rows(results)
                out[rows] = o[rows]
                if return_lse:
                    lse[:, rows] = lse_t[:, rows]
        if torch_results or not is_torch(like):
            return (out, lse) if return_lse else out
        out_t = out_tensor if out_tensor is not None else from_numpy(out, like)
        return (out_t, from_numpy(lse, like)) if return_lse else out_t

    def _run_tiles(self, q, kc, vc, results, out, return_lse):
        """(out, LSE) of the plan's tile-prefill calls (calls/tiles.py):
        each computes q's rows [start, stop), in order, its LSE [HQ, rows].
        The region a call copies the keys into holds zeros past each
        sequence's keys, so stale rows need no check."""
        lay, t = self.p.layout, self.p.tables
        qf = q.reshape((t.total_q, lay.nhead_q, lay.hdim_q))
        qf = qf.contiguous() if is_torch(qf) else np.ascontiguousarray(qf)
        outs, lses = [], []
        for n, call in enumerate(self.plan.tiles):
            key = ("tiles", n, str(results.torch_device))
            args = self._steps.get(key)
            if args is None:
                args = self._steps[key] = results.upload(list(call.plan.args))
            align = self.session.binding_alignment(call.kernel)
            kcc, vcc = (self.session.kernel_cache(c, False, self._imports, align) for c in (kc, vc))
            rows = qf[call.start : call.stop]
            if (call.start * qf[0].nbytes) % align:  # a slice the kernel cannot bind
                rows = rows.clone() if is_torch(rows) else np.array(rows)
            got = results.run(call.kernel, [[rows, kcc, vcc, *args]], 2 if return_lse else 1)[0]
            outs.append(got[0])
            lses.append(got[1] if return_lse else None)
        if len(outs) == 1:
            o, lse = outs[0], lses[0]
        else:  # the calls' rows follow each other: q's rows in order
            ops = ops_for(outs[0])
            o = ops.concat(outs, 0)
            lse = ops.concat(lses, 1) if return_lse else None
        o = o.reshape(tuple(q.shape[:-1]) + (lay.hdim_v,))
        if return_lse and not t.group:
            lse = lse.reshape((lay.nhead_q, t.batch, t.seqlen_q)).swapaxes(0, 1)
            lse = lse.contiguous() if is_torch(lse) else np.ascontiguousarray(lse)
        if out is not None:
            out[...] = o
            o = out
        return o, lse

    def _tiles_rows(self, results):
        """The q rows of the tiles' part (a mixed batch's prefills), once."""
        key = ("tiles rows", str(results.torch_device))
        rows = self._index.get(key)
        if rows is None:
            t, part = self.p.tables, self.parts[self.plan.tiles_part]
            own = [np.arange(t.seqstart[b], t.seqstart[b + 1]) for b in part.active]
            rows = self._index[key] = results.index(np.concatenate(own))
        return rows

    def _run_parts(self, q, v_cache, kc, vc, results, out, return_lse, sinks):
        """(out, LSE) of the parts' kernels (not the tiles')."""
        v_src = v_cache if not is_torch(v_cache) else vc
        tiles = self.plan.tiles_part if self.plan.tiles is not None else None
        parts = [i for i, pt in enumerate(self.parts) if pt.rows and i != tiles]
        finite = [self._rows_finite(i, v_src, defer=True) for i in parts]
        if NONFINITE_SEEN and self._defers(v_src) and all(f is True for f in finite):
            # Checked before the kernels and finite in every part: deferred
            # from now on. (One part's finite rows say nothing of another's.)
            NONFINITE_SEEN.pop(_memory_of(v_src), None)
        # A deferred check starts once the kernels are queued, behind them,
        # and its answer is read after their wait; the kernels assume finite
        # rows meanwhile, and run again guarded if they were not. The
        # guarded variants a rerun would take are chosen before anything
        # runs: where the artifacts hold none, that part is checked now
        # instead (finite rows run unguarded, others fail here, with `out`
        # as given).
        fallback = []
        for n, (i, f) in enumerate(zip(parts, finite)):
            try:
                fallback.append(self.variant(i, False) if isinstance(f, LaterBool) else None)
            except ArtifactError:
                finite[n] = f.value()
                fallback.append(None)
        later = [f for f in finite if isinstance(f, LaterBool)]
        if later:
            results.while_queued = lambda: [f.start() for f in later]
        work = [(i, self.variant(i, f if isinstance(f, bool) else True)) for i, f in zip(parts, finite)]
        given_out = out
        out, lse = self._launch(work, q, kc, vc, results, out, return_lse, sinks=sinks)
        redo = [(i, g) for i, f, g in zip(parts, finite, fallback) if isinstance(f, LaterBool) and not f.value()]
        if redo:
            if len(NONFINITE_SEEN) >= MAX_NONFINITE_SEEN:
                NONFINITE_SEEN.clear()
            NONFINITE_SEEN[_memory_of(v_src)] = True
            if len(redo) == len(work):
                out, lse = self._launch(redo, q, kc, vc, results, given_out, return_lse, sinks=sinks)
            else:  # a mixed batch's other part was right: its rows stay
                self._launch(redo, q, kc, vc, results, out, return_lse, lse, sinks)
        return out, lse

    def _launch(self, work, q, kc, vc, results, out, return_lse, lse=None, sinks=None):
        """(out, lse) of the parts' kernels (`work`: (part index, variant));
        with `lse`, the parts write into the `out` and `lse` of an earlier
        launch; `sinks`: the run's in place of the plan's (_run_sinks)."""
        steps = [self.device_steps(i, v, results) for i, v in work]
        one = lse is None and len(work) == 1
        i, part = (work[0][0], self.parts[work[0][0]]) if one else (None, None)
        if one and out is None and direct(self.plan, part, steps[0]):
            # One kernel call computes exactly the output: its results are it.
            qb = self._batch_q(i, q, results)
            res = self._call(work[0][1], steps[0], qb, kc, vc, results, 1 + return_lse, sinks)[0]
            return res if return_lse else (res[0], None)
        axis = join_axis(self.plan, part, steps[0]) if one else None
        if axis is not None:
            # The calls' results tile the outputs along one axis: each output
            # is one concatenation of them (one copy, into `out` if given),
            # not an allocation, a fill and a copy per call. Row entries are
            # joined first, then rearranged by that one copy.
            qb = self._batch_q(i, q, results)
            pieces = self._call(work[0][1], steps[0], qb, kc, vc, results, 1 + return_lse, sinks)
            cut = [((st.b1 - st.b0) // st.merge, st.e - st.s) for st in steps[0]]
            xp = ops_for(pieces[0][0])
            outs = [r[0][:nb, :nr] for r, (nb, nr) in zip(pieces, cut)]
            lses = [r[1][:nb, :, :nr] for r, (nb, nr) in zip(pieces, cut)] if return_lse else None
            if part.entries:
                o, lse = (None if xs is None else xs[0] if len(xs) == 1 else xp.concat(xs, 0) for xs in (outs, lses))
                o, lse = from_entries(o, lse, part.entries, part.rows)
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
        for (j, variant), st in zip(work, steps):
            self._compute(j, variant, st, q, kc, vc, results, out, lse, sinks)
        return out, lse

    def _arrays(self, q, k_cache, v_cache, out):
        """Checks the layer's arrays against the plan; returns (q, k and v
        as the kernels take them, whether results stay torch tensors)."""
        lay, t, session = self.p.layout, self.p.tables, self.session
        info = TensorInfo(q) if is_torch(q) else to_numpy(q, "q")
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
                c = cache_array(a, name)
                if tuple(c.shape) != shape or c.dtype != lay.cache_dtype:
                    raise ValueError(
                        f"{name} must have shape {list(shape)} and dtype {lay.cache_dtype} "
                        f"(as planned), got {list(c.shape)} {c.dtype}"
                    )
            caches.append(c)
        if isinstance(caches[0], DeviceCache) != isinstance(caches[1], DeviceCache):
            raise TypeError("k_cache and v_cache must both be host arrays or both IREE device arrays")
        torch_out = (
            is_torch(q)
            and not lay.static_quant
            and (out is None or is_torch(out))
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
        # numpy views (Results says why).
        return q, *self._bind_caches(caches), torch_out and q.device.type != "cpu"

    def _bound_cache(self, name: str, a):
        """The torch GPU cache `a` as checked and imported by an earlier run
        of this executor, if its memory and layout are unchanged: a serving
        step runs each layer's caches, and a bind costs an import."""
        if not (is_torch(a) and a.is_cuda):
            return None
        hit = self._binds.get((name, id(a)))
        if hit is not None and hit[0] is a and hit[1] == _fingerprint(a):
            return hit[2]
        return None

    def _bind_caches(self, caches):
        """torch GPU caches imported for this run; IREE device arrays must
        be the session's."""
        for name, c in zip(("k_cache", "v_cache"), caches):
            if isinstance(c, TorchDeviceCache) and c.array is None:  # its device was checked on entry
                c.bind(self.session)
                if len(self._binds) < self._max_binds:
                    t = c.source
                    self._binds[(name, id(t))] = (t, _fingerprint(t), c)
            elif isinstance(c, DeviceCache) and c.array._device is not self.session.device_of():
                raise ValueError(
                    f"{name} is a DeviceArray of another device than the session's ({self.session.device})"
                )
        return caches

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

    def _compute(self, i, variant, steps, q, k_cache, v_cache, results, out, lse, sinks=None):
        lay, t, part = self.p.layout, self.p.tables, self.parts[i]
        qb = self._batch_q(i, q, results)
        if lay.static_quant:
            qb = qb.view(np.int8)  # fp8 travels as i8
        split = part.host_split  # partials merged here, not in the kernel
        if split:
            qb = repeat_rows(qb, part.splits)
        n, rows, active = part.call.batch, part.rows, part.active
        if t.group:
            out_b = results.empty((active.size, rows, lay.nhead_q, lay.hdim_v), lay.q_dtype)
            lse_b = results.empty((active.size, lay.nhead_q, rows), np.float32)
        else:
            out_b, lse_b = out, lse
        dst = [out_b.view(np.int8) if lay.static_quant else out_b, lse_b]
        if split or part.entries:
            r = part.call.rows  # ENTRY_ROWS for row entries
            dst = [results.empty((n, r, lay.nhead_q, lay.hdim_v), lay.q_dtype)]
            dst += [results.empty((n, lay.nhead_q, r), np.float32) for _ in range(3 if split else 1)]
            if lay.static_quant:
                dst[0] = dst[0].view(np.int8)
        for st, res in zip(steps, self._call(variant, steps, qb, k_cache, v_cache, results, len(dst), sinks)):
            st.place(dst, res)
        if split:
            o_c, l_c = combine_splits(*dst, part.splits, self.p.scores.sinks if sinks is None else sinks)
            out_b[...] = o_c  # rounded to q's dtype once
            lse_b[...] = l_c
        elif part.entries:
            o_e, l_e = from_entries(dst[0], dst[1], part.entries, rows)
            (out_b.view(np.int8) if lay.static_quant else out_b)[...] = o_e
            lse_b[...] = l_e
        if t.group:
            src, dst_rows = self._indices(i, results)
            out[src] = out_b.reshape((active.size * rows, lay.nhead_q, lay.hdim_v))[dst_rows]
            lse[:, src] = lse_b.swapaxes(0, 1).reshape((lay.nhead_q, active.size * rows))[:, dst_rows]

    def _indices(self, i: int, results):
        key = (i, str(results.torch_device))
        idx = self._index.get(key)
        if idx is None:
            part = self.parts[i]
            src, dst = regroup(self.p.tables, part.active, part.rows)
            idx = self._index[key] = (results.index(src), results.index(dst))
        return idx

    def _batch_q(self, i: int, q, results):
        """q as [entries, rows, heads, dim]: varlen rows regrouped by one
        gather (one launch on a GPU, not one per sequence)."""
        part = self.parts[i]
        if not self.p.tables.group:
            qb = q.contiguous() if is_torch(q) else np.ascontiguousarray(q)
        else:
            src, dst = self._indices(i, results)
            qb = results.empty((part.active.size, part.rows) + tuple(q.shape[1:]), self.p.layout.q_dtype, fill=0)
            qb.reshape((part.active.size * part.rows,) + tuple(q.shape[1:]))[dst] = q[src]
        return to_entries(qb, part.entries, self.p.layout.q_dtype, results) if part.entries else qb


def to_entries(qb, chunks: int, dtype, results):
    """q [batch, rows, ...] as row entries [chunks * batch, ENTRY_ROWS, ...]
    (entry c * batch + b is rows c * ENTRY_ROWS.. of sequence b; rows past
    the end are zero)."""
    batch, rows = qb.shape[:2]
    padded = results.empty((batch, chunks * ENTRY_ROWS) + tuple(qb.shape[2:]), dtype, fill=0)
    padded[:, :rows] = qb
    view = padded.reshape((batch, chunks, ENTRY_ROWS) + tuple(qb.shape[2:]))
    return _swap01(view).reshape((chunks * batch, ENTRY_ROWS) + tuple(qb.shape[2:]))


def from_entries(out_e, lse_e, chunks: int, rows: int):
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
    lse = (lse.permute(1, 2, 0, 3) if is_torch(lse) else lse.transpose(1, 2, 0, 3)).reshape(
        (batch, heads, chunks * ENTRY_ROWS)
    )
    return out[:, :rows], lse[:, :, :rows]


def _dense(a, xp):
    """a if C-contiguous, else a contiguous copy."""
    return a if (a.is_contiguous() if is_torch(a) else a.flags.c_contiguous) else xp.concat([a], 0)


def _swap01(a):
    return a.transpose(0, 1) if is_torch(a) else a.swapaxes(0, 1)


def _fingerprint(t) -> tuple:
    """What a bound torch cache depends on: its memory and layout."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


class LaterBool:
    """predicate(x) for the 0-d array x that `compute` yields, asked for
    early and read late: start() queues compute, value() reads it. A torch
    GPU x travels to pinned host memory behind an event on torch's current
    stream, so reading it waits for the work queued up to it and for
    nothing queued later."""

    # Per thread and device, the (pinned float, event) pairs of values read:
    # reused, so a check allocates nothing.
    _spare = threading.local()

    def __init__(self, compute, predicate=bool):
        self._compute, self._predicate = compute, predicate
        self._host = self._pair = None
        self._started = False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        x = self._compute()
        if not (is_torch(x) and x.is_cuda):
            self._host = self._predicate(float(x))
            return
        import torch

        pools = getattr(self._spare, "pools", None)
        if pools is None:
            pools = self._spare.pools = {}
        self._spare_list = pools.setdefault(x.device, [])  # an event records on its device's streams only
        if self._spare_list:
            self._pair = self._spare_list.pop()
        else:
            with torch.cuda.device(x.device):
                self._pair = (torch.empty((), dtype=torch.float32, pin_memory=True), torch.cuda.Event())
        host, event = self._pair
        host.copy_(x, non_blocking=True)
        event.record(torch.cuda.current_stream(x.device))

    def value(self) -> bool:
        self.start()
        if self._pair is not None:
            host, event = self._pair
            event.synchronize()
            self._host, self._pair = self._predicate(float(host)), None
            self._spare_list.append((host, event))
        return self._host
