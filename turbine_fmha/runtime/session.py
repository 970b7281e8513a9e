"""Runtime session: loads AOT artifacts and runs them. numpy + iree.runtime only.

The Session's jobs live in their own modules: reading and verifying
artifact directories (artifacts.py), choosing a variant (selection.py) and
moving arrays in and out of the device (interop.py); this module loads
modules and invokes them.

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
import weakref
from collections.abc import Iterable
from pathlib import Path

from ..build.artifacts import ArtifactError
from ..build.targets import (
    CPU_TARGET_PREFERENCE,
    DEFAULT_BINDING_ALIGNMENT,
    DEVICE_DEFAULT_TARGET,
    TARGETS,
    Target,
    get_target,
)
from ..core import cpu as host_cpu
from ..core import env
from ..core.devices import device_name, parse_device
from ..core.tracing import untraced
from ..kernels.append_kernel import AppendKernel
from ..kernels.signature import KERNEL_ABI
from ..kernels.variants import Variant, parse_kernel
from . import hip_handoff
from .interop import DeviceInterop
from .invoke import Loaded, host_array, wait_all
from .paths import default_artifact_dir, default_cache_dir, default_compile_missing
from .plan_cache import PlanCache
from .selection import VariantSelection, problem_key

# The CUDA device's allocators ($TURBINE_FMHA_CUDA_ALLOCATORS, "" for none).
# The default pools device buffers freed by calls
# (results, transients) for reuse: plain CUDA allocations (which DLPack
# needs) are a synchronous cuMemAlloc and a device-synchronizing cuMemFree
# each, and a decode call's kernels waited for them (docs/devlog/perf-notes.md).
# Buffers up to 256 MiB are pooled, at most 2 GiB and 256 buffers retained:
# each call in flight holds its own result and transient buffers, and with
# 64 a queue of 200 decode calls released most of them with cuMemFree,
# which waits for the device, so every call behind it waited too
# (docs/devlog/perf-notes.md, "The host side of a GPU call: queued calls
# and the call-buffer pool").
DEFAULT_CUDA_ALLOCATORS = "caching:device_local=256mib;2gib;256"


def runtime_version() -> str:
    from iree.runtime.version import VERSION

    return VERSION


class Session(VariantSelection, DeviceInterop):
    """Loaded kernels for one device.

    Args:
      device: "cpu" (llvm-cpu artifacts on the local-task driver), "cuda"
        or "hip" (the first GPU), "cuda:N" or "hip:N" (the process's N-th
        GPU, as torch counts them), or a torch.device. `device` is then the
        kind ("cuda") and `ordinal` the GPU's index (0 on the CPU). A GPU
        device that IREE's driver for it does not list (no such driver on
        this machine, or an ordinal past its GPUs) raises ValueError naming
        it, before anything is read, compiled or opened.
      artifact_dir: directory with manifest.json (default: $TURBINE_FMHA_ARTIFACTS,
        else the user cache directory: turbine_fmha.paths).
      target: artifact target to load (default: cuda, gfx942; on the CPU the
        first of build.targets.CPU_TARGET_PREFERENCE the directories hold
        and this CPU can run, else host). A target of another device
        (Session("cuda", target="host")), or a CPU target this CPU cannot
        run, raises ValueError; a directory of only such artifacts
        ArtifactError.
      compile_missing: bool, default False. When a variant has no
        artifact, compile it into `cache_dir` (needs iree-base-compiler
        and iree-turbine) instead of raising. Off by default: services
        should ship prebuilt artifacts.
      cache_dir: where compile_missing puts what it compiles (default: the
        user cache directory, turbine_fmha.runtime.paths).
      formulation: "explicit" or "online", default None (the target's
        own: online on GPUs, explicit on the CPU). "online" on the CPU runs
        the GPU formulation there, as a check of it, not a fast path.
      compute_units: int, what automatic split-KV fills (fmha_fwd_paged
        num_splits=None): CPU worker threads, GPU SMs/CUs (default:
        DEFAULT_COMPUTE_UNITS: the CPU worker threads, 132 for cuda, 304
        for hip; set it on other GPUs).
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
      prefill_tiles: bool or None (default: True on GPU targets, False on
        the CPU). Runs compute-bound prefill calls through contiguous tiles
        (kernels.tiles_kernel: the keys copied out of the pages once, then
        unpaged attention over whole chunks, only the diagonal blocks
        masked) where a built tile kernel serves the call, or
        compile_missing builds one. On the CPU the explicit kernels are
        faster (docs/benchmarks.md).

    Every problem with a manifest (unreadable, not JSON, a field missing or
    of the wrong type, an unsupported manifest_version) raises ArtifactError
    naming the file and the field here, not at the first call.
    """

    @untraced
    def __init__(
        self,
        device="cpu",
        *,
        artifact_dir: str | os.PathLike | None = None,
        target: str | None = None,
        compile_missing: bool = False,
        cache_dir: str | os.PathLike | None = None,
        formulation: str | None = None,
        compute_units: int | None = None,
        manifest_sha256: str | Iterable[str] | None = None,
        prefill_tiles: bool | None = None,
    ):
        from ..build.artifacts import parse_pins

        device, ordinal = parse_device(device)
        # Errors name the device as given: "cuda", not the "cuda:0" it means.
        given = device if ordinal is None else device_name(device, ordinal)
        self.device = device
        self.ordinal = ordinal or 0
        chosen = _checked_target(device, self.ordinal, target, given)
        if formulation not in (None, "explicit", "online"):
            raise ValueError(f"formulation must be 'explicit' or 'online', got {formulation!r}")
        if prefill_tiles is not None and not isinstance(prefill_tiles, bool):
            raise TypeError(f"prefill_tiles must be a bool or None, got {type(prefill_tiles).__name__}")
        self.artifact_dir = Path(artifact_dir) if artifact_dir else default_artifact_dir()
        self.compile_missing = compile_missing
        if compute_units is not None and (
            isinstance(compute_units, bool) or not isinstance(compute_units, int) or compute_units < 1
        ):
            raise ValueError(f"compute_units must be a positive int, got {compute_units!r}")
        self.compute_units = compute_units or (cpu_threads() if device == "cpu" else DEFAULT_COMPUTE_UNITS[device])
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._lock = threading.RLock()
        self._loaded: dict[str, Loaded] = {}
        self._tls = threading.local()
        self._executor = None
        self._config = None
        # One-shot calls' plans, for the next call with equal inputs.
        self.plans = PlanCache()
        # run()'s sinks on the device, by value and torch device: a model's
        # layers bring the same few every step, to a new plan each step.
        self.sinks_uploads: dict[tuple, object] = {}
        self._index: dict[str, dict] = {}
        # Variants by problem (Variant.problem as a tuple), so choosing one
        # per call does not re-parse every manifest name.
        self._by_problem: dict[tuple, list[Variant]] = {}
        from_env = manifest_sha256 is None
        if from_env:
            manifest_sha256 = env.comma_list(env.MANIFEST_SHA256)
        try:
            pins = parse_pins(manifest_sha256)
        except ValueError as e:
            raise ValueError(f"${env.MANIFEST_SHA256}: {e}" if from_env else str(e)) from None
        if pins is not None and compile_missing:
            raise ValueError(
                "manifest_sha256 cannot be combined with compile_missing: variants compiled "
                "into cache_dir would load outside the pinned manifest"
            )
        from ..build.artifacts import read_manifest

        manifests = [(self.artifact_dir, read_manifest(self.artifact_dir, pins=pins))]
        if compile_missing:
            manifests.append((self.cache_dir, read_manifest(self.cache_dir)))
        self.target: Target = chosen or _cpu_target(manifests, compile_missing)
        # The formulation to run: the target's own by default. Tests force
        # "online" on the CPU to execute the GPU kernels' formulation.
        self.formulation = formulation or self.target.formulation
        self.prefill_tiles = self.target.kind != "cpu" if prefill_tiles is None else prefill_tiles
        # Entries of this target that this CPU cannot run, by directory:
        # what build_hint names.
        self._foreign: dict[str, list[str]] = {}
        for directory, manifest in manifests:
            self._index_manifest(directory, manifest)
        # Last: a session whose construction raised is in no table.
        with _SHARED_LOCK:
            LIVE_SESSIONS[id(self)] = self

    # -- manifest and loading ---------------------------------------------

    def _read_manifest(self, directory: Path) -> None:
        from ..build.artifacts import read_manifest

        self._index_manifest(directory, read_manifest(directory))

    def _index_manifest(self, directory: Path, manifest) -> None:
        from ..build.artifacts import entries_for

        if manifest is None:
            return
        for variant, a in entries_for(manifest, self.target.name, KERNEL_ABI, parse_kernel):
            lacks = _cpu_lacks(self.target, a)
            if lacks:
                self._foreign.setdefault(str(directory), lacks)
            elif a["variant"] not in self._index:
                self._index[a["variant"]] = dict(a, _dir=str(directory))
                if isinstance(variant, Variant):
                    self._by_problem.setdefault(problem_key(variant.problem), []).append(variant)
        self._variants_changed()

    def available_variants(self) -> list[Variant]:
        """The attention variants of the session's manifests (append kernels
        left out)."""
        return [k for k in (parse_kernel(n) for n in sorted(self._index)) if isinstance(k, Variant)]

    @property
    def device_name(self) -> str:
        """ "cpu", or "cuda:N" / "hip:N": the device this session runs on."""
        return device_name(self.device, self.ordinal)

    def __repr__(self) -> str:
        return f"Session({self.device_name!r}, target={self.target.name!r}, artifact_dir={str(self.artifact_dir)!r})"

    def _iree_config(self):
        with self._lock:
            if self._config is None:
                self._config = _shared_config(self.target.driver, self.ordinal, self.device_name)
            return self._config

    def _load(self, variant: Variant) -> Loaded:
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
                        f"{self.artifact_dir}. " + self.build_hint(name)
                    )
                entry = self._compile_into_cache(variant)
            loaded = self._load_entry(variant, entry)
            self._loaded[name] = loaded
            return loaded

    def _compile_into_cache(self, variant: Variant) -> dict:
        import logging

        from ..build.aot import build, require_build_extra

        # The runtime alone would fail deep in the build on its first
        # import of the compiler or torch; say which extra to install.
        require_build_extra(f"compile_missing (compiling {variant.name})")
        if variant.name not in self._index:
            # Visible without any logging setup (WARNING reaches stderr):
            # a first call stalls for seconds while this compiles.
            logging.getLogger(__name__).warning(
                "turbine-fmha: compiling %s for %s into %s (first use)", variant.name, self.target.name, self.cache_dir
            )
        build(self.cache_dir, [self.target.name], [variant])
        if self._index.pop(variant.name, None) is not None and isinstance(variant, Variant):
            self._by_problem[problem_key(variant.problem)].remove(variant)
        self._variants_changed()
        self._read_manifest(self.cache_dir)
        return self._index[variant.name]

    def _load_entry(self, variant: Variant, entry: dict) -> Loaded:
        import iree.runtime as rt

        from ..build.artifacts import verify_artifact

        path, data = verify_artifact(Path(entry["_dir"]), entry, runtime_version())
        config = self._iree_config()
        key = (self.target.driver, self.ordinal, entry.get("sha256"))
        with _SHARED_LOCK:
            vm_module = _MODULES.get(key)
            if vm_module is None:
                try:
                    vm_module = rt.VmModule.copy_buffer(config.vm_instance, data)
                except Exception as e:  # the runtime's own message says what is wrong
                    raise ArtifactError(f"cannot load {path}: {e}") from None
                _MODULES[key] = vm_module
        loaded = Loaded(variant, vm_module, config, spin=self.target.driver != "local-task")
        try:
            _ = loaded.function  # resolve the entry point now: a bad module fails here
        except Exception as e:
            raise ArtifactError(f"cannot load {path}: {e}") from None
        return loaded

    # -- execution ----------------------------------------------------------

    def binding_alignment(self, kernel: Variant) -> int:
        """The alignment in bytes that `kernel`'s artifact assumes of its
        arguments' memory (the manifest's binding_alignment; IREE's default
        for entries without one). The kernel is loaded first, built where
        the session compiles missing kernels: asked before its first build,
        the answer was IREE's default and changed after it, so a plan's host
        caches, kept by alignment, were imported again by the next run."""
        self._load(kernel)
        entry = self._index.get(kernel.name)
        return DEFAULT_BINDING_ALIGNMENT if entry is None else entry.get("binding_alignment", DEFAULT_BINDING_ALIGNMENT)

    def append_function(self, kernel: AppendKernel):
        """The loaded in-place append kernel (PagedKVCache on a device)."""
        return self._load(kernel)

    def device_of(self):
        """The IREE HAL device this session runs on."""
        return self._iree_config().device

    def trim(self) -> None:
        """Returns the device buffers that the device's pool keeps for reuse
        (IREE's caching allocator on CUDA, shared by every session on that
        GPU) to the GPU. The pool keeps at most 256 buffers and never
        evicts: after a burst of calls queued at once, it can hold only
        that burst's sizes, and every buffer of another size is then a
        synchronous allocation and free. Buffers in use are untouched; a
        device never opened is not opened."""
        config = _CONFIGS.get((self.target.driver, self.ordinal))
        if config is not None:
            config.device.allocator.trim()

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
        return self.run_variants(variant, [args], on_device=on_device, outputs=4 if stats else 2)[0]

    def run_variants(
        self, variant: Variant, arg_lists, on_device: bool = False, outputs: int = 2, while_queued=None, handoff=None
    ) -> list:
        """The first `outputs` results of each call (out, lse, then the
        max and sum of stats) for each argument list, the calls queued back
        to back and waited for at the end (a chunked prefill's calls are
        independent). Results not asked for are never mapped or copied.
        `while_queued()`, if given, runs once the calls are queued and
        before their wait: host work that the device's then hides.
        `handoff` (a hip_handoff.Handoff, with on_device): the calls wait
        for torch's stream and torch's stream for them, on the device; the
        results are handed back in flight, not waited for."""
        loaded = self._load(variant)
        self._tls.last_variant = variant
        if handoff is not None and (not on_device or not loaded.fenced):
            handoff = handoff.host_wait()
        # No call waits for the one before it: IREE's allocations would wait
        # on the host, idling the device meanwhile (docs/devlog/perf-notes.md).
        calls, queued = [], False
        try:
            for i, args in enumerate(arg_lists):
                calls.append(loaded.enqueue(list(args), own_timeline=i > 0, handoff=handoff))
            if while_queued is not None:
                while_queued()
            queued = True
        finally:
            if handoff is not None and queued:
                failure = handoff.finish(calls)
            else:
                # Every queued call is waited for, also when a later one
                # could not be queued: they read their arguments' memory
                # until done.
                failure = wait_all(calls)
                if handoff is not None:
                    handoff.waited()
        if failure is not None:
            raise failure
        res = [c.results(outputs) for c in calls]
        if on_device:
            return res
        # Only the results asked for are copied: a copy back from a GPU has
        # a fixed cost however small it is (docs/devlog/benchmarks-history.md,
        # "H200, device time on both sides", the output-to-host columns).
        return [tuple(host_array(r) for r in one) for one in res]


# Worker threads of Session.submit (calls in flight at once per session).
ASYNC_WORKERS = 4
_TOPOLOGY_SET = False


def _set_cpu_topology_once() -> None:
    """One local-task worker per CPU this process may run on: IREE's
    default topology ran the CPU kernels far slower (docs/devlog/perf-notes.md,
    "CPU runtime", "Local-task topology").
    Flags are process-wide and must precede the first local-task device, so
    this runs once; $TURBINE_FMHA_CPU_THREADS overrides the count.
    """
    global _TOPOLOGY_SET
    if _TOPOLOGY_SET:
        return
    import iree.runtime as rt

    rt.flags.parse_flags(f"--task_topology_group_count={cpu_threads()}")
    _TOPOLOGY_SET = True


def cpu_threads() -> int:
    given = env.positive_int(env.CPU_THREADS)
    if given is not None:
        return given
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


# Compute units the split-KV heuristic fills, per device: CPU workers; SMs of
# an H100/H200 (132); CUs of an MI300X (304). The IREE runtime does not
# report them, so a service on other hardware sets Session(compute_units=).
DEFAULT_COMPUTE_UNITS = {"cuda": 132, "hip": 304}


# One IREE device per driver and ordinal, and one loaded module per artifact
# (by sha256) on each, for the whole process: sessions share them, so a
# second session on the same GPU neither opens another device nor loads a
# kernel twice.
_SHARED_LOCK = threading.Lock()
# Every live Session by id(), held weakly: what the torch ops' session
# handles name (torch_ops.session_handle).
LIVE_SESSIONS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_CONFIGS: dict[tuple, object] = {}
_MODULES: dict[tuple, object] = {}


# The devices each IREE GPU driver lists, by driver name, or why the driver
# cannot be opened: asked once per process (every GPU session's
# construction checks its device against it), and again when a device is
# opened (_shared_config).
_DRIVER_DEVICES: dict[str, list | str] = {}
# Its own lock, not _SHARED_LOCK: _shared_config holds that one while it
# checks the device it opens.
_DRIVER_LOCK = threading.Lock()


def _checked_target(device: str, ordinal: int, target: str | None, given: str) -> Target | None:
    """The target a session of `device` (named `given` in errors) runs:
    `target`, else the device's default; None for a CPU session without
    one, which takes the best its directories hold for this CPU
    (_cpu_target, once they are read). Raises ValueError for a target the
    device or this CPU cannot run, or a GPU the machine does not have."""
    chosen = get_target(target) if target is not None else None
    if chosen is None and device != "cpu":
        chosen = get_target(DEVICE_DEFAULT_TARGET[device])
    if chosen is not None and chosen.driver != _device_driver(device):
        # Such a session loaded artifacts for another device: a GPU
        # session of a CPU target ran its calls on the CPU.
        raise ValueError(
            f"device {given!r}: cannot run target {chosen.name!r} (a {chosen.kind} target, for IREE's "
            f"{chosen.driver} driver); a {device} device takes {', '.join(_device_targets(device))}"
        )
    if chosen is not None and chosen.kind == "cpu":
        lacks = host_cpu.this_cpu().lacks(chosen.cpu_arch, chosen.cpu_requires)
        if lacks:
            raise ValueError(
                f"target {chosen.name!r} needs what this CPU ({host_cpu.this_cpu().arch}) lacks: {', '.join(lacks)}"
            )
    if device == "hip":
        env.switch(env.HIP_HOST_WAIT)  # read (and refused if invalid) now, not at the first call
    if device != "cpu":
        _check_device(chosen.driver, ordinal, given)
    return chosen


def _device_driver(kind: str) -> str:
    """The IREE driver that runs a device kind's artifacts."""
    return get_target(DEVICE_DEFAULT_TARGET[kind]).driver


def _device_targets(kind: str) -> list[str]:
    """The targets whose artifacts a device kind runs."""
    return [t.name for t in TARGETS.values() if t.driver == _device_driver(kind)]


def _hal_driver(driver: str):
    """IREE's `driver`, which IREE creates once per process."""
    import iree.runtime as rt

    if driver == "cuda" and not env.switch(env.CUDA_ASYNC_ALLOCATIONS):
        # Plain allocations for results: torch can then take them
        # zero-copy (DLPack refuses stream-ordered ones), which saves a
        # device-to-device copy, its allocations and its wait on every
        # call (docs/devlog/perf-notes.md, "The host side of a call:
        # plan/run").
        # The CUDA driver reads the flag when it is created, for every
        # device it opens: so before the first get_driver("cuda"), which
        # a session's construction makes (_driver_devices).
        rt.flags.parse_flags("--cuda_async_allocations=false")
    return rt.get_driver(driver)


def _driver_devices(driver: str, fresh: bool = False) -> list | str:
    """The devices IREE's `driver` lists, or, where the driver cannot be
    opened (no GPU runtime on this machine) or list its devices, IREE's
    reason. `fresh` asks the driver again."""
    with _DRIVER_LOCK:
        devices = None if fresh else _DRIVER_DEVICES.get(driver)
        if devices is None:
            try:
                devices = list(_hal_driver(driver).query_available_devices())
            except (RuntimeError, ValueError) as e:
                devices = str(e) or type(e).__name__
            _DRIVER_DEVICES[driver] = devices
        return devices


def _check_device(driver: str, ordinal: int, name: str, fresh: bool = False) -> None:
    """Raises ValueError naming device `name` unless IREE's `driver` lists
    a device `ordinal`."""
    devices = _driver_devices(driver, fresh)
    if isinstance(devices, str):
        raise ValueError(f"device {name!r}: IREE's {driver} driver is not available on this machine ({devices})")
    if ordinal >= len(devices):
        kind = name.split(":")[0]
        seen = {0: "none", 1: f"{kind}:0"}.get(len(devices), f"{kind}:0 to {kind}:{len(devices) - 1}")
        raise ValueError(
            f"device {name!r}: IREE's {driver} driver sees {len(devices)} device(s) ({seen}); "
            "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES renumber them from 0"
        )


def cuda_allocator_specs() -> list[str]:
    """The allocator specs a CUDA device opens with: the environment's
    override (env.CUDA_ALLOCATORS, comma-separated) or the default."""
    return [s for s in os.environ.get(env.CUDA_ALLOCATORS, DEFAULT_CUDA_ALLOCATORS).split(",") if s]


def _shared_config(driver: str, ordinal: int = 0, name: str = "cpu"):
    with _SHARED_LOCK:
        config = _CONFIGS.get((driver, ordinal))
        if config is None:
            import iree.runtime as rt

            if driver == "local-task":
                _set_cpu_topology_once()
            specs = cuda_allocator_specs() if driver == "cuda" else []
            try:
                hal_driver = _hal_driver(driver)
            except (RuntimeError, ValueError) as e:
                raise RuntimeError(f"cannot open IREE's {driver} driver: {e}") from e
            if driver == "local-task":
                config = rt.Config(driver)
            else:
                # Asked again: a GPU can go away between a session's
                # construction and its first call, and opening a device
                # costs far more than listing them.
                _check_device(driver, ordinal, name, fresh=True)
                # "cuda://N" / "hip://N": the N-th device the GPU runtime
                # enumerates (cuDeviceGet / hipDeviceGet), torch's cuda:N.
                # GPU 0 keeps the bare driver name (its default device, the
                # same GPU), the URI that the GPU runs in docs/devlog opened.
                uri = f"{driver}://{ordinal}" if ordinal else driver
                try:
                    # A HIP device runs on torch's stream where it can, so
                    # that calls on that stream need no events
                    # (hip_handoff).
                    device = (
                        hip_handoff.create_device(hal_driver, _driver_devices(driver)[ordinal], ordinal)
                        if driver == "hip"
                        else None
                    )
                    if device is None:
                        device = hal_driver.create_device_by_uri(uri, allocators=specs or None)
                except (RuntimeError, ValueError) as e:
                    with_specs = f" with allocators {specs} (${env.CUDA_ALLOCATORS})" if specs else ""
                    raise RuntimeError(f"cannot create the {driver} device {name!r}{with_specs}: {e}") from e
                config = rt.Config(device=device)
            _CONFIGS[(driver, ordinal)] = config
        return config


def _cpu_lacks(target: Target, entry: dict) -> list[str]:
    """What this CPU lacks to run a CPU artifact (core/cpu.py): the entry
    records it (host artifacts: the build machine's features); entries of
    builds before the record are the host's own, as they always were."""
    if target.kind != "cpu" or ("cpu_arch" not in entry and target.cpu_arch is None):
        return []
    return host_cpu.this_cpu().lacks(
        entry.get("cpu_arch", target.cpu_arch), entry.get("cpu_requires", target.cpu_requires)
    )


def _cpu_target(manifests, compile_missing: bool) -> Target:
    """The first of CPU_TARGET_PREFERENCE with an artifact this CPU can run
    in the session's directories; `host` where there is none, unless the
    directories hold only CPU artifacts this CPU cannot run (and nothing
    may be compiled): that is an ArtifactError saying why, here, rather
    than "no artifact" at every call."""
    from ..build.artifacts import entries_for

    lacking: dict[str, list[str]] = {}
    for name in CPU_TARGET_PREFERENCE:
        target = get_target(name)
        for _, manifest in manifests:
            for _kernel, entry in entries_for(manifest, name, KERNEL_ABI, parse_kernel) if manifest else ():
                lacks = _cpu_lacks(target, entry)
                if not lacks:
                    return target
                lacking.setdefault(name, lacks)
    if lacking and not compile_missing:
        cpu = host_cpu.this_cpu()
        why = "; ".join(f"{name} needs {', '.join(lacks)}" for name, lacks in lacking.items())
        raise ArtifactError(
            f"{manifests[0][0]} holds no CPU artifact this CPU ({cpu.arch}) can run ({why}). Build for it:\n"
            f"  turbine-fmha build --targets host --artifacts {manifests[0][0]}\n"
            '(or a named CPU target it supports: docs/user-guide.md, "CPU targets")'
        )
    return get_target("host")


_DEFAULT_SESSIONS: dict[str, Session] = {}
_DEFAULT_LOCK = threading.Lock()


def default_session(device) -> Session:
    """The process-wide session of a device ("cuda" and "cuda:0" are one)."""
    name = device_name(*parse_device(device))
    with _DEFAULT_LOCK:
        s = _DEFAULT_SESSIONS.get(name)
        if s is None:
            s = Session(name, compile_missing=default_compile_missing())
            _DEFAULT_SESSIONS[name] = s
        return s


def resolve_session(session, device) -> Session:
    """`session`, checked against the call's `device` (a kind alone, such
    as "cuda", matches a session on any of its GPUs; None, any device), or
    the default session of `device` (None: the CPU)."""
    if device is None:
        device = session.device_name if isinstance(session, Session) else "cpu"
    kind, ordinal = parse_device(device)
    if session is None:
        return default_session(device)
    if not isinstance(session, Session):
        raise TypeError(f"session must be a turbine_fmha.Session, got {type(session).__name__}")
    if session.device != kind or (ordinal is not None and ordinal != session.ordinal):
        raise ValueError(
            f"session is for device {session.device_name!r}, call asked for {device_name(kind, ordinal)!r}"
        )
    return session
