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
static, quantized, offloaded caches; a sliding window's layer once it would drop a position), or states
that do not match the cached ones in batch, heads, head size, dtype or device, goes through
``cache.update`` unchanged. A layer still empty (a prompt's step) fills through ``cache.update``, then
its keys and values move to a buffer with room, so that the first decode step appends in place too (a
replayed decode step, `hub_kernels/llm`, runs only on such a layer).

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
    """Layer ``layer_idx`` of ``cache`` if a filled plain ``DynamicLayer`` of a plain ``DynamicCache``, or a
    ``DynamicSlidingWindowLayer`` that has dropped nothing yet (below its window it holds every position,
    as a ``DynamicLayer`` does, and counts them)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    kind = type(layer)
    if (
        kind not in (DynamicLayer, DynamicSlidingWindowLayer)
        or not layer.is_initialized
        or layer.keys is None
    ):
        return None
    if layer.keys.dim() != 4 or not layer.keys.numel():
        return None
    if kind is DynamicSlidingWindowLayer and layer.cumulative_length != layer.keys.shape[2]:
        return None
    return layer


def holds(layer: Any, total: int) -> bool:
    """Whether the layer may hold ``total`` positions without dropping any (a sliding window's keeps the
    last ``sliding_window - 1``)."""
    window = getattr(layer, "sliding_window", None)
    return window is None or total <= window - 1


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
    held, new = (0, 0) if layer is None else (layer.keys.shape[2], key.shape[2])
    if layer is None or not (
        _fits(layer.keys, key) and _fits(layer.values, value) and holds(layer, held + new)
    ):
        keys, values = cache.update(key, value, layer_idx)
        if layer is None:  # a layer this call filled (a prompt's): its keys move to a buffer with room
            layer = _plain_layer(cache, layer_idx)
            if layer is not None and all(
                a.shape == b.shape and a.data_ptr() == b.data_ptr()
                for a, b in ((layer.keys, keys), (layer.values, values))
            ):
                return _with_room(layer, keys.shape[2], 0)
        return keys, values
    room = _own_room(layer)
    if room is not None and room[0].shape[2] >= held + new:
        kbuf, vbuf = room[0], room[1]
    else:
        kbuf, vbuf = _with_room(layer, held, new, views=False)
    kbuf[:, :, held : held + new].copy_(key)
    vbuf[:, :, held : held + new].copy_(value)
    return advance(layer, kbuf, vbuf, held + new)


def _own_room(layer: Any) -> tuple | None:
    """(keys buffer, values buffer, keys view, values view) of the layer's last append here, when nothing
    replaced the layer's keys and values since (a crop, a beam reorder, a reset)."""
    room = getattr(layer, "_kernelize_room", None)
    if room is None or room[2] is not layer.keys or room[3] is not layer.values:
        return None
    return room


def _with_room(layer: Any, held: int, new: int, views: bool = True):
    """New buffers holding the layer's ``held`` positions with room for ``new`` more and then some; with
    ``views`` the layer's keys and values become views of them (as :func:`advance` returns them), else the
    buffers are returned."""
    size = held + new + max(MIN_ROOM, int((held + new) * (GROWTH - 1)))
    kbuf, vbuf = (t.new_empty(t.shape[0], t.shape[1], size, t.shape[3]) for t in (layer.keys, layer.values))
    kbuf[:, :, :held].copy_(layer.keys)
    vbuf[:, :, :held].copy_(layer.values)
    return advance(layer, kbuf, vbuf, held) if views else (kbuf, vbuf)


def room(cache: Any, layer_idx: int, new: int) -> tuple[Any, torch.Tensor, torch.Tensor, int] | None:
    """Where :func:`update` would write ``new`` positions of layer ``layer_idx`` in place:
    ``(layer, keys buffer, values buffer, positions held)``, in the room of the buffers it made last time
    (moved to larger ones when full); None when it would not write in place (the layer changed since its
    last append here, or is not a plain one). A caller that writes them itself (a replayed decode step)
    then calls :func:`advance`."""
    layer = _plain_layer(cache, layer_idx)
    room = None if layer is None else _own_room(layer)
    if room is None:
        return None
    held = layer.keys.shape[2]
    if not holds(layer, held + new):
        return None
    if room[0].shape[2] < held + new:
        _with_room(layer, held, new)
        room = layer._kernelize_room
    return layer, room[0], room[1], held


def advance(
    layer: Any, kbuf: torch.Tensor, vbuf: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the layer's keys and values the first ``total`` positions of ``kbuf`` / ``vbuf`` (written)."""
    layer.keys, layer.values = kbuf[:, :, :total], vbuf[:, :, :total]
    if hasattr(layer, "cumulative_length"):  # a sliding window's count of the positions seen
        layer.cumulative_length = total
    layer._kernelize_room = (kbuf, vbuf, layer.keys, layer.values)
    return layer.keys, layer.values


__all__ = ["advance", "holds", "room", "update"]
