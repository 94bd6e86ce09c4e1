"""``linear(x, packed, bias)``: a matmul against a packed weight, the torch-callable entry.

On the CPU, up to :data:`FEW_ROWS` rows (decode) run the generated few-row kernel, which reads the packed
bytes and never widens the weight in memory. More rows (prefill) are compute-bound: the weight is
dequantized a panel of :data:`PANEL_ROWS` output rows at a time into one f32 scratch (bf16, twice the rows,
where the CPU's bf16 GEMMs are native: :func:`native_panels`) and each panel goes through ``torch.mm`` into
its slice of the output, so no full float copy of the weight is ever held.

On a CUDA device the generated Triton or CUDA C kernels (:mod:`kernelize.quant.gpu`) read the packed bytes
and dequantize in registers, for decode and prefill alike; x may also be float16 there. Other devices raise.

Example:
    >>> import torch
    >>> from kernelize.quant.formats import quantize
    >>> p = quantize(torch.randn(16, 64), "q8_0")
    >>> linear(torch.randn(2, 64), p).shape  # doctest: +SKIP
    torch.Size([2, 16])
"""

from __future__ import annotations

import ctypes

import torch

from kernelize.codegen import cpu_build
from kernelize.quant import gpu, kernels
from kernelize.quant.formats import PackedWeight, dequantize
from kernelize.runtime.backend import CCall

FEW_ROWS = 8  # rows up to which the packed kernel runs (decode); above, panels of dequantized weight
# output rows per dequantized panel (the GEMM's rows; 1024 x 4096 f32: 16 MiB of scratch). A 300 M Llama's
# 512-token prompt, 2 threads, Zen 3, against our bf16 prefill: panels of 256 rows 0.93-0.94x, 512 0.97-0.98x,
# 1024 1.00-1.03x, 2048 1.01-1.09x (q4_0 / q8_0)
PANEL_ROWS = 1024


# device type -> the x dtypes its kernels take
DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.float32, torch.bfloat16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}


def _check(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(packed, PackedWeight):
        raise TypeError(
            f"linear: `packed` must be a PackedWeight (from quantize()), got {type(packed).__name__}"
        )
    n, k = packed.shape
    dev = x.device
    if dev.type not in DTYPES:
        raise ValueError(
            f"linear: input x is on {dev}; the packed kernels run on {' and '.join(DTYPES)}, so move the "
            "input and the layer there (module.to('cuda') or .to('cpu'))"
        )
    if x.dtype not in DTYPES[dev.type]:
        names = " or ".join(str(d).removeprefix("torch.") for d in DTYPES[dev.type])
        raise TypeError(
            f"linear: input x has dtype {x.dtype}; the packed kernels on {dev.type} take {names}, so "
            "convert it first (x.float() or x.bfloat16())"
        )
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(
            f"linear: input x of shape {tuple(x.shape)} does not match the packed weight [N={n}, K={k}]: x's "
            f"last dimension must be K = {k}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"linear: bias of shape {tuple(bias.shape)} must be 1-d of length N = {n}")
    held = [("packed weight", packed.data), ("row scales", packed.scales), ("bias", bias)]
    for what, t in held:
        if t is not None and t.device != dev:
            raise ValueError(
                f"linear: the {what} is on {t.device} but input x is on {dev}; move the layer to x's device "
                f"(module.to({str(dev)!r}))"
            )


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` the packed weight's values.

    Args:
        x: ``[..., K]`` float32 or bfloat16 on the CPU; float32, bfloat16 or float16 on a CUDA device
            (the packed tensors and bias on the same device).
        packed: the weight ``[N, K]`` (:func:`kernelize.quant.formats.quantize`).
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype. On the CPU, decode rows quantize ``x`` to int8 blocks of 32 (the
        llama.cpp scheme), so they differ from a float product by that rounding; prefill rows multiply in
        f32. On CUDA, x is used as it is and products accumulate in f32. Where ``x`` needs a gradient (a
        LoRA adapter trained over packed layers) the product is ``F.linear`` over the dequantized weight:
        the kernels have no backward, and their output would silently cut the graph.

    Example:
        >>> from kernelize.quant.formats import quantize
        >>> linear(torch.ones(1, 32), quantize(torch.ones(4, 32), "int8")).tolist()  # doctest: +SKIP
        [[32.0, 32.0, 32.0, 32.0]]
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return differentiable(x, packed, bias)
    fast = _few_rows_cpu(x, packed, bias)
    if fast is not None:
        return fast
    _check(x, packed, bias)
    n, k = packed.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    b = None if bias is None else bias.detach().float().contiguous()
    RUNS[x.device.type](x2, packed, b, out)
    return out.reshape(*lead, n)


def differentiable(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` by ``F.linear`` over the dequantized weight (W itself stays packed and frozen): a
    product autograd can differentiate with respect to ``x``."""
    w = dequantize(packed).to(device=x.device, dtype=x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def _few_rows_cpu(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Decode on the CPU, the common call, with the few checks it needs (None: anything else, which takes
    the full checks): a decode step makes dozens of these calls, and each microsecond of Python is paid
    by every one of them."""
    if not (isinstance(packed, PackedWeight) and x.is_cpu and packed.data.is_cpu and x.dim() > 1):
        return None
    n, k = packed.shape
    m = x.numel() // k if x.shape[-1] == k else 0
    if not 0 < m <= FEW_ROWS or x.dtype not in DTYPES["cpu"]:
        return None
    if bias is not None and not (
        bias.is_cpu and bias.dtype == torch.float32 and bias.shape == (n,) and bias.is_contiguous()
    ):
        return None
    out = torch.empty(m, n, dtype=x.dtype)
    kernels.gemv(x.reshape(m, k).contiguous(), packed, bias, out)
    return out.view(*x.shape[:-1], n)


class FewRows:
    """The few-row CPU kernel call of one packed weight, resolved once (entry points, addresses, sizes,
    epilogue): :func:`linear`'s decode path for callers that hold the weight across calls (the packed
    decoder block makes four per layer per token). A call pays a size check, the output's allocation and
    the ctypes call; it returns None for what it does not take (more rows, another dtype or device, a
    non-contiguous x), which the caller runs through :func:`linear` / :func:`kernelize.quant.fused.glu`.

    ``act`` (a :data:`kernels.GLU_ACTS` name): ``packed`` is a merged gate|up weight and the call returns
    ``act(x @ gate.T) * (x @ up.T)``, as :func:`kernels.gemv` does.

    Example:
        >>> from kernelize.quant.formats import quantize
        >>> p = quantize(torch.randn(16, 64), "q8_0")
        >>> FewRows(p)(torch.randn(2, 64)).shape  # doctest: +SKIP
        torch.Size([2, 16])
    """

    __slots__ = ("bias", "entries", "k", "n_out", "packed", "up", "act", "weight_ptrs")

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None, act: str | None = None):
        n, self.k = packed.shape
        self.up = 0 if act is None else n // 2
        self.n_out, self.act = n - self.up, kernels.GLU_ACTS.get(act, 0)
        assert FewRows.takes(packed, bias), "FewRows: the weight and bias must be ones FewRows.takes"
        self.packed, self.bias = packed, bias  # held: the kernel reads them through the addresses below
        scales = 0 if packed.scales is None else packed.scales.data_ptr()
        bias_ptr = 0 if bias is None else bias.data_ptr()
        self.weight_ptrs = (packed.data.data_ptr(), scales, n - self.up, bias_ptr)
        # output in x's dtype, as linear()
        self.entries = {d: kernels.entry(packed.format.name, d, d) for d in DTYPES["cpu"]}

    @staticmethod
    def takes(packed: PackedWeight, bias: torch.Tensor | None) -> bool:
        """Whether the kernel reads ``packed`` and ``bias`` as they are (on the CPU; the bias f32 ``[N]``,
        contiguous)."""
        if not packed.data.is_cpu:
            return False
        return bias is None or (
            bias.is_cpu and bias.dtype == torch.float32 and bias.shape == (packed.shape[0],)
            and bias.is_contiguous()
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        k = self.k
        if x.shape[-1] != k or not x.is_cpu or not x.is_contiguous() or x.dim() < 2:
            return None
        m = x.numel() // k
        entry = self.entries.get(x.dtype)
        if entry is None or not 0 < m <= FEW_ROWS:
            return None
        out = torch.empty(m, self.n_out, dtype=x.dtype)
        w, s, n, b = self.weight_ptrs
        entry(x.data_ptr(), m, k, w, s, n, b, out.data_ptr(), cpu_build.threads(), self.up, self.act)
        return out.view(*x.shape[:-1], self.n_out)

    # where c_call's arguments hold x's and the output's data pointers, and the thread count
    X_ARG, OUT_ARG, THREADS_ARG = 0, 7, 8

    def c_call(self, x: torch.Tensor, out: torch.Tensor) -> CCall | None:
        """The call ``self(x)`` makes, writing into ``out`` (``[rows, n]`` contiguous, x's dtype), for a
        replay program (:class:`kernelize.runtime.replay.Program`; the thread count goes to argument
        :attr:`THREADS_ARG`); None for what the call does not take."""
        k, m = self.k, x.numel() // self.k
        entry = self.entries.get(x.dtype)
        if (
            x.shape[-1] != k
            or not x.is_cpu
            or not x.is_contiguous()
            or entry is None
            or not 0 < m <= FEW_ROWS
        ):
            return None
        if out.shape[-1] != self.n_out or out.numel() != m * self.n_out or not out.is_contiguous():
            return None
        if out.dtype != x.dtype:
            return None
        w, s, n, b = self.weight_ptrs
        fn = ctypes.cast(entry, ctypes.c_void_p).value
        args = (x.data_ptr(), m, k, w, s, n, b, out.data_ptr(), 0, self.up, self.act)
        return CCall(fn, args, "the packed few-row kernel cannot fail", keep=(self.packed, self.bias))


def _cpu(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if x.shape[0] <= FEW_ROWS:
        kernels.gemv(x, packed, bias, out)
    else:
        panels(x if native_panels(x.dtype) else x.float(), packed, bias, out)


def native_panels(dtype: torch.dtype) -> bool:
    """Whether prefill's panels are ``dtype`` (bf16 activations where the CPU's bf16 GEMMs are native:
    AVX512-BF16 or AMX, `cpu_gemv.lowp_gemm_in_f32`) instead of f32: one 4096 x 1536 q8_0 weight, 512 rows of
    x, AMX Xeon, 2 threads: 29 ms with f32 panels, 5.1-5.5 ms with bf16 ones (3.7 ms for the bf16 weight
    itself); a 300 M Llama's 512-token prompt: q8_0 / q4_0 / q4_k 0.98x / 1.05x / 1.00x our bf16 prefill."""
    from kernelize.codegen.cpu_gemv import lowp_gemm_in_f32
    from kernelize.ir.dtypes import DType

    return dtype == torch.bfloat16 and not lowp_gemm_in_f32(DType.BF16)


def panels(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Prefill: ``out[:, n0:n1] = x @ W[n0:n1].T`` panel by panel, dequantized into one scratch of x's dtype.
    In f32 the product is built transposed (``[N, M]``) so each panel's result is a contiguous slice that
    ``torch.mm`` writes; in bf16 (:func:`native_panels`) ``x @ panel.T`` (oneDNN's native bf16 GEMM: 0.86
    against 1.44 ms for the transposed product of a 1024-row panel, 512 rows of x) goes into the output's
    columns."""
    n, k = packed.shape
    # bf16 panels: twice the rows in the same bytes (a 1536 x 4096 weight, 512 rows of x, AMX Xeon: 1024
    # rows 6.3-7.1 ms, 2048 4.9-5.2, against 3.8 for the bf16 weight itself)
    rows = min(PANEL_ROWS * 4 // x.element_size(), n)
    scratch = torch.empty(rows * k, dtype=x.dtype)
    if x.dtype != torch.float32:
        for n0 in range(0, n, rows):
            panel = kernels.dequantize_rows(packed, n0, min(n0 + rows, n), scratch)
            out[:, n0 : n0 + panel.shape[0]] = torch.mm(x, panel.T)
        if bias is not None:
            out += bias
        return
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    for n0 in range(0, n, rows):
        n1 = min(n0 + rows, n)
        torch.mm(kernels.dequantize_rows(packed, n0, n1, scratch), x.T, out=out_t[n0:n1])
    if bias is not None:
        out_t += bias[:, None]
    out.copy_(out_t.T)


# device type -> its kernels: run(x [M, K] contiguous, packed, bias f32 or None, out [M, N]); DTYPES' keys
RUNS = {"cpu": _cpu, "cuda": gpu.run}

__all__ = [
    "DTYPES",
    "FEW_ROWS",
    "PANEL_ROWS",
    "RUNS",
    "FewRows",
    "differentiable",
    "linear",
    "native_panels",
    "panels",
]
