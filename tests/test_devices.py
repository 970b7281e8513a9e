"""Device names and GPU ordinals ("cuda:N", "hip:N"): parsed in one place
(core/devices.py), each GPU of the machine its own IREE device, an ordinal
the machine lacks refused by name before any device work, and torch
tensors accepted only on the session's own GPU. This machine has no GPU:
the IREE driver is replaced by one that reports GPUs and opens CPU
devices, which checks the routing (which ordinal opens which device, what
is refused when); benchmarks/probes/h200_devices.py makes the same calls
on real GPUs (not yet run: see its entry in benchmarks/probes/README.md)."""

from __future__ import annotations

import numpy as np
import pytest

import turbine_fmha
import turbine_fmha.runtime.session as session_mod
from turbine_fmha.core.arrays import _check_tensor_devices
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


BAD = ["gpu", "cuda:", "cuda:-1", "cuda:1:2", "CUDA", " cuda", "cuda:x", "cpu:1", "cuda:0 ", ""]


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
        self.count, self.opened = count, []

    def query_available_devices(self):
        return [{"device_id": i + 1, "path": f"GPU-{i}", "name": "fake"} for i in range(self.count)]

    def create_device_by_uri(self, uri, allocators=None):
        import iree.runtime as rt

        self.opened.append(uri)
        return rt.get_driver("local-task").create_default_device()


@pytest.fixture
def two_gpus(monkeypatch):
    import iree.runtime as rt

    driver = _FakeGpuDriver(2)
    real = rt.get_driver
    monkeypatch.setattr(rt, "get_driver", lambda name: driver if name == "cuda" else real(name))
    monkeypatch.setattr(session_mod, "_CONFIGS", {})  # no device opened by another test
    return driver


def test_each_gpu_is_its_own_device(two_gpus):
    s0, s1 = turbine_fmha.Session("cuda:0"), turbine_fmha.Session("cuda:1")
    again = turbine_fmha.Session("cuda")  # the first GPU, sharing s0's device
    assert (s0.device, s0.ordinal, s1.device, s1.ordinal) == ("cuda", 0, "cuda", 1)
    assert (s0.torch_device, s1.torch_device, again.torch_device) == ("cuda:0", "cuda:1", "cuda:0")
    assert repr(s1).startswith("Session('cuda:1', target='cuda'")
    assert s0.device_of() is not s1.device_of() and again.device_of() is s0.device_of()
    assert two_gpus.opened == ["cuda", "cuda://1"]  # GPU 0: the driver's default device


def test_an_ordinal_the_machine_lacks_is_refused_by_name(two_gpus):
    with pytest.raises(
        ValueError, match=r"device 'cuda:2': IREE's cuda driver sees 2 device\(s\) \(cuda:0 to cuda:1\)"
    ):
        turbine_fmha.Session("cuda:2")
    assert two_gpus.opened == []  # refused at Session(), before any device was opened
    # A GPU that went away between Session() and its first call (or a
    # session made where the driver could not yet say): refused on opening.
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
        _check_tensor_devices(where, q=host, k_cache=np.zeros(2))
    with pytest.raises(
        ValueError,
        match=r"k_cache is a torch tensor on meta, but the session runs on 'cuda:1': pass it in host memory or cuda:1",
    ):
        _check_tensor_devices("cuda:1", q=host, k_cache=host.to("meta"))
    with pytest.raises(ValueError, match=r"on meta, but the session runs on 'hip:2': pass it in host memory or cuda:2"):
        _check_tensor_devices("hip:2", q=host.to("meta"))
    with pytest.raises(ValueError, match="device"):
        _check_tensor_devices("tpu", q=host)


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
