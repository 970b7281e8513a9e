"""KV writes into paged caches from numpy or torch: `reshape_and_cache`.

vLLM's reshape_and_cache: token t's K and V rows go to slot slot_mapping[t]
= page * page_block_size + row, and a slot of -1 skips the token. The AOT
append kernel (variants.AppendKernel) writes the caller's caches in place
on the session's device: host memory imported zero-copy on a CPU session,
torch GPU tensors through DLPack, IREE DeviceArrays as they are. An HND
cache (FlashInfer's [pages, nhead_k, page, hdim]) is written through a view
of its memory as nhead_k times as many one-head NHD pages. With rotary
tables, the same kernel call rotates the new K rows before the write and
returns q rotated (ck_tile appendkv's RoPE, placed as flash-attn's in-call
rotary). Everything is checked before anything is written, each error
naming its argument, and values are never converted.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from ..core.arrays import (
    DeviceCache,
    TensorInfo,
    check_tensor_devices,
    dtype_name,
    fp8_name,
    is_device_array,
    is_torch,
    numpy_to_torch,
    overlapping,
    to_numpy,
)
from ..core.checks import check_int, int_array
from ..kernels.append_kernel import AppendKernel
from ..kernels.variants import KV_LAYOUTS as LAYOUTS
from ..runtime.interop import run_append
from ..runtime.invoke import host_array
from ..runtime.session import resolve_session


def reshape_and_cache(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    kv_layout="NHD",
    q=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_dim=None,
    rotary_interleaved=False,
    seqlen_k=None,
    seqstart=None,
    seqstart_q=None,
    has_mask=False,
    session=None,
    device=None,
):
    """Writes K/V rows into paged caches in place (vLLM's reshape_and_cache).

    Token t's K and V rows go to slot slot_mapping[t] = page *
    page_block_size + row of k_cache and v_cache, through the AOT append
    kernel; with rotary tables the same kernel call rotates the new K rows
    first (ck_tile appendkv's RoPE) and rotates q too.

    Args:
      Rows (numpy arrays or torch tensors, of the caches' dtype: values
          are never converted):
        k: [tokens, nhead_k, hdim] (vLLM's form) or [batch, seqlen_new,
            nhead_k, hdim]. The new keys.
        v: [tokens, nhead_k, hdim_v] or [batch, seqlen_new, nhead_k,
            hdim_v]. The new values.
        slot_mapping: [tokens] or [batch, seqlen_new], any integer dtype.
            Distinct slots in [0, num_pages * page_block_size), or -1 to
            skip the token (checked in its own dtype: only a signed -1
            skips; an unsigned 2**64 - 1 is out of range).
      Caches (written in place; float16, bfloat16, float32 or fp8, one
          dtype):
        k_cache: [num_pages, page_block_size, nhead_k, hdim] (NHD) or
            [num_pages, nhead_k, page_block_size, hdim] (HND). On a CPU
            session a writeable, C-contiguous numpy array or CPU torch
            tensor on a 64-byte boundary (turbine_fmha.aligned_zeros, any
            torch allocation); on a GPU session a contiguous torch tensor
            on its GPU; or a DeviceArray of the session's device. Anything
            else is refused by name before anything is written.
        v_cache: as k_cache, with hdim_v.
        kv_layout: 'NHD' or 'HND', default 'NHD'. The caches' page layout
            (an HND cache is written as nhead_k times as many one-head
            pages); pass the attention the same.
      Rotary embedding (not for fp8 caches):
        rotary_cos: [rotary_seqlen, rotary_dim / 2], float16, bfloat16 or
            float32 (computed in float32), default None. With rotary_sin,
            the new K rows are rotated at their positions before the write.
        rotary_sin: as rotary_cos, default None.
        rotary_dim: even int <= hdim, default None (twice the tables'
            width). The leading dims of each head that are rotated.
        rotary_interleaved: bool, default False. False rotates pairs (i, i
            + rotary_dim / 2) (GPT-NeoX); True (0, 1), (2, 3), ... (GPT-J).
        seqlen_k: [batch] int, default None; required with rotary. The
            keys each sequence has before this write: new token i of
            sequence b is at position seqlen_k[b] + i.
        seqstart: [batch + 1] int, default None. Flat rows ([tokens, ...])
            with rotary: sequence b's tokens are seqstart[b]:seqstart[b+1].
        q: [batch, seqlen_q, nhead_q, hdim], or flat [total_q, nhead_q,
            hdim] with seqstart_q, default None. Rotated too and returned
            as a new array of q's kind.
        seqstart_q: [batch + 1] int, default None (seqstart). q's
            sequences when q is flat.
        has_mask: bool, default False. True: q's row i of sequence b is at
            seqlen_k[b] + i (a causal or local mask follows); False: all
            its rows are at seqlen_k[b] (ck_tile's has_mask, flash-attn's
            rule).
      Device:
        session: a turbine_fmha.Session, default None (the default session
            of device).
        device: 'cpu', 'cuda', 'cuda:N', 'hip', 'hip:N' or a torch.device,
            default None (the session's, else 'cpu').

    Returns:
      q rotated when q is given, else None.

    Raises:
      ValueError or TypeError naming the argument before anything is
        written.
    """
    session = resolve_session(session, getattr(session, "device", "cpu") if device is None else device)
    rot = dict(
        q=q,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        rotary_dim=rotary_dim,
        seqlen_k=seqlen_k,
        seqstart=seqstart,
        seqstart_q=seqstart_q,
        rotary_interleaved=rotary_interleaved,
        has_mask=has_mask,
    )
    return _run(session, _plan(session, k, v, k_cache, v_cache, slot_mapping, kv_layout, rot))


@dataclasses.dataclass
class WritableCache:
    """A cache the kernel can write in place, with its numpy dtype."""

    array: object  # numpy over the caller's memory, torch on the session's GPU, or a DeviceArray
    shape: tuple
    dtype: np.dtype


@dataclasses.dataclass
class _Rotary:
    cos: object  # [R, RH] float32: numpy, or torch on the session's GPU
    sin: object
    k_pos: np.ndarray  # [tokens] int32
    q: object  # [rows, nhead_q, hdim] or None
    q_pos: np.ndarray
    q_shape: tuple


@dataclasses.dataclass
class _Write:
    kernel: AppendKernel
    caches: tuple  # (WritableCache, WritableCache)
    views: tuple  # their shapes as the kernel sees them
    k: object  # [tokens, nhead_k, hdim], numpy or torch
    v: object
    keep: np.ndarray | None  # the tokens written (None: all)
    slots: np.ndarray  # [rows, 2] int32 (page, row) in the kernel's view: nhead_k rows a token for HND
    rotary: _Rotary | None


def _plan(session, k, v, k_cache, v_cache, slot_mapping, kv_layout, rot) -> _Write:
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {kv_layout!r}")
    arrays = {n: rot[n] for n in ("q", "rotary_cos", "rotary_sin", "seqlen_k", "seqstart", "seqstart_q")}
    check_tensor_devices(
        session.device_name, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, **arrays
    )
    kc, vc = cache_arg(k_cache, "k_cache", session), cache_arg(v_cache, "v_cache", session)
    num_pages, page, nhead_k, hdim, hdim_v = _cache_layout(kc, vc, kv_layout)
    name = dtype_name(kc.dtype) or ("i8" if fp8_name(kc.dtype) else None)
    if name is None:
        raise TypeError(f"k_cache must be float16, bfloat16, float32 or fp8, got {kc.dtype}")
    k_info, v_info = rows_info(k, "k"), rows_info(v, "v")
    if k_info.ndim not in (3, 4):
        raise ValueError(
            f"k must be [tokens, nhead_k, hdim] or [batch, seqlen_new, nhead_k, hdim], got shape {list(k_info.shape)}"
        )
    lead = tuple(k_info.shape[:-2])
    for what, info, d in (("k", k_info, hdim), ("v", v_info, hdim_v)):
        check_rows(info, what, lead + (nhead_k, d), kc.dtype)
    slots = int_array(slot_mapping, "slot_mapping", len(lead))
    if slots.shape != lead:
        raise ValueError(f"slot_mapping must have shape {list(lead)} (k's leading dims), got {list(slots.shape)}")
    # Checked in the caller's dtype: a uint64 2**64 - 1 is out of range,
    # not the -1 (skip) that a cast to int64 would make of it.
    _check_slots(slots.reshape(-1), lead, num_pages * page)
    flat = slots.reshape(-1).astype(np.int64)
    kept = np.flatnonzero(flat >= 0)
    rotary = _rotary(rot, name, lead, hdim, kept, kc.dtype)
    for c, cname, others in ((kc, "k_cache", dict(v_cache=v_cache)), (vc, "v_cache", {})):
        if not is_device_array(c.array):
            clash = overlapping(c.array, dict(k=k, v=v, **arrays, **others))
            if clash:
                raise ValueError(f"{cname} overlaps {clash} in memory: the caches are written while it is read")
    tokens = int(np.prod(lead, dtype=np.int64))
    page_of, row = flat[kept] // page, (flat[kept] % page).astype(np.int32)
    if kv_layout == "HND":
        page_of, row = one_head_slots(page_of, row, nhead_k)
        views = ((num_pages * nhead_k, page, 1, hdim), (num_pages * nhead_k, page, 1, hdim_v))
    else:
        views = (kc.shape, vc.shape)
    mode = "none" if rotary is None else ("interleaved" if rot["rotary_interleaved"] else "half")
    kernel = AppendKernel(name, 1 if kv_layout == "HND" else nhead_k, hdim, hdim_v, page, mode)
    return _Write(
        kernel,
        (kc, vc),
        views,
        k.reshape(tokens, nhead_k, hdim),
        v.reshape(tokens, nhead_k, hdim_v),
        None if kept.size == tokens else kept,
        np.stack([page_of.astype(np.int32), row], axis=1),
        rotary,
    )


def one_head_slots(pages: np.ndarray, rows: np.ndarray, nhead_k: int) -> tuple[np.ndarray, np.ndarray]:
    """An HND cache is written as nhead_k times as many one-head pages (page
    p, head h is page p * nhead_k + h) by the append kernel for one head:
    the (page, row) slot of each token's head, token-major."""
    return (pages[:, None] * nhead_k + np.arange(nhead_k)).reshape(-1), np.repeat(rows, nhead_k)


def _cache_layout(kc: WritableCache, vc: WritableCache, kv_layout: str) -> tuple:
    """(num_pages, page_block_size, nhead_k, hdim, hdim_v) of the caches."""
    dims = "page_block_size, nhead_k" if kv_layout == "NHD" else "nhead_k, page_block_size"
    for name, c in (("k_cache", kc), ("v_cache", vc)):
        if len(c.shape) != 4:
            raise ValueError(
                f"{name} must be [num_pages, {dims}, hdim] for kv_layout={kv_layout!r}, got shape {list(c.shape)}"
            )
    num_pages, a, b, hdim = kc.shape
    page, nhead_k = (a, b) if kv_layout == "NHD" else (b, a)
    if vc.shape[:3] != kc.shape[:3]:
        raise ValueError(
            f"v_cache must match k_cache's first three dims {list(kc.shape[:3])}, got shape {list(vc.shape)}"
        )
    if vc.dtype != kc.dtype:
        raise TypeError(f"v_cache has dtype {vc.dtype} but k_cache has {kc.dtype}")
    if min(kc.shape) < 1 or vc.shape[3] < 1:
        raise ValueError(f"the caches need no empty dims, got {list(kc.shape)} and {list(vc.shape)}")
    return num_pages, page, nhead_k, hdim, vc.shape[3]


def cache_arg(x, name: str, session) -> WritableCache:
    """`x` as a cache the kernel can write in place on `session`'s device;
    refused by name otherwise (a copy would not be written back)."""
    arr = x.array if isinstance(x, DeviceCache) else x if is_device_array(x) else None
    if arr is not None:
        if arr._device is not session.device_of():
            raise ValueError(f"{name} is a DeviceArray of another device than the session's ({session.device})")
        dtype = x.dtype if isinstance(x, DeviceCache) else np.dtype(arr.dtype)
        return WritableCache(arr, tuple(int(d) for d in arr.shape), dtype)
    gpu = session.device != "cpu"
    if is_torch(x):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous tensor to be written in place")
        if x.device.type != "cpu":  # the session's GPU (check_tensor_devices)
            info = TensorInfo(x)
            return WritableCache(x.detach(), info.shape, info.dtype)
        a = None if gpu else to_numpy(x, name)
        if a is not None and a.ctypes.data != x.data_ptr():
            raise ValueError(f"{name} cannot be viewed as host memory without a copy")
    elif isinstance(x, np.ndarray):
        a = x
    else:
        raise TypeError(f"{name} must be a numpy array, a torch tensor or an IREE DeviceArray, got {type(x).__name__}")
    if gpu:
        raise ValueError(
            f"{name} is in host memory, but the session runs on {session.device!r}: pass a torch "
            f"tensor on {session.torch_device} or a DeviceArray of the session's device"
        )
    if not (a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 64 == 0):
        raise ValueError(
            f"{name} must be writeable, C-contiguous and 64-byte aligned to be written in place "
            f"(turbine_fmha.aligned_zeros makes such arrays, and so does every torch allocation; a view "
            f"at an offset, such as buf[1:], is not one)"
        )
    return WritableCache(a, a.shape, a.dtype)


def rows_info(x, name: str):
    """shape / ndim / dtype of an input array (numpy or torch), not copied."""
    if is_torch(x):
        return TensorInfo(x)
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def check_rows(info, name: str, shape: tuple, dtype: np.dtype) -> None:
    if tuple(info.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(info.shape)}")
    if info.dtype != dtype:
        raise TypeError(
            f"{name} has dtype {info.dtype} but the cache holds {dtype}: values are never converted "
            f"here, cast them first"
        )


def _check_slots(flat: np.ndarray, lead: tuple, capacity: int) -> None:
    def at(i):  # a token's index in slot_mapping's shape
        return [int(j) for j in np.unravel_index(i, lead)]

    bad = (flat < -1) | (flat >= capacity)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"slot_mapping{at(i)} = {int(flat[i])} is neither a slot in [0, {capacity}) "
            f"(num_pages * page_block_size) nor -1 (skip)"
        )
    flat = flat.astype(np.int64)  # in range now: exact
    used = np.sort(flat[flat >= 0])
    dup = used[1:][used[1:] == used[:-1]]
    if dup.size:  # the scatter's rows must be unique: which write wins is undefined
        first, second = np.flatnonzero(flat == dup[0])[:2]
        raise ValueError(f"slot_mapping writes slot {dup[0]} twice (tokens {at(first)} and {at(second)})")


def _rotary(rot: dict, name: str, lead: tuple, hdim: int, kept: np.ndarray, dtype) -> _Rotary | None:
    """The rotary tables and every row's position, checked; None without
    tables (then none of the rotary arguments may be given)."""
    cos, sin = rot["rotary_cos"], rot["rotary_sin"]
    if cos is None and sin is None:
        given = [n for n in ("q", "seqlen_k", "seqstart", "seqstart_q", "rotary_dim") if rot[n] is not None]
        given += [n for n in ("rotary_interleaved", "has_mask") if rot[n] is not False]
        if given:
            raise ValueError(f"{given[0]} is used only by the rotary embedding: pass rotary_cos and rotary_sin too")
        return None
    if cos is None or sin is None:
        raise ValueError(f"{'rotary_sin' if sin is None else 'rotary_cos'} is missing: the tables go together")
    if name == "i8":
        raise ValueError(
            "rotary_cos: the rotary embedding needs a float16/bfloat16/float32 cache "
            "(fp8 caches are written as their bits)"
        )
    for flag in ("rotary_interleaved", "has_mask"):
        if not isinstance(rot[flag], bool):
            raise TypeError(f"{flag} must be a bool, got {type(rot[flag]).__name__}")
    tables = _tables(cos, sin, rot["rotary_dim"], hdim)
    if rot["seqlen_k"] is None:
        raise ValueError("seqlen_k is needed with the rotary tables: positions start at each sequence's length")
    seqlen_k = int_array(rot["seqlen_k"], "seqlen_k", 1).astype(np.int64)
    seq, idx, batch = _sequences(lead, rot["seqstart"], "seqstart")
    if seqlen_k.shape[0] != batch or (batch and seqlen_k.min() < 0):
        raise ValueError(f"seqlen_k must hold {batch} lengths >= 0 (one per sequence), got {seqlen_k.tolist()[:8]}")
    k_pos = seqlen_k[seq] + idx
    q, q_pos, q_shape = _rotary_q(rot, lead, seqlen_k, hdim, dtype)
    rows = cos.shape[0]
    for what, pos in (("k", k_pos[kept]), ("q", q_pos)):
        if pos.size and pos.max() >= rows:
            raise ValueError(
                f"rotary_cos has {rows} rows (positions), but a row of {what} is at position "
                f"{pos.max()} (seqlen_k + its index)"
            )
    return _Rotary(*tables, k_pos.astype(np.int32), q, q_pos.astype(np.int32), q_shape)


def _tables(cos, sin, rotary_dim, hdim) -> tuple:
    infos = [rows_info(cos, "rotary_cos"), rows_info(sin, "rotary_sin")]
    for what, info in zip(("rotary_cos", "rotary_sin"), infos):
        if info.ndim != 2 or info.shape[1] < 1:
            raise ValueError(f"{what} must be [rotary_seqlen, rotary_dim / 2], got shape {list(info.shape)}")
        if dtype_name(info.dtype) is None:
            raise TypeError(f"{what} must be float16, bfloat16 or float32, got {info.dtype}")
    if tuple(infos[1].shape) != tuple(infos[0].shape):
        raise ValueError(f"rotary_sin must have rotary_cos's shape {list(infos[0].shape)}, got {list(infos[1].shape)}")
    width = infos[0].shape[1]
    if rotary_dim is not None and check_int(rotary_dim, "rotary_dim", minimum=2) != 2 * width:
        raise ValueError(f"rotary_dim = {rotary_dim}, but the tables hold rotary_dim / 2 = {width} columns")
    if 2 * width > hdim:
        raise ValueError(f"rotary_dim = {2 * width} (the tables' width x 2) exceeds hdim = {hdim}")
    # Widening to float32 is exact; the kernel computes in float32.
    return tuple(
        t.detach().float().contiguous()
        if is_torch(t) and t.device.type != "cpu"
        else np.ascontiguousarray(to_numpy(t, n), np.float32)
        for t, n in ((cos, "rotary_cos"), (sin, "rotary_sin"))
    )


def _sequences(lead: tuple, seqstart, name: str) -> tuple:
    """(sequence, index in it) of each row, and the batch: from the shape
    [batch, rows, ...], or from seqstart for flat rows."""
    if len(lead) == 2:
        if seqstart is not None:
            raise ValueError(f"{name} is for flat rows; [batch, rows, ...] arrays give the sequences by shape")
        b, n = lead
        return np.repeat(np.arange(b), n), np.tile(np.arange(n), b), b
    if seqstart is None:
        raise ValueError(f"{name} [batch + 1] is needed with flat rows and rotary: it gives their sequences")
    st = int_array(seqstart, name, 1).astype(np.int64)
    if st.size < 1 or st[0] != 0 or (np.diff(st) < 0).any() or st[-1] != lead[0]:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at {lead[0]} (the rows), got {st.tolist()[:8]}"
        )
    seq = np.repeat(np.arange(st.size - 1), np.diff(st))
    return seq, np.arange(lead[0]) - st[seq], st.size - 1


def _rotary_q(rot: dict, lead: tuple, seqlen_k: np.ndarray, hdim: int, dtype) -> tuple:
    """q as [rows, nhead_q, hdim] (or None), its rows' positions, its shape."""
    q = rot["q"]
    if q is None:
        if rot["has_mask"] or rot["seqstart_q"] is not None:
            raise ValueError(f"{'has_mask' if rot['has_mask'] else 'seqstart_q'} is about q's positions: pass q")
        return None, np.zeros(0, np.int64), ()
    info = rows_info(q, "q")
    if info.ndim not in (3, 4) or info.shape[-1] != hdim:
        raise ValueError(
            f"q must be [batch, seqlen_q, nhead_q, {hdim}] or [total_q, nhead_q, {hdim}], got shape {list(info.shape)}"
        )
    if info.dtype != dtype:
        raise TypeError(f"q has dtype {info.dtype} but the cache holds {dtype}: values are never converted here")
    q_lead = tuple(info.shape[:-2])
    st = rot["seqstart_q"] if rot["seqstart_q"] is not None or len(q_lead) == 2 else rot["seqstart"]
    seq, idx, batch = _sequences(q_lead, st, "seqstart_q")
    if batch != seqlen_k.shape[0]:
        raise ValueError(f"q holds {batch} sequences, but seqlen_k has {seqlen_k.shape[0]}")
    pos = seqlen_k[seq] + (idx if rot["has_mask"] else 0)
    rows = int(np.prod(q_lead, dtype=np.int64))
    return q.reshape(rows, info.shape[-2], hdim), pos, tuple(info.shape)


def _run(session, w: _Write):
    r = w.rotary
    if not w.slots.size and (r is None or r.q is None):  # nothing to write, no q to rotate
        return None
    if not w.slots.size and session.device != "cpu":
        raise NotImplementedError(
            "rotating q without writing any K row is not supported on GPU sessions (the "
            "kernel's K bindings would be empty, which IREE's CUDA driver refuses): rotate "
            "q in the call that writes its keys"
        )
    fn = session.append_function(w.kernel)  # loaded (or compiled) before anything is written
    k = _take(w.k, w.keep, (-1, w.kernel.nhead_k, w.kernel.hdim))
    v = _take(w.v, w.keep, (-1, w.kernel.nhead_k, w.kernel.hdim_v))
    caches = [kernel_cache(session, c, shape) for c, shape in zip(w.caches, w.views)]
    extra = []
    if r is not None:
        k_pos = r.k_pos if w.keep is None else r.k_pos[w.keep]
        # IREE's CUDA driver refuses empty bindings (CUDA_ERROR_INVALID_VALUE,
        # and the device fails every call after it): without q, one row of
        # zeros at position 0 stands in, and its result is dropped.
        q, q_pos = (
            (r.q, r.q_pos)
            if r.q is not None
            else (np.zeros((1, 1, w.kernel.hdim), w.caches[0].dtype), np.zeros(1, np.int32))
        )
        extra = [np.repeat(k_pos, w.k.shape[1] // w.kernel.nhead_k), q, q_pos, r.cos, r.sin]
    res = run_append(session, fn, k, v, w.slots, *caches, *extra)
    if r is None or r.q is None:
        return None
    if is_torch(r.q) and r.q.device.type != "cpu":
        return session.to_torch(res[2])[0].reshape(r.q_shape)
    out = host_array(res[2]).reshape(r.q_shape)
    return numpy_to_torch(out) if is_torch(r.q) else out


def _take(x, keep, shape):
    """Rows `keep` of x (all for None), gathered where x lives, reshaped."""
    if keep is not None:
        x = x.index_select(0, sys.modules["torch"].as_tensor(keep, device=x.device)) if is_torch(x) else x[keep]
    return x.reshape(shape)


def kernel_cache(session, c: WritableCache, shape: tuple):
    """A cache as the append kernel's in-place argument, viewed as `shape`
    (the same memory): imported host memory, imported torch GPU memory
    (DLPack), or the DeviceArray itself. fp8 caches go as their bytes."""
    a, fp8 = c.array, fp8_name(c.dtype) is not None
    if is_device_array(a):
        if tuple(shape) == tuple(c.shape):
            return a
        import iree.runtime as rt

        bv = a._buffer_view
        return rt.DeviceArray(a._device, rt.HalBufferView(bv.get_buffer(), list(shape), bv.element_type))
    if is_torch(a):
        return session.import_torch((a.view(sys.modules["torch"].int8) if fp8 else a).view(shape))
    imported = session.import_host(a.reshape(shape).view(np.int8) if fp8 else a.reshape(shape))
    if imported is None:  # cache_arg admitted only arrays the session imports
        raise RuntimeError(f"the session could not import a {c.dtype} cache in place")
    return imported
