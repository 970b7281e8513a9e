"""Padding masks of Hugging Face models as the paged kernels' gappy KV, and
the other arguments the "turbine_fmha" attention refuses.

Left padding (HF's convention for batched generation) puts row b's p_b pad
tokens first. The cache stores their K/V too (a cache's `update` does not
see the mask), so row b's keys are the stored rows p_b.. and the pad rows
are skipped with the kernels' `kv_offset[b] = p_b`, `seqlen_k[b] = stored
- p_b`. Bottom-right causal masking then gives a real query i of a step of
L rows the keys p_b..i, as HF's mask does; a pad query sees no key and
gets 0 (HF never reads those positions). Any other pattern (right padding,
holes) would need a mask the kernels do not take, so it is refused.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch
from transformers.masking_utils import causal_mask_function, flash_attention_mask

NAME = "turbine_fmha"


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask=None,
    **kwargs,
):
    """The mask function registered for "turbine_fmha" (transformers'
    `AttentionMaskInterface`): flash attention's (None for a batch without
    padding, else the 2D bool mask), checked here. The model builds its
    mask before any layer runs, so a refused mask leaves the cache as it
    was."""
    # flash_attention_mask drops the mask function: an overlay (image
    # tokens, blocks, bidirectional attention) would silently be lost. A
    # sliding window is kept: each layer passes its own to the attention.
    if mask_function is not causal_mask_function and sliding_window_of(mask_function) is None:
        raise NotImplementedError(
            f"{NAME} attention takes causal masks, with or without a sliding window, only: the model "
            f"builds its mask with another mask function ({getattr(mask_function, '__name__', '?')}: "
            "chunks, bidirectional attention or an overlay)"
        )
    if attention_mask is not None:
        left_padding(attention_mask, batch_size, kv_length)
    return flash_attention_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs
    )


def sliding_window_of(mask_function) -> int | None:
    """W where `mask_function` is transformers'
    sliding_window_causal_mask_function(W), i.e. and_masks of
    sliding_window_overlay(W) and causal_mask_function and nothing else
    (query i sees keys i - W < j <= i), checked on a grid of positions as
    well; None for any other function."""
    if getattr(mask_function, "__qualname__", None) != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function):
        return None
    if getattr(parts[0], "__qualname__", None) != "sliding_window_overlay.<locals>.inner_mask":
        return None
    w = _closure(parts[0]).get("sliding_window")
    if type(w) is not int or w < 1:
        return None
    q = torch.arange(2 * w + 3)
    kv = q[None, :]
    got = mask_function(0, 0, q[:, None], kv)
    return w if torch.equal(got, (kv <= q[:, None]) & (kv > q[:, None] - w)) else None


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def left_padding(attention_mask, batch: int, rows: int) -> np.ndarray | None:
    """kv_offset [batch] int32 (each row's leading pad positions) of a 2D
    bool mask over the `rows` positions the cache holds after this step's
    update; None without padding. Raises for anything else."""
    shape = tuple(getattr(attention_mask, "shape", ()))
    if len(shape) != 2:
        raise NotImplementedError(
            f"{NAME} attention supports left padding only (a 2D [batch, kv_length] padding mask): got an "
            f"attention_mask of shape {list(shape)} (a custom mask)"
        )
    if str(getattr(attention_mask, "dtype", "")) != "torch.bool":
        raise NotImplementedError(
            f"{NAME} attention takes the 2D padding mask as a torch.bool tensor, got an "
            f"attention_mask of dtype {getattr(attention_mask, 'dtype', None)}"
        )
    if shape[0] != batch:
        raise ValueError(f"attention_mask has {shape[0]} rows, the batch has {batch}")
    if shape[1] != rows:
        raise ValueError(
            f"attention_mask covers {shape[1]} positions, but the cache holds {rows} after this "
            "step: pass the mask of every cached position and the new ones"
        )
    m = attention_mask.detach().cpu().numpy()
    # [False] * p + [True] * rest is exactly a row that never falls from
    # True back to False.
    bad = (np.diff(m.astype(np.int8), axis=1) < 0).any(axis=1)
    if bad.any():
        b = int(np.argmax(bad))
        raise NotImplementedError(
            f"{NAME} attention supports left padding only: attention_mask row {b} is not [False] * p + "
            "[True] * rest (right padding or a hole); pad on the left (tokenizer padding_side='left')"
        )
    offsets = (~m).sum(axis=1).astype(np.int32)
    return offsets if offsets.any() else None


@dataclasses.dataclass(frozen=True)
class Terms:
    """A layer's score terms that the kernels take: its sliding window (HF's
    W: a query sees the W keys up to its own), logit soft-cap and attention
    sinks (one logit per query head, as float32 bytes); None for none."""

    window: int | None = None
    softcap: float | None = None
    sinks: bytes | None = None

    def planned(self) -> tuple:
        """What a plan depends on: layers equal in it share a plan, and
        each run brings its layer's sinks (run_kwargs)."""
        return self.window, self.softcap, self.sinks is not None

    def plan_kwargs(self) -> dict:
        return dict(
            window_size_left=-1 if self.window is None else self.window - 1,
            logits_soft_cap=self.softcap or 0.0,
            **self.run_kwargs(),
        )

    def run_kwargs(self) -> dict:
        return {} if self.sinks is None else dict(sinks=np.frombuffer(self.sinks, np.float32))


NO_TERMS = Terms()

# A layer's sinks read back once per version of the parameter (on a GPU,
# a read is a device sync): they are weights, not per-step data. Keyed by
# id (tensors do not hash by value), each entry dropped with its tensor.
_SINKS: dict[int, tuple] = {}


def _sinks_bytes(s_aux) -> bytes:
    if not isinstance(s_aux, torch.Tensor) or s_aux.ndim != 1 or not s_aux.dtype.is_floating_point:
        raise ValueError(f"s_aux (attention sinks) must be a 1-D float tensor, one logit per query head, got {s_aux!r}")
    hit = _SINKS.get(id(s_aux))
    if hit is None or hit[0]() is not s_aux or hit[1] != s_aux._version:
        key = id(s_aux)
        ref = weakref.ref(s_aux, lambda _, key=key: _SINKS.pop(key, None))
        hit = _SINKS[key] = (ref, s_aux._version, s_aux.detach().to("cpu", torch.float32).numpy().tobytes())
    return hit[2]


def refuse_unsupported(module, dropout, kwargs) -> Terms:
    """Raises NotImplementedError for whatever else would make the kernels
    compute something other than the model asks for; returns the layer's
    score terms that the kernels take."""
    if dropout:
        raise NotImplementedError(f"{NAME} attention is inference only: got dropout={dropout}")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{NAME} attention is causal only")
    for name in ("sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{NAME} attention does not support {name} yet")
    window = kwargs.get("sliding_window")
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    softcap = kwargs.get("softcap")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
        softcap = float(softcap)
    s_aux = kwargs.get("s_aux")
    return Terms(window, softcap, None if s_aux is None else _sinks_bytes(s_aux))
