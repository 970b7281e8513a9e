"""Device names and GPU ordinals ("cuda:N", "hip:N"): parsed in one place
(core/devices.py), each GPU of the machine its own IREE device, an ordinal
the machine lacks refused by name before any device work, and torch
tensors accepted only on the session's own GPU. This machine has no GPU:
the IREE driver is replaced by one that reports GPUs and opens CPU
devices, which checks the routing (which ordinal opens which device, what
is refused when); tests/gpu/test_gpu_devices.py makes the same calls
on real GPUs (not yet run: see its entry in benchmarks/probes/README.md)."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
import turbine_fmha.runtime.session as session_mod
from turbine_fmha.core import env
from turbine_fmha.core.arrays import check_tensor_devices
from turbine_fmha.core.devices import device_name, parse_device

GOOD = [
    ("cpu", ("cpu", None), "cpu"),
    ("cpu:0", ("cpu", 0), "cpu"),
    ("cuda", ("cuda", None), "cuda:0"),
    ("cuda:0", ("cuda", 0), "cuda:0"),
    ("cuda:7", ("cuda", 7), "cuda:7"),
    ("hip:3", ("hip", 3), "hip:3"),
]


@pytest.mark.parametrize("text, parsed, canonical", GOOD)
def test_device_names(text, parsed, canonical):
    assert parse_device(text) == parsed
    assert device_name(*parse_device(text)) == canonical


# "cuda:\u0661": an Arabic-Indic one, which int() reads as 1.
BAD = ["gpu", "cuda:", "cuda:-1", "cuda:1:2", "CUDA", " cuda", "cuda:x", "cpu:1", "cuda:0 ", "", "cuda:\u0661"]


@pytest.mark.parametrize("text", BAD)
def test_bad_device_names_are_refused_by_name(text):
    with pytest.raises(ValueError, match="device"):
        parse_device(text)
    with pytest.raises(ValueError, match="device"):
        turbine_fmha.Session(text)


def test_torch_devices_and_other_types():
    torch = pytest.importorskip("torch")
    assert parse_device(torch.device("cuda", 2)) == ("cuda", 2)
    assert parse_device(torch.device("cpu")) == ("cpu", None)
    with pytest.raises(ValueError, match="device"):
        parse_device(torch.device("meta"))
    for bad in (0, None, b"cuda"):
        with pytest.raises(TypeError, match="device must be a str"):
            parse_device(bad)


class _FakeGpuDriver:
    """IREE's driver as a machine with `count` GPUs would show it; the
    devices it opens are CPU devices (this machine has no GPU)."""

    def __init__(self, count):
        self.count, self.opened, self.queries, self.allocators = count, [], 0, []

    def query_available_devices(self):
        self.queries += 1
        return [{"device_id": i + 1, "path": f"GPU-{i}", "name": "fake"} for i in range(self.count)]

    def create_device_by_uri(self, uri, allocators=None):
        import iree.runtime as rt

        self.opened.append(uri)
        self.allocators.append(allocators)
        return rt.get_driver("local-task").create_default_device()


@pytest.fixture
def two_gpus(monkeypatch):
    import iree.runtime as rt

    driver = _FakeGpuDriver(2)
    real = rt.get_driver
    monkeypatch.setattr(rt, "get_driver", lambda name: driver if name == "cuda" else real(name))
    monkeypatch.setattr(session_mod, "_CONFIGS", {})  # no device opened by another test
    monkeypatch.setattr(session_mod, "_DRIVER_DEVICES", {})  # listed by this driver, not by an earlier test's
    return driver


def test_each_gpu_is_its_own_device(two_gpus):
    s0, s1 = turbine_fmha.Session("cuda:0"), turbine_fmha.Session("cuda:1")
    again = turbine_fmha.Session("cuda")  # the first GPU, sharing s0's device
    assert (s0.device, s0.ordinal, s1.device, s1.ordinal) == ("cuda", 0, "cuda", 1)
    assert (s0.torch_device, s1.torch_device, again.torch_device) == ("cuda:0", "cuda:1", "cuda:0")
    assert repr(s1).startswith("Session('cuda:1', target='cuda'")
    assert s0.device_of() is not s1.device_of() and again.device_of() is s0.device_of()
    assert two_gpus.opened == ["cuda", "cuda://1"]  # GPU 0: the driver's default device


def test_a_gpu_opens_with_the_allocators_the_environment_names(two_gpus, monkeypatch):
    """The CUDA device's allocator specs: the default caching pool, or the
    environment's override (what benchmarks read the pool's capacity from,
    session.cuda_allocator_specs)."""
    turbine_fmha.Session("cuda:0").device_of()
    override = "caching:device_local=1gib;4gib;256"
    monkeypatch.setenv(env.CUDA_ALLOCATORS, override)
    assert session_mod.cuda_allocator_specs() == [override]
    turbine_fmha.Session("cuda:1").device_of()
    assert two_gpus.allocators == [[session_mod.DEFAULT_CUDA_ALLOCATORS], [override]]


def test_an_ordinal_the_machine_lacks_is_refused_by_name(two_gpus):
    with pytest.raises(
        ValueError, match=r"device 'cuda:2': IREE's cuda driver sees 2 device\(s\) \(cuda:0 to cuda:1\)"
    ):
        turbine_fmha.Session("cuda:2")
    assert two_gpus.opened == []  # refused at Session(), before any device was opened
    # A GPU that went away between Session() and its first call: refused on
    # opening, which asks the driver again.
    s = turbine_fmha.Session("cuda:1")
    two_gpus.count = 1
    with pytest.raises(ValueError, match=r"device 'cuda:1': IREE's cuda driver sees 1 device\(s\) \(cuda:0\)"):
        s.device_of()
    assert two_gpus.opened == []


def test_resolve_session_matches_kind_and_ordinal(two_gpus):
    from turbine_fmha.runtime.session import default_session, resolve_session

    s1 = turbine_fmha.Session("cuda:1")
    assert resolve_session(s1, "cuda") is s1 and resolve_session(s1, "cuda:1") is s1
    with pytest.raises(ValueError, match="session is for device 'cuda:1', call asked for 'cuda:0'"):
        resolve_session(s1, "cuda:0")
    with pytest.raises(ValueError, match="session is for device 'cuda:1', call asked for 'hip:0'"):
        resolve_session(s1, "hip")
    assert default_session("cuda") is default_session("cuda:0") is not default_session("cuda:1")
    assert default_session("cuda:1").ordinal == 1


def test_tensors_only_on_the_sessions_gpu():
    """The rule on tensors' devices, per session device: meta tensors stand
    for a GPU's (this machine has none; the H200 probe passes cuda:0 and
    refuses the rest)."""
    torch = pytest.importorskip("torch")
    host = torch.zeros(2)
    for where in ("cpu", "cuda", "cuda:1", "hip:2"):
        check_tensor_devices(where, q=host, k_cache=np.zeros(2))
    with pytest.raises(
        ValueError,
        match=r"k_cache is a torch tensor on meta, but the session runs on 'cuda:1': pass it in host memory or cuda:1",
    ):
        check_tensor_devices("cuda:1", q=host, k_cache=host.to("meta"))
    with pytest.raises(ValueError, match=r"on meta, but the session runs on 'hip:2': pass it in host memory or cuda:2"):
        check_tensor_devices("hip:2", q=host.to("meta"))
    with pytest.raises(ValueError, match="device"):
        check_tensor_devices("tpu", q=host)


def _calls_with_a_session_only():
    """Each public entry point called with `session=` and no `device=`."""
    torch = pytest.importorskip("torch")
    from turbine_fmha.api import torch_ops

    q = np.zeros((1, 1, 4, 32), np.float16)
    pages = np.zeros((4, 16, 2, 32), np.float16)
    rows = np.zeros((1, 16, 2, 32), np.float16)
    table, seqlen = np.zeros((1, 2), np.int32), np.ones(1, np.int32)
    t = {n: torch.from_numpy(a) for n, a in dict(q=q, k_cache=pages, v_cache=pages, seqlen_k=seqlen).items()}
    return {
        "fmha_fwd_paged": lambda s: turbine_fmha.fmha_fwd_paged(q, pages, pages, table, seqlen, session=s),
        "fmha_fwd_paged_async": lambda s: turbine_fmha.fmha_fwd_paged_async(
            q, pages, pages, table, seqlen, session=s
        ).result(),
        "fmha_fwd_kvcache": lambda s: turbine_fmha.fmha_fwd_kvcache(q, rows, rows, seqlen, session=s),
        "flash_attn_with_kvcache": lambda s: turbine_fmha.flash_attn_with_kvcache(
            q, pages, pages, cache_seqlens=seqlen, block_table=table, session=s
        ),
        "the torch op": lambda s: torch_ops.call_paged(**t, block_table=torch.from_numpy(table), session=s),
    }


@pytest.mark.parametrize("call", list(_calls_with_a_session_only()))
def test_a_session_alone_picks_the_device(two_gpus, call):
    """session=Session("cuda:1") with no device= runs on that session (here:
    it looks up its cuda kernels, which this machine lacks), as PagedAttention
    and reshape_and_cache always did; it was refused as "call asked for
    'cpu'" (device defaulted to "cpu"), found by the H200 probe."""
    s1 = turbine_fmha.Session("cuda:1")
    with pytest.raises(turbine_fmha.ArtifactError, match="no cuda artifact"):
        _calls_with_a_session_only()[call](s1)
    with pytest.raises(ValueError, match="session is for device 'cuda:1', call asked for 'cpu'"):
        turbine_fmha.fmha_fwd_paged(*(np.zeros(1),) * 5, session=s1, device="cpu")


def test_trim_returns_the_pool_and_opens_nothing(two_gpus):
    """Session.trim() empties the pool of the session's own GPU (the device
    opened for it), and opens no device that was never used."""
    s0, s1 = turbine_fmha.Session("cuda:0"), turbine_fmha.Session("cuda:1")
    s1.trim()
    assert two_gpus.opened == []
    trimmed = []
    device = s1.device_of()

    class Allocator:
        def trim(self):
            trimmed.append("cuda:1")

    class Device:  # the stand-in device's allocator, watched
        allocator = Allocator()

    session_mod._CONFIGS[("cuda", 1)].device = Device()
    try:
        s1.trim()
        s0.trim()  # cuda:0 never opened: nothing
    finally:
        session_mod._CONFIGS[("cuda", 1)].device = device
    assert trimmed == ["cuda:1"] and two_gpus.opened == ["cuda://1"]
    turbine_fmha.Session("cpu").trim()  # the CPU device: IREE's trim, a no-op there


# -- what a session refuses at construction -----------------------------------
#
# A GPU session is refused at Session() unless IREE's driver for it lists
# its GPU, and any session is refused a target of another device: such
# sessions were made, and their first call asked for a `--targets cuda`
# build, compiled a CUDA kernel (compile_missing) before failing on the
# driver, or ran a "cuda" session's calls on the CPU (target="host").


@pytest.fixture
def no_gpu_runtime(monkeypatch):
    """IREE's GPU drivers as on a machine without the CUDA or HIP runtime
    (this one, and CI's, whatever the machine running the tests has): each
    try to get one raises as IREE does, and is recorded."""
    import iree.runtime as rt

    tries, real = [], rt.get_driver

    def get_driver(name):
        if name not in ("cuda", "hip"):
            return real(name)
        tries.append(name)
        raise RuntimeError(f"Error creating driver: dynamic_symbols.c:66: UNAVAILABLE; {name} library not available")

    monkeypatch.setattr(rt, "get_driver", get_driver)
    monkeypatch.setattr(session_mod, "_DRIVER_DEVICES", {})
    monkeypatch.setattr(session_mod, "_CONFIGS", {})
    return tries


@pytest.fixture
def listed(no_gpu_runtime):
    """listed(driver, n): the session's check then finds n devices listed
    for IREE's `driver` (its list of the driver's devices, kept per
    process), as on a machine with n GPUs; opening one still fails."""

    def lists(driver, count):
        session_mod._DRIVER_DEVICES[driver] = [
            {"device_id": i + 1, "path": f"GPU-{i}", "name": "stand-in"} for i in range(count)
        ]

    return lists


@pytest.fixture
def no_compiling(monkeypatch):
    """A compile fails the test (Session(compile_missing=True) and the
    default sessions compile a missing kernel on first use)."""
    from turbine_fmha.build import aot

    def build(*a, **k):
        raise AssertionError("a kernel was compiled")

    monkeypatch.setattr(aot, "build", build)


def _tables():
    """The process-wide tables that sessions join or fill."""
    return tuple(
        dict(t)
        for t in (session_mod.LIVE_SESSIONS, session_mod._DEFAULT_SESSIONS, session_mod._CONFIGS, session_mod._MODULES)
    )


@pytest.mark.parametrize(
    "device, named, driver",
    [("cuda:1", "cuda:1", "cuda"), ("hip:99", "hip:99", "hip"), ("cuda", "cuda", "cuda"), ("torch", "cuda:1", "cuda")],
)
def test_a_gpu_without_its_driver_is_refused_at_construction(
    no_gpu_runtime, no_compiling, tmp_path, device, named, driver
):
    if device == "torch":
        device = pytest.importorskip("torch").device("cuda", 1)
    before = _tables()
    with pytest.raises(
        ValueError, match=rf"^device '{named}': IREE's {driver} driver is not available on this machine \(.*UNAVAILABLE"
    ) as refused:
        turbine_fmha.Session(device, artifact_dir=tmp_path / "a", compile_missing=True, cache_dir=tmp_path / "c")
    # Checked while the error, and the half-made session its frames hold,
    # are alive: that session is in no table, and nothing was read,
    # compiled or opened.
    assert _tables() == before and refused.value is not None
    assert list(tmp_path.iterdir()) == [] and no_gpu_runtime == [driver]


def _calls_on_cuda_without_a_session():
    q = np.zeros((1, 1, 4, 32), np.float16)
    pages = np.zeros((4, 16, 2, 32), np.float16)
    table, seqlen = np.zeros((1, 2), np.int32), np.ones(1, np.int32)
    return {
        "fmha_fwd_paged": lambda: turbine_fmha.fmha_fwd_paged(q, pages, pages, table, seqlen, device="cuda"),
        "fmha_fwd_paged_async": lambda: turbine_fmha.fmha_fwd_paged_async(
            q, pages, pages, table, seqlen, device="cuda"
        ),
        "fmha_fwd_kvcache": lambda: turbine_fmha.fmha_fwd_kvcache(q, pages, pages, seqlen, device="cuda"),
        "PagedAttention": lambda: turbine_fmha.PagedAttention(device="cuda"),
    }


@pytest.mark.parametrize("call", list(_calls_on_cuda_without_a_session()))
def test_an_eager_call_on_a_gpu_without_its_driver_fails_before_compiling(
    no_gpu_runtime, no_compiling, monkeypatch, tmp_path, call
):
    """device="cuda" without a session= makes the process-wide session of
    cuda:0, which compiles missing kernels: refused by name instead, before
    any compile, and no default session is kept."""
    from turbine_fmha.core import env

    monkeypatch.setenv(env.ARTIFACTS, str(tmp_path / "a"))
    monkeypatch.setenv(env.CACHE, str(tmp_path / "c"))
    monkeypatch.setattr(session_mod, "default_compile_missing", lambda: True)
    monkeypatch.setattr(session_mod, "_DEFAULT_SESSIONS", {})
    with pytest.raises(ValueError, match="^device 'cuda:0': IREE's cuda driver is not available on this machine"):
        _calls_on_cuda_without_a_session()[call]()
    assert session_mod._DEFAULT_SESSIONS == {} and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "device, target, words",
    [
        ("cuda", "host", "device 'cuda': cannot run target 'host' (a cpu target, for IREE's local-task driver)"),
        ("cuda:1", "gfx942", "device 'cuda:1': cannot run target 'gfx942' (a rocm target, for IREE's hip driver)"),
        ("cpu", "cuda", "device 'cpu': cannot run target 'cuda' (a cuda target, for IREE's cuda driver)"),
        ("hip", "cuda", "device 'hip': cannot run target 'cuda' (a cuda target, for IREE's cuda driver)"),
    ],
)
def test_a_target_the_device_cannot_run_is_refused(listed, tmp_path, device, target, words):
    listed("cuda", 2)
    listed("hip", 2)
    takes = {"cuda": "cuda", "hip": "gfx942, gfx90a, gfx950", "cpu": "host, x86-64-v3, x86-64-v4, aarch64"}
    kind = device.split(":")[0]
    before = _tables()
    with pytest.raises(ValueError) as e:
        turbine_fmha.Session(device, target=target, artifact_dir=tmp_path)
    assert str(e.value) == f"{words}; a {kind} device takes {takes[kind]}"
    assert _tables() == before


def test_each_device_takes_its_own_targets(listed, tmp_path):
    listed("cuda", 1)
    listed("hip", 1)
    for device, target in (("cuda", "cuda"), ("hip:0", "gfx90a"), ("hip", None), ("cpu", "host"), ("cpu", None)):
        s = turbine_fmha.Session(device, target=target, artifact_dir=tmp_path)
        assert s.target.driver == {"cuda": "cuda", "hip": "hip", "cpu": "local-task"}[s.device]


@pytest.mark.parametrize("count", [1, 2])
def test_gpus_the_driver_lists_are_served(listed, tmp_path, count):
    """What the check sees on a GPU machine whose IREE cuda driver lists one
    GPU (the H100) or two: each of them is served, "cuda" as the first;
    the next ordinal is refused."""
    listed("cuda", count)
    for device in ("cuda", "cuda:0", *(f"cuda:{i}" for i in range(1, count))):
        s = turbine_fmha.Session(device, artifact_dir=tmp_path)
        assert s.device_name == (device if ":" in device else "cuda:0") and s.target.name == "cuda"
    seen = "cuda:0" if count == 1 else "cuda:0 to cuda:1"
    with pytest.raises(
        ValueError, match=rf"^device 'cuda:{count}': IREE's cuda driver sees {count} device\(s\) \({seen}\)"
    ):
        turbine_fmha.Session(f"cuda:{count}", artifact_dir=tmp_path)


def test_a_driver_that_lists_no_gpu_serves_no_session(listed, tmp_path):
    """libcuda present but no GPU visible (CUDA_VISIBLE_DEVICES=""): "cuda"
    too is refused, not only "cuda:N"."""
    listed("cuda", 0)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=rf"^device '{device}': IREE's cuda driver sees 0 device\(s\) \(none\)"):
            turbine_fmha.Session(device, artifact_dir=tmp_path)


def test_ordinals_too_large_for_c_are_refused_by_name(listed, tmp_path):
    listed("cuda", 2)
    assert parse_device("cuda:2147483647") == ("cuda", 2**31 - 1)
    assert parse_device("cuda:" + "0" * 40 + "1") == ("cuda", 1)
    for text in ("cuda:2147483648", "cuda:99999999999999999999", "hip:" + "9" * 5000):
        with pytest.raises(ValueError, match="a GPU ordinal is at most 2147483647$") as e:
            parse_device(text)
        assert str(e.value).startswith(f"device {text!r}: ")
    with pytest.raises(ValueError, match=r"^device 'cuda:99999999999999999999': a GPU ordinal is at most"):
        turbine_fmha.Session("cuda:99999999999999999999", artifact_dir=tmp_path)
    with pytest.raises(ValueError, match=r"^device 'cuda:2147483647': IREE's cuda driver sees 2 device"):
        turbine_fmha.Session("cuda:2147483647", artifact_dir=tmp_path)


def test_each_driver_is_asked_once_from_many_threads(two_gpus, monkeypatch, tmp_path):
    """Sessions made at once from several threads ask each driver for its
    devices once (here: the stand-in cuda driver, and a hip driver this
    machine lacks)."""
    import concurrent.futures
    import time

    import iree.runtime as rt

    hip_tries, real = [], rt.get_driver

    def get_driver(name):
        if name == "hip":
            hip_tries.append(name)
            time.sleep(0.01)  # a slow first answer, which the other threads must wait for
            raise RuntimeError("UNAVAILABLE; libamdhip64.so not available")
        return real(name)

    monkeypatch.setattr(rt, "get_driver", get_driver)
    devices = ["cuda", "cuda:0", "cuda:1", "hip", "hip:1"] * 4

    def make(device):
        try:
            return turbine_fmha.Session(device, artifact_dir=tmp_path).device_name
        except ValueError:
            return "refused"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(make, devices))
    assert made == ["cuda:0", "cuda:0", "cuda:1", "refused", "refused"] * 4
    assert (two_gpus.queries, hip_tries, two_gpus.opened) == (1, ["hip"], [])


def test_a_session_that_raises_joins_no_table(tmp_path):
    """Also a session refused after its arguments were checked (here: an
    unreadable manifest) stays out of LIVE_SESSIONS, which the torch ops'
    session handles name."""
    (tmp_path / "manifest.json").write_text("{not json")
    before = _tables()
    with pytest.raises(turbine_fmha.ArtifactError) as refused:
        turbine_fmha.Session("cpu", artifact_dir=tmp_path)
    # The error's frames hold the half-made session: it would stay in the
    # weak table as long as they live.
    assert _tables() == before and refused.value is not None


def test_the_cuda_flags_precede_the_cuda_driver(two_gpus, monkeypatch, tmp_path):
    """IREE's CUDA driver reads the flags when it is created, once per
    process, for every device it opens: --cuda_async_allocations=false
    (plain allocations, which torch takes zero-copy) is set before the
    first get_driver("cuda"), which Session() now makes."""
    import iree.runtime as rt

    from turbine_fmha.core import env

    monkeypatch.delenv(env.CUDA_ASYNC_ALLOCATIONS, raising=False)
    order, get_driver = [], rt.get_driver
    monkeypatch.setattr(rt.flags, "parse_flags", lambda *flags: order.extend(flags))
    monkeypatch.setattr(rt, "get_driver", lambda name: order.append(f"get_driver({name})") or get_driver(name))
    turbine_fmha.Session("cuda", artifact_dir=tmp_path)
    assert order[:2] == ["--cuda_async_allocations=false", "get_driver(cuda)"]
