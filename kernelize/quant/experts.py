"""Routed experts whose weights stay packed: :class:`QuantizedExperts` stands in for a transformers experts
module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, a gated MLP: Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE, DeepSeek-V3, gpt-oss with its biases and clamped SwiGLU, ...) under
``kernelize_model(model, quantize=...)``, so that a mixture-of-experts model's largest weights are the ones
packed.

The E experts' gate|up weights are one packed ``[E * 2I, H]`` weight (expert ``e``'s gate rows from row
``2I e``, its up rows ``I`` after) and their down weights one ``[E * H, I]``: a row of a packed weight runs
along K, so an expert's rows are a slice of bytes. As for a packed linear layer
(:mod:`kernelize.quant.ops`), a call of up to :data:`~kernelize.quant.ops.FEW_ROWS` tokens (decode) on the
CPU is one generated kernel (``templates/cpu_quant_gemv.cpp``, ``kz_qexperts``): the (token, slot) pairs
sorted by expert, each selected expert's packed rows read once for all its pairs with the activation rows
quantized to 8-bit blocks (the few-row kernel's integer dot products), ``act(gate) * up`` and the routing
weights' combine in its stages. More tokens (prefill) dequantize the selected experts into scratch a few
at a time (:data:`PREFILL_BYTES`) and run each group through the float grouped-expert kernel
(:func:`kernelize.experts.grouped_experts`): the float product of the packed values, as a packed linear
layer's prefill. One Qwen3-MoE layer, 512 tokens, top-4 of 32, q4_0, 2 threads, AMX Xeon: f32 61-79 -> 60
ms, bf16 29-41 -> 25-27 ms against each selected expert through its own panels (the float kernel alone on
the dequantized weights 44-48 and 12.6 ms, the dequantization 10-15 ms). Another device runs each selected
expert through the packed matmul (:func:`kernelize.quant.ops.linear`).
The float weights are not kept; ``state_dict()`` holds the bytes and the format, and loads back.

Example:
    >>> import torch
    >>> q = QuantizedExperts(4, 64, 32, "q8_0")
    >>> q(torch.randn(3, 64), torch.tensor([[0, 2], [1, 3], [2, 4]]), torch.ones(3, 2)).shape
    torch.Size([3, 64])
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch
from torch import nn

from kernelize.codegen import cpu_build
from kernelize.quant import kernels
from kernelize.quant.formats import PackedWeight, apply_keeping_f32, get_format, quantize
from kernelize.quant.ops import FEW_ROWS, linear, native_panels, panels

PREFILL_BYTES = 64 << 20  # the most scratch a prefill's dequantized experts take at once
_SCRATCH = threading.local()  # that scratch, per thread and dtype, kept for the next prefill
# the experts' activation as the IR names it (model_experts.experts_activation) -> the kernels' GLU_ACTS name
ACTS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def experts_reason(module: nn.Module, fmt: str) -> str | None:
    """Why the transformers experts module ``module`` stays float under ``fmt`` (None: it can be packed)."""
    from kernelize.model_experts import experts_blocker, experts_operands, kernel_keywords

    f = get_format(fmt)
    why = experts_blocker(module)
    if why is not None:
        return why
    keywords = kernel_keywords(module)
    if not keywords["gated"]:
        return "packed experts take gated MLPs only (gate and up rows); this module's is not gated"
    if keywords["act"] not in ACTS:
        return f"activation {keywords['act']} is not one of the packed kernel's {sorted(ACTS)}"
    up, down, _ = experts_operands(module, True)
    (_, two_i, h), i = up.shape, down.shape[2]
    if two_i != 2 * i or down.shape[1] != h:
        return f"gate_up {list(up.shape)} and down {list(down.shape)} are not [E, 2I, H] and [E, H, I]"
    if h % f.block_size or i % f.block_size:
        return f"hidden {h} and intermediate {i} are not multiples of {f.name}'s block of {f.block_size}"
    return None


class QuantizedExperts(nn.Module):
    """The routed experts' weighted sum per token, ``forward(hidden_states [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H]`` as a transformers experts module's, over packed weights (see the
    module docstring). ``top_k_index`` may hold ``num_experts`` itself (a pair routed elsewhere: skipped).
    ``form``: the gate form's :class:`~kernelize.ir.ops.ExpertsArgs` fields (``alpha``, ``gate_limit``,
    ``act_limit``, ``up_limit``, ``up_shift``: gpt-oss's clamped SwiGLU); ``bias``: f32 gate|up and down
    biases per expert (``gate_up_bias [E * 2I]``, ``down_bias [E * H]``). Interleaved gate|up rows are stored
    as gate rows then up rows (:meth:`from_experts` reorders them).

    Example:
        >>> q = QuantizedExperts(2, 32, 32, "q4_0")
        >>> sorted(q.state_dict())
        ['_extra_state', 'down_qscales', 'down_qweight', 'gate_up_qscales', 'gate_up_qweight']
    """

    packed_experts = True  # what kernelize.model_experts.packed_experts finds (without importing this module)

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        fmt: str = "q8_0",
        act: str = "silu",
        form: dict[str, float | None] | None = None,
        bias: bool = False,
        down_fmt: str | None = None,
    ) -> None:
        super().__init__()
        f, fd = get_format(fmt), get_format(down_fmt or fmt)
        if hidden % f.block_size or intermediate % fd.block_size:
            raise ValueError(
                f"QuantizedExperts: hidden {hidden} must be a multiple of {f.name}'s block of {f.block_size} "
                f"and intermediate {intermediate} of {fd.name}'s of {fd.block_size}; leave these experts "
                "unquantized"
            )
        if act not in ACTS:
            raise ValueError(f"QuantizedExperts: activation {act!r} is not one of {sorted(ACTS)}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.format, self.down_format, self.act, self.form = f.name, fd.name, act, _form(form, act)
        e, i, row = num_experts, intermediate, f.scale_per == "row"
        self.register_buffer(
            "gate_up_qweight", torch.zeros(e * 2 * i, f.row_bytes(hidden), dtype=torch.uint8)
        )
        self.register_buffer("gate_up_qscales", torch.zeros(e * 2 * i if row else 0))
        self.register_buffer("down_qweight", torch.zeros(e * hidden, fd.row_bytes(i), dtype=torch.uint8))
        self.register_buffer("down_qscales", torch.zeros(e * hidden if fd.scale_per == "row" else 0))
        self.register_buffer("gate_up_bias", torch.zeros(e * 2 * i if bias else 0))
        self.register_buffer("down_bias", torch.zeros(e * hidden if bias else 0))

    @classmethod
    def from_experts(cls, module: nn.Module, fmt: str, down_fmt: str | None = None) -> QuantizedExperts:
        """``module`` (a transformers experts module that :func:`experts_reason` passes) quantized to ``fmt``
        (its down weights to ``down_fmt``, default ``fmt``), expert by expert (one expert's float copy at a
        time); ``module`` itself is left as it was."""
        from kernelize.model_experts import experts_operands, kernel_keywords

        why = experts_reason(module, fmt)
        if why is not None:
            raise ValueError(f"QuantizedExperts.from_experts({type(module).__name__}): {why}")
        up, down, biases = experts_operands(module, True)
        (e, _, h), i = up.shape, down.shape[2]
        keywords = dict(kernel_keywords(module))
        act, interleaved = keywords.pop("act"), keywords.pop("interleaved", False)
        keywords.pop("gated")
        q = cls(e, h, i, fmt, act, keywords, bias=bool(biases), down_fmt=down_fmt)

        def rows(w: torch.Tensor) -> torch.Tensor:  # gate rows, then up rows
            return torch.cat((w[..., 0::2, :], w[..., 1::2, :]), dim=-2) if interleaved else w

        for name, w, f in (("gate_up", up, q.format), ("down", down, q.down_format)):
            parts = [
                quantize((rows(w[x]) if name == "gate_up" else w[x]).detach().float(), f) for x in range(e)
            ]
            setattr(q, f"{name}_qweight", torch.cat([p.data for p in parts]))
            if parts[0].scales is not None:
                setattr(q, f"{name}_qscales", torch.cat([p.scales for p in parts]))
        if biases:
            up_bias = biases["up_bias"].detach().float()
            up_bias = torch.cat((up_bias[:, 0::2], up_bias[:, 1::2]), dim=1) if interleaved else up_bias
            q.gate_up_bias = up_bias.reshape(-1).contiguous()
            q.down_bias = biases["down_bias"].detach().float().reshape(-1).contiguous()
        return q.train(module.training)

    @property
    def packed(self) -> tuple[PackedWeight, PackedWeight]:
        """The gate|up ``[E * 2I, H]`` and down ``[E * H, I]`` weights as :class:`PackedWeight` views of the
        buffers (made once while they stay put), with one view per expert (``experts[e]``: its gate|up and
        down rows)."""
        b = self._buffers
        key = tuple((id(b[n]), b[n].data_ptr()) for n in sorted(b)) + (self.format, self.down_format)
        held = self.__dict__.get("_packed")
        if held is None or held[0] != key:
            e, h, i = self.num_experts, self.hidden_dim, self.intermediate_dim

            def weight(name: str, rows: int, k: int) -> PackedWeight:
                scales = b[f"{name}_qscales"]
                f = get_format(self.format if name == "gate_up" else self.down_format)
                return PackedWeight(b[f"{name}_qweight"], f, (rows, k), scales if scales.numel() else None)

            held = self.__dict__["_packed"] = (
                key,
                (weight("gate_up", e * 2 * i, h), weight("down", e * h, i)),
            )
            self.__dict__["_experts"] = [None] * e
        return held[1]

    def expert(self, e: int) -> tuple[PackedWeight, PackedWeight]:
        """Expert ``e``'s gate|up ``[2I, H]`` and down ``[H, I]`` packed weights (views)."""
        up, down = self.packed
        views = self.__dict__["_experts"]
        if views[e] is None:
            n, h = 2 * self.intermediate_dim, self.hidden_dim

            def rows(p: PackedWeight, r0: int, r1: int) -> PackedWeight:
                scales = None if p.scales is None else p.scales[r0:r1]
                return PackedWeight(p.data[r0:r1], p.format, (r1 - r0, p.shape[1]), scales)

            views[e] = rows(up, e * n, (e + 1) * n), rows(down, e * h, (e + 1) * h)
        return views[e]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = hidden_states
        if x.dim() != 2 or x.shape[1] != self.hidden_dim or top_k_index.shape != top_k_weights.shape:
            raise ValueError(
                f"QuantizedExperts: hidden_states {list(x.shape)} must be [T, {self.hidden_dim}] and "
                f"top_k_index {list(top_k_index.shape)} / top_k_weights {list(top_k_weights.shape)} [T, K]"
            )
        grad = torch.is_grad_enabled() and (x.requires_grad or top_k_weights.requires_grad)
        if grad or not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16):  # the kernels: no backward
            return self._per_expert(x, top_k_index, top_k_weights)
        if x.shape[0] > FEW_ROWS:
            return self._groups(x, top_k_index, top_k_weights)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._call(*self._kernel_operands(x, top_k_index, top_k_weights), out, cpu_build.threads())
        return out

    def _kernel_operands(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple:
        return x.contiguous(), index.to(torch.int64).contiguous(), weights.to(x.dtype).contiguous()

    def _calls(self, x, index, weights, out, threads: int) -> list[tuple[Any, tuple, tuple]]:
        """The kernel calls: (entry, arguments, the arrays they point into: held by a replay program's call):
        one, or two where gate|up and down are in two formats (two libraries, h between them)."""
        t, k = index.shape
        ops = (x.data_ptr(), index.data_ptr(), weights.data_ptr(), out.data_ptr())
        return [(entry, (*ops, *tail, threads), held) for entry, tail, held in self._resolved(x.dtype, t, k)]

    def _resolved(self, dtype: torch.dtype, t: int, k: int) -> list[tuple]:
        """Per kernel call of ``t`` tokens of ``k`` slots: (entry, the addresses of its sizes array, weight
        addresses and gate form, the objects they point into). One format: made once per size and kept (a
        decode step's call then pays the ctypes call and little else); two: made per call (their h buffer is
        the call's own)."""
        up, down = packed = self.packed
        split = self.format != self.down_format
        cache = self.__dict__.setdefault("_resolved_calls", {})
        hit = cache.get((dtype, t, k))
        if hit is not None and hit[0] is packed and not split:
            return hit[1]
        b = self._buffers

        def ptr(v: torch.Tensor | None) -> int:
            return 0 if v is None or not v.numel() else v.data_ptr()

        h = torch.empty(t * k if split else 0, self.intermediate_dim)
        ptrs = (ctypes.c_int64 * 7)(
            up.data.data_ptr(), ptr(up.scales), down.data.data_ptr(), ptr(down.scales),
            ptr(b["gate_up_bias"]), ptr(b["down_bias"]), ptr(h),
        )  # fmt: skip
        form = self._form_array()
        calls = []
        for fmt, stages in ((self.format, 1), (self.down_format, 2)) if split else ((self.format, 3),):
            sizes = (ctypes.c_int64 * 6)(
                t, k, self.num_experts, self.hidden_dim, self.intermediate_dim, stages
            )
            tail = (ctypes.addressof(sizes), ctypes.addressof(ptrs), form.data_ptr())
            held = (sizes, ptrs, form, h, up, down, b["gate_up_bias"], b["down_bias"])
            calls.append((kernels.experts_entry(fmt, dtype), tail, held))
        if not split:
            cache[(dtype, t, k)] = (packed, calls)
        return calls

    def _form_array(self) -> torch.Tensor:
        """kz_qglu's form: the activation's code, alpha, the gate / activation / up limits (+inf: none), the
        up shift (f32; made once per form)."""
        key = (self.act, tuple(sorted(self.form.items())))
        held = self.__dict__.get("_form")
        if held is None or held[0] != key:
            f, inf = self.form, float("inf")
            values = [kernels.GLU_ACTS[ACTS[self.act]], f.get("alpha", 1.0)]
            values += [inf if f.get(n) is None else f[n] for n in ("gate_limit", "act_limit", "up_limit")]
            held = self.__dict__["_form"] = (key, torch.tensor([*values, f.get("up_shift", 0.0)]))
        return held[1]

    def _call(self, x, index, weights, out, threads: int) -> None:
        for entry, args, _held in self._calls(x, index, weights, out, threads):
            rc = entry(*args)
            if rc == 2:
                self._check_index(index)
            if rc:
                raise MemoryError(f"QuantizedExperts: out of memory for {index.numel()} routed pairs")

    # where c_calls' arguments hold x's, the index's, the weights' and the output's data pointers, and the
    # thread count
    X_ARG, INDEX_ARG, WEIGHTS_ARG, OUT_ARG, THREADS_ARG = 0, 1, 2, 3, 7

    def c_calls(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, out: torch.Tensor):
        """The calls ``self(x, index, weights)`` makes (one, or two for two formats), writing ``out``, for a
        replay program (:class:`kernelize.runtime.replay.Program`; the thread count goes to
        :attr:`THREADS_ARG`); None where the call would not run the kernel (more tokens, another dtype or
        device, operands the kernel would have to convert)."""
        from kernelize.runtime.backend import CCall

        ops = (x, index, weights, out)
        if (
            not all(t.is_cpu and t.is_contiguous() for t in ops)
            or x.dtype not in (torch.float32, torch.bfloat16)
            or out.dtype != x.dtype
            or weights.dtype != x.dtype
            or index.dtype != torch.int64
            or x.dim() != 2
            or out.shape != x.shape
            or index.shape != weights.shape
            or x.shape[0] > FEW_ROWS
        ):
            return None
        return [
            CCall(ctypes.cast(entry, ctypes.c_void_p).value, args, _C_ERRORS, keep=held)
            for entry, args, held in self._calls(x, index, weights, out, 0)
        ]

    def _groups(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Prefill on the CPU: the selected experts dequantized (as x's dtype) into scratch of at most
        :data:`PREFILL_BYTES` a group at a time, each group through the float grouped-expert kernel (the other
        pairs routed to its sentinel), the groups' outputs summed in f32."""
        from kernelize.experts import ExpertsUnsupported, grouped_experts

        self._check_index(index)
        n, h, i = self.num_experts, self.hidden_dim, self.intermediate_dim
        hit = [e for e in torch.unique(index).tolist() if e != n]
        size = max(1, min(len(hit), PREFILL_BYTES // (3 * i * h * x.element_size())))
        kept = _SCRATCH.__dict__.setdefault("by_dtype", {})
        held = kept.get(x.dtype)
        if held is None or held.numel() < size * 3 * i * h:  # kept: a fresh one page-faults on every call
            held = kept[x.dtype] = torch.empty(size * 3 * i * h, dtype=x.dtype)
        up = held[: size * 2 * i * h].view(size, 2 * i, h)
        down = held[size * 2 * i * h : size * 3 * i * h].view(size, h, i)
        total = None
        for g0 in range(0, max(len(hit), 1), size):
            group = hit[g0 : g0 + size]
            where = torch.full((n + 1,), len(group), dtype=torch.int64)  # sentinel: outside the group
            for j, e in enumerate(group):
                kernels.dequantize_rows(self.expert(e)[0], 0, 2 * i, up[j])
                kernels.dequantize_rows(self.expert(e)[1], 0, h, down[j])
                where[e] = j
            biases = {}
            if self._buffers["gate_up_bias"].numel():
                rows = torch.tensor(group)
                biases = {
                    "up_bias": self._buffers["gate_up_bias"].view(n, -1)[rows].to(x.dtype),
                    "down_bias": self._buffers["down_bias"].view(n, -1)[rows].to(x.dtype),
                }
            try:
                y = grouped_experts(
                    x, where[index], weights, up[: len(group)], down[: len(group)], self.act,
                    **biases, **self.form,
                )  # fmt: skip
            except ExpertsUnsupported:
                return self._per_expert(x, index, weights)
            if len(hit) <= size:
                return y
            total = y.float() if total is None else total.add_(y.float())
        return total.to(x.dtype)

    def _check_index(self, index: torch.Tensor) -> None:
        if index.numel() and (int(index.min()) < 0 or int(index.max()) > self.num_experts):
            raise IndexError(
                f"QuantizedExperts: top_k_index holds {int(index.min())}..{int(index.max())}, outside "
                f"[0, {self.num_experts}] (num_experts itself: a pair routed to no expert here)"
            )

    def _per_expert(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each selected expert through its dequantized panels, its tokens' weighted rows summed in f32."""
        from kernelize.ir.experts import split_gate
        from kernelize.ir.ops import ExpertsArgs

        self._check_index(index)
        e_max, b = self.num_experts, self._buffers
        args = ExpertsArgs(self.act, True, **self.form)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(index).tolist():
            if e == e_max:
                continue
            tok, slot = torch.where(index == e)
            up, down = self.expert(e)
            h = _product(x[tok], up).float()
            if b["gate_up_bias"].numel():
                h = h + b["gate_up_bias"].view(e_max, -1)[e].to(h.device)
            y = _product(split_gate(h, args).to(x.dtype), down).float()
            if b["down_bias"].numel():
                y = y + b["down_bias"].view(e_max, -1)[e].to(y.device)
            out.index_add_(0, tok, y * weights[tok, slot, None].float())
        return out.to(x.dtype)

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "format": self.format, "num_experts": self.num_experts, "hidden": self.hidden_dim,
            "intermediate": self.intermediate_dim, "act": self.act, "form": self.form,
            "down_format": self.down_format,
        }  # fmt: skip

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.format, self.act = get_format(state["format"]).name, state["act"]
        self.down_format = get_format(state.get("down_format", self.format)).name
        self.num_experts, self.hidden_dim = state["num_experts"], state["hidden"]
        self.intermediate_dim, self.form = state["intermediate"], _form(state.get("form"), self.act)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        names = ("gate_up_qscales", "down_qscales", "gate_up_bias", "down_bias")
        return apply_keeping_f32(self, names, super()._apply, fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001
        # a fresh module may have another format or shape: take the stored buffers' shapes first
        for name in list(self._buffers):
            src = state_dict.get(prefix + name)
            if src is not None:
                setattr(self, name, torch.empty_like(src))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, format={self.format}, act={self.act}"
            + ("" if self.down_format == self.format else f", down_format={self.down_format}")
            + "".join(f", {k}={v}" for k, v in self.form.items())
        )


def _product(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """``x @ W.T`` of the packed weight's values through dequantized panels whatever the rows (on the CPU;
    elsewhere, or where x needs a gradient, :func:`~kernelize.quant.ops.linear`), in x's dtype or f32."""
    if not x.is_cpu or (torch.is_grad_enabled() and x.requires_grad):
        return linear(x, packed)
    x = (x if native_panels(x.dtype) else x.float()).contiguous()
    out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
    panels(x, packed, None, out)
    return out


def _form(form: dict[str, float | None] | None, act: str) -> dict[str, float | None]:
    """The gate form's fields that differ from ``act(gate) * up`` (checked by ExpertsArgs' own rules)."""
    from kernelize.ir.ops import ExpertsArgs

    fields = {"alpha": 1.0, "gate_limit": None, "act_limit": None, "up_limit": None, "up_shift": 0.0}
    form = {k: v for k, v in (form or {}).items() if fields.get(k, object()) != v}
    if set(form) - set(fields):
        raise ValueError(f"QuantizedExperts: unknown gate form fields {sorted(set(form) - set(fields))}")
    ExpertsArgs(act, True, **form)  # raises for values the kernels do not take
    return form


_C_ERRORS = "the packed experts kernel: 1 out of memory, 2 an index outside [0, E]"

__all__ = ["ACTS", "QuantizedExperts", "experts_reason"]
