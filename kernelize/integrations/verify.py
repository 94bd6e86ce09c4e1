"""Verify before trusting: every replaced module's kernel forward against its own forward, on the model's real
inputs.

Recognition is a hypothesis (a module that looks like a Llama attention may skip rotary in some layers, take
another signature or return a tuple); the probe decides. `verify_replacements` runs one call of the whole
model (a small batch of random token ids, no cache) with each replaced module's forward checked: it runs the
module's own forward (the reference; its submodules and attention take their eager paths too), then the
kernel forward on the same arguments, and compares the outputs tensor by tensor. A kernel forward that
raises, returns another structure, or differs by more than the dtype's tolerance (relative to the largest
reference value) is refused; the reference output is handed on, so the modules after it are probed on
correct inputs. Each module is judged on its own: a decoder layer's kernel forward runs its submodules'
checked forwards. Inside an MoE layer, the kernel forward's experts take the routing the module's own
forward gave them (`kernelize.model_experts.Routing`): a bf16 rounding difference before the router can
flip a near-tie token to another expert, which moves that token's output by far more than the tolerance
although every kernel is right (Qwen3-MoE layout, bf16: one of four decoder layers was refused so).

Example:
    >>> refused, ran = verify_replacements(model, targets, lambda: model(input_ids=ids))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from kernelize.layer.kernelize import original_forward
from kernelize.model_attention import reference_attention
from kernelize.model_experts import Routing
from kernelize.shards import shards_of

__all__ = ["TOLERANCE", "difference", "evaluating", "verify_replacements"]

# max |kernel - reference| allowed, relative to max |reference|, per output dtype
TOLERANCE: Mapping[torch.dtype, float] = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}


def difference(got: Any, want: Any, where: str = "output", compute: torch.dtype | None = None) -> str | None:
    """Why `got` is not `want` within `TOLERANCE` (None: it is), walking tuples, lists and dicts.

    `None` where the module's own forward returns a tensor is accepted: an optional output the kernel does
    not compute (attention weights, as transformers' SDPA path returns them); a caller that reads it fails
    in its own probe. `compute`: the dtype the values were computed in when coarser than the output's (a
    bf16 model whose logits are upcast to f32) sets the tolerance.
    """
    if isinstance(want, tuple | list | dict):
        same = type(got) is type(want) and len(got) == len(want)
        if not same or (isinstance(want, dict) and got.keys() != want.keys()):
            return f"{where} is {_shape_of(got)}, the module's own is {_shape_of(want)}"
        keys = want.keys() if isinstance(want, dict) else range(len(want))
        found = (difference(got[k], want[k], f"{where}[{k!r}]", compute) for k in keys)
        return next((why for why in found if why), None)
    if isinstance(want, torch.Tensor):
        if got is None:
            return None
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return f"{where} is {_shape_of(got)}, the module's own is {_shape_of(want)}"
        why = _tensor_difference(got, want, compute)
        return f"{where} {why}" if why else None
    if type(got) is not type(want):
        return f"{where} is {_shape_of(got)}, the module's own is {_shape_of(want)}"
    return None


def _tensor_difference(got: torch.Tensor, want: torch.Tensor, compute: torch.dtype | None) -> str | None:
    if not want.is_floating_point():
        return None if torch.equal(got, want) else "differs (integer output)"
    allowed_relative = max(TOLERANCE.get(want.dtype, 1e-4), TOLERANCE.get(compute, 0.0))
    got, want = got.detach().double(), want.detach().double()
    if not torch.equal(got.isnan(), want.isnan()):
        return "has NaN where the module's own forward has none (or the reverse)"
    infinite = want.isinf() | got.isinf()
    if not torch.equal(got[infinite], want[infinite]):
        return "has infinities where the module's own forward has none (or the reverse)"
    finite = want.isfinite() & got.isfinite()
    if not finite.any():
        return None
    scale = want[finite].abs().max().item()
    worst = (got[finite] - want[finite]).abs().max().item()
    allowed = allowed_relative * max(scale, 1e-6)
    if worst <= allowed or math.isclose(worst, 0.0):
        return None
    return f"differs by {worst:.3g} (largest value {scale:.3g}, allowed {allowed:.3g})"


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} tensor"
    if isinstance(value, dict):
        return f"a {type(value).__name__} of {', '.join(map(str, value))}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


class _Checked:
    """A replaced module's forward during a probe: its own forward (the reference), then the kernel forward,
    compared. It stands for the installed kernel forward: `__func__` is that forward's function, so code
    that checks which kernel layer a submodule runs (a decoder layer's fused block) sees the same."""

    def __init__(self, probe: _Probe, path: str, module: nn.Module) -> None:
        self.probe, self.path = probe, path
        self.kernel, self.own = module.__dict__["forward"], original_forward(module)
        self.__func__ = getattr(self.kernel, "__func__", None)
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe, path = self.probe, self.path
        if probe.reference or path in probe.refused:
            return self.own(*args, **kwargs)
        routing = Routing(self.module)  # the experts modules inside (an MoE decoder layer's)
        with probe.as_reference(), routing.recording():
            want = self.own(*args, **kwargs)
        probe.ran.add(path)
        try:  # the kernel forward's experts take the routing its own forward's took (see `Routing`)
            got = routing.pinning(lambda: self.kernel(*args, **kwargs))()
        except Exception as exc:  # any failure of the kernel path refuses it; the reference stands
            raised = f"the kernel forward raised {type(exc).__name__}: {exc}"
            probe.refused[path] = sharded(self.module) or raised
            return want
        why = difference(got, want)
        if why is not None:
            probe.refused[path] = f"the kernel forward {why}"
            return want
        return got


def sharded(module: nn.Module) -> str | None:
    """Why `module` keeps its own forward under tensor parallelism (DTensor parameters not in the Megatron
    split whose local shards the kernels take, see `kernelize.shards`), else None."""
    found = shards_of(module)
    return found if isinstance(found, str) else None


class _Probe:
    """The checked forwards of one probe call and what they found."""

    def __init__(self) -> None:
        self.reference = False
        self.refused: dict[str, str] = {}
        self.ran: set[str] = set()

    @contextlib.contextmanager
    def as_reference(self) -> Iterator[None]:
        outer, self.reference = self.reference, True
        try:
            with reference_attention():
                yield
        finally:
            self.reference = outer


def verify_replacements(
    model: nn.Module, targets: Mapping[str, nn.Module], call: Callable[[], Any]
) -> tuple[dict[str, str], set[str]]:
    """Run `call()` (one forward of `model`) with every target's kernel forward checked against its own.

    Args:
        model: The kernelized model (for the train/eval state: the probe runs in eval mode).
        targets: path -> module whose instance forward is a kernel layer's (installed by `kernelize`).
        call: Runs the model once; its result is discarded.

    Returns:
        `(refused, ran)`: path -> why, for each kernel forward refused; the paths whose forward ran.
    """
    probe = _Probe()
    installed = {path: module.__dict__["forward"] for path, module in targets.items()}
    try:
        for path, module in targets.items():
            module.__dict__["forward"] = _Checked(probe, path, module)
        with evaluating(model):
            call()
    finally:
        for path, module in targets.items():
            module.__dict__["forward"] = installed[path]
    return probe.refused, probe.ran


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Within: `model` in eval mode and no gradients; every module's train/eval flag is restored after."""
    training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, mode in training.items():
            module.training = mode
