"""Activation layers: the math once, as plain torch; `forward` runs the kernels kernelize generates from it.

Each `*_math` function is the definition (and the reference); each layer class is a stateless kernel
layer whose forward hands that function to `kernelize.hub.run`, which traces it once per signature and
runs the fused kernel for the tensor's device. Backward recomputes the same math with autograd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernelize import hub
from kernelize.merge import linear_layout, merged_parameter
from kernelize.shards import local, require

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ---- the math (plain torch; traced into kernels) ---------------------------------------------------------
def silu_and_mul_math(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul_math(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :d]) * x[..., d:] (exact, erf-based gelu)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul_math(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[..., :d]) * x[..., d:] (tanh-approximated gelu)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def fast_gelu_math(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2)))."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu_math(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def new_gelu_math(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT-2's gelu)."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def silu_mul_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the gated MLP's activation with gate and up projections as separate tensors."""
    return F.silu(gate) * up


def gelu_mul_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate) * up


def gelu_tanh_mul_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def silu_gate_up_math(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) with gate|up merged into one (2I, H) weight: one matmul kernel reads the
    merged weight once (few rows: both accumulators and the product in registers)."""
    i = gate_up.shape[0] // 2
    return F.silu(x @ gate_up[:i].t()) * (x @ gate_up[i:].t())


def gelu_gate_up_math(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    i = gate_up.shape[0] // 2
    return F.gelu(x @ gate_up[:i].t()) * (x @ gate_up[i:].t())


def gelu_tanh_gate_up_math(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    i = gate_up.shape[0] // 2
    return F.gelu(x @ gate_up[:i].t(), approximate="tanh") * (x @ gate_up[i:].t())


def down_math(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h @ weight.t()


# hidden_act name (transformers' config.hidden_act) -> gated math; other activations keep the module's own
GATED_MATH = {
    "silu": silu_mul_math,
    "swish": silu_mul_math,
    "gelu": gelu_mul_math,
    "gelu_pytorch_tanh": gelu_tanh_mul_math,
    "gelu_new": gelu_tanh_mul_math,
}

# hidden_act -> math on one tensor holding gate and up side by side (Phi-3's fused gate_up_proj)
GATED_PAIR_MATH = {
    "silu": silu_and_mul_math,
    "swish": silu_and_mul_math,
    "gelu": gelu_and_mul_math,
    "gelu_pytorch_tanh": gelu_tanh_and_mul_math,
    "gelu_new": gelu_tanh_and_mul_math,
}


def _hidden_act(module: nn.Module) -> object:
    """The activation: the instance's `hidden_act` (kernelize_model's probe sets it), else the config's."""
    own = module.__dict__.get("hidden_act")
    return own or getattr(getattr(module, "config", None), "hidden_act", None) or "silu"


# the same, over the merged gate|up weight
GATE_UP_MATH = {
    silu_mul_math: silu_gate_up_math,
    gelu_mul_math: gelu_gate_up_math,
    gelu_tanh_mul_math: gelu_tanh_gate_up_math,
}


# hidden_act -> the activation of a non-gated MLP (GPT-2, GPT-NeoX, Phi, Falcon, OPT, StarCoder2, Nemotron)
ACT_MATH = {
    "gelu": F.gelu,
    "gelu_new": new_gelu_math,
    "gelu_pytorch_tanh": new_gelu_math,
    "gelu_fast": fast_gelu_math,
    "quick_gelu": quick_gelu_math,
    "relu": torch.relu,
    "relu2": lambda x: torch.square(torch.relu(x)),
    "silu": F.silu,
}


def dense_up_math(x, weight, bias, *, act: str, transposed: bool) -> torch.Tensor:
    """`act(x @ W.T + b)`; `transposed`: W is stored `(in, out)` (transformers' `Conv1D`)."""
    return ACT_MATH[act](x @ (weight if transposed else weight.t()) + bias)


def dense_up_nobias_math(x, weight, *, act: str, transposed: bool) -> torch.Tensor:
    return ACT_MATH[act](x @ (weight if transposed else weight.t()))


def dense_down_math(h, weight, bias, *, transposed: bool) -> torch.Tensor:
    return h @ (weight if transposed else weight.t()) + bias


def dense_down_nobias_math(h, weight, *, transposed: bool) -> torch.Tensor:
    return h @ (weight if transposed else weight.t())


# ---- functional API (as in kernels-community/activation) --------------------------------------------------
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    hub.require_float("silu_and_mul", x)
    return hub.run(None, silu_and_mul_math, [x])


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    hub.require_float("gelu_and_mul", x)
    return hub.run(None, gelu_and_mul_math, [x])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    hub.require_float("gelu_tanh_and_mul", x)
    return hub.run(None, gelu_tanh_and_mul_math, [x])


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    hub.require_float("fast_gelu", x)
    return hub.run(None, fast_gelu_math, [x])


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    hub.require_float("quick_gelu", x)
    return hub.run(None, quick_gelu_math, [x])


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    hub.require_float("new_gelu", x)
    return hub.run(None, new_gelu_math, [x])


# ---- kernel layers ----------------------------------------------------------------------------------------
class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] in one kernel."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, x)
        return hub.run(self, silu_and_mul_math, [x])


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] in one kernel."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, x)
        return hub.run(self, gelu_and_mul_math, [x])


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(x[..., :d]) * x[..., d:] in one kernel."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, x)
        return hub.run(self, gelu_tanh_and_mul_math, [x])


class FastGELU(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, x)
        return hub.run(self, fast_gelu_math, [x])


class QuickGELU(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, x)
        return hub.run(self, quick_gelu_math, [x])


class NewGELU(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, x)
        return hub.run(self, new_gelu_math, [x])


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) for Llama-style MLPs (LlamaMLP, Qwen2MLP, MistralMLP...).

    Inference: gate_proj and up_proj (bias-free linears) are merged once, on the first call, into one
    (2I, H) weight whose row halves become the two parameters (`kernelize.merge.merged_parameter`: no
    extra memory, `state_dict` unchanged, a loaded state dict is what the kernel reads); one generated
    matmul kernel computes `act(x @ gate.T) * (x @ up.T)` (on the CPU, up to 16 rows, the few-row kernel
    with both accumulators and the product fused), and down_proj is a second matmul kernel. With
    gradients, or biased projections, the projections stay torch matmuls and `act(gate) * up` runs as one
    kernel. Under tensor parallelism (the Megatron split, `kernelize.shards`) the kernels read the local
    shards and the down_proj product is all-reduced. State read from the replaced module: `gate_proj`,
    `up_proj`, `down_proj`, and the activation from `config.hidden_act` (or `hidden_act`), default silu. An
    activation without gated math here falls back to the module's own `act_fn`. Packed projections
    (`QuantizedLinear`, from `kernelize_model(quantize=...)`): gate|up merged as bytes, one packed call with
    `act(gate) * up` in its epilogue, then down_proj's packed call (`kernelize.quant.fused`).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = _hidden_act(self)
        math_fn = GATED_MATH.get(act) if isinstance(act, str) else None
        if math_fn is None:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        if _packed(gate_proj, up_proj, down_proj):
            y = _packed_mlp(self, x, ("gate_proj", "up_proj"), act)
            return self.down_proj(self.act_fn(gate_proj(x)) * up_proj(x)) if y is None else y
        if _training(x, gate_proj, up_proj, down_proj) or not _bias_free(gate_proj, up_proj, down_proj):
            gate, up = hub.project(gate_proj, x), hub.project(up_proj, x)
            return hub.project(down_proj, hub.run(self, math_fn, [gate, up]))
        shards = require(self)  # tensor parallelism: this rank's slice of the intermediate size
        gate_up = merged_parameter(self, ("gate_proj", "up_proj"))
        h = hub.run(self, GATE_UP_MATH[math_fn], [x], [gate_up])
        y = hub.run(self, down_math, [h], [local(down_proj.weight)])
        return y if shards is None else shards.reduce(y)  # the row-parallel partial sums, all-reduced


def _packed(*linears: nn.Module) -> bool:
    """Packed projections (`kernelize_model(quantize=...)`): gate|up as one packed call, the product fused."""
    from kernelize.quant.fused import is_packed

    return is_packed(*linears)


def _packed_mlp(owner: nn.Module, x: torch.Tensor, gate_up: tuple[str, ...], act: str) -> torch.Tensor | None:
    from kernelize.quant.fused import packed_mlp

    return packed_mlp(owner, x, gate_up, act)


def _training(x: torch.Tensor, *linears: nn.Module) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in linears))


def _bias_free(*linears: nn.Module) -> bool:
    return all(
        getattr(m, "bias", None) is None and isinstance(getattr(m, "weight", None), torch.Tensor)
        for m in linears
    )


# public: a decoder layer that runs the MLP's math in its own kernel graph reads the same facts
hidden_act_of = _hidden_act
bias_free = _bias_free


class FusedGatedMLP(nn.Module):
    """down_proj(act(gate) * up) with gate and up from one fused projection (Phi-3's `gate_up_proj`).

    Inference with bias-free projections: `act(x @ gate.T) * (x @ up.T)` over the halves of
    `gate_up_proj.weight` as one matmul kernel (few rows: the few-row kernel, product fused), then down_proj
    as a second. Otherwise the projections stay one torch matmul and act(gate) * up over its halves runs as
    one generated kernel. Reads `gate_up_proj`, `down_proj` and the activation from `config.hidden_act`; an
    activation without gated math here falls back to the module's own `activation_fn`.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        act = _hidden_act(self)
        math_fn = GATED_PAIR_MATH.get(act) if isinstance(act, str) else None
        fused, down_proj = self.gate_up_proj, self.down_proj
        if math_fn is not None and _packed(fused, down_proj):
            y = _packed_mlp(self, hidden_states, ("gate_up_proj",), act)
            if y is not None:
                return y
        if _packed(fused, down_proj):
            gate, up = fused(hidden_states).chunk(2, dim=-1)
            return down_proj(up * self.activation_fn(gate))
        merged = not _training(hidden_states, fused, down_proj) and _bias_free(fused, down_proj)
        if math_fn is not None and merged:
            h = hub.run(self, GATE_UP_MATH[GATED_MATH[act]], [hidden_states], [fused.weight])
            return hub.run(self, down_math, [h], [down_proj.weight])
        gate_up = hub.project(fused, hidden_states)
        if math_fn is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return hub.project(down_proj, up * self.activation_fn(gate))
        return hub.project(down_proj, hub.run(self, math_fn, [gate_up]))


class DenseMLP(nn.Module):
    """`down(act(up(x)))`, the non-gated MLP: two matmul kernels, the bias and activation fused into the first
    one's epilogue, the second's bias into its own.

    State read from the replaced module: `kernelize_dense_mlp = (up name, down name, activation name)` (set
    by `kernelize_model`'s probe), the two projections (`nn.Linear`, or transformers' `Conv1D`, whose weight
    is stored `(in, out)`), each with or without a bias. With gradients the projections run as torch's; the
    module's dropout, if any, is not applied: the layer serves inference (`has_backward = False`).
    """

    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up_name, down_name, act = self.kernelize_dense_mlp
        up, down = getattr(self, up_name), getattr(self, down_name)
        if _training(hidden_states, up, down):
            return down(ACT_MATH[act](up(hidden_states)))
        weight, transposed = _weight(up)
        if up.bias is None:
            h = hub.run(self, dense_up_nobias_math, [hidden_states], [weight], act=act, transposed=transposed)
        else:
            h = hub.run(
                self, dense_up_math, [hidden_states], [weight, up.bias], act=act, transposed=transposed
            )
        weight, transposed = _weight(down)
        if down.bias is None:
            return hub.run(self, dense_down_nobias_math, [h], [weight], transposed=transposed)
        return hub.run(self, dense_down_math, [h], [weight, down.bias], transposed=transposed)


def _weight(proj: nn.Module) -> tuple[torch.Tensor, bool]:
    """(weight, stored (in, out)): a `Conv1D`'s weight re-laid once as `(out, in)` in memory where it can be
    (`kernelize.merge.linear_layout`: the layout the matmul kernels read fastest), else as it is."""
    if type(proj).__name__ != "Conv1D":
        return proj.weight, False
    weight = linear_layout(proj.weight)
    return (proj.weight, True) if weight is None else (weight, False)
