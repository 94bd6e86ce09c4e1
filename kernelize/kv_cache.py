"""Appending to transformers' ``DynamicCache`` in place: :func:`update` is ``cache.update(key, value,
layer_idx)`` for the kernelized attention layers, without the copy of the whole cache each step makes.

transformers' ``DynamicLayer.update`` grows the keys and values with ``torch.cat``, so every decode step
copies the layer's whole cache: at 2,048 cached tokens a GPT-2-medium-sized model (24 layers, 16 heads of 64,
f32) copies 400 MB per token, beside the 1.4 GB of weights it reads. Here a plain
``DynamicLayer`` keeps its keys and values in a buffer with room at the end (1.25x what it holds, at least
64 more positions); a step writes the new positions into that room and the layer's ``keys`` / ``values``
become views of the filled part, which the attention kernels read through their strides.

It appends in place only while nothing else changed the layer since its last append here: its ``keys`` and
``values`` must be the very views it set then (a crop, a beam reorder, a batch select or a reset replace
them, and the next step starts a new buffer). So every view it ever handed out stays as it was: positions
are written only past the longest view of the buffer. Any other cache or layer kind (sliding windows,
static, quantized, offloaded caches), a layer still empty, or states that do not match the cached ones in
batch, heads, head size, dtype or device, goes through ``cache.update`` unchanged.

Example:
    >>> from transformers import DynamicCache  # doctest: +SKIP
    >>> cache = DynamicCache()  # doctest: +SKIP
    >>> keys, values = update(cache, k, v, layer_idx=0)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

GROWTH = 1.25  # room kept at the end of a new buffer, as a multiple of what it holds
MIN_ROOM = 64  # positions


def _plain_layer(cache: Any, layer_idx: int) -> Any:
    """Layer ``layer_idx`` of ``cache`` if a filled plain ``DynamicLayer`` of a plain ``DynamicCache``."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys is None:
        return None
    return layer if layer.keys.dim() == 4 and layer.keys.numel() else None


def _fits(old: torch.Tensor, new: torch.Tensor) -> bool:
    return (
        new.dim() == 4
        and old.shape[:2] == new.shape[:2]
        and old.shape[3] == new.shape[3]
        and old.dtype == new.dtype
        and old.device == new.device
    )


def update(
    cache: Any, key: torch.Tensor, value: torch.Tensor, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update(key, value, layer_idx)``: the layer's keys and values with ``key`` / ``value``
    ([batch, heads, new, head_dim]) appended, written in place where the layer allows (module docstring)."""
    layer = _plain_layer(cache, layer_idx)
    if layer is None or not (_fits(layer.keys, key) and _fits(layer.values, value)):
        return cache.update(key, value, layer_idx)
    held, new = layer.keys.shape[2], key.shape[2]
    # (keys buffer, values buffer, the keys view and values view set from them last time)
    room = getattr(layer, "_kernelize_room", None)
    if (
        room is not None
        and room[2] is layer.keys
        and room[3] is layer.values
        and room[0].shape[2] >= held + new
    ):
        kbuf, vbuf = room[0], room[1]
    else:  # a new buffer with room at the end, holding what the layer holds
        size = held + new + max(MIN_ROOM, int((held + new) * (GROWTH - 1)))
        kbuf, vbuf = (
            t.new_empty(t.shape[0], t.shape[1], size, t.shape[3]) for t in (layer.keys, layer.values)
        )
        kbuf[:, :, :held].copy_(layer.keys)
        vbuf[:, :, :held].copy_(layer.values)
    kbuf[:, :, held : held + new].copy_(key)
    vbuf[:, :, held : held + new].copy_(value)
    return advance(layer, kbuf, vbuf, held + new)


def room(cache: Any, layer_idx: int, new: int) -> tuple[Any, torch.Tensor, torch.Tensor, int] | None:
    """Where :func:`update` would write ``new`` positions of layer ``layer_idx`` in place, in the room of
    the buffers it made last time: ``(layer, keys buffer, values buffer, positions held)``; None when it
    would not (no room left, or the layer changed since). A caller that writes them itself (a replayed
    decode step) then calls :func:`advance`."""
    layer = _plain_layer(cache, layer_idx)
    held = getattr(layer, "_kernelize_room", None)
    if held is None or held[2] is not layer.keys or held[3] is not layer.values:
        return None
    n = layer.keys.shape[2]
    return (layer, held[0], held[1], n) if held[0].shape[2] >= n + new else None


def advance(
    layer: Any, kbuf: torch.Tensor, vbuf: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the layer's keys and values the first ``total`` positions of ``kbuf`` / ``vbuf`` (written)."""
    layer.keys, layer.values = kbuf[:, :, :total], vbuf[:, :, :total]
    layer._kernelize_room = (kbuf, vbuf, layer.keys, layer.values)
    return layer.keys, layer.values


__all__ = ["advance", "room", "update"]
