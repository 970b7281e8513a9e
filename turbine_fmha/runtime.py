"""Runtime session: loads AOT artifacts and runs them. numpy + iree.runtime only.

A `Session` owns one IREE device (driver) and the modules loaded on it.
Services create one and reuse it; `fmha_fwd_paged(..., session=None)` uses a
process-wide session per device.

Checks (turbine_fmha.artifacts): the whole manifest is validated when a
Session opens the directory; before any module is mapped, the artifact path
stays inside the artifact directory, the file's sha256 matches the manifest,
and the compiler version that built it equals the runtime's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .artifacts import ArtifactError  # re-exported: defined with the artifact store
from .targets import DEVICE_DEFAULT_TARGET, Target, get_target
from .variants import KERNEL_ABI, AppendKernel, Variant, online_unsupported, parse_kernel

ENV_ARTIFACTS = "TURBINE_FMHA_ARTIFACTS"
ENV_CACHE = "TURBINE_FMHA_CACHE"
ENV_MANIFEST_SHA256 = "TURBINE_FMHA_MANIFEST_SHA256"


def default_artifact_dir() -> Path:
    env = os.environ.get(ENV_ARTIFACTS)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "artifacts"


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    return Path(os.path.expanduser("~/.cache/turbine-fmha"))


def runtime_version() -> str:
    from iree.runtime.version import VERSION

    return VERSION


class _Loaded:
    """One verified, loaded artifact. The VM module is shared; each thread
    gets its own VM context (IREE contexts are not safe for concurrent
    invocation), so calls from several threads run concurrently."""

    def __init__(self, variant: Variant, vm_module, config):
        self.variant = variant
        self.vm_module = vm_module
        self.config = config
        self._tls = threading.local()

    @property
    def function(self):
        fn = getattr(self._tls, "fn", None)
        if fn is None:
            import iree.runtime as rt

            ctx = rt.SystemContext(config=self.config)
            ctx.add_vm_module(self.vm_module)
            fn = ctx.modules[self.vm_module.name][self.variant.name]
            self._tls.ctx, self._tls.fn = ctx, fn
        return fn


class Session:
    """Loaded kernels for one device.

    Args:
      device: "cpu" (llvm-cpu artifacts on the local-task driver), "cuda" or
        "hip".
      artifact_dir: directory with manifest.json (default: $TURBINE_FMHA_ARTIFACTS
        or <repo>/artifacts).
      target: artifact target to load (default per device: host, cuda, gfx942).
      compile_missing: when a variant has no artifact, compile it into
        `cache_dir` (needs iree-base-compiler and iree-turbine) instead of
        raising. Off by default: services should ship prebuilt artifacts.
      compute_units: what automatic split-KV fills (fmha_fwd_paged
        num_splits=None): CPU worker threads, GPU SMs/CUs (default:
        DEFAULT_COMPUTE_UNITS).
      manifest_sha256: the sha256 hex digest of artifact_dir's manifest.json
        that the session accepts, or a collection of them (any may match,
        e.g. the old and new ones during a rollout); default
        $TURBINE_FMHA_MANIFEST_SHA256 (comma-separated), else no pin. A
        manifest with another digest, or none, raises ArtifactError here,
        before anything is loaded. The manifest lists each vmfb's sha256,
        which every load verifies, so the pin fixes every kernel the session
        can run: a vmfb is native code, and an artifact directory is
        otherwise trusted like code (README, "Trust"). `turbine-fmha build`
        prints the digest. Cannot be combined with compile_missing (the
        cache's manifest changes as it compiles).

    Every problem with a manifest (unreadable, not JSON, a field missing or
    of the wrong type, an unsupported manifest_version) raises ArtifactError
    naming the file and the field here, not at the first call.
    """

    def __init__(
        self,
        device: str = "cpu",
        *,
        artifact_dir: str | os.PathLike | None = None,
        target: str | None = None,
        compile_missing: bool = False,
        cache_dir: str | os.PathLike | None = None,
        formulation: str | None = None,
        compute_units: int | None = None,
        manifest_sha256: str | Iterable[str] | None = None,
    ):
        from .artifacts import parse_pins

        if device not in DEVICE_DEFAULT_TARGET:
            raise ValueError(
                f"device must be one of {sorted(DEVICE_DEFAULT_TARGET)}, got {device!r}"
            )
        self.device = device
        self.target: Target = get_target(target or DEVICE_DEFAULT_TARGET[device])
        if formulation not in (None, "explicit", "online"):
            raise ValueError(f"formulation must be 'explicit' or 'online', got {formulation!r}")
        # The formulation to run: the target's own by default. Tests force
        # "online" on the CPU to execute the GPU kernels' formulation.
        self.formulation = formulation or self.target.formulation
        self.artifact_dir = Path(artifact_dir) if artifact_dir else default_artifact_dir()
        self.compile_missing = compile_missing
        if compute_units is not None and (isinstance(compute_units, bool) or not isinstance(compute_units, int) or compute_units < 1):
            raise ValueError(f"compute_units must be a positive int, got {compute_units!r}")
        self.compute_units = compute_units or (cpu_threads() if device == "cpu" else DEFAULT_COMPUTE_UNITS[device])
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._lock = threading.RLock()
        self._loaded: dict[str, _Loaded] = {}
        self._tls = threading.local()
        self._executor = None
        self._config = None
        self._index: dict[str, dict] = {}
        # Variants by problem (Variant.problem as a tuple), so choosing one
        # per call does not re-parse every manifest name.
        self._by_problem: dict[tuple, list[Variant]] = {}
        if manifest_sha256 is None and os.environ.get(ENV_MANIFEST_SHA256):
            manifest_sha256 = [d for d in os.environ[ENV_MANIFEST_SHA256].split(",") if d.strip()]
        pins = parse_pins(manifest_sha256)
        if pins is not None and compile_missing:
            raise ValueError("manifest_sha256 cannot be combined with compile_missing: variants compiled "
                             "into cache_dir would load outside the pinned manifest")
        self._read_manifest(self.artifact_dir, pins)
        if compile_missing:
            self._read_manifest(self.cache_dir)

    # -- manifest and loading ---------------------------------------------

    def _read_manifest(self, directory: Path, pins: frozenset[str] | None = None) -> None:
        from .artifacts import entries_for, read_manifest

        manifest = read_manifest(directory, pins=pins)
        if manifest is None:
            return
        for variant, a in entries_for(manifest, self.target.name, KERNEL_ABI, parse_kernel):
            if a["variant"] not in self._index:
                self._index[a["variant"]] = dict(a, _dir=str(directory))
                if isinstance(variant, Variant):
                    self._by_problem.setdefault(_problem_key(variant.problem), []).append(variant)

    def available_variants(self) -> list[Variant]:
        """The attention variants of the session's manifests (append kernels
        left out)."""
        return [k for k in (parse_kernel(n) for n in sorted(self._index)) if isinstance(k, Variant)]

    def _iree_config(self):
        with self._lock:
            if self._config is None:
                self._config = _shared_config(self.target.driver)
            return self._config

    def _load(self, variant: Variant) -> _Loaded:
        name = variant.name
        with self._lock:
            hit = self._loaded.get(name)
            if hit is not None:
                return hit
            entry = self._index.get(name)
            from_cache = entry is not None and Path(entry["_dir"]) == self.cache_dir
            if entry is None or (self.compile_missing and from_cache):
                # On-demand builds go through build(), which recompiles only
                # when the rendered kernel, flags or compiler changed.
                if not self.compile_missing:
                    raise ArtifactError(
                        f"no {self.target.name} artifact for variant {name} in "
                        f"{self.artifact_dir}. Build it with:\n"
                        f"  turbine-fmha build --targets {self.target.name} "
                        f"--out {self.artifact_dir} --variants {name}\n"
                        f"or create the Session with compile_missing=True."
                    )
                entry = self._compile_into_cache(variant)
            loaded = self._load_entry(variant, entry)
            self._loaded[name] = loaded
            return loaded

    def _compile_into_cache(self, variant: Variant) -> dict:
        from .build import build

        build(self.cache_dir, [self.target.name], [variant])
        if self._index.pop(variant.name, None) is not None and isinstance(variant, Variant):
            self._by_problem[_problem_key(variant.problem)].remove(variant)
        self._read_manifest(self.cache_dir)
        return self._index[variant.name]

    def _load_entry(self, variant: Variant, entry: dict) -> _Loaded:
        import iree.runtime as rt

        from .artifacts import verify_artifact

        path, data = verify_artifact(Path(entry["_dir"]), entry, runtime_version())
        config = self._iree_config()
        key = (self.target.driver, entry.get("sha256"))
        with _SHARED_LOCK:
            vm_module = _MODULES.get(key)
            if vm_module is None:
                try:
                    vm_module = rt.VmModule.copy_buffer(config.vm_instance, data)
                except Exception as e:  # the runtime's own message says what is wrong
                    raise ArtifactError(f"cannot load {path}: {e}") from None
                _MODULES[key] = vm_module
        loaded = _Loaded(variant, vm_module, config)
        try:
            loaded.function  # resolve the entry point now: a bad module fails here
        except Exception as e:
            raise ArtifactError(f"cannot load {path}: {e}") from None
        return loaded

    # -- execution ----------------------------------------------------------

    def append_function(self, kernel: AppendKernel):
        """The loaded in-place append kernel (PagedKVCache on a device)."""
        return self._load(kernel).function

    def device_of(self):
        """The IREE HAL device this session runs on."""
        return self._iree_config().device

    def import_host(self, array):
        """A DeviceArray over a C-contiguous numpy array's own memory (no
        copy) on a CPU session, or None where that is not possible (GPU
        sessions, dtypes without an IREE element type). The result holds a
        reference to `array`; the array must stay unchanged while calls use
        it."""
        # The kernels assume 64-byte aligned bindings (aligned vector loads):
        # importing a less aligned array crashes them, so copy those.
        if self.target.driver != "local-task" or not array.flags.c_contiguous or array.ctypes.data % 64:
            return None
        import iree.runtime as rt

        et = {
            np.dtype(np.float16): rt.HalElementType.FLOAT_16,
            np.dtype(np.float32): rt.HalElementType.FLOAT_32,
            np.dtype(np.int8): rt.HalElementType.SINT_8,
        }.get(array.dtype)
        if et is None and array.dtype.name == "bfloat16":
            et = rt.HalElementType.BFLOAT_16
        if et is None:
            return None
        device = self.device_of()
        try:
            buf = device.allocator.import_host_allocation(
                array, rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE, rt.BufferUsage.DEFAULT)
        except Exception:  # e.g. an alignment the allocator refuses: copy instead
            return None
        imported = rt.DeviceArray(device, rt.HalBufferView(buf, list(array.shape), et))
        # The buffer is the array's memory: the DeviceArray owns a reference
        # to it, so the memory lives as long as anything can reach the buffer
        # (a caller dropping its copy early once made kernels read freed
        # memory).
        imported._host_keepalive = array
        return imported

    @property
    def last_variant(self) -> Variant | None:
        """The variant that served this thread's latest kernel call."""
        return getattr(self._tls, "last_variant", None)

    def submit(self, fn, *args, **kwargs):
        """Runs fn(*args, **kwargs) on this session's worker threads and
        returns a concurrent.futures.Future, so a service can prepare the
        next batch while a call runs. See turbine_fmha.fmha_fwd_paged_async."""
        import concurrent.futures

        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=ASYNC_WORKERS, thread_name_prefix="turbine-fmha"
                )
            return self._executor.submit(fn, *args, **kwargs)

    def run_variant(self, variant: Variant, *args, on_device: bool = False, stats: bool = False):
        """One kernel call on validated, contiguous numpy arguments, in the
        kernel's order (see turbine_fmha.plan.plan_calls). Returns (out,
        lse), plus each row's max score and sum with stats=True (what the
        split-KV merge needs), as numpy arrays, or as the session device's
        DeviceArrays with on_device=True (see to_torch)."""
        loaded = self._load(variant)
        self._tls.last_variant = variant
        res = tuple(loaded.function(*args))[: 4 if stats else 2]
        if on_device:
            return res
        # Only the results asked for are copied (a copy back from a GPU
        # costs ~0.2 ms however small).
        return tuple(r.to_host() for r in res)

    @property
    def torch_device(self) -> str:
        """The torch device whose memory this session's device reads: "cpu",
        or "cuda:0" for cuda/hip sessions (IREE opens the first visible
        GPU, which torch calls cuda:0; ROCm torch also says "cuda")."""
        return "cpu" if self.target.driver == "local-task" else "cuda:0"

    def to_torch(self, *arrays):
        """torch tensors on this session's device with the DeviceArrays'
        contents, never through the host: DLPack views of the IREE buffers
        (which they keep alive) where the driver exports them, else
        device-to-device copies into new tensors (device_copy_to_torch).
        Returns one tensor per array."""
        import torch

        if getattr(self, "_exports", True):
            # DLPack device type codes: kDLCPU, kDLCUDA, kDLROCM.
            code = {"local-task": 1, "cuda": 2, "hip": 10}[self.target.driver]
            index = 0 if code == 1 else torch.device(self.torch_device).index
            try:
                return tuple(torch.from_dlpack(self.device_of().create_dlpack_capsule(a._buffer_view, code, index))
                             for a in arrays)
            except RuntimeError:
                # IREE's CUDA driver exports only plain device allocations,
                # not the stream-ordered ones that hold function results
                # (measured on the H200: "buffer type is not supported for
                # export"). Remembered, so later calls go straight to copies.
                self._exports = False
        return self.device_copy_to_torch(*arrays)

    def import_torch(self, tensor):
        """A DeviceArray over a torch tensor on this session's GPU, zero
        copy (DLPack). The tensor must stay alive while calls use it, and
        torch's pending writes to it must be finished first (IREE runs on
        its own stream)."""
        import iree.runtime as rt

        t = tensor if tensor.is_contiguous() else tensor.contiguous()
        device = self.device_of()
        array = rt.DeviceArray(device, device.from_dlpack_capsule(t.__dlpack__(stream=None)))
        array._torch_keepalive = t
        return array

    def device_copy_to_torch(self, *arrays):
        """New torch tensors on this session's device holding copies of
        DeviceArrays, made by IREE queue copies into the tensors' memory
        (imported through DLPack), waited for once before returning.
        Verified on CUDA (scripts/h200_torch_interop.py); the CPU driver
        never needs it (it exports) and refuses queue copies into imported
        torch memory."""
        import torch

        # torch names its dtypes as numpy and ml_dtypes do.
        out = [torch.empty(tuple(a.shape), dtype=getattr(torch, np.dtype(a.dtype).name), device=self.torch_device)
               for a in arrays]
        if out and out[0].is_cuda:
            torch.cuda.synchronize(out[0].device)  # the allocations are stream-ordered too
        device = self.device_of()
        done = device.create_semaphore(0)
        for i, (a, t) in enumerate(zip(arrays, out), 1):
            dst = device.from_dlpack_capsule(t.__dlpack__(stream=None) if t.is_cuda else t.__dlpack__())
            device.queue_copy(a._buffer_view.get_buffer(), dst.get_buffer(), [(done, i - 1)], [(done, i)])
        if out:
            done.wait(len(out))
        return tuple(out)

    def select(self, problem: dict, seqlen_q: int, batch: int, stale_rows_finite: bool = False) -> Variant:
        """Picks the variant for a call: an exact match of `problem` (see
        Variant.problem); among static (online) variants, the one that pads
        least, then the one with the fewest launches, then one without the
        stale-row guard, which is allowed only when stale_rows_finite says
        the V rows holding no key are finite (plan.stale_rows_finite)."""
        formulation = self._formulation_for(problem)
        cands = [
            v for v in self._by_problem.get(_problem_key(problem), [])
            if v.formulation == formulation and (v.v_guard or stale_rows_finite)
        ]
        if self.compile_missing:
            # The default variant for the call competes with the built ones
            # (and is compiled if chosen).
            preferred = self._default_variant_for(problem, seqlen_q, stale_rows_finite)
            if preferred not in cands:
                cands.append(preferred)
        if not cands:
            described = ", ".join(f"{k}={v}" for k, v in problem.items())
            raise ArtifactError(
                f"no {self.target.name} artifact in {self.artifact_dir} for {described}. "
                f"Build it with:\n"
                f"  turbine-fmha build --targets {self.target.name} --out {self.artifact_dir} "
                f"--variants {self._default_variant_for(problem, seqlen_q).name}\n"
                f"or create the Session with compile_missing=True."
            )

        def cost(v: Variant):
            # Least padded work first, then fewest kernel calls.
            if v.formulation == "explicit":
                return (0, 0, True)
            btiles = -(-batch // v.batch_tile)
            qtiles = -(-seqlen_q // v.seqlen_q_tile)
            return (btiles * v.batch_tile * qtiles * v.seqlen_q_tile, btiles * qtiles, v.v_guard)

        return min(cands, key=cost)

    def serves(self, problem: dict) -> bool:
        """Whether select() can find (or, with compile_missing, build) a
        variant for `problem`."""
        if self.compile_missing:
            return True
        formulation = self._formulation_for(problem)
        return any(v.formulation == formulation for v in self._by_problem.get(_problem_key(problem), []))

    def _formulation_for(self, problem: dict) -> str:
        """The session's formulation, unless the online one cannot serve the
        problem (variants.online_unsupported): then the explicit one."""
        if self.formulation == "online" and online_unsupported(problem):
            return "explicit"
        return self.formulation

    def _default_variant_for(self, problem: dict, seqlen_q: int, stale_rows_finite: bool = False) -> Variant:
        if self._formulation_for(problem) == "explicit":
            return Variant(**problem)
        from .variants import GPU_DECODE_TILE, GPU_PREFILL_TILE

        bt, mq = GPU_DECODE_TILE if seqlen_q == 1 else GPU_PREFILL_TILE
        guard = not (stale_rows_finite and problem["v_layout"] == "row")
        return Variant(**problem, formulation="online", batch_tile=bt, seqlen_q_tile=mq, v_guard=guard)


def _problem_key(problem: dict) -> tuple:
    return tuple(sorted(problem.items()))


ENV_CPU_THREADS = "TURBINE_FMHA_CPU_THREADS"
# Worker threads of Session.submit (calls in flight at once per session).
ASYNC_WORKERS = 4
_TOPOLOGY_SET = False


def _set_cpu_topology_once() -> None:
    """One local-task worker per CPU this process may run on.

    IREE's default topology on this 2-vCPU machine ran the decode benchmark
    at 106 ms; one worker took 84 ms and an explicit group count of 2 took
    48 ms (docs/perf-notes.md). Flags are process-wide and must precede the
    first local-task device, so this runs once; $TURBINE_FMHA_CPU_THREADS
    overrides the count.
    """
    global _TOPOLOGY_SET
    if _TOPOLOGY_SET:
        return
    import iree.runtime as rt

    rt.flags.parse_flags(f"--task_topology_group_count={cpu_threads()}")
    _TOPOLOGY_SET = True


def cpu_threads() -> int:
    env = os.environ.get(ENV_CPU_THREADS)
    if env:
        return max(1, int(env))
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


# Compute units the split-KV heuristic fills, per device: CPU workers; SMs of
# an H100/H200 (132); CUs of an MI300X (304). The IREE runtime does not
# report them, so a service on other hardware sets Session(compute_units=).
DEFAULT_COMPUTE_UNITS = {"cuda": 132, "hip": 304}


# One IREE device per driver and one loaded module per artifact (by sha256)
# for the whole process: sessions share them, so a second session on the
# same GPU neither opens another device nor loads a kernel twice.
_SHARED_LOCK = threading.Lock()
_CONFIGS: dict[str, object] = {}
_MODULES: dict[tuple, object] = {}


def _shared_config(driver: str):
    with _SHARED_LOCK:
        config = _CONFIGS.get(driver)
        if config is None:
            import iree.runtime as rt

            if driver == "local-task":
                _set_cpu_topology_once()
            config = _CONFIGS[driver] = rt.Config(driver)
        return config


_DEFAULT_SESSIONS: dict[str, Session] = {}
_DEFAULT_LOCK = threading.Lock()


def default_session(device: str) -> Session:
    with _DEFAULT_LOCK:
        s = _DEFAULT_SESSIONS.get(device)
        if s is None:
            s = Session(device)
            _DEFAULT_SESSIONS[device] = s
        return s
