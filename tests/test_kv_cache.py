"""kernelize.kv_cache.update against transformers' own DynamicCache.update: the same keys and values at every
step, through growth, crops, beam reorders, resets and the layer kinds it leaves alone; earlier views never
change; and generation through the one call (greedy and beam search) gives eager's tokens."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402

from kernelize import kv_cache  # noqa: E402


def states(n: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, n, 8, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(2, 3, 8, n, generator=g, dtype=torch.float32).to(dtype).transpose(2, 3)  # strided
    return k, v


def test_appends_equal_dynamic_cache_through_growth_and_keep_earlier_views():
    ours, ref = DynamicCache(), DynamicCache()
    views, saved = [], []
    for step, n in enumerate([5, *[1] * 80, 3, 70, 1]):
        k, v = states(n, step)
        got = kv_cache.update(ours, k, v, 0)
        want = ref.update(k, v, 0)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        views.append(got)
        saved.append(tuple(t.clone() for t in got))
    for view, copy_ in zip(views, saved):  # nothing written over what a view showed
        assert all(torch.equal(a, b) for a, b in zip(view, copy_))
    layer = ours.layers[0]
    assert layer.keys._base is not None  # a view of a buffer with room, not a fresh cat
    assert ours.get_seq_length(0) == ref.get_seq_length(0) == 5 + 80 + 3 + 70 + 1


def test_steps_within_the_room_write_in_place():
    cache = DynamicCache()
    kv_cache.update(cache, *states(4, 0), 0)  # the prompt's keys move to a buffer with room
    assert cache.layers[0].keys._base is not None
    base = cache.layers[0].keys.data_ptr()
    for step in range(20):
        kv_cache.update(cache, *states(1, 2 + step), 0)
        assert cache.layers[0].keys.data_ptr() == base


def test_room_moves_a_full_layer_to_larger_buffers():
    """`room` (what a replayed decode step writes into) gives the next row's place; when the buffer is
    full it moves the layer's keys and values to larger buffers first, the earlier views kept."""
    ours, ref = DynamicCache(), DynamicCache()
    k, v = states(5, 0)
    kv_cache.update(ours, k, v, 0)
    ref.update(k, v, 0)
    views = []
    for step in range(150):
        layer, kbuf, vbuf, held = kv_cache.room(ours, 0, 1)
        assert held == 5 + step and kbuf.shape[2] > held
        k, v = states(1, step + 1)
        kbuf[:, :, held : held + 1].copy_(k)
        vbuf[:, :, held : held + 1].copy_(v)
        views.append((kv_cache.advance(layer, kbuf, vbuf, held + 1), ref.update(k, v, 0)))
    assert all(torch.equal(a, b) for got, want in views for a, b in zip(got, want))
    assert len({got[0].data_ptr() for got, _ in views}) >= 2  # it moved at least once


@pytest.mark.parametrize("change", ["crop", "reorder", "reset", "deepcopy", "replace"])
def test_after_the_cache_is_changed_appends_still_equal_transformers(change):
    ours, ref = DynamicCache(), DynamicCache()
    for step, n in enumerate([6, 1, 1, 1]):
        k, v = states(n, step)
        kv_cache.update(ours, k, v, 0)
        ref.update(k, v, 0)
    if change == "crop":
        ours.crop(-2), ref.crop(-2)
    elif change == "reorder":
        idx = torch.tensor([1, 0])
        ours.reorder_cache(idx), ref.reorder_cache(idx)
    elif change == "reset":
        ours.reset(), ref.reset()
    elif change == "deepcopy":
        keep, ours = ours, copy.deepcopy(ours)
        before = [t.clone() for t in (keep.layers[0].keys, keep.layers[0].values)]
    else:  # someone sets the layer's tensors directly
        ours.layers[0].keys = ours.layers[0].keys.clone()
    for step in range(3):
        k, v = states(1 + step, 10 + step)
        for g, w in zip(kv_cache.update(ours, k, v, 0), ref.update(k, v, 0)):
            assert torch.equal(g, w)
    if change == "deepcopy":  # the copy's appends never reach the original
        assert torch.equal(keep.layers[0].keys, before[0]) and torch.equal(keep.layers[0].values, before[1])


def test_other_layers_and_mismatched_states_go_through_cache_update():
    config = transformers.MistralConfig(
        num_hidden_layers=1, sliding_window=4, hidden_size=16, num_attention_heads=2, num_key_value_heads=1
    )
    ours, ref = DynamicCache(config=config), DynamicCache(config=config)
    assert type(ours.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    for step, n in enumerate([6, 1, 1, 2]):
        k, v = states(n, step)
        for g, w in zip(kv_cache.update(ours, k, v, 0), ref.update(k, v, 0)):
            assert torch.equal(g, w)
    assert not hasattr(ours.layers[0], "_kernelize_room")
    ours, ref = DynamicCache(), DynamicCache()
    for step, (n, dtype) in enumerate(
        [(3, torch.float32), (1, torch.float32), (1, torch.bfloat16), (1, None)]
    ):
        k, v = states(n, step, dtype or torch.float32)
        if dtype is None:  # other heads
            k, v = k[:, :2], v[:, :2]
            with pytest.raises(RuntimeError):  # torch.cat's own error, as before
                kv_cache.update(ours, k, v, 0)
            continue
        for g, w in zip(kv_cache.update(ours, k, v, 0), ref.update(k, v, 0)):  # bf16: cat promotes
            assert torch.equal(g, w) and g.dtype == w.dtype


def test_a_sliding_window_layer_appends_in_place_until_it_would_drop_a_position():
    """Below its window a `DynamicSlidingWindowLayer` holds every position: appends go in place (its count of
    positions moves with them); the append that would drop one goes through its own update, and every step
    equals transformers' (states, sequence length, mask sizes)."""
    config = transformers.MistralConfig(
        num_hidden_layers=1, sliding_window=12, hidden_size=16, num_attention_heads=2, num_key_value_heads=1
    )
    ours, ref = DynamicCache(config=config), DynamicCache(config=config)
    in_place = []
    for step, n in enumerate([5, *[1] * 12]):
        k, v = states(n, step)
        for g, w in zip(kv_cache.update(ours, k, v, 0), ref.update(k, v, 0)):
            assert torch.equal(g, w)
        layer = ours.layers[0]
        in_place.append(getattr(layer, "_kernelize_room", (None,) * 4)[2] is layer.keys)
        assert layer.get_seq_length() == ref.layers[0].get_seq_length()
        assert layer.get_mask_sizes(1) == ref.layers[0].get_mask_sizes(1)
        assert torch.equal(layer.keys, ref.layers[0].keys) and torch.equal(layer.values, ref.layers[0].values)
    assert in_place == [True] * 7 + [False] * 6  # 5 + 6 = 11 = window - 1 positions kept in place
    assert kv_cache.room(ours, 0, 1) is None


@pytest.mark.parametrize("beams", [1, 2])
def test_generation_through_the_one_call_equals_eager(beams):
    from kernelize.integrations.transformers import kernelize_model

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config).eval()
    fast = kernelize_model(copy.deepcopy(eager))
    prompt = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=70, min_new_tokens=70, do_sample=False, num_beams=beams, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(fast.generate(prompt, **kw), eager.generate(prompt, **kw))
