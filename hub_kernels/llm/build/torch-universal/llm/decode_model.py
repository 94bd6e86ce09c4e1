"""A causal LM's whole decode step with no module calls between its layers' replayed programs (#33 item 6).

With each decoder layer's step one replayed C call (`decode_step.py`), what was left per token was the
Python around those calls: per layer, the module call, transformers' layer wrapper, the block's checks and
the cache bookkeeping; per model, the base model's forward (its mask, position ids, output objects). On a
300 M Llama at q4_0 that was ~2 ms of a ~7.5 ms token, and slower than the same code in a tight loop,
since each layer's weights stream the interpreter's data out of the caches.

`model_step` runs a plain decode step (one token, a cache with room, no mask or an all-ones one, no
hooks, no outputs requested beyond the logits) as: the token embedding, the rotary tables, then every
layer's program (each layer's readiness checked before any runs, so a step either runs whole or goes the
model's own way), the final norm and the LM head (one more replayed call where the head is packed and
nothing hooks the two, else their module calls). That walk's result is kept as one chain of every
program (`_Chain`): the next steps run the whole token as one C call while a few comparisons show that
nothing the walk checked has changed (`_Chain.fresh`). Which base models this fits is not read from their
source: the first such step runs it, rolls the cache back, runs the model's own
forward, and keeps the path only when the logits are bit for bit the same (else the reason goes into
``kernelize.inspect``). A model whose mask could stop being None (a sliding window the keys are about to
reach, chunked attention) goes its own way at those steps. ``KERNELIZE_DECODE_REPLAY=0`` turns it off
with the layers' programs.

Example:
    >>> out = model_step(lm, input_ids, None, None, cache, None, True, 1, {}, own)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import threading
from collections.abc import Callable
from itertools import repeat
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from kernelize import kv_cache
from kernelize.model_attention import _REFERENCE, note_fallback
from kernelize.runtime.replay import Program, copy_rows_call, tree_epoch

from . import decode_step
from .block import _CAPTURE_HOOK, ROTARY_TABLES, _capturing, _installed, block_of, own_mlp, rotary_tables

logger = logging.getLogger(__name__)
_STATE = "_kernelize_model_step"  # in the causal LM's __dict__: a `_State`
_DIFFERS = "the model's own decode step computes more than embed -> rotary -> layers -> norm -> head"
# the call's keywords a plain decode step may carry (what `generate` passes besides the named arguments)
_PLAIN_KWARGS = frozenset({"return_dict"})


def model_step(
    lm: nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Any,
    inputs_embeds: torch.Tensor | None,
    use_cache: bool | None,
    logits_to_keep: Any,
    kwargs: dict[str, Any],
    own_forward: Callable[[], Any],
) -> Any:
    """The causal LM's output for this call through the fast path, or None: the model's own forward
    (``own_forward()``) runs it (not a plain decode step, or a model this path does not fit; module
    docstring). The step that checks the path returns ``own_forward()``'s output."""
    if not decode_step.ENABLED or input_ids is None or inputs_embeds is not None:
        return None
    if cache is None and "past_key_values" in kwargs:  # the cache's name before transformers 5.24
        kwargs = dict(kwargs)
        cache = kwargs.pop("past_key_values")
    if position_ids is not None and position_ids.shape != (1, 1):
        return None
    if cache is None or use_cache is not True or not isinstance(logits_to_keep, int):
        return None
    if not _PLAIN_KWARGS.issuperset(kwargs) or kwargs.get("return_dict") is False:
        return None
    if input_ids.shape != (1, 1) or not input_ids.is_cpu or lm.training or torch.is_grad_enabled():
        return None
    if attention_mask is not None and not (attention_mask.dim() == 2 and bool(attention_mask.all())):
        return None
    base = getattr(lm, "model", None)
    config = getattr(base, "config", None)
    if getattr(config, "output_hidden_states", False) or getattr(config, "output_attentions", False):
        return None
    state = lm.__dict__.get(_STATE)
    if state is not None and state.verdict is True and state.chain is not None and state.chain.fresh():
        logits = _run_chain(state.chain, state.parts, input_ids, position_ids, cache)
        if logits is not None:
            return _output(state.output_type, logits, cache)
    key = _key(lm, base)
    if state is None or state.key != key:
        parts = _parts(lm, base)
        state = lm.__dict__[_STATE] = _State(key, parts)
        if isinstance(parts, str):
            _note(lm, parts)
    parts, verdict = state.parts, state.verdict
    if isinstance(verdict, str) or _blocked(base, parts[3]):
        return None
    if verdict:
        logits = _run(state, base, input_ids, position_ids, cache)
        return None if logits is None else _output(state.output_type, logits, cache)
    # the first plain step: run it both ways and compare (not while hooks on the parts it calls would see
    # their calls twice)
    if any(m._forward_hooks or m._forward_pre_hooks for m in (*parts[:3], parts[4])):
        return None
    saved = [(c, dict(c.__dict__)) for c in _kv_layers(cache)]  # (keys, values, counts, the room: shallow)
    try:
        fast = _run(state, base, input_ids, position_ids, cache)
    except Exception as e:  # a part called otherwise than the path calls it (OLMo3's rotary: a layer type)
        fast = f"the path raised {type(e).__name__}: {e}"
    if fast is None:  # not every layer could run its program this step: try again at the next
        return None
    for c, before in saved:  # as before the step: the model's own forward writes the same rows
        c.__dict__.clear()
        c.__dict__.update(before)
    own = own_forward()
    logits = getattr(own, "logits", None)
    same = torch.is_tensor(logits) and not isinstance(fast, str) and torch.equal(fast, logits)
    state.verdict = fast if isinstance(fast, str) else True if same else _DIFFERS
    state.output_type = type(own)  # the path's outputs are the model's type
    if state.verdict is not True:
        _note(lm, state.verdict)
    return own


class _State:
    """What the model step keeps on the causal LM: the key its parts were found from, the parts (embedding,
    rotary, norm, layers, head) or why none, the verdict of the checked step (None: not checked yet; True;
    or why not), the model's output type, and the layers' programs run as one (:class:`_Chain`)."""

    __slots__ = ("chain", "key", "output_type", "parts", "verdict")

    def __init__(self, key: tuple, parts: tuple | str) -> None:
        self.key, self.parts = key, parts
        self.verdict = parts if isinstance(parts, str) else None
        self.output_type, self.chain = None, None


def _parts(lm: nn.Module, base: nn.Module | None) -> tuple | str:
    """(embedding, rotary, norm, layers, head): what the path calls, or why the model has none of them."""
    if base is None:
        return "no base model"
    names = ("embed_tokens", "rotary_emb", "norm", "layers")
    missing = [n for n in names if not isinstance(getattr(base, n, None), nn.Module)]
    if missing:
        return f"the base model has no {', '.join(missing)}"
    config = getattr(base, "config", None)
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention (its mask changes with the position)"
    from .layers import EmbeddingsFirstDecoderLayer, PreNormDecoderLayer

    layers = tuple(base.layers[: getattr(config, "num_hidden_layers", len(base.layers))])
    ours = (PreNormDecoderLayer.forward, EmbeddingsFirstDecoderLayer.forward)
    if not all(getattr(layer.__dict__.get("forward"), "__func__", None) in ours for layer in layers):
        return "a layer does not run kernelize's decoder layer (its steps are not replayed programs)"
    return base.embed_tokens, base.rotary_emb, base.norm, layers, lm.lm_head


def _kv_layers(cache: Any) -> list:
    """The cache's layers that hold keys and values (what a step may move on)."""
    return [c for c in getattr(cache, "layers", ()) if hasattr(c, "keys") and hasattr(c, "values")]


def _key(lm: nn.Module, base: nn.Module | None) -> tuple:
    """What the model's parts were found from (cheap to compare per step): the base model's and its layer
    list's submodules, the forwards installed on the layers (kernelize's, or their own again), the head
    and the base model's forward."""
    layers = getattr(base, "layers", None)
    subs = tuple(layers._modules.values()) if isinstance(layers, nn.Module) else ()
    mods = tuple(base._modules.values()) if isinstance(base, nn.Module) else ()
    forwards = tuple(layer.__dict__.get("forward") for layer in subs)
    own = (type(base).forward, getattr(base, "__dict__", {}).get("forward"))
    return base, mods, subs, forwards, lm._modules.get("lm_head"), own


def _note(lm: nn.Module, reason: str) -> None:
    logger.debug("decode steps of %s run the model's own forward: %s", type(lm).__name__, reason)
    note_fallback(lm, reason, "decode steps run the model's own forward")


def _blocked(base: nn.Module, layers: tuple) -> bool:
    """Whether hooks the path would skip are registered (on the base model or a layer, or global ones), or
    transformers is capturing outputs."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks or _capturing():
        return True
    for mod in (base, *layers):
        for hook in (*mod._forward_pre_hooks.values(), *mod._forward_hooks.values()):
            if (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) != _CAPTURE_HOOK:
                return True
    return False


def _run(state: _State, base: nn.Module, input_ids: torch.Tensor, position_ids, cache: Any) -> Any:
    """The step's logits through every layer's program, or None (before anything ran) when a layer cannot
    take it. Every layer's readiness is checked here; the programs then run as one call (the chain, which
    the next steps reuse while :meth:`_Chain.fresh`), or one by one where an MLP runs its own forward
    between them."""
    embed, rotary, norm, layers, head = state.parts
    from .layers import CausalSelfAttention

    x = embed(input_ids)
    if position_ids is None:  # as the base model makes them
        position_ids = (torch.arange(1, device=x.device) + cache.get_seq_length()).unsqueeze(0)
    position_embeddings = rotary(x, position_ids=position_ids)
    kwargs = {"position_ids": position_ids, "use_cache": True}
    plans = []
    try:
        for layer in layers:
            block = block_of(layer, x, CausalSelfAttention)
            if block is None or block.attn_shards is not None or block.mlp_shards is not None:
                return None
            tables = rotary_tables(layer.self_attn, *position_embeddings)
            if not (tables[0].is_contiguous() and tables[1].is_contiguous()):
                return None
            args = (layer, layer.self_attn, block, x, tables, None, cache, kwargs, decode_step._build_llama)
            ready = decode_step.prepare(*args, margin=1)
            if ready is None:
                return None
            plans.append((layer, block, tables, ready))
    finally:
        if len(plans) < len(layers):
            for plan in plans:
                decode_step.release(plan[3])
    one_table = len({_table_kind(layer) for layer in layers}) == 1
    if one_table and all(ready[0].outputs == 1 for *_, ready in plans):
        tail = _tail_of(norm, head, x)
        chain = state.chain
        steps = tuple(ready[0] for *_, ready in plans)
        if chain is None or chain.steps != steps or chain.tail is not tail or chain.dtype != x.dtype:
            chain = state.chain = _Chain(steps, tail, x, plans[0][2], layers, embed, rotary)
        if tail is None or tail.lock.acquire(blocking=False):
            chain.watch(base, layers, embed, rotary, norm, head)
            cos, sin = plans[0][2]
            rows = [ready[1:] for *_, ready in plans]
            return _chain_run(chain, int(input_ids), x, cos.data_ptr(), sin.data_ptr(), rows, norm, head)
    for i, (layer, block, tables, ready) in enumerate(plans):
        try:
            step, out, residual = decode_step.execute(ready, x, tables)
            x = out if not block.own_mlp or step.moe else own_mlp(layer, block, out, residual)
        except BaseException:
            for later in plans[i + 1 :]:
                decode_step.release(later[3])
            raise
    return _tail(norm, head, x)


class _Chain:
    """Every layer's program, then the final norm's and packed LM head's (`_Tail`) where there is one, as
    one replayed call; first the token's embedding row copied into the chain's buffer where the embedding is
    a plain `nn.Embedding` of the model's dtype. Slots: the embedding `h0` (or its row `embed_row`), the
    rotary tables `cos` / `sin`, per layer the cache row `key{i}` / `value{i}` and key length `keylen{i}`
    and the cache's buffers (`decode_step.BUFFER_SLOTS`), the hidden state between two layers `h{i}` (the
    chain's own two buffers), the last layer's output `hidden` and the `logits`. The programs' buffers stay
    the layers' own: a run holds every layer's lock. Where the rotary embedding's type has no state that
    changes with the positions (not a dynamic or long RoPE), its tables for the next positions are made
    ahead, `ROTARY_ROWS` at a time, by the module's own calls (:meth:`rotary_at`: one call over the positions
    as a batch where that gives each position's call bit for bit). A hooked embedding or
    rotary module is called at every step instead (its output is then the row the chain copies).

    A step after the one that checked every layer takes it when :meth:`fresh` (the same checks, in a few
    comparisons instead of a walk over the model): no submodule, parameter or buffer assigned anywhere
    since (`tree_epoch`), no hook registered anywhere (torch's hook handle count), the same forwards
    installed on the base model, the layers, their submodules, the norm and the head, no layer training,
    the weights at the same addresses, and transformers not capturing outputs."""

    ROTARY_ROWS = 32

    def __init__(self, steps, tail: _Tail | None, x: torch.Tensor, tables, layers, embed, rotary) -> None:
        self.steps, self.tail, self.dtype, self.shape = steps, tail, x.dtype, x.shape
        self.table = (tables[0].shape, tables[0].dtype)  # the rotary tables' shape and dtype
        n = len(steps)
        prog = Program()
        self.embedding = _plain_embedding(embed, x)
        if self.embedding is not None:
            h0 = torch.empty_like(x)
            prog.add(copy_rows_call(self.embedding[:1].view(x.shape), h0), threads_at=-1, embed_row=0)
            prog.hold(h0)
        hidden = [torch.empty_like(x) for _ in range(min(n - 1, 2))]
        per_layer = (*decode_step.ROW_SLOTS, *decode_step.BUFFER_SLOTS)
        for i, step in enumerate(steps):
            out = "hidden" if i == n - 1 else f"h{i + 1}"
            prog.include(step.program, {"x": f"h{i}", "out": out, **{k: f"{k}{i}" for k in per_layer}})
        if tail is not None:
            prog.include(tail.program, {"x": "hidden"})
        prog.hold(*hidden)
        head = ("h0", "cos", "sin", "hidden", "logits", "embed_row")
        order = [*head, *(f"h{i}" for i in range(1, n)), *(f"{k}{i}" for i in range(n) for k in per_layer)]
        at = {name: i for i, name in enumerate(prog.seal(order))}
        self.template = [0] * len(at)
        for i in range(1, n):
            self.template[at[f"h{i}"]] = hidden[(i - 1) % 2].data_ptr()  # (a layer's input is not its output)
        if self.embedding is not None:
            self.template[at["h0"]] = h0.data_ptr()
        self.at = tuple(at.get(name, -1) for name in head)
        assert min(self.at[:4]) >= 0  # every layer's program reads h{i} and the rotary tables
        # per layer, where its row and buffer values start (laid out in `per_layer`'s order)
        self.starts = tuple(at[f"key{i}"] for i in range(n))
        assert all(at[f"{k}{i}"] == self.starts[i] + j for i in range(n) for j, k in enumerate(per_layer))
        self.width = len(per_layer)
        self.program, self.n_out = prog, None if tail is None else tail.n_out
        self.locks = tuple(step.lock for step in steps) + (() if tail is None else (tail.lock,))
        self.cache_at = tuple(layer.self_attn.layer_idx for layer in layers)
        self.windows = tuple(step.window for step in steps)
        self.tables = ROTARY_TABLES[_table_kind(layers[0])]  # every layer's (`_run` checks)
        rope = getattr(rotary, "rope_type", None)
        self.static_rotary = isinstance(rope, str) and "dynamic" not in rope and rope != "longrope"
        self._rotary = None  # (first position, cos rows, sin rows)
        self.batched_rotary = None  # one call over a batch of positions gives their tables (None: not tried)
        self._batched_for = None  # the rotary module that verdict is about
        self.call_embed = self.call_rotary = False  # (set by `watch`)
        self._watched = None

    def rotary_at(self, rotary: nn.Module, position: int) -> tuple[int, int] | None:
        """The addresses of the rotary tables at ``position`` (made ahead by the module's own calls), or
        None: this step calls the module."""
        made = self._rotary
        if made is None or not made[0] <= position < made[0] + len(made[1]):
            made = self._rotary = self._rotary_rows(rotary, position)
            if made is None:
                return None
        row = (position - made[0]) * made[1].stride(0) * made[1].element_size()
        return made[1].data_ptr() + row, made[2].data_ptr() + row

    def _rotary_rows(self, rotary: nn.Module, position: int) -> tuple | None:
        """(position, cos rows, sin rows) of the `ROTARY_ROWS` positions from ``position``: one module call
        over them as a batch of one-token rows where that call gave the per-position calls' tables bit for
        bit the first time (checked once per chain: `batched_rotary`), else one call per position (~60 us
        each on a 300 M Llama: ~0.06 ms of every decode token)."""
        n = self.ROTARY_ROWS
        if self._batched_for is not rotary:  # a verdict holds for the module it was found with
            self.batched_rotary, self._batched_for = None, rotary
        if self.batched_rotary is not False:
            x = torch.empty((n, *self.shape[1:]), dtype=self.dtype)
            c, s = map(self.tables, rotary(x, position_ids=torch.arange(position, position + n).view(n, 1)))
            fits = c.shape == (n, *self.table[0][1:]) and c.dtype == self.table[1] and s.shape == c.shape
            batched = (position, c.reshape(n, -1).contiguous(), s.reshape(n, -1).contiguous())
            batched = batched if fits else None
            if batched is not None and self.batched_rotary:
                return batched
            single = self._rotary_single(rotary, position)
            self.batched_rotary = bool(
                batched is not None and single is not None
                and torch.equal(batched[1], single[1]) and torch.equal(batched[2], single[2])
            )  # fmt: skip
            return single
        return self._rotary_single(rotary, position)

    def _rotary_single(self, rotary: nn.Module, position: int) -> tuple | None:
        x = torch.empty(self.shape, dtype=self.dtype)
        cos, sin = [], []
        for p in range(position, position + self.ROTARY_ROWS):
            c, s = map(self.tables, rotary(x, position_ids=torch.tensor([[p]])))
            if (c.shape, c.dtype) != self.table or s.shape != c.shape:
                return None
            cos.append(c.reshape(-1))
            sin.append(s.reshape(-1))
        return position, torch.stack(cos), torch.stack(sin)

    def watch(self, base, layers: tuple, embed, rotary, norm: nn.Module, head: nn.Module) -> None:
        """Snapshot what :meth:`fresh` compares, right after every layer was checked (and drop the rotary
        tables made ahead: the slow path's checks found the model as it is now)."""
        self._rotary = None
        # hooked now (a later hook changes the hook count, and the next step walks again): module calls
        self.call_embed, self.call_rotary = (
            bool(m._forward_hooks or m._forward_pre_hooks) for m in (embed, rotary)
        )
        mods = [base, embed, rotary, norm, head]
        for layer in layers:
            mods += [layer, *layer._modules.values()]
        for step, layer in zip(self.steps, layers):
            if step.moe:  # hooks on the router or the experts send a step the Python way
                mods += layer.mlp._modules.values()
        tensors = [t for step in self.steps for t in step.sources[1]]
        if self.tail is not None:
            tensors += self.tail.sources[1]
        if self.embedding is not None:
            tensors.append(embed.weight)
        dicts = tuple(m.__dict__ for m in mods)
        self._watched = (
            tree_epoch(),
            RemovableHandle.next_id,
            type(base).forward,
            dicts,
            tuple(map(dict.get, dicts, repeat("forward"))),
            layers,  # (the slow path checks the layers' mode)
            tuple(tensors),
            list(map(torch.Tensor.data_ptr, tensors)),
            base,
            base.layers._modules,  # (`del layers[i]` makes a new dict; `del` assigns nothing)
            len(base.layers._modules),
        )

    def fresh(self) -> bool:
        """Whether every check of the slow path would pass as it did at :meth:`watch` (class docstring)."""
        w = self._watched
        return (
            w is not None
            and w[0] == tree_epoch()
            and w[1] == RemovableHandle.next_id
            and type(w[8]).forward is w[2]
            and w[8].layers._modules is w[9]
            and len(w[9]) == w[10]
            and all(map(operator.is_, map(dict.get, w[3], repeat("forward")), w[4]))
            and not any(map(_TRAINING, w[5]))
            and list(map(torch.Tensor.data_ptr, w[6])) == w[7]
            and not _capturing()
            and not _REFERENCE.get()
        )


_TRAINING = operator.attrgetter("training")


def _table_kind(layer: nn.Module) -> str:
    return getattr(layer.self_attn, "rotary_tables", "same")


def _run_chain(chain: _Chain, parts: tuple, input_ids: torch.Tensor, position_ids, cache: Any) -> Any:
    """A fresh chain's step (the embedding and the rotary tables as the chain makes them, or their module
    calls; then the one call), or None before anything ran (a cache layer without room, a window reached,
    a program busy in another thread, a token outside the vocabulary: the model's forward raises)."""
    embed, rotary, norm, _, head = parts
    rows = _cache_rows(chain, cache)
    if rows is None:
        return None
    token = int(input_ids)
    position = rows[0][3] if position_ids is None else int(position_ids)
    x = None
    if chain.embedding is None or chain.call_embed:
        x = embed(input_ids)
        if x.dtype != chain.dtype or x.shape != chain.shape or not x.is_contiguous():
            return None
    elif not 0 <= token < chain.embedding.shape[0]:
        return None
    tables = chain.rotary_at(rotary, position) if chain.static_rotary and not chain.call_rotary else None
    if tables is None:
        if position_ids is None:
            position_ids = torch.tensor([[position]])
        like = x if x is not None else torch.empty(chain.shape, dtype=chain.dtype)
        cos, sin = map(chain.tables, rotary(like, position_ids=position_ids))
        if (cos.shape, cos.dtype) != chain.table or sin.shape != cos.shape:
            return None
        if not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        tables = (cos.data_ptr(), sin.data_ptr())  # (cos and sin live to the end of the call)
    locks = chain.locks
    for i, lock in enumerate(locks):
        if not lock.acquire(blocking=False):
            for held in locks[:i]:
                held.release()
            return None
    return _chain_run(chain, token, x, *tables, rows, norm, head)


def _plain_embedding(embed: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The weight of ``embed`` when its forward is `nn.Embedding`'s own (a row of the weight per token) and
    its rows are ``x``'s: the chain copies the row itself."""
    if type(embed) is not nn.Embedding or "forward" in embed.__dict__ or embed.max_norm is not None:
        return None
    w = embed.weight
    fits = w.dim() == 2 and w.dtype == x.dtype and w.stride(1) == 1 and w.shape[1] == x.shape[-1]
    return w if fits and x.shape[:2] == (1, 1) else None


def _cache_rows(chain: _Chain, cache: Any) -> list | None:
    """Per layer (cache layer, keys buffer, values buffer, positions held) where the chain's programs write
    this step's row (`kv_cache.room`, which moves a full layer to larger buffers), or None."""
    from transformers.cache_utils import DynamicCache

    if type(cache) is not DynamicCache:
        return None
    layers = cache.layers
    if len(layers) <= max(chain.cache_at):
        return None
    rows = []
    for at, window in zip(chain.cache_at, chain.windows):
        layer = layers[at]
        room = layer.__dict__.get("_kernelize_room")  # (perf) `room`'s checks, the common case inline
        if room is None or room[2] is not layer.keys or room[3] is not layer.values:
            return None
        held = room[2].shape[2]
        if room[0].shape[2] > held:
            row = (layer, room[0], room[1], held)
        else:
            row = kv_cache.room(cache, at, 1)
            if row is None:
                return None
        if window is not None and held + 2 > window:
            return None
        if not kv_cache.holds(layer, held + 1):  # a sliding window's cache layer about to drop a position
            return None
        rows.append(row)
    return rows


def _chain_run(chain: _Chain, token: int, x, cos: int, sin: int, rows: list, norm, head) -> torch.Tensor:
    """Run the chain (every lock in ``chain.locks`` held: released here) on the token (its embedding row,
    or ``x``, the embedding's output) with the rotary tables at ``cos`` / ``sin``; the cache layers show
    the new row. Returns the logits."""
    try:
        values = chain.template.copy()
        hidden = torch.empty(chain.shape, dtype=chain.dtype)
        logits = (
            None if chain.n_out is None else torch.empty((*chain.shape[:-1], chain.n_out), dtype=chain.dtype)
        )
        h0, at_cos, at_sin, at_hidden, at_logits, at_row = chain.at
        values[at_cos], values[at_sin], values[at_hidden] = cos, sin, hidden.data_ptr()
        if logits is not None:
            values[at_logits] = logits.data_ptr()
        if chain.embedding is None:
            values[h0] = x.data_ptr()
        elif x is not None:  # the module's output (a call that ran it: hooks, the slow path) is the row
            values[at_row] = x.data_ptr()
        else:
            embedding = chain.embedding
            values[at_row] = embedding.data_ptr() + token * embedding.stride(0) * embedding.element_size()
        width = chain.width
        for start, (_, kbuf, vbuf, held) in zip(chain.starts, rows):
            row = decode_step.row_values(kbuf, vbuf, held) + decode_step.buffer_values(kbuf, vbuf)
            values[start : start + width] = row
        chain.program.run_values(values)
    finally:
        for lock in chain.locks:
            lock.release()
    for layer, kbuf, vbuf, held in rows:
        kv_cache.advance(layer, kbuf, vbuf, held + 1)
    return logits if logits is not None else head(norm(hidden))


class _Tail:
    """The final norm and a packed LM head as one replayed call (slots `x`, `logits`)."""

    __slots__ = ("dtype", "forwards", "lock", "n_out", "program", "sources")

    def __init__(self, program: Program, sources: tuple, dtype: torch.dtype, forwards: tuple, n_out: int):
        self.program, self.sources, self.n_out = program, sources, n_out
        # what it was built for: x's dtype, the forwards installed on the norm and the head
        self.dtype, self.forwards = dtype, forwards
        self.lock = threading.Lock()


def _tail_of(norm: nn.Module, head: nn.Module, x: torch.Tensor) -> _Tail | None:
    """The norm and head's replayed call for ``x`` (built or checked again), or None: their module calls
    run them (a float head, or hooks on either)."""
    built = head.__dict__.get("_kernelize_decode_tail")
    forwards = (_installed(norm), _installed(head))
    if built is None or (
        not isinstance(built, str)
        and (built.dtype != x.dtype or built.forwards != forwards or not decode_step._unchanged(built))
    ):
        built = head.__dict__["_kernelize_decode_tail"] = _build_tail(norm, head, x, forwards)
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (norm, head))  # their calls run them
    return None if isinstance(built, str) or hooked else built


def _tail(norm: nn.Module, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`head(norm(x))`: one call where the norm is a kernel layer's and the head a packed few-row product
    (their Python took ~0.2 ms of a q4_0 token), else the modules' calls."""
    built = _tail_of(norm, head, x)
    if built is None or not built.lock.acquire(blocking=False):
        return head(norm(x))
    try:
        logits = torch.empty((*x.shape[:-1], built.n_out), dtype=x.dtype)
        built.program.run(x=x.data_ptr(), logits=logits.data_ptr())
    finally:
        built.lock.release()
    return logits


def _build_tail(norm: nn.Module, head: nn.Module, x: torch.Tensor, forwards: tuple) -> _Tail | str:
    from kernelize.quant.module import QuantizedLinear
    from kernelize.quant.ops import FewRows

    from .block import _hubs, norm_math, norm_style_of

    if not isinstance(head, QuantizedLinear) or not FewRows.takes(head.packed, head.bias):
        return "the LM head is not a packed few-row product"
    norms = _hubs()[0]
    style = norm_style_of(norm)
    if style is None:
        return "the final norm does not run an RMSNorm or LayerNorm kernel layer"
    prog = Program()
    try:
        params = norms.norm_params(style, norm)
        (h,) = decode_step._graph(
            prog, norm, norm_math, [x], params, {0: "x"}, norm=style, eps=norms.eps_of(norm)
        )
    except decode_step._NotFixed as e:
        return str(e)
    call = FewRows(head.packed, head.bias)
    c_call = call.c_call(h, torch.empty((*h.shape[:-1], call.n_out), dtype=h.dtype))
    if c_call is None:
        return "the LM head's product has no C call"
    prog.add(c_call, threads_at=FewRows.THREADS_ARG, logits=FewRows.OUT_ARG)
    sources = decode_step._sources(nn.ModuleList([norm, head]))
    prog.hold(*sources[1])
    return _Tail(prog, sources, x.dtype, forwards, call.n_out)


def _output(output_type: type, logits: torch.Tensor, cache: Any) -> Any:
    """The model's own output type (as the checked step returned it) with the logits and the cache (named
    `cache` since transformers 5.24)."""
    return output_type(logits=logits, **{_cache_field(output_type): cache})


@functools.cache
def _cache_field(output_type: type) -> str:
    return "cache" if "cache" in {f.name for f in dataclasses.fields(output_type)} else "past_key_values"


__all__ = ["model_step"]
