"""The `kernelize` experts function for transformers' `ExpertsInterface`, with its fallback.

transformers' MoE families keep their experts in one module (`Qwen3MoeExperts`, `MixtralExperts`, ...:
`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, `act_fn`) decorated with `use_experts_implementation`,
whose forward dispatches on `config._experts_implementation`. `experts_forward(module, hidden_states,
top_k_index, top_k_weights)` is the implementation `kernelize`: the generated grouped-expert kernel
(`kernelize.experts.grouped_experts`). It serves every family whose experts module has the default layout
(concatenated gate|up rows, not transposed, no biases, no post-expert norm, the default gate
`act(gate) * up`) and an activation it recognises by probing `act_fn` against the IR's formulas.

A module or a call the kernel does not support runs the implementation the model had before (`grouped_mm`
by default, with its backward), and the reason is noted on the module for `kernelize.inspect`. Calls that
need gradients take that implementation too: the kernel has no backward. This module imports neither
transformers nor the kernel at import time.

Example:
    >>> from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # doctest: +SKIP
    >>> ALL_EXPERTS_FUNCTIONS.register("kernelize", experts_forward)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kernelize.ir.ops import EXPERT_ACTIVATIONS
from kernelize.layer.mode import Mode
from kernelize.layer.record import FallbackReason, KernelChoice, record_choice, recorded_choice
from kernelize.model_attention import note_fallback

__all__ = [
    "EXPERTS_LAYER",
    "EXPERTS_NAME",
    "Routing",
    "experts_activation",
    "experts_blocker",
    "experts_forward",
    "experts_modules",
    "keep_experts",
    "packed_experts",
    "register_experts",
    "use_experts_function",
]

EXPERTS_NAME = "kernelize"  # the name in transformers' ExpertsInterface
# the implementation a module falls back to, per module (the model's own choice before the switch)
_FALLBACK: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# the layout flags `use_experts_implementation` sets, with the value the kernel takes (transposed weights
# are read through strides, biases are operands, interleaved rows and own gates are probed: see gate_form)
_LAYOUT = {
    "has_post_expert_norm": (False, "a norm after each expert"),
}
# attribute names of the clamp limit and the sigmoid scale of the clamped SwiGLU gates (gpt-oss, MiniMax,
# DeepSeek-V4, HY-V4, Step-3): the probe tries the gate forms these values allow
_LIMITS = ("limit", "swiglu_limit")
_ALPHAS = ("alpha", "swiglu_alpha")


def register_experts() -> None:
    """Register `kernelize` with transformers' ExpertsInterface."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, experts_forward)


def experts_activation(act_fn: Any) -> str | None:
    """The IR activation `act_fn` computes (probed on a fixed grid of values, f32), or None."""
    if not callable(act_fn):
        return None
    return _activation_of(act_fn)


@functools.lru_cache(maxsize=64)
def _activation_of(act_fn: Any) -> str | None:
    from kernelize.ir.experts import ACTIVATIONS

    grid = torch.linspace(-8, 8, 257)
    try:
        with torch.no_grad():
            got = act_fn(grid)
    except Exception:  # an activation that does not take a plain tensor
        return None
    for name, fn in ACTIVATIONS.items():
        if (
            isinstance(got, torch.Tensor)
            and got.shape == grid.shape
            and torch.allclose(got, fn(grid), atol=1e-6)
        ):
            return name
    return None


def experts_blocker(module: torch.nn.Module) -> str | None:
    """Why the grouped-expert kernel cannot stand in for this experts module (None: it can)."""
    from transformers.integrations.moe import _default_apply_gate

    for flag, (want, what) in _LAYOUT.items():
        if getattr(module, flag, want) != want:
            return f"{what} ({flag}={not want}) are not in the grouped-expert kernel"
    gated = getattr(module, "has_gate", True)
    up = getattr(module, "gate_up_proj" if gated else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if (
        not isinstance(up, torch.Tensor)
        or not isinstance(down, torch.Tensor)
        or up.dim() != 3
        or down.dim() != 3
    ):
        return "no 3-D gate_up_proj / up_proj and down_proj weights"
    own_gate = gated and getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate
    if own_gate and gate_form(module) is None:
        return (
            f"{type(module).__name__} has its own gate (_apply_gate) that matches none of the kernel's forms "
            "(act(g) * u with optional clamps, sigmoid scale and up shift, concatenated or interleaved)"
        )
    if not own_gate and experts_activation(getattr(module, "act_fn", None)) is None:
        act = type(getattr(module, "act_fn", None)).__name__
        return f"activation {act} is not one of the kernel's {EXPERT_ACTIVATIONS}"
    return None


def _numbers(module: torch.nn.Module, names: tuple[str, ...]) -> set[float]:
    values = (getattr(module, n, None) for n in names)
    return {float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)}


def gate_form(module: torch.nn.Module) -> dict | None:
    """The ``ExpertsArgs`` fields (act, interleaved, the gate form) that reproduce a gated experts module's
    ``_apply_gate``, found by probing it on values that cross every clamp (f32); None: no form matches."""
    import itertools

    from kernelize.ir.experts import split_gate
    from kernelize.ir.ops import ExpertsArgs

    act = experts_activation(getattr(module, "act_fn", None))
    limits, alphas = _numbers(module, _LIMITS), _numbers(module, _ALPHAS) | {1.0}
    span = 2 * max(limits, default=0.0) + 8
    gen = torch.Generator().manual_seed(0)
    probe = (torch.rand(64, 2 * 12, generator=gen) * 2 - 1) * span
    try:
        with torch.no_grad():
            want = module._apply_gate(probe.clone())
    except Exception:  # a gate that wants other inputs
        return None
    options = [None, *sorted(limits)]
    for interleaved, alpha, gl, al, ul, shift in itertools.product(
        (False, True), sorted(alphas), options, options, options, (0.0, 1.0)
    ):
        try:
            form = dict(interleaved=interleaved, alpha=alpha, gate_limit=gl, act_limit=al, up_limit=ul)
            args = ExpertsArgs(act or "silu", True, up_shift=shift, **form)
        except ValueError:  # alpha with another activation
            continue
        got = split_gate(probe, args)
        if got.shape == want.shape and torch.allclose(got, want.float(), rtol=1e-6, atol=1e-6):
            return {"act": args.act, "up_shift": shift, **form}
    return None


def experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers experts implementation `kernelize`: the grouped-expert kernel, or the model's previous
    implementation with the reason noted."""
    from kernelize.experts import ExpertsUnsupported, grouped_experts

    plan = _PLANS.get(module)
    if plan is None:  # the module's structure decides once: (why not, the kernel's keywords)
        reason = experts_blocker(module)
        plan = _PLANS[module] = (reason, None if reason else kernel_keywords(module))
    reason, keywords = plan
    fallback = _FALLBACK.get(module, "grouped_mm")
    if reason is None:
        up, down, biases = experts_operands(module, keywords["gated"])
        if _library_wins(hidden_states, top_k_index, fallback, down):
            return fallback_forward(module, fallback)(module, hidden_states, top_k_index, top_k_weights)
        if torch.is_grad_enabled() and (hidden_states.requires_grad or up.requires_grad):
            reason = "the call needs gradients; the grouped-expert kernel has no backward"
    if reason is None:
        try:
            return grouped_experts(
                hidden_states, top_k_index, top_k_weights, up, down, **biases, owner=module, **keywords
            )
        except ExpertsUnsupported as exc:
            reason = f"the experts kernel declined the call: {exc}"
    note_fallback(module, reason, f"{fallback} experts")
    return fallback_forward(module, fallback)(module, hidden_states, top_k_index, top_k_weights)


def experts_c_call(
    module: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
):
    """The C call ``experts_forward(module, x, index, weights)`` makes for these tensors, writing ``out``
    (a :class:`~kernelize.runtime.backend.CCall` for a replay program), or None where that call would not
    be one generated kernel's (the model's implementation, the many-pair path, another backend)."""
    from kernelize.experts import ExpertsUnsupported, experts_launcher_for

    plan = _PLANS.get(module)
    fallback = _FALLBACK.get(module, "grouped_mm")
    if plan is None or plan[0] is not None:
        return None
    keywords = dict(plan[1])
    act, gated = keywords.pop("act", "silu"), keywords.pop("gated")
    up, down, biases = experts_operands(module, gated)
    if _library_wins(x, index, fallback, down):
        return None
    ops = (x, index, weights, up, down, *((biases["up_bias"], biases["down_bias"]) if biases else ()))
    try:
        launch, _ = experts_launcher_for(ops, act, gated, keywords)
    except ExpertsUnsupported:
        return None
    c_call = getattr(launch, "c_call", None)
    return None if c_call is None else c_call(list(ops), [out])


def _library_wins(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, fallback: str, down: torch.Tensor
) -> bool:
    """Whether a call runs the model's previous implementation by choice: on the CPU past a few tokens, in
    f32 where `KERNELIZE_CPU_GEMM` names a library for the GEMMs (elsewhere the generated tiles run the
    kernel's transposed GEMM path, `_tiles`, and it wins: one Qwen3-MoE layer's experts at 512 tokens, AVX2,
    73-85 against 92-134 ms; AVX-512 Xeon 48 against 60),
    and in bf16 where the CPU has native bf16 dot products (AVX512-BF16 or AMX) unless the kernel's products
    run on AMX tiles (`cpu_experts.amx_products`: one layer's experts at 512 tokens, 14.6 against 26.2 ms
    for `grouped_mm`). There the kernel's
    many-pair path (library GEMMs per expert, past `FEW_PAIRS` routed pairs) measured slower than, or level
    with, `grouped_mm` (Qwen3-MoE layout, one layer's experts, 2 threads, AVX-512 EPYC with AVX512-BF16:
    bf16 at 24 tokens 21.4 against 11.2 ms, f32 29.1 against 28.1), while its few-pair path wins up to
    its limit (16 tokens, top-4: bf16 5.7 against 11.1 ms, f32 10.1 against 29.5). On a CPU without native
    bf16 the kernel's bf16 path wins at every size (`grouped_mm`'s bf16 GEMMs convert every element: whole
    model, prefill 512, AVX2 EPYC, 893 against 3,040 ms). The bound is in tokens, the one call's probe
    forward (2 x 8 tokens), so that the probe checks the kernel's path."""
    cpu = hidden_states.device.type == "cpu"
    if fallback == EXPERTS_NAME or not cpu or top_k_index.shape[0] <= LIBRARY_TOKENS:
        return False
    if hidden_states.dtype == torch.float32:
        return not _tiles()
    from kernelize.codegen.cpu_experts import amx_products

    amx = amx_products(hidden_states.dtype, hidden_states.shape[-1], down.shape[-1])
    return hidden_states.dtype == torch.bfloat16 and _native_bf16() and not amx


def _tiles() -> bool:
    """The generated GEMM tiles run the experts' f32 GEMMs (`cpu_gemv.tiles_take`: unless
    `KERNELIZE_CPU_GEMM` names a library): the kernel's many-pair path then runs them transposed, over the
    weights as stored (`cpu_experts.call_path`)."""
    from kernelize.codegen.cpu_gemv import tiles_take

    return tiles_take(True, 0)


def _native_bf16() -> bool:
    """The CPU has the bf16 dot-product instructions that make torch's bf16 GEMMs fast (the generated
    matmuls' own test, `cpu_gemv.lowp_gemm_in_f32`, with its `KERNELIZE_CPU_LOWP_GEMM` override)."""
    from kernelize.codegen.cpu_gemv import lowp_gemm_in_f32
    from kernelize.ir.dtypes import DType

    return not lowp_gemm_in_f32(DType.BF16)


LIBRARY_TOKENS = 16  # calls of more tokens than this run the model's previous implementation (see above)


def kernel_keywords(module: torch.nn.Module) -> dict:
    """`grouped_experts`' act, gated and gate form for a module `experts_blocker` passed."""
    from transformers.integrations.moe import _default_apply_gate

    gated = getattr(module, "has_gate", True)
    if gated and getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return {"gated": True, **gate_form(module)}
    return {"act": experts_activation(module.act_fn), "gated": gated}


def _rows_contiguous(module: torch.nn.Module) -> None:
    """Store a transposed module's weights ([E, H, N] and [E, I, H]) with unit stride along H and I, the
    axis the kernel reads: the same tensors (values, shapes, state_dict), laid out once as the kernel's
    [E, N, H] and [E, H, I] (the previous storage is freed; kernelize_model trims the heap after)."""
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        p = getattr(module, name, None)
        if isinstance(p, torch.Tensor) and p.dim() == 3 and p.stride(1) != 1:
            with torch.no_grad():
                p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)


def experts_operands(module: torch.nn.Module, gated: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The module's up [E, N, H] and down [E, H, I] weights (views of transposed ones) and its biases."""
    up, down = module.gate_up_proj if gated else module.up_proj, module.down_proj
    if getattr(module, "is_transposed", False):
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    if not getattr(module, "has_bias", False):
        return up, down, {}
    up_bias = module.gate_up_proj_bias if gated else module.up_proj_bias
    return up, down, {"up_bias": up_bias, "down_bias": module.down_proj_bias}


# per experts module: (why the kernel cannot serve it or None, the kernel's keywords), decided on first use
_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def fallback_forward(module: torch.nn.Module, implementation: str):
    """The forward of experts implementation `implementation` for this module (`eager`: its own)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    own = getattr(type(module).forward, "__wrapped__", type(module).forward)
    if implementation == EXPERTS_NAME:
        return own
    return ALL_EXPERTS_FUNCTIONS.get(implementation, own)


def set_fallback(module: torch.nn.Module, implementation: str) -> None:
    """Remember the implementation `module` runs when the kernel cannot (the model's before the switch)."""
    _FALLBACK[module] = implementation


EXPERTS_LAYER = "Experts"  # the layer name `inspect` lists the experts modules under


def keep_experts(module: torch.nn.Module, reason: str) -> None:
    """Record that `module` runs its previous implementation after all (the whole model's output differed)."""
    choice = recorded_choice(module)
    if choice is not None and choice.uses_kernel:
        record_choice(module, dataclasses.replace(choice, fallback=FallbackReason.VERIFY, reason=reason))


def experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """path -> module, for each experts module decorated with transformers' `use_experts_implementation`."""
    return {
        path: m
        for path, m in model.named_modules()
        if hasattr(type(m), "_apply_gate") and hasattr(m, "is_concatenated") and hasattr(m, "has_gate")
    }


def use_experts_function(model: torch.nn.Module, mode: Mode, device: Any = None) -> tuple[str, str | None]:
    """Switch `model` to the `kernelize` experts implementation where its experts modules allow it, recording
    each module's outcome for `kernelize.inspect`. Returns (what happened, the implementation before the
    switch or None when nothing was switched)."""

    found = experts_modules(model)
    packed = _record_packed(model, mode, device)
    if not found:
        return ("no experts modules" if not packed else f"{packed} packed experts modules"), None
    previous = getattr(getattr(model, "config", None), "_experts_implementation", None) or "grouped_mm"
    setter = getattr(model, "set_experts_implementation", None)
    why = None if setter is not None else "not a transformers PreTrainedModel"
    if mode & (Mode.TRAINING | Mode.TORCH_COMPILE):
        why = f"the grouped-expert kernel has no backward and is not traceable: {mode} keeps `{previous}`"
    if device is None:
        device = next((p.device.type for p in model.parameters()), None)
    why = why or _gpu_blocker(device, previous)
    served = 0
    for path, module in found.items():
        _PLANS.pop(module, None)  # decided afresh on the next call
        blocker = why or experts_blocker(module)
        record_choice(
            module,
            KernelChoice(
                path,
                EXPERTS_LAYER,
                type(module).__qualname__,
                None if device is None else str(device),
                mode,
                kernel_layer=None if blocker else f"{__name__}.experts_forward",
                fallback=FallbackReason.CONDITION if blocker else None,
                reason=blocker or "",
            ),
        )
        set_fallback(module, previous)
        served += blocker is None
        if blocker is None and getattr(module, "is_transposed", False):
            _rows_contiguous(module)
    if not served:
        return (
            f"experts implementation unchanged (`{previous}`): {why or 'no experts module fits the kernel'}",
            None,
        )
    register_experts()
    try:
        setter(EXPERTS_NAME)
    except (ValueError, KeyError, RuntimeError) as exc:
        return f"experts implementation unchanged: {exc}", None
    return f"experts implementation set to `{EXPERTS_NAME}` ({served} of {len(found)} modules)", previous


def packed_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """path -> module, for each packed experts module (`kernelize.quant.experts.QuantizedExperts`, marked by
    its class's `packed_experts`: `kernelize_model(quantize=...)` put it in place of an experts module)."""
    return {p: m for p, m in model.named_modules() if getattr(type(m), "packed_experts", False)}


def _record_packed(model: torch.nn.Module, mode: Mode, device: Any) -> int:
    """Record each packed experts module (its own kernels) for `kernelize.inspect`; returns how many."""
    packed = packed_experts(model)
    where = None if device is None else str(device)
    for path, module in packed.items():
        kernel = f"{type(module).__module__}.{type(module).__qualname__}"
        record_choice(module, KernelChoice(path, EXPERTS_LAYER, kernel, where, mode, kernel_layer=kernel))
    return len(packed)


# On a GPU transformers' `grouped_mm` (torch._grouped_mm) measured faster than the generated kernels (H200,
# Qwen3-MoE layout, bf16, two runs: prefill 0.70-0.84x and decode 0.70-0.76x eager's speed with the kernel;
# benchmarks/results/gpu/moe.json): the one call keeps it there unless this variable is 1.
GPU_EXPERTS_ENV = "KERNELIZE_GPU_EXPERTS"


def _gpu_blocker(device: Any, previous: str) -> str | None:
    """Why the experts of a model on `device` keep `previous` (a GPU, unless opted in), else None."""
    kind = getattr(device, "type", device)
    if kind in (None, "cpu") or os.environ.get(GPU_EXPERTS_ENV, "") == "1":
        return None
    return (
        f"on {kind} `{previous}` measured faster than the generated grouped-expert kernel (H200: prefill "
        f"0.70-0.84x, decode 0.70-0.76x); set {GPU_EXPERTS_ENV}=1 to use the kernel there"
    )


class Routing:
    """The routing (``top_k_index``, ``top_k_weights``) each experts module of a model was called with during
    one forward, replayed in a later one.

    The one call's whole-model check compares the kernelized model's output with the model's own on a
    probe. Top-k routing is discontinuous: a rounding difference anywhere upstream (a bf16 kernel, a fused
    norm) flips a near-tie token to another expert and its logits move by far more than the dtype's
    tolerance, so a correct kernel would be withdrawn. Replaying the reference forward's routing removes
    the discontinuity and nothing else: a wrong kernel still changes the output it is compared on.

    Example:
        >>> routing = Routing(model)  # doctest: +SKIP
        >>> with routing.recording():  # doctest: +SKIP
        ...     want = model(ids)
        >>> got = routing.pinning(lambda: model(ids))()  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [*experts_modules(model).values(), *packed_experts(model).values()]
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Within: each experts module call's routing is recorded, in call order."""

        def hook(module, args, kwargs):
            routed = _routing_args(args, kwargs)
            if routed is not None:
                self.calls.append((id(module), routed[0].clone(), routed[1].clone()))

        with _hooks(self.modules, hook):
            yield

    def pinning(self, call: Callable[[], Any]) -> Callable[[], Any]:
        """``call`` with each experts module call taking the recorded routing (when the calls line up)."""
        if not self.calls:
            return call

        def pinned() -> Any:
            queue = list(self.calls)

            def hook(module, args, kwargs):
                routed = _routing_args(args, kwargs)
                if (
                    routed is None
                    or not queue
                    or queue[0][0] != id(module)
                    or queue[0][1].shape != routed[0].shape
                ):
                    return None
                _, index, weights = queue.pop(0)
                return (args[0], index, weights.to(routed[1].dtype), *args[3:]), kwargs

            with _hooks(self.modules, hook):
                return call()

        return pinned


def _routing_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(top_k_index, top_k_weights) of an experts module call passed positionally, else None."""
    if (
        len(args) >= 3
        and all(isinstance(a, torch.Tensor) for a in args[1:3])
        and not args[1].is_floating_point()
    ):
        return args[1], args[2]
    return None


@contextlib.contextmanager
def _hooks(modules: list[torch.nn.Module], hook) -> Iterator[None]:
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
