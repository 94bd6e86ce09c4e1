"""Fused linear + cross-entropy: ``cross_entropy(hidden @ weight.T + bias, labels)`` in row chunks.

The full ``[tokens, vocab]`` logits matrix is never materialised: rows go through in chunks whose logits
are about as large as the hidden states (one reused buffer); for each chunk a generated row kernel
(:func:`chunk_grad_math`) turns the logits into the softmax part of their gradient plus each row's
log-sum-exp and mean, the one-hot part is scattered in, and the chunk's two matmuls give the gradients for
the hidden states and the LM-head weight. Backward returns the stored gradients (scaled when the upstream
gradient is not 1), so a training step holds ``hidden + weight`` sized gradients and one chunk of logits
instead of two ``[tokens, vocab]`` matrices.

On the CPU in f32, the logits and hidden-state-gradient products are oneDNN matmuls
(:func:`kernelize.codegen.cpu_gemv.onednn_linear`: 256 x 512 x 32000, 2 threads, 158 -> 209 and 180 -> 208
GFLOP/s against MKL's ``torch.mm``), the weight gradient stays in MKL (faster there), and the gradients are
new tensors that ask for transparent huge pages before their first touch
(:func:`kernelize.runtime.memory.empty_huge`: ~30 faults of 2 MiB for a [32000, 512] f32 gradient, not
16,000 of 4 KiB). Each chunk's logits are dropped before the next chunk's are made, so the next takes
the same heap memory.

Formula per row ``i`` with logits ``z``, ``p = softmax(z)``, label ``y``, smoothing ``e``, vocab ``V``:
``loss_i = lse(z) - (1 - e) z_y - e mean(z)``; ``dz = p - (1 - e) onehot(y) - e / V``; rows whose label is
``ignore_index`` contribute neither loss nor gradient; ``mean`` divides by the count of the other rows.

Example:
    >>> loss = fused_linear_cross_entropy(h, lm_head.weight, labels)  # doctest: +SKIP
    >>> loss.backward()  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from kernelize import hub
from kernelize.codegen.cpu_gemv import onednn_gemm, onednn_linear
from kernelize.runtime.memory import OutputPool, empty_huge, pool_of

REDUCTIONS = ("mean", "sum")


class LossAndGrads(NamedTuple):
    """What the chunked pass returns: the reduced loss and the gradients for a unit upstream gradient."""

    loss: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None


MIN_CHUNK = 256


def chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: logits about as large as the hidden states, but at least :data:`MIN_CHUNK` rows.

    The floor is measured: below ~256 rows the CPU GEMMs lose more than chunking saves (1024 x 512 hidden
    states at vocab 32k, forward+backward on 2 threads: 16-row chunks 11.7 s, 256 rows 0.93 s, 1024 rows
    0.75 s, unchunked eager 2.5 s). A power of two, never more than `tokens` rounded up.
    """
    per = max(1, math.ceil(vocab / max(hidden, 1)))
    rows = max(MIN_CHUNK, math.ceil(tokens / per))
    rows = min(rows, max(tokens, 1))
    return 1 << (rows - 1).bit_length()


def chunk_grad_math(z: torch.Tensor, scale: torch.Tensor, *, smoothing: float) -> tuple[torch.Tensor, ...]:
    """Per row of logits ``z``: ``dz = (softmax(z) - smoothing / V) * scale`` in ``z``'s dtype, ``lse(z)`` and
    ``mean(z)`` (f32). One generated row kernel: the row is read from memory once and again from cache,
    where torch's ``logsumexp``, ``sub``, ``exp`` and ``mul`` make about six passes over the chunk."""
    zf = z.float()
    m = zf.amax(-1, keepdim=True)
    e = torch.exp(zf - m)
    s = e.sum(-1, keepdim=True)
    dz = e * (scale / s) - scale * (smoothing / z.shape[-1])
    return dz.to(z.dtype), m + torch.log(s), zf.mean(-1, keepdim=True)


def _launch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    chunk: int,
    need_weight_grad: bool,
) -> LossAndGrads:
    """One pass over row chunks: the logits (a oneDNN matmul on the CPU in f32, else into one reused
    buffer), the generated row kernel writing the softmax part of their gradient over them, the one-hot
    part scattered in, then the two matmuls."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    valid = labels != ignore_index
    count = int(valid.sum()) if reduction == "mean" else 1
    row_scale = torch.where(valid, 1.0 / max(count, 1), 0.0).unsqueeze(1)
    grad_h = empty_huge(hidden.shape, hidden.dtype, hidden.device)  # new tensors: autograd adopts them
    grad_w = empty_huge(weight.shape, torch.float32, weight.device) if need_weight_grad else None
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if bias is not None else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    keep = 1.0 - label_smoothing
    logits = (
        None
        if onednn_gemm(hidden, weight)
        else _pool_of(weight).empty("logits", (min(chunk, tokens), vocab), hidden.dtype)
    )
    for start in range(0, tokens, chunk):
        h = hidden[start : start + chunk]
        scale = row_scale[start : start + chunk]
        z = onednn_linear(h, weight, bias)
        if z is None:
            z = logits[: h.shape[0]]
            torch.mm(h, weight.t(), out=z) if bias is None else torch.addmm(bias, h, weight.t(), out=z)
        safe_y = torch.where(valid[start : start + chunk], labels[start : start + chunk], 0).unsqueeze(1)
        z_y = z.gather(1, safe_y).float()
        # the gradient over the logits in place: one chunk-sized buffer, not two
        dz, lse, mean = hub.run_into(chunk_grad_math, [z, scale], [z, None, None], smoothing=label_smoothing)
        row_loss = lse - keep * z_y - label_smoothing * mean
        total += (row_loss * scale).sum()
        dz.scatter_add_(1, safe_y, (-keep * scale).to(dz.dtype))
        dh = onednn_linear(dz, weight.t())
        if dh is None:
            torch.mm(dz, weight, out=grad_h[start : start + chunk])
        else:
            grad_h[start : start + chunk] = dh
        if grad_w is not None:
            _accumulate(grad_w, dz.t(), h, first=start == 0)
        if grad_b is not None:
            grad_b += dz.sum(0, dtype=torch.float32)
        # the next chunk's logits take this chunk's memory: two chunks alive at once (~65 MB at vocab 32k)
        # would make glibc trim the heap after the step and page-fault it back in the next one
        del z, dz
    return LossAndGrads(total, grad_h, grad_w, grad_b)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (+)= a @ b`` in f32 (the first chunk writes ``acc``: no zero-filled start)."""
    if a.dtype != torch.float32:  # 16-bit matmul, accumulated across chunks in f32
        acc.copy_(a @ b) if first else acc.add_(a @ b)
    elif first:
        torch.mm(a, b, out=acc)
    else:
        acc.addmm_(a, b)


def _pool_of(weight: torch.Tensor) -> OutputPool | _PlainBuffers:
    """The buffers of the loss over ``weight``: the logits chunk is reused call after call. CPU only;
    elsewhere plain allocations."""
    return pool_of(weight) if weight.device.type == "cpu" else _PlainBuffers(weight.device)


class _PlainBuffers:
    """:class:`OutputPool`'s interface over plain allocations on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, key, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and the gradients; backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, reduction, chunk):  # type: ignore[override]
        out = _launch(
            hidden,
            weight,
            bias,
            labels,
            ignore_index,
            label_smoothing,
            reduction,
            chunk,
            weight.requires_grad,
        )
        grads = [out.grad_hidden, out.grad_weight, out.grad_bias]
        ctx.has = [g is not None for g in grads]
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        return out.loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        it = iter(ctx.saved_tensors)
        gh, gw, gb = (next(it) if has else None for has in ctx.has)
        # the usual `loss.backward()` seeds 1: the stored gradients as they are, which saves a pass over,
        # and a copy of, the LM head's weight gradient (checked on the CPU only: no device sync)
        by = None if grad_loss.device.type == "cpu" and grad_loss.item() == 1.0 else grad_loss
        return (
            _scaled(gh, by, gh.dtype),
            _scaled(gw, by, ctx.dtypes[0]),
            _scaled(gb, by, ctx.dtypes[1]),
            *(None,) * 5,
        )


def _scaled(
    grad: torch.Tensor | None, by: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor | None:
    """``grad * by`` (``grad`` when ``by`` is None) in ``dtype``."""
    if grad is None:
        return None
    return (grad if by is None else grad * by).to(dtype)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` without the ``[tokens, vocab]`` logits.

    Args:
        hidden: ``[..., hidden]`` activations before the LM head (leading dims are flattened).
        weight: ``[vocab, hidden]`` LM-head weight.
        labels: integer targets, shape ``hidden.shape[:-1]``; ``ignore_index`` rows are skipped.
        bias: optional ``[vocab]`` LM-head bias.
        label_smoothing: in ``[0, 1]``, as in ``F.cross_entropy``.
        reduction: ``"mean"`` (over non-ignored rows) or ``"sum"``.
        chunk_size: rows per chunk (default: logits of a chunk about the size of ``hidden``).

    Raises:
        ValueError: an unsupported reduction, smoothing outside [0, 1], or shapes that do not fit.
        TypeError: non-integer labels or mismatched dtypes.

    Example:
        >>> loss = fused_linear_cross_entropy(h, lm_head.weight, labels, ignore_index=-100)  # doctest: +SKIP
    """
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"fused_linear_cross_entropy: reduction={reduction!r} is not supported (use one of "
            f"{REDUCTIONS}); per-row losses need the logits: use F.cross_entropy(..., reduction='none')"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"fused_linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(
            f"fused_linear_cross_entropy: labels must be integer class indices, got {labels.dtype}"
        )
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(
            f"fused_linear_cross_entropy: hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must "
            "share a dtype; cast them first"
        )
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
            f"labels {tuple(labels.shape)} do not fit (want [..., H], [V, H] and [...])"
        )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_size or chunk_rows(h2.shape[0], weight.shape[0], weight.shape[1])
    loss = _FusedLinearCrossEntropy.apply(
        h2, weight, bias, labels.reshape(-1), ignore_index, float(label_smoothing), reduction, chunk
    )
    return loss


class LinearCrossEntropy(nn.Module):
    """An LM head plus its loss: ``forward(hidden, labels)`` returns the loss; reads ``self.weight`` (and
    ``self.bias``, ``self.ignore_index``, ``self.label_smoothing`` when present)."""

    has_backward = True
    can_torch_compile = False

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(
            hidden,
            self.weight,
            labels,
            getattr(self, "bias", None),
            ignore_index=getattr(self, "ignore_index", -100),
            label_smoothing=getattr(self, "label_smoothing", 0.0),
        )
