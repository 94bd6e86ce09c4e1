"""The CPU attention kernel: ``templates/cpu_attention.cpp`` filled for one ``ATTENTION`` kernel.

Static in the source: the storage dtypes, the head dims, causal and the mask kind (so the inner loops have
constant trip counts and unroll into register tiles). At run time: the sizes (batch, heads, lengths) and
every operand's strides, read from the tensors the launch gets, so transposed views (what transformers
passes) and broadcast masks (stride 0) are read in place. Only a head dim whose stride is not 1 is copied.

Example:
    >>> src, fn = render_attention(kernel)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import AttentionKernel
from kernelize.codegen import cpu_build
from kernelize.codegen.render import Renderer, c_name, score_mod_lines
from kernelize.codegen.template import fill, load_template
from kernelize.ir.attention import split_operands
from kernelize.ir.dtypes import DType
from kernelize.ir.ops import AttentionArgs

# storage types of the prelude (16-bit floats as bit patterns, widened to f32 on load)
C_TYPES = {DType.F32: "float", DType.F16: "kz_f16", DType.BF16: "kz_bf16", DType.BOOL: "bool"}
MASK_CODES = {"none": 0, "bool": 1, "add": 2}
# 16-row micro tiles per prefill block: a key / value block in cache serves 64 query rows (with AVX-512's
# 16-lane vectors the tiles hold 32 rows, half as many of them: still 64)
ROW_GROUPS = 4
DECODE_ROWS = 4  # a key head with at most this many query rows (heads sharing it x positions) decodes
PARALLEL_MIN = 1 << 16  # multiply-adds below which one thread beats waking the team


def check_attention_kernel(kernel: AttentionKernel) -> AttentionArgs:
    """The node's args, after checking the generated kernels support its dtypes (f32 / f16 / bf16)."""
    node = kernel.node
    if node.dtype not in (DType.F32, DType.F16, DType.BF16):
        raise ValueError(
            f"attention kernel {kernel.name}: dtype {node.dtype} is not supported by the generated kernels "
            "(f32, f16, bf16); cast the operands or run the reference backend"
        )
    args: AttentionArgs = node.arg
    mask = split_operands(node.src, args)[3]
    if mask is not None and mask.dtype not in C_TYPES:
        raise ValueError(f"attention kernel {kernel.name}: mask dtype {mask.dtype} is not supported")
    return args


def render_attention(kernel: AttentionKernel, prelude: str) -> tuple[str, str]:
    """The C++ source of an ``ATTENTION`` kernel and its exported function name."""
    args = check_attention_kernel(kernel)
    node = kernel.node
    q, _, v = node.src[:3]
    name = c_name(kernel.name)
    mask = split_operands(node.src, args)[3]
    mask_t = C_TYPES[mask.dtype] if mask is not None else "float"
    lines, result = score_mod_lines(Renderer(), args.score_mod, ("sm0", "sm1", "sm2", "sm3"))
    values = dict(
        PRELUDE=prelude,
        T=C_TYPES[node.dtype],
        TM=mask_t,
        D=str(q.shape[-1]),
        DV=str(v.shape[-1]),
        CAUSAL=str(int(args.causal)),
        MASK=str(MASK_CODES[args.mask]),
        HAS_MOD="true" if args.score_mod is not None else "false",
        SINKS="true" if args.sinks else "false",
        SCORE_MOD="\n".join(f"    {line}" for line in [*lines, f"return {result};"]),
        F32="true" if node.dtype is DType.F32 else "false",
        DECODE_ROWS=str(DECODE_ROWS),
        ROW_GROUPS=str(ROW_GROUPS),
        PARALLEL_MIN=str(PARALLEL_MIN),
    )
    # the namespace is named after what makes the source (never its name, so sources the same up to the
    # name stay the same: cpu_build.same_source_groups)
    ns = "kz_attention_" + hashlib.sha1(repr(sorted(values.items())).encode()).hexdigest()[:16]
    return fill(load_template("cpu_attention.cpp"), NAME=name, NS=ns, **values), name


ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_int]  # the scale as its f32 bits


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride on its last axis (a copy only when it has another stride)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def scale_bits(scale: float) -> int:
    """The f32 bits of ``scale``, as the kernel takes it (an integer argument, so that a replay program
    calls it as it calls the other kernels)."""
    return struct.unpack("<I", struct.pack("<f", scale))[0]


def attention_launcher(fn, kernel: AttentionKernel, scale: float | None = None):
    """A ``launch(operands, [out], sizes)`` calling the compiled function with the operands' own strides;
    ``launch.c_call(operands, [out])`` is the same call for ``kz_replay`` (:class:`CCall`; its ``keep``
    holds the sizes array ``[batch, heads, kv heads, query length, key length]`` and the strides array the
    arguments point to: a replay program may write a new key length into the first).

    ``scale`` overrides the node's (one compiled kernel serves every scale: it is a call argument).
    """
    from kernelize.runtime.backend import CCall

    args: AttentionArgs = kernel.node.arg
    bits = scale_bits(args.scale if scale is None else scale)
    address = ctypes.cast(fn, ctypes.c_void_p).value
    error = f"cpu attention kernel {kernel.name}: out of memory for the decode partials"

    def arguments(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]):
        q, k, v, m, sinks = split_operands(reads, args)
        k, v = unit_last(k), unit_last(v)
        (out,) = writes
        assert out.is_contiguous(), "attention output must be contiguous"
        if sinks is not None:
            sinks = sinks.float().contiguous()
        shape = (ctypes.c_int64 * 5)(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
        st = (*q.stride(), *k.stride(), *v.stride(), *(m.stride() if m is not None else (0, 0, 0, 0)))
        ptrs = [t.data_ptr() if t is not None else 0 for t in (q, k, v, m, sinks, out)]
        return ptrs, shape, (ctypes.c_int64 * 16)(*st), (k, v, sinks)

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int] | None = None
    ) -> None:
        ptrs, shape, strides, _ = arguments(reads, writes)
        if fn(*ptrs, shape, strides, bits, cpu_build.threads()):
            raise MemoryError(error)

    def c_call(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> CCall:
        ptrs, shape, strides, held = arguments(reads, writes)
        addresses = (ctypes.addressof(shape), ctypes.addressof(strides))
        return CCall(
            address, (*ptrs, *addresses, bits), error, raises=MemoryError, keep=(shape, strides, *held)
        )

    launch.c_call = c_call
    return launch


__all__ = ["attention_launcher", "check_attention_kernel", "render_attention", "scale_bits", "unit_last"]
