"""The Triton attention kernel: ``templates/triton_attention.py.tmpl`` filled for one ``ATTENTION`` kernel.

One program per (query block of ``BM`` rows, batch x query head, key split). Prefill uses one split; decode
(few query blocks, long keys) splits the keys so every multiprocessor gets work, and a second kernel
combines the splits' (max, sum, accumulator) partials. Operands are read through their strides (runtime
arguments), so transposed views are not copied.

Example:
    >>> ck = compile_attention(kernel)  # doctest: +SKIP
    >>> ck.launch([q, k, v], [out], {})  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import Kernel
from kernelize.codegen.cpu_attention import MASK_CODES, check_attention_kernel
from kernelize.codegen.render import score_mod_lines
from kernelize.codegen.template import fill, load_template
from kernelize.codegen.triton_base import TritonRenderer
from kernelize.ir.attention import split_operands
from kernelize.ir.dtypes import DType
from kernelize.runtime.backend import CompiledKernel, KernelCompileError

BM, BN, NUM_WARPS = 64, 64, 4
DECODE_BM = 16  # tl.dot needs 16 rows at least
MIN_SPLIT = 256  # keys per split, at least


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def render_attention(kernel: Kernel) -> str:
    """The Triton module source of an ``ATTENTION`` kernel (functions ``<name>`` and ``<name>_combine``)."""
    args = check_attention_kernel(kernel)
    q, _, v = kernel.node.src[:3]
    d, dv = int(q.shape[-1]), int(v.shape[-1])
    # the score modification on the tile: query positions counted among the keys, key positions, the head
    inputs = ("s", "(rm[:, None] + (LK - LQ))", "rn[None, :]", "h")
    lines, result = score_mod_lines(TritonRenderer(), args.score_mod, inputs, typed=False)
    if lines:
        lines.append(f"s = {result}")
    prelude = fill(load_template("triton_prelude.py.tmpl"), KERNEL=kernel.name) if lines else ""
    return fill(
        load_template("triton_attention.py.tmpl"),
        KERNEL=kernel.name,
        NAME=kernel.name,
        D=str(d),
        DV=str(dv),
        BD=str(max(16, next_power_of_2(d))),
        BDV=str(max(16, next_power_of_2(dv))),
        CAUSAL=str(args.causal),
        MASK=str(MASK_CODES[args.mask]),
        SINKS=str(args.sinks),
        PRECISION=', input_precision="ieee"' if kernel.node.dtype is DType.F32 else "",
        PRELUDE=prelude,
        SCORE_MOD="".join(f"        {line}\n" for line in lines),
    )


def plan_launch(lq: int, lk: int, programs_per_split: int, processors: int) -> tuple[int, int, int]:
    """(rows per program, key splits, keys per split) for one call."""
    bm = BM if lq > DECODE_BM else DECODE_BM
    blocks = -(-lq // bm) * programs_per_split
    nsplit = 1
    if blocks < processors and lk >= 2 * MIN_SPLIT:
        nsplit = min(-(-processors // blocks), lk // MIN_SPLIT)
        nsplit = 1 << (nsplit.bit_length() - 1)  # a power of two: few distinct compiled variants
    return bm, nsplit, -(-lk // nsplit)


def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: long keys get split, which exercises the combine kernel


def compile_attention(kernel: Kernel, interpret: bool) -> CompiledKernel:
    """Load the rendered module (disk + memory cached) and return the launch for the runtime."""
    from kernelize.codegen.triton_base import load_module
    from kernelize.runtime.cache import KERNELS

    source = render_attention(kernel)
    key = (hashlib.sha256(source.encode()).hexdigest(), "interpret" if interpret else "cuda")
    try:
        module = KERNELS.get_or_build(key, lambda: load_module(source, kernel.name, interpret))
    except Exception as e:
        raise KernelCompileError(kernel.name, key[0], f"{type(e).__name__}: {e}", source, "triton") from e
    fn, combine = getattr(module, kernel.name), getattr(module, f"{kernel.name}_combine")
    args = kernel.node.arg
    upcast = interpret or kernel.node.dtype is DType.F32

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int] | None
    ):
        q, k, v, m, sinks = split_operands(reads, args)
        sinks = sinks.float().contiguous() if sinks is not None else None
        (out,) = writes
        b, hq, lq, _ = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        bm, nsplit, split_len = plan_launch(lq, lk, b * hq, _processors(q.device))
        part = (
            out
            if nsplit == 1
            else torch.empty(b * hq * nsplit * lq * (out.shape[-1] + 2), dtype=torch.float32, device=q.device)
        )
        mst = m.stride() if m is not None else (0, 0, 0, 0)
        grid = (-(-lq // bm), b * hq, nsplit)
        fn[grid](
            q,
            k,
            v,
            m if m is not None else q,
            sinks if sinks is not None else q,
            out,
            part,
            hq,
            lq,
            lk,
            hq // hkv,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *mst,
            args.scale,
            split_len,
            BM=bm,
            BN=BN,
            NSPLIT=nsplit,
            UPCAST=upcast,
            num_warps=NUM_WARPS,
        )
        if nsplit > 1:
            combine[(-(-lq // bm), b * hq)](part, out, hq, lq, BM=bm, NSPLIT=nsplit, num_warps=NUM_WARPS)

    return CompiledKernel(kernel.name, "triton", source, launch, kernel)


def aot_jobs(kernel: Kernel, arch: int, path: str, nsplit: int = 1) -> list[dict]:
    """``triton.compile`` jobs (see :mod:`kernelize.codegen.triton_aot`) for the attention kernel and, when
    ``nsplit > 1``, its combine kernel."""
    from kernelize.codegen.triton_base import SIG

    node = kernel.node
    t = "*" + SIG[node.dtype]
    mask = split_operands(node.src, node.arg)[3]
    mask_t = "*" + SIG[mask.dtype] if mask is not None else t
    sig = {
        "q_ptr": t,
        "k_ptr": t,
        "v_ptr": t,
        "m_ptr": mask_t,
        "sink_ptr": "*fp32" if node.arg.sinks else t,
        "o_ptr": t,
        "part_ptr": "*fp32" if nsplit > 1 else t,
    }
    sig.update(dict.fromkeys(("HQ", "LQ", "LK", "G"), "i32"))
    sig.update(
        {
            f"s{o}{a}": "i32"
            for o in "qkvm"
            for a in ("b", "h", "l" if o != "m" else "l", "d" if o != "m" else "k")
        }
    )
    sig.update({"scale": "fp32", "SPLIT_LEN": "i32"})
    bm = BM if nsplit == 1 else DECODE_BM
    consts = {"BM": bm, "BN": BN, "NSPLIT": nsplit, "UPCAST": node.dtype is DType.F32}
    sig.update(dict.fromkeys(consts, "constexpr"))
    jobs = [
        {
            "path": path,
            "name": kernel.name,
            "signature": sig,
            "constexprs": consts,
            "arch": arch,
            "num_warps": NUM_WARPS,
        }
    ]
    if nsplit > 1:
        csig = {
            "part_ptr": "*fp32",
            "o_ptr": t,
            "HQ": "i32",
            "LQ": "i32",
            "BM": "constexpr",
            "NSPLIT": "constexpr",
        }
        jobs.append(
            {
                "path": path,
                "name": f"{kernel.name}_combine",
                "signature": csig,
                "constexprs": {"BM": bm, "NSPLIT": nsplit},
                "arch": arch,
                "num_warps": NUM_WARPS,
            }
        )
    return jobs


__all__ = ["aot_jobs", "compile_attention", "plan_launch", "render_attention"]
