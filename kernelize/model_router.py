"""Mixture-of-experts routers run as generated kernels, traced from the router module's own forward.

transformers' MoE families keep the router in a module of its own (`Qwen3MoeTopKRouter`,
`MixtralTopKRouter`, `OlmoeTopKRouter`, `GptOssTopKRouter`, ...): `forward(hidden [T, H])` returns
`(router_logits, weights, indices)`. `use_router_kernels(model)` traces each such module's forward into a
graph (:func:`kernelize.ir.trace`, the weight and bias as graph inputs, the token count symbolic), lets the
optimizer fold the score / top-k / renormalisation / cast chain into `ROUTE` nodes (`passes.router`),
compiles it (the projection, then one ROUTER kernel per row) and checks it by a probe: random hidden
states through the module's own forward and through the kernels, indices equal (ties may be ordered
differently: :func:`kernelize.ir.router.same_choice`), logits and weights within the dtype's tolerance.
A module that passes runs the kernels from then on; one that cannot be traced, has no router in its graph
or fails the probe keeps its own forward, with the reason in `kernelize.inspect`. Nothing here raises for a
module it cannot serve. DeepSeek-V3's group-limited choice (a top-2 sum per group, a scatter into a group
mask) does not trace into the IR (no scatter op) and stays eager, with that reason.

Example:
    >>> status = use_router_kernels(model, Mode.INFERENCE)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from kernelize.layer.mode import Mode
from kernelize.layer.record import FallbackReason, KernelChoice, record_choice
from kernelize.model_attention import note_fallback

__all__ = ["ROUTER_LAYER", "RouterForward", "router_blocker", "router_modules", "use_router_kernels"]

logger = logging.getLogger(__name__)

ROUTER_LAYER = "Router"  # the layer name `inspect` lists router modules under
PROBE_TOKENS = 24  # rows of the probe (random hidden states, several per expert)
# logits and weights tolerance of the probe per dtype (atol = rtol): the kernels compute in f32 as eager does
# the router's projection: the generated few-row kernel up to its rows (a decode step), torch's GEMM past
# them. Against torch's matmul for every size (the choice until stop 50: a generated gemv then opened a thread
# team per layer, and on a loaded 2-core machine a team waited a scheduler slice for a late worker), a
# Qwen3-MoE decode step took 6.85 against 7.55 ms in bf16, 9.91 against 9.94 in f32 (2 threads, interleaved),
# and the router graph is then all C calls, which a replayed decode step makes
PROJECTION = "generate"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def router_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """path -> module, for each module that looks like a top-k router: a 2-D `weight`, an int `top_k`."""
    return {
        path: m
        for path, m in model.named_modules()
        if isinstance(getattr(m, "top_k", None), int)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and "Router" in type(m).__name__
    }


class RouterForward:
    """The forward a served router runs: the compiled graph on 2-D hidden states of the graph's device
    and dtype without gradients; anything else is the module's own forward (noted for `inspect`)."""

    def __init__(self, module: torch.nn.Module, compiled: Any, params: tuple[str, ...]) -> None:
        from kernelize.hub import KernelRecord

        self.module, self.compiled, self.params = module, compiled, params
        self.own = type(module).forward
        self.width = module.weight.shape[1]
        kernels = tuple((k.name, k.source_hash) for k in compiled.kernels)
        what = f"router({module.weight.shape[0]} experts, top-{module.top_k}, {str(module.weight.dtype)[6:]})"
        self.record = KernelRecord(compiled.backend, kernels, what)

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        why = None
        if args or kwargs or hidden_states.dim() != 2 or hidden_states.shape[-1] != self.width:
            why = f"a call other than forward(hidden [T, {self.width}])"
        elif hidden_states.dtype != m.weight.dtype or hidden_states.device != m.weight.device:
            why = "hidden states of another dtype or device than the router's weight"
        elif torch.is_grad_enabled() and (hidden_states.requires_grad or m.weight.requires_grad):
            why = "the call needs gradients; the router kernel has no backward"
        if why is not None:
            note_fallback(m, why, "eager router")
            return self.own(m, hidden_states, *args, **kwargs)
        from kernelize.hub import note_kernels

        note_kernels(m, self.record)
        return tuple(self.compiled(hidden_states, *[getattr(m, p) for p in self.params]))

    def fixed_call(self, hidden_states: torch.Tensor):
        """The router graph's calls on ``hidden_states`` ``[T, H]`` (a buffer that stays put) for a replay
        program (:meth:`~kernelize.runtime.compiled.CompiledGraph.fixed_call`), or None."""
        m = self.module
        if hidden_states.dim() != 2 or hidden_states.dtype != m.weight.dtype:
            return None
        return self.compiled.fixed_call([hidden_states, *[getattr(m, p) for p in self.params]], ())


def _build(module: torch.nn.Module) -> tuple[Any, tuple[str, ...]] | str:
    """(compiled graph, its parameter names) for a router module, or why not."""
    from kernelize.autokernel.plan import plan
    from kernelize.hub import backend_for
    from kernelize.ir import trace
    from kernelize.ir.graph import Op
    from kernelize.passes.optimize import optimize
    from kernelize.runtime.compiled import compile_graph, make_backend

    w = module.weight
    x = torch.randn(4, w.shape[1], dtype=w.dtype, device=w.device)
    try:
        with torch.no_grad():
            graph = optimize(trace(module, x, dynamic_dims={0: "tokens"}, params="input"))
    except Exception as exc:  # an op the IR lacks, a data-dependent branch: the module stays eager
        return f"its forward does not trace into the IR: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    ops = {n.op for n in graph.nodes}
    if Op.ROUTE not in ops:
        return f"no score -> top-k router in its traced graph (ops: {', '.join(sorted(map(str, ops)))})"
    params = tuple(str(i.arg) for i in graph.inputs[1:])
    backend = backend_for(w.device)
    try:
        settings = dataclasses.replace(make_backend(backend).plan_settings, matmul=PROJECTION)
        compiled = compile_graph(graph, backend=backend, plan=plan(graph, settings))
        compiled.own_workers = False  # a layer's: see hub.signatures
        return compiled, params
    except Exception as exc:  # a backend without the kind or the dtype
        return f"the router kernels did not compile: {type(exc).__name__}: {exc}"


def _probe(module: torch.nn.Module, run: RouterForward) -> str | None:
    """Why the kernels' outputs differ from the module's own on random hidden states, or None."""
    from kernelize.ir.router import same_choice

    w = module.weight
    gen = torch.Generator().manual_seed(3)
    tol = TOLERANCE.get(w.dtype, 1e-5)
    for tokens in (PROBE_TOKENS, 2):  # the projection's library GEMM, then its few-row kernel (decode)
        x = torch.randn(tokens, w.shape[1], generator=gen).to(w.device, w.dtype)
        with torch.no_grad():
            want, got = run.own(module, x), run(x)
        if len(want) != len(got) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(want, got)):
            return "the kernels' outputs differ from the forward's in number, shape or dtype"
        for i, (a, b) in enumerate(zip(want, got)):
            if a.is_floating_point() and not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
                return f"output {i} differs by {(a.float() - b.float()).abs().max().item():.3g} (probed)"
            if not a.is_floating_point() and not same_choice(want[0].float(), b, a):
                return f"output {i} (the indices) differs from the forward's choice (probed)"
    return None


def router_blocker(module: torch.nn.Module) -> tuple[RouterForward | None, str]:
    """(the forward to install, what it runs) or (None, why the module keeps its own forward)."""
    if module.weight.is_meta:
        return None, "weights on the meta device: cannot trace the router"
    built = _build(module)
    if isinstance(built, str):
        return None, built
    run = RouterForward(module, *built)
    try:
        why = _probe(module, run)
    except Exception as exc:  # the kernels raised on the probe
        why = f"the router kernels raised on the probe: {type(exc).__name__}: {exc}"
    return (None, why) if why else (run, "projection + one ROUTER row kernel (traced, probed)")


def _choice(
    path: str, module: torch.nn.Module, mode: Mode, run: RouterForward | None, why: str
) -> KernelChoice:
    return KernelChoice(
        path,
        ROUTER_LAYER,
        type(module).__qualname__,
        str(module.weight.device.type),
        mode,
        kernel_layer=None if run is None else f"{__name__}.RouterForward",
        fallback=FallbackReason.CONDITION if run is None else None,
        reason=why if run is None else "",
    )


BLOCKING_MODES: dict[Mode, str] = {
    Mode.TRAINING: "the router kernel has no backward",
    Mode.TORCH_COMPILE: "torch.compile traces the router's own forward",
}


def use_router_kernels(model: torch.nn.Module, mode: Mode) -> str:
    """Install the router kernels on every router module of `model` that passes (see the module docstring);
    record each module's outcome for `kernelize.inspect`. Returns what happened, in words."""
    found = router_modules(model)
    if not found:
        return "no router modules"
    blocked = next((why for flag, why in BLOCKING_MODES.items() if mode & flag), None)
    served = 0
    for path, module in found.items():
        run, why = (None, f"{mode}: {blocked}") if blocked else router_blocker(module)
        record_choice(module, _choice(path, module, mode, run, why))
        if run is not None:
            module.forward = run  # the instance's forward: the class and its other instances are untouched
            served += 1
        else:
            logger.info("router `%s` stays eager: %s", path, why)
    return f"router kernels on {served} of {len(found)} router modules"


def restore_routers(model: torch.nn.Module, reason: str) -> None:
    """Give every served router its own forward back (the whole model's output differed)."""
    for module in router_modules(model).values():
        if isinstance(module.__dict__.get("forward"), RouterForward):
            del module.forward
            _withdraw(module, reason)


def _withdraw(module: torch.nn.Module, reason: str) -> None:
    from kernelize.layer.record import recorded_choice

    choice = recorded_choice(module)
    if choice is not None:
        record_choice(module, dataclasses.replace(choice, fallback=FallbackReason.VERIFY, reason=reason))
