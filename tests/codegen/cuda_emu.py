"""Run generated CUDA C on the CPU: the same source, compiled by g++ against ``cuda_host_emu.h``.

``emulate(kernel, reads, writes, sizes)`` renders ``kernel`` with the CUDA backend, prepends the emulation
header, adds an ``extern "C"`` trampoline that unpacks an argument array into the kernel's parameters,
builds a shared library (cached per source in a temporary folder) and launches it over a small grid, so
grid-stride loops and the block-level reductions' barriers really run.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from kernelize.autokernel.kernels import Compute, Kernel, KernelKind, Load, PointwiseKernel, Store
from kernelize.codegen.cuda import CudaSource, render
from kernelize.codegen.render import gather_error
from kernelize.codegen.template import load_template
from kernelize.ir.graph import ELEMENTWISE, LAYOUT, Graph, Node, Op
from kernelize.ir.reference import bind_inputs
from kernelize.ir.shapes import bind

_DIR = Path(tempfile.mkdtemp(prefix="kz-cuda-emu-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
_LIBS: dict[str, ctypes.CDLL] = {}


def _trampoline(src: CudaSource) -> str:
    args = []
    for i, (ctype, _) in enumerate(src.params):
        if "*" in ctype:
            args.append(f"({ctype.replace('__restrict__', '')})args[{i}]")
        else:
            args.append(f"*(const int64_t*)args[{i}]")
    call = f"{src.name}({', '.join(args)});"
    return (
        '\nextern "C" int kz_emu_run(void** args, unsigned gx, unsigned gy, unsigned gz, unsigned bx,'
        " char* err) {\n"
        f"  int rc = kz_emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, 1, 1}}, [&] {{ {call} }});\n"
        "  if (rc) std::strcpy(err, kz_emu::error);\n"
        "  return rc;\n}\n"
    )


def build(src: CudaSource) -> ctypes.CDLL:
    """Compile the host-emulated kernel (cached by source hash)."""
    return _build_text(load_template("cuda_host_emu.h") + "\n" + src.source + _trampoline(src), src.name)


def _build_text(text: str, name: str) -> ctypes.CDLL:
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    if key not in _LIBS:
        cpp, so = _DIR / f"{key}.cpp", _DIR / f"{key}.so"
        cpp.write_text(text)
        proc = subprocess.run(
            ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-o", str(so), str(cpp)],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            numbered = "\n".join(f"{i + 1:4d} | {line}" for i, line in enumerate(text.splitlines()))
            raise RuntimeError(f"g++ failed on {name}:\n{proc.stderr}\n{numbered}")
        _LIBS[key] = ctypes.CDLL(str(so))
    return _LIBS[key]


def emulate(
    kernel: Kernel,
    reads: Sequence[torch.Tensor],
    writes: Sequence[torch.Tensor],
    sizes: Mapping[str, int],
    max_blocks: int = 3,
) -> None:
    """Launch ``kernel``'s generated CUDA C on CPU tensors (contiguous, in ``reads``/``writes`` order).

    ``max_blocks`` caps grid-stride kernels' grids so each thread walks several elements / rows.
    """
    src = render(kernel)
    lib = build(src)
    tensors = [*reads, *writes]
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    ints = [ctypes.c_int64(int(sizes[s])) for s in kernel.symbols]
    flag = torch.zeros(1, dtype=torch.int32)  # a gather kernel's error flag (its last parameter, kz_err)
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
    flagged = src.params[-1][1] == "kz_err"
    argv = (ctypes.c_void_p * (len(ptrs) + len(ints) + flagged))(
        *[p.value for p in ptrs], *[ctypes.addressof(i) for i in ints], *[flag.data_ptr()][:flagged]
    )
    grid = src.grid(sizes, max_blocks)
    if kernel.kind is KernelKind.MATMUL and 0 in grid:
        return
    err = ctypes.create_string_buffer(256)
    rc = lib.kz_emu_run(argv, *[ctypes.c_uint(g) for g in grid], ctypes.c_uint(src.block), err)
    if rc:
        raise RuntimeError(f"emulated {src.name}: {err.value.decode()}")
    torch._assert_async(flag == 0, "emulated " + gather_error(kernel, "cuda"))  # what the launcher does


def emulate_attention(
    kernel: Kernel, reads: Sequence[torch.Tensor], out: torch.Tensor, nsplit: int = 1
) -> None:
    """Run an ATTENTION kernel's generated CUDA C (and its split combine kernel) on CPU tensors."""
    from kernelize.codegen.cuda_attention import launch_args, render_attention

    source, name = render_attention(kernel)
    b, hq, lq, dv = out.shape
    part = out if nsplit == 1 else torch.empty(b * hq * nsplit * lq * (dv + 2), dtype=torch.float32)
    if kernel.node.arg.sinks:
        reads = [*reads[:-1], reads[-1].float().contiguous()]
    ptrs, ints, grid = launch_args(reads, out, part, nsplit, kernel.node.arg)
    casts = ["(const kz_t*)"] * 3 + ["(const kz_tm*)", "(kz_t*)", "(float*)", "(const float*)"]
    call = ", ".join([f"{c}p[{i}]" for i, c in enumerate(casts)] + [f"n[{i}]" for i in range(len(ints))])
    tramp = (
        '\nextern "C" int kz_emu_attention(void** p, const int64_t* n, unsigned gx, unsigned gy, unsigned gz,'
        " char* err) {\n"
        f"  int rc = kz_emu::launch(dim3{{gx, gy, gz}}, dim3{{32, 1, 1}}, [&] {{ {name}({call}); }});\n"
        f"  if (!rc && gz > 1) rc = kz_emu::launch(dim3{{gx, gy, 1}}, dim3{{32, 1, 1}},"
        f" [&] {{ {name}_combine("
        "(const float*)p[5], (kz_t*)p[4], n[1], (int64_t)gz); });\n"
        "  if (rc) std::strcpy(err, kz_emu::error);\n  return rc;\n}\n"
    )
    lib = _build_text(load_template("cuda_host_emu.h") + "\n" + source + tramp, name)
    argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
    nums = (ctypes.c_int64 * len(ints))(*ints)
    err = ctypes.create_string_buffer(256)
    rc = lib.kz_emu_attention(argv, nums, *[ctypes.c_uint(g) for g in grid], err)
    if rc:
        raise RuntimeError(f"emulated {name}: {err.value.decode()}")


def emulate_experts(kernel: Kernel, reads: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Run an EXPERTS kernel's generated CUDA C (both grouped GEMMs) on CPU tensors, with the launcher's
    sort / pad and K-sum (:mod:`kernelize.codegen.cuda_experts`)."""
    from kernelize.codegen.cuda_experts import THREADS, finish, launch_args, render_experts

    source, name = render_experts(kernel)
    if reads[1].numel() == 0:
        return
    call = launch_args(kernel, reads)
    up_casts = ["(const kz_t*)", "(const kz_t*)", "(float*)", "(const int*)", "(const int*)", "(const kz_t*)"]
    down_casts = [
        "(const float*)",
        "(const kz_t*)",
        "(const kz_tw*)",
        "(float*)",
        "(const int*)",
        "(const int*)",
        "(const kz_t*)",
    ]

    def spell(fn: str, casts: list[str], n_ints: int) -> str:
        ptrs = [f"{c}p[{i}]" for i, c in enumerate(casts)]
        return f"{fn}({', '.join(ptrs + [f'n[{i}]' for i in range(n_ints)])});"

    tramp = (
        '\nextern "C" int kz_emu_experts(int which, void** p, const int64_t* n, unsigned gx, unsigned gy,'
        " char* err) {\n"
        f"  int rc = which == 0 ? kz_emu::launch(dim3{{gx, gy, 1}}, dim3{{{THREADS}, 1, 1}}, [&] {{ "
        f"{spell(f'{name}_up', up_casts, len(call.up[1]))} }})\n"
        f"    : kz_emu::launch(dim3{{gx, gy, 1}}, dim3{{{THREADS}, 1, 1}}, [&] {{ "
        f"{spell(f'{name}_down', down_casts, len(call.down[1]))} }});\n"
        "  if (rc) std::strcpy(err, kz_emu::error);\n  return rc;\n}\n"
    )
    lib = _build_text(load_template("cuda_host_emu.h") + "\n" + source + tramp, name)
    for which, (ptrs, ints, grid) in enumerate((call.up, call.down)):
        argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
        nums = (ctypes.c_int64 * len(ints))(*ints)
        err = ctypes.create_string_buffer(256)
        rc = lib.kz_emu_experts(which, argv, nums, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), err)
        if rc:
            raise RuntimeError(f"emulated {name}: {err.value.decode()}")
    finish(call, out)


# -- a small lowering for tests: graphs of layout + elementwise ops -> one POINTWISE kernel ----------------


def contiguous_strides(shape: Sequence) -> tuple:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc = acc * d
    return tuple(reversed(out))


def layout(node: Node) -> tuple[Node, tuple, int]:
    """(buffer, strides, offset) reading ``node`` through its chain of layout ops (no copies)."""
    if node.op not in LAYOUT:
        return node, contiguous_strides(node.shape), 0
    buf, st, off = layout(node.src[0])
    src = node.src[0]
    if node.op is Op.BROADCAST:
        st = tuple(0 if a == 1 and b != 1 else s for a, b, s in zip(src.shape, node.shape, st))
    elif node.op is Op.PERMUTE:
        st = tuple(st[p] for p in node.arg)
    elif node.op is Op.SLICE:
        off += sum(a * s for (a, _, _), s in zip(node.arg, st))
        st = tuple(s * c for (_, _, c), s in zip(node.arg, st))
    elif node.op is Op.FLIP:
        off += sum((src.shape[a] - 1) * st[a] for a in node.arg)
        st = tuple(-s if a in node.arg else s for a, s in enumerate(st))
    elif node.op is Op.VIEW:
        kept = [(d, s) for d, s in zip(src.shape, st) if d != 1]
        if [d for d in node.shape if d != 1] == [d for d, _ in kept]:  # only size-1 axes added / removed
            it = iter(s for _, s in kept)
            st = tuple(0 if d == 1 else next(it) for d in node.shape)
        elif st == contiguous_strides(src.shape):
            st = contiguous_strides(node.shape)
        else:
            raise NotImplementedError(f"view of a strided value {node}")
    return buf, st, off


def pointwise_kernel(graph: Graph, name: str = "k0") -> Kernel:
    """One POINTWISE kernel computing every output of an elementwise graph (outputs share one shape)."""
    domain = graph.outputs[0].shape
    body: list[Load | Compute] = []
    pos: dict[Node, int] = {}
    for n in graph.nodes:
        if n.op in ELEMENTWISE:
            for s in n.src:
                if s not in pos:
                    buf, st, off = layout(s)
                    pos[s] = len(body)
                    body.append(Load(buf, st, off))
            pos[n] = len(body)
            body.append(Compute(n.op, n.dtype, tuple(pos[s] for s in n.src), n.arg))
    stores = []
    for o in graph.outputs:
        if o not in pos:
            buf, st, off = layout(o)
            pos[o] = len(body)
            body.append(Load(buf, st, off))
        stores.append(Store(pos[o], o, contiguous_strides(o.shape)))
    return PointwiseKernel(name, domain, tuple(body), tuple(stores))


def run_kernels(
    graph: Graph, kernels: Sequence[Kernel], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Run ``kernels`` in order under host emulation, as the runtime would (buffers by graph node)."""
    env = bind_inputs(graph, inputs)
    vals: dict[Node, torch.Tensor] = dict(zip(graph.inputs, (t.contiguous() for t in inputs)))
    for n in graph.nodes:
        if n.op is Op.CONST:
            vals[n] = n.arg.tensor.contiguous()
    for k in kernels:
        reads = [vals[b] for b in k.reads]
        writes = [torch.empty(bind(b.shape, env), dtype=b.dtype.torch) for b in k.writes]
        if any(w.numel() for w in writes):
            emulate(k, reads, writes, {s: env[s] for s in k.symbols})
        vals.update(zip(k.writes, writes))
    return [vals[o] for o in graph.outputs]


def run_plan(plan, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run a plan as the runtime does: generated kernels under host emulation, LIBRARY ones with torch."""
    from kernelize.runtime.library import materialize, run_library

    graph = plan.graph
    env = bind_inputs(graph, inputs)
    vals: dict[Node, torch.Tensor] = {n: n.arg.tensor for n in graph.nodes if n.op is Op.CONST}
    vals.update((n, t.contiguous()) for n, t in zip(graph.inputs, inputs))
    for k in plan.kernels:
        if k.kind in (KernelKind.LIBRARY, KernelKind.CONV):
            vals[k.writes[0]] = run_library(k, vals, env)
            continue
        reads = [materialize(b, vals, env).contiguous() for b in k.reads]
        writes = [torch.empty(bind(b.shape, env), dtype=b.dtype.torch) for b in k.writes]
        if any(w.numel() for w in writes):
            emulate(k, reads, writes, {s: env[s] for s in k.symbols})
        vals.update(zip(k.writes, writes))
    return [materialize(o, vals, env) for o in graph.outputs]


def emulate_quant(fmt: str, x: torch.Tensor, packed, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Run the packed-weight matmul's generated CUDA C (:mod:`kernelize.codegen.cuda_quant`) on CPU tensors,
    with the launcher's choice of entry point and grid."""
    from kernelize.codegen.cuda_quant import THREADS, launch_args, render_quant

    source, name = render_quant(fmt, x.dtype)
    call = launch_args(x, packed, bias, out)
    casts = ["(const kz_t*)", "(const uint8_t*)", "(const float*)", "(const float*)", "(kz_t*)"]
    args = ", ".join([f"{c}p[{i}]" for i, c in enumerate(casts)] + [f"n[{i}]" for i in range(3)])
    tramp = (
        '\nextern "C" int kz_emu_quant(int part, void** p, const int64_t* n, unsigned gx, unsigned gy,'
        " char* err) {\n"
        f"  int rc = kz_emu::launch(dim3{{gx, gy, 1}}, dim3{{{THREADS}, 1, 1}}, [&] {{ if (part == 2) "
        f"{name}_mm({args}); else if (part == 1) {name}_gemv4({args}); else {name}_gemv1({args}); }});\n"
        "  if (rc) std::strcpy(err, kz_emu::error);\n  return rc;\n}\n"
    )
    lib = _build_text(load_template("cuda_host_emu.h") + "\n" + source + tramp, name)
    argv = (ctypes.c_void_p * len(call.ptrs))(*call.ptrs)
    nums = (ctypes.c_int64 * len(call.ints))(*call.ints)
    err = ctypes.create_string_buffer(256)
    part = ("gemv1", "gemv4", "mm").index(call.part)
    rc = lib.kz_emu_quant(part, argv, nums, ctypes.c_uint(call.grid[0]), ctypes.c_uint(call.grid[1]), err)
    if rc:
        raise RuntimeError(f"emulated {name}_{call.part}: {err.value.decode()}")


def emulate_router(kernel: Kernel, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    """Run a ROUTER kernel's generated CUDA C (a warp per row, rows grid-strided over two blocks) on CPU
    tensors, with the launcher's operands (:mod:`kernelize.codegen.router`)."""
    from kernelize.codegen.router import _operands, render_cuda, router_spec

    source, name = render_cuda(kernel)
    sp = router_spec(kernel)
    tramp = (
        '\nextern "C" int kz_emu_router(void** p, int64_t rows, char* err) {\n'
        "  int rc = kz_emu::launch(dim3{2, 1, 1}, dim3{32, 1, 1}, [&] { "
        f"{name}((const kz_tx*)p[0], (const kz_tb*)p[1], (kz_tw*)p[2], (int64_t*)p[3], rows); }});\n"
        "  if (rc) std::strcpy(err, kz_emu::error);\n  return rc;\n}\n"
    )
    lib = _build_text(load_template("cuda_host_emu.h") + "\n" + source + tramp, name)
    tensors = _operands(kernel, sp, reads, writes)
    ptrs = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in tensors))
    err = ctypes.create_string_buffer(512)
    if lib.kz_emu_router(ptrs, ctypes.c_int64(reads[0].numel() // sp.experts), err):
        raise RuntimeError(f"emulated {name}: {err.value.decode()}")
