"""A decoder layer's decode step as one replayed call: every kernel of the block, the cache write and the
attention, from C, with no Python between them (issue #33 item 6). Llama-style blocks (`block.py`: dense,
packed, MoE) and GPT-2's (`fused_qkv.py`) take it.

Decoding one token, the block's Python (looking up each graph, binding its shapes, allocating its outputs,
the cache bookkeeping, a ctypes call per kernel) took about as long as its packed q4_0 kernels on a small
model. Here a layer's first decode step builds a :class:`~kernelize.runtime.replay.Program`: the C calls of
its graphs (:meth:`~kernelize.runtime.compiled.CompiledGraph.fixed_call`), of its packed projections
(:meth:`~kernelize.quant.ops.FewRows.c_call`) and of the attention kernel, with the buffers between them
held by the program. Each step after that writes the few values that change into the program (the input's
and output's addresses, the rotary tables', the cache's buffers and the row the new key and value go to,
the key length) and makes one ``kz_replay`` call; transformers' cache object then shows the new position, as
:func:`kernelize.kv_cache.update` leaves it.

It runs the same kernels on the same values as the block's Python path, so the outputs are bit for bit the
same. An MoE block's router graph and experts kernel join the program when a probe shows they are all the
block computes (Qwen3-MoE, Mixtral); another MLP that runs its own forward (a shared expert, a router that
is not a graph) runs it on the program's output, then the residual, as the Python path does. A step that
is not a plain decode step (more than one token, a mask, a cache layer `kv_cache` does not append to in
place, hooks, training: anything the Python path handles differently) goes the Python way; so does a layer
whose graphs are not all generated C kernels (the reason is kept on the layer and logged at debug level:
the same kernels run, with Python between them). A changed weight (another tensor, or the same one moved)
builds the program again; a new cache, or a full one moved to a larger buffer, does not.
``KERNELIZE_DECODE_REPLAY=0`` turns it off.

Example:
    >>> out = replayed(layer, block, hidden, position_embeddings, None, cache, {})  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import operator
import os
import threading
from typing import Any

import torch
from torch import nn

from kernelize import kv_cache
from kernelize.hub import backend_for, entry_for, note_kernels, note_ran
from kernelize.model_attention import _REFERENCE, call_fallback_reason
from kernelize.runtime.replay import Program, copy_rows_call

from .block import (
    Block,
    _hooked,
    _norm_params,
    _packed_calls,
    _weights,
    after_mlp_math,
    mlp_math,
    norm_math,
    own_mlp,
    post_attention_math,
    post_weights,
    pre_attention_math,
    pre_weights,
    residual_norm_math,
    rotary_tables,
    rotate_math,
    rotate_params,
)

logger = logging.getLogger(__name__)
ENABLED = os.environ.get("KERNELIZE_DECODE_REPLAY", "1") != "0"


class _Step:
    """A layer's built program (slots: `x`, `cos`, `sin`, `out`, `residual`, :data:`ROW_SLOTS`,
    :data:`BUFFER_SLOTS`) and what it was built from."""

    __slots__ = ("lock", "moe", "outputs", "program", "sources", "window")

    def __init__(self, program: Program, sources: tuple, outputs: int, moe: bool, window) -> None:
        self.program, self.sources = program, sources
        # 1: the layer's output; 2: h and the residual before an MoE block's own MLP
        self.outputs = outputs
        # the program runs the MoE block's router and experts (hooks on them send a step Python's way)
        self.moe = moe
        # the sliding window, which cuts nothing while the keys fit in it (then the attention call is the
        # Python path's; past it, steps go Python's way)
        self.window = window
        self.lock = threading.Lock()  # a program's buffers serve one call at a time (another thread: Python)


def replayed(
    layer: nn.Module,
    block: Block,
    x: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any,
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The layer's output for one decode token ``x`` ``[1, 1, hidden]`` through its program, or None: the
    block's Python path runs this step (module docstring)."""
    if block.attn_shards is not None or block.mlp_shards is not None:
        return None
    cos, sin = rotary_tables(layer.self_attn, *position_embeddings)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    ran = _replay(layer, layer.self_attn, block, x, (cos, sin), attention_mask, cache, kwargs, _build_llama)
    if ran is None:
        return None
    step, out, residual = ran
    if not block.own_mlp or step.moe:
        return out
    return own_mlp(layer, block, out, residual)  # on the program's h, as `run_block` runs it


def replayed_fused_qkv(
    layer: nn.Module, block: Any, x: torch.Tensor, attention_mask: torch.Tensor | None, cache: Any, kwargs
) -> torch.Tensor | None:
    """GPT-2's decoder layer (`fused_qkv.run_dense_block`'s three graphs around the cache write and the
    attention) for one decode token through its program, or None (the Python path runs this step)."""
    cache = getattr(cache, "self_attention_cache", cache)  # an EncoderDecoderCache's own half
    ran = _replay(layer, layer.attn, block, x, (), attention_mask, cache, kwargs, _build_fused_qkv)
    return None if ran is None else ran[1]


def _replay(layer, attn, block, x, tables, attention_mask, cache, kwargs, build) -> tuple | None:
    """Run the layer's program (built by ``build(prog, layer, block, x, tables, kbuf, vbuf, held)`` when
    needed) for this step: ``(step, output, residual)``, or None when the step goes the Python way."""
    ready = prepare(layer, attn, block, x, tables, attention_mask, cache, kwargs, build)
    return None if ready is None else execute(ready, x, tables)


def prepare(
    layer, attn, block, x, tables, attention_mask, cache, kwargs, build, margin: int = 0
) -> tuple | None:
    """What :func:`execute` needs to run the layer's program for this step (the program's lock taken), or
    None: the step goes the Python way. ``margin``: positions the keys must stay clear of a sliding window
    by (a caller that passes no mask and so must know the model would build none)."""
    if not ENABLED or cache is None or attention_mask is not None or x.shape[:2] != (1, 1) or not x.is_cpu:
        return None
    if _REFERENCE.get() or call_fallback_reason(attn, x, x, 0.0, kwargs) is not None or not x.is_contiguous():
        return None
    if kwargs.get("alibi") is not None or kwargs.get("s_aux") is not None:  # score terms the program lacks
        return None
    where = kv_cache.room(cache, attn.layer_idx, 1)
    if where is None:
        return None
    cache_layer, kbuf, vbuf, held = where
    shapes = tuple((t.shape, t.dtype) for t in tables)
    key = (block, x.dtype, shapes, buffer_kind(kbuf), buffer_kind(vbuf))
    built = layer.__dict__.get("_kernelize_decode_step")
    if built is None or built[0] != key or not _unchanged(built[1]):
        step = _build(layer, attn, block, x, tables, kbuf, vbuf, held, build)
        if isinstance(step, str):  # not a fallback: the same kernels run, with Python between them
            logger.debug("decode steps of %s run the block's Python path: %s", type(layer).__name__, step)
        built = layer.__dict__["_kernelize_decode_step"] = (key, step)
    step = built[1]
    if isinstance(step, str) or (step.window is not None and held + 1 + margin > step.window):
        return None
    if step.moe and _hooked(layer.mlp, ("gate", "experts")) is not None:
        return None
    if not step.lock.acquire(blocking=False):
        return None
    return step, cache_layer, kbuf, vbuf, held


def release(ready: tuple) -> None:
    """Give back the lock of a :func:`prepare` d step that will not run."""
    ready[0].lock.release()


def execute(ready: tuple, x: torch.Tensor, tables: tuple) -> tuple:
    """Run a :func:`prepare` d step on ``x``: ``(step, output, residual)``; the cache shows the new row."""
    step, cache_layer, kbuf, vbuf, held = ready
    try:
        out = torch.empty_like(x)
        residual = torch.empty_like(x) if step.outputs == 2 else out
        cos, sin = tables or (x, x)  # (no rotary tables: slots no call reads)
        step.program.run(
            x=x.data_ptr(),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            out=out.data_ptr(),
            residual=residual.data_ptr(),
            **dict(zip(ROW_SLOTS, row_values(kbuf, vbuf, held))),
            **dict(zip(BUFFER_SLOTS, buffer_values(kbuf, vbuf))),
        )
    finally:
        step.lock.release()
    kv_cache.advance(cache_layer, kbuf, vbuf, held + 1)
    return step, out, residual


# the slots of the cache's buffers (their addresses; the strides of the batch and heads axes, in elements
# for the attention and in bytes for the row copy), written per run: a step's program serves any buffers of
# the same kind (`buffer_kind`), so a new cache or a grown one builds nothing
BUFFER_SLOTS = ("kbase", "vbase", "kst0", "kst1", "vst0", "vst1", "krows", "vrows")
ROW_SLOTS = ("key", "value", "keylen")  # where this step's key and value go, and the key length after it


def buffer_kind(buf: torch.Tensor) -> tuple:
    """What a program reads of a cache buffer besides the slots: dtype, batch, heads, head size and the
    strides of the positions and of the head size."""
    return buf.dtype, buf.shape[0], buf.shape[1], buf.shape[3], buf.stride(2), buf.stride(3)


def buffer_values(kbuf: torch.Tensor, vbuf: torch.Tensor) -> tuple[int, ...]:
    """The values of :data:`BUFFER_SLOTS` for these buffers."""
    ks, vs = kbuf.stride(), vbuf.stride()
    return (
        kbuf.data_ptr(), vbuf.data_ptr(), ks[0], ks[1], vs[0], vs[1],
        ks[1] * kbuf.element_size(), vs[1] * vbuf.element_size(),
    )  # fmt: skip


def row_values(kbuf: torch.Tensor, vbuf: torch.Tensor, held: int) -> tuple[int, int, int]:
    """The values of :data:`ROW_SLOTS` for a step after ``held`` positions."""
    return (
        kbuf.data_ptr() + held * kbuf.stride(2) * kbuf.element_size(),
        vbuf.data_ptr() + held * vbuf.stride(2) * vbuf.element_size(),
        held + 1,
    )


def _sources(layer: nn.Module) -> tuple[tuple, tuple[torch.Tensor, ...], list[int]]:
    """What the layer's program was built from: every submodule, parameter and buffer in its place (the
    dicts, the names and the objects, as three tuples), and the parameters' and buffers' addresses (cheap
    to check per step; a replaced or moved one, as `load_state_dict` into new tensors or `set_packed` leaves
    it, builds the program again)."""
    places, tensors = [], []
    for mod in layer.modules():
        places += [(mod._modules, name, child) for name, child in mod._modules.items()]
        for d in (mod._parameters, mod._buffers):
            places += [(d, name, t) for name, t in d.items() if t is not None]
            tensors += [t for t in d.values() if t is not None]
    return tuple(zip(*places)) or ((), (), ()), tuple(tensors), [t.data_ptr() for t in tensors]


def _unchanged(step: _Step | str) -> bool:
    if isinstance(step, str):
        return True
    (dicts, names, objects), tensors, addresses = step.sources
    # (perf) loops in C: per layer and step this ran ~20 us as generator expressions
    return all(map(operator.is_, map(dict.get, dicts, names), objects)) and (
        list(map(torch.Tensor.data_ptr, tensors)) == addresses
    )


def _graph(prog: Program, owner: nn.Module, fn, inputs: list, weights: list, names: dict[int, str], **params):
    """Append the graph ``fn`` on ``inputs`` (+ ``weights``) to ``prog``; ``names``: input index -> the slot
    its address comes from per run. Returns its outputs (the program's buffers), or raises _NotFixed."""
    tensors = [*inputs, *weights]
    entry = entry_for(fn, tensors, len(inputs), params, backend_for(tensors[0].device))
    fixed = entry.compiled.fixed_call(tensors, tuple(names))
    if fixed is None:
        raise _NotFixed(f"`{fn.__name__}` is not all generated kernels with C calls at these sizes")
    note_ran(owner, entry)
    prog.add_graph(fixed, names)
    prog.hold(*weights)  # merged weights live in a cache the layer may drop
    return fixed.outputs


class _NotFixed(Exception):
    """A piece of the step that a program cannot make (the message says which)."""


def _build(layer, attn, block, x, tables, kbuf, vbuf, held, build) -> _Step | str:
    """The layer's program for decode steps like this one, or why it has none."""
    from .layers import sliding_window_of

    sources = _sources(layer)
    try:
        prog = Program()
        outs, moe = build(prog, layer, block, x, tables, kbuf, vbuf, held)
        for out, slot in zip(outs, ("out", "residual")):  # into the step's own tensors
            final = copy_rows_call(out, torch.empty_like(x))
            if final is None:
                raise _NotFixed("the layer's output is not a dense row")
            prog.add(final, threads_at=-1, **{slot: 1})
        prog.hold(*sources[1])  # the weights the calls read in place
        return _Step(prog, sources, len(outs), moe, sliding_window_of(attn))
    except _NotFixed as e:
        return str(e)


def _build_llama(prog, layer, block, x, tables, kbuf, vbuf, held):
    """`block.run_block`'s steps: packed (`_packed`) or dense (`_dense`)."""
    cos, sin = tables
    return (_packed if block.packed is not None else _dense)(
        prog, layer, block, x, cos, sin, kbuf, vbuf, held
    )


def _build_fused_qkv(prog, layer, block, x, tables, kbuf, vbuf, held):
    """`fused_qkv.run_dense_block`'s steps: [ln_1] -> c_attn -> q, k, v; the cache row and attention;
    c_proj + residual -> ln_2; c_fc -> act -> c_proj + residual."""
    from .fused_qkv import dense_graphs, dense_mlp_math, dense_post_math, dense_pre_math

    graphs = dense_graphs(layer, block)
    if graphs is None:
        raise _NotFixed("a projection's weight cannot be read as (out, in)")
    (pre_w, pre), (post_w, post), (mlp_w, flags) = graphs
    q, k, v = _graph(prog, layer.attn, dense_pre_math, [x], pre_w, {0: "x"}, **pre)
    out = _attention(prog, layer.attn, q, k, v, kbuf, vbuf, held)
    normed, h = _graph(prog, layer, dense_post_math, [out, x], post_w, {1: "x"}, **post)
    return _graph(prog, layer.mlp, dense_mlp_math, [normed, h], mlp_w, {}, **flags), False


def _attention(prog: Program, attn: nn.Module, q, k, v, kbuf, vbuf, held) -> torch.Tensor:
    """The new key and value copied into the cache's row (slots `key`, `value`), then attention over the
    cache (the key length: slot `keylen`): its output ``[1, 1, heads * head_dim]``."""
    from kernelize.attention import AttentionUnsupported, _launcher
    from kernelize.ir.ops import AttentionArgs

    if getattr(attn, "attn_logit_softcapping", None) is not None:
        raise _NotFixed("soft-capped attention")
    if isinstance(getattr(attn, "sinks", None), torch.Tensor):
        raise _NotFixed("attention sinks")
    for new, buf, slot, rows in ((k, kbuf, "key", "krows"), (v, vbuf, "value", "vrows")):
        call = copy_rows_call(new, buf[:, :, held : held + 1])
        if call is None:
            raise _NotFixed("a key or value the cache row cannot take as rows")
        prog.add(call, threads_at=-1, **{slot: 1, rows: 5})  # kz_copy_rows(src, dst, .., dst row stride)
    keys, values = kbuf[:, :, : held + 1], vbuf[:, :, : held + 1]
    hq, hkv = q.shape[1], keys.shape[1]
    scale = attn.scaling if getattr(attn, "scaling", None) is not None else 1.0 / math.sqrt(q.shape[3])
    args = AttentionArgs(scale=float(scale), causal=False, mask="none", groups=hq // hkv)
    try:
        launch, record = _launcher(q, keys, values, None, args)
    except AttentionUnsupported as e:
        raise _NotFixed(f"the attention kernel declined: {e}") from None
    c_call = getattr(launch, "c_call", None)
    if c_call is None:
        raise _NotFixed("the attention kernel has no C call on this backend")
    note_kernels(attn, record)
    out = torch.empty((1, hq, 1, values.shape[3]), dtype=q.dtype)
    call = c_call([q, keys, values], [out])
    # the cache's buffers are not held (a generation's cache is freed with it): their addresses and strides
    # are slots (the strides array: q's, k's, v's, the mask's)
    prog.add(call._replace(keep=call.keep[:2]), kbase=1, vbase=2)
    prog.add_cell(call.keep[0], 4, "keylen")  # the sizes array's key length
    for at, slot in ((4, "kst0"), (5, "kst1"), (8, "vst0"), (9, "vst1")):
        prog.add_cell(call.keep[1], at, slot)
    prog.hold(out)
    return out.view(1, 1, -1)


def _packed(prog, layer, block, x, cos, sin, kbuf, vbuf, held):
    """norm -> packed q|k|v -> rotary -> cache, attention -> packed o_proj -> residual and norms -> packed
    gate|up with its activation -> packed down_proj -> [norm] + residual (`block._run_packed`'s steps)."""
    attn, mlp = layer.self_attn, layer.mlp
    calls = _packed_calls(layer, block)
    if any(c is None for c in calls):
        raise _NotFixed("a packed projection's bias is not the few-row kernel's (f32)")
    weight_of = _norm_params(layer, block)
    pre = block.pre
    h = x
    if pre["norm"] is not None:
        (h,) = _graph(
            prog, layer, norm_math, [x], weight_of["input"], {0: "x"}, norm=pre["norm"], eps=pre["eps"]
        )
    qkv = _project(prog, calls[0], h, h is x)
    qk_w, rotary = rotate_params(attn, pre)
    q, k, v = _graph(prog, attn, rotate_math, [qkv, cos, sin], qk_w, {1: "cos", 2: "sin"}, **rotary)
    o_in = _attention(prog, attn, q, k, v, kbuf, vbuf, held)
    o = _project(prog, calls[1], o_in, False)
    post_w = _weights(weight_of, "post_attn", "pre_ff")
    h = _graph(prog, layer, residual_norm_math, [o, x], post_w, {1: "x"}, **block.post)
    h, residual = (h[0], h[0]) if block.post["norm"] is None else h
    if block.own_mlp:
        return _own_mlp_step(prog, mlp, block, weight_of, h, residual)
    y = _project(prog, calls[3], _project(prog, calls[2], h, False), False)
    return _after_mlp_graph(prog, mlp, block, weight_of, y, residual), False


def _after_mlp_graph(prog: Program, mlp: nn.Module, block: Block, weight_of: dict, y, residual):
    """`[post-MLP norm](y) + residual` (`block._after_mlp`) appended to the program."""
    tail = {"norm": block.mlp["norm"], "eps": block.mlp["eps"]}
    return _graph(prog, mlp, after_mlp_math, [y, residual], _weights(weight_of, "post_ff"), {}, **tail)


def _project(prog: Program, call, x: torch.Tensor, varying: bool) -> torch.Tensor:
    """A packed few-row product of ``x`` into a new buffer of the program (``varying``: x is the step's
    input, slot `x`)."""
    from kernelize.quant.ops import FewRows

    out = torch.empty((*x.shape[:-1], call.n_out), dtype=x.dtype)
    c_call = call.c_call(x, out)
    if c_call is None:
        raise _NotFixed("a packed projection the few-row kernel does not take")
    prog.add(c_call, threads_at=FewRows.THREADS_ARG, **({"x": FewRows.X_ARG} if varying else {}))
    prog.hold(x, out)
    return out


def _dense(prog, layer, block, x, cos, sin, kbuf, vbuf, held):
    """The three graphs of `block.run_block` around the cache write and the attention."""
    from .block import _gate_up
    from .layers import merged_qkv

    attn, mlp = layer.self_attn, layer.mlp
    weight_of = _norm_params(layer, block)
    pre_w, bias = pre_weights(layer, block, weight_of, merged_qkv)
    names = {0: "x", 1: "cos", 2: "sin"}
    q, k, v = _graph(prog, attn, pre_attention_math, [x, cos, sin], pre_w, names, bias=bias, **block.pre)
    out = _attention(prog, attn, q, k, v, kbuf, vbuf, held)
    post_w, bias = post_weights(layer, weight_of)
    h = _graph(prog, layer, post_attention_math, [out, x], post_w, {1: "x"}, bias=bias, **block.post)
    h, residual = (h[0], h[0]) if block.post["norm"] is None else h
    if block.own_mlp:
        return _own_mlp_step(prog, mlp, block, weight_of, h, residual)
    mlp_w = [_gate_up(mlp, block), mlp.down_proj.weight, *_weights(weight_of, "post_ff")]
    return _graph(prog, mlp, mlp_math, [h, residual], mlp_w, {}, **block.mlp), False


def _own_mlp_step(prog: Program, mlp: nn.Module, block: Block, weight_of: dict, h, residual) -> tuple:
    """An MLP of its own after the attention: an MoE block as its router's and experts' calls (`_moe`) and
    the `[norm] + residual` graph, (outputs, True); else (h and the residual, False): the block runs its own
    forward on the program's outputs."""
    y = _moe(prog, mlp, h)
    if y is None:
        return ((h,) if h is residual else (h, residual)), False
    return _after_mlp_graph(prog, mlp, block, weight_of, y, residual), True


def _moe(prog: Program, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """An MoE block's forward as its router graph's calls then the experts kernel's, when a probe shows
    that this is all the block computes (Qwen3-MoE, Mixtral, OLMoE: route, run the experts, reshape; a
    shared expert or a scaling would differ); else None (the block's own forward runs on the program's
    output). Returns the block's output, a buffer of the program."""
    from kernelize.model_experts import EXPERTS_NAME, experts_c_call
    from kernelize.model_router import RouterForward
    from kernelize.quant.experts import QuantizedExperts

    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    router = None if gate is None else gate.__dict__.get("forward")
    config = getattr(experts, "config", None)
    packed = isinstance(experts, QuantizedExperts)  # packed experts: their own kernel call
    if not isinstance(router, RouterForward) or not (
        packed or getattr(config, "_experts_implementation", None) == EXPERTS_NAME
    ):
        return None
    x = h.view(-1, h.shape[-1])
    fixed = router.fixed_call(x)
    if fixed is None or len(fixed.outputs) != 3:
        return None
    _, weights, index = fixed.outputs
    y = torch.empty_like(x)
    calls = (
        experts.c_calls(x, index, weights, y) if packed else [experts_c_call(experts, x, index, weights, y)]
    )
    if calls is None or None in calls:
        return None
    threads_at = QuantizedExperts.THREADS_ARG if packed else None
    probe = Program()
    probe.add_graph(fixed, {})
    for call in calls:
        probe.add(call, threads_at=threads_at)
    with torch.no_grad():
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(0)))
        want = mlp(h.clone())
        probe.run()
    want = want[0] if isinstance(want, tuple) else want
    if not torch.equal(y.view(h.shape), want):
        return None
    prog.add_graph(fixed, {})
    for call in calls:
        prog.add(call, threads_at=threads_at)
    prog.hold(y)
    return y.view(h.shape)


__all__ = ["ENABLED", "replayed", "replayed_fused_qkv"]
