"""The CPU backend: compiles each kernel's C++ (:mod:`kernelize.codegen.cpu` renders it,
:mod:`kernelize.codegen.cpu_build` builds and loads it) and wraps the functions in ctypes launchers.

What a kernel compiles to and how its functions become one :class:`CompiledKernel` is a table keyed by
kernel class (``_KINDS``): loop kernels are one function launched with (reads, writes, sizes, threads);
a matmul kernel is its few-row function plus the epilogue run after torch's GEMM; attention and conv
kernels bring launchers of their own (:mod:`.cpu_attention`, :mod:`.cpu_conv`). Symbolic dims and the
thread count (``cpu_build.threads()``: torch's) are call arguments.

Example:
    >>> ck = CpuBackend().compile(kernel)  # doctest: +SKIP
    >>> ck.launch([x, w], [y], {"batch": 4})  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from kernelize.autokernel.generic import sizes_as_arguments, small
from kernelize.autokernel.kernels import (
    AttentionKernel,
    ConvChainKernel,
    ConvKernel,
    ExpertsKernel,
    Kernel,
    LibraryKernel,
    MatmulKernel,
    PointwiseKernel,
    RouterKernel,
    RowKernel,
    dispatch,
)
from kernelize.autokernel.matmul import row_sides
from kernelize.codegen import cpu_build, cpu_conv, cpu_pool
from kernelize.codegen.cpu import CpuRenderer, normalized, render
from kernelize.codegen.cpu_attention import ARGTYPES as ATTENTION_ARGTYPES
from kernelize.codegen.cpu_attention import attention_launcher, unit_last
from kernelize.codegen.cpu_build import load, same_source_groups, unit_chunks, unit_source
from kernelize.codegen.cpu_experts import experts_launcher
from kernelize.codegen.cpu_gemv import PLAIN, cpu_gemm, gemm_forms, prebuild
from kernelize.codegen.render import gather_error
from kernelize.codegen.template import load_template
from kernelize.ir.attention import split_operands
from kernelize.runtime.backend import Backend, CCall, CompiledKernel


# ---- ctypes launchers -----------------------------------------------------------------------------------
def _launcher(fn, kernel: Kernel, generic: tuple[Kernel, Mapping[str, int]] | None = None):
    """A launch of loop kernel ``kernel``'s function: its buffers, its symbols' values, the thread count.
    ``generic``: the kernel the function was compiled from with the sizes it takes as arguments
    (``generic.sizes_as_arguments``); errors still name ``kernel``'s sizes."""
    symbols, values = _symbol_values(kernel, generic)
    n_reads, n_writes = len(kernel.reads), len(kernel.writes)
    get_threads = cpu_build.threads

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]
    ) -> None:
        assert len(reads) == n_reads and len(writes) == n_writes, "launch arity"
        rc = fn(
            *[t.data_ptr() for t in reads],
            *[t.data_ptr() for t in writes],
            *[sizes[s] if v is None else v for s, v in zip(symbols, values)],
            get_threads(),
        )
        if rc:
            raise IndexError(gather_error(kernel, "cpu"))

    return launch


def _c_caller(fn, kernel: Kernel, generic=None) -> Callable[..., CCall]:
    """``c_call`` of a kernel launched by :func:`_launcher`: the same arguments, for ``kz_replay``."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    (symbols, values), error = _symbol_values(kernel, generic), gather_error(kernel, "cpu")

    def c_call(reads, writes, sizes: Mapping[str, int]) -> CCall:
        ptrs = tuple(0 if t is None else t.data_ptr() for t in (*reads, *writes))
        args = tuple(sizes[s] if v is None else v for s, v in zip(symbols, values))
        return CCall(address, ptrs + args, error, raises=IndexError)

    return c_call


def _symbol_values(kernel: Kernel, generic) -> tuple[tuple[str, ...], tuple]:
    """The compiled function's symbols and, per symbol, its fixed value or None (read from the call's
    sizes)."""
    compiled, fixed = generic or (kernel, {})
    return compiled.symbols, tuple(fixed.get(s) for s in compiled.symbols)


def _generic(kernel: Kernel) -> tuple[Kernel, dict[str, int]]:
    """The kernel a small loop kernel is compiled as, sizes as arguments (``generic.small``), with those
    sizes; any other kernel as it is."""
    return sizes_as_arguments(normalized(kernel)) if small(kernel) else (kernel, {})


class CpuBackend(Backend):
    """Generates, compiles (disk-cached) and launches C++ kernels on CPU tensors.

    Example:
        >>> ck = CpuBackend().compile(kernel)  # doctest: +SKIP
        >>> ck.launch(reads, writes, sizes)  # doctest: +SKIP
    """

    name = "cpu"

    def __init__(self, renderer: CpuRenderer | None = None) -> None:
        self.renderer = renderer or CpuRenderer()

    @property
    def plan_settings(self):
        """Matmuls are MATMUL kernels with the epilogue fused, and matmuls sharing their left operand share a
        kernel (``silu(x @ Wg) * (x @ Wu)``): :meth:`compile` runs them as the few-row kernel for up to
        ``FEW_ROWS`` rows and as torch's GEMM plus the epilogue kernel above (see ``cpu_gemv``). Column sums
        over leading axes (weight gradients) accumulate inside the row kernel over the same rows: each thread
        adds its rows into partial sums in the write pass, so the summed operand (``dy * xhat``) is never
        written; other column sums go to torch (a generated kernel walking each column with a row stride
        was measured 6x slower than torch's blocked partial sums on 2048x2048 f32)."""
        from kernelize.autokernel.plan import PlanSettings

        return PlanSettings(
            matmul="generate",
            merge_matmuls=True,
            column_reduce="accumulate",
            channels_last=True,
            conv_chains=cpu_conv.chains_enabled(),
        )

    def device_ok(self, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    def generates(self, kernel: Kernel) -> bool:
        """Everything but LIBRARY kernels, and the convolutions :func:`cpu_conv.algorithm` takes."""
        return dispatch(_KINDS, kernel, "the cpu backend").generates(kernel)

    def render(self, kernel: Kernel) -> str:
        """The C++ source :meth:`compile` builds (a MATMUL kernel: its few-row function, then the epilogue
        kernel run after torch's GEMM)."""
        return dispatch(_KINDS, kernel, "the cpu backend").source(kernel, self.renderer)

    def compile(self, kernel: Kernel) -> CompiledKernel:
        return self.compile_many([kernel])[0]

    def compile_many(self, kernels: Sequence[Kernel], progress: Callable[[int], None] | None = None):
        """Compile ``kernels`` as a few translation units (one per core) built in parallel.

        A compiler run costs ~0.3 s of start-up and prelude parsing before any kernel code, so dozens of
        kernels in one unit build many times faster than one unit each (a matmul kernel brings its few-row
        function and its epilogue); units of one graph share one cache entry, so a warm start is one lookup
        per unit. Kernels whose source differs only in their name (the same block in each of a
        transformer's layers: ViT-base has 159 kernels, 15 distinct) are compiled once and share the
        function. Kernels whose kind builds alone (experts) get a unit of their own each. ``progress(n)``
        is called as kernels finish.
        """
        kinds = [dispatch(_KINDS, k, "the cpu backend") for k in kernels]
        # the fixed libraries the kernels' calls use build beside the units (every unit binds to the workers)
        warm_libraries(dict.fromkeys((cpu_build.workers, *(lib for kind in kinds for lib in kind.libraries))))
        prebuild(gemm_forms(kernels))  # the GEMMs' library too
        parts = {i: kind.parts(k) for i, (k, kind) in enumerate(zip(kernels, kinds, strict=True))}
        rendered = {p.name: render(p, self.renderer) for ps in parts.values() for p, _ in ps}
        assert len({name for _, name in rendered.values()}) == len(rendered), "kernel names collide"
        together = [i for i, kind in enumerate(kinds) if not kind.alone]
        groups = same_source_groups(together, parts, rendered)
        alone = same_source_groups([i for i, kind in enumerate(kinds) if kind.alone], parts, rendered)
        units = [[i] for i in alone]
        units += unit_chunks(
            list(groups), [sum(len(rendered[k.name][0]) for k, _ in parts[i]) for i in groups]
        )
        groups.update(alone)
        shared = [load_template(name) for name in ("cpu_prelude.h", "cpu_gemv.h", "cpu_conv.h")]
        out: list[CompiledKernel | None] = [None] * len(kernels)

        def build(chunk: list[int]) -> tuple[list[int], Path]:
            sources = [rendered[k.name][0] for i in chunk for k, _ in parts[i]]
            what = kernels[chunk[0]].name if len(chunk) == 1 else f"{len(chunk)} kernels"
            return chunk, cpu_build.build_shared_object(unit_source(sources, shared), what)

        with ThreadPoolExecutor(max_workers=len(units)) as pool:
            for chunk, path in pool.map(build, units):
                lib = load(path)
                for rep in chunk:
                    fns = [lib[rendered[k.name][1]] for k, _ in parts[rep]]
                    for i in groups[rep]:
                        out[i] = kinds[i].assemble(self.name, kernels[i], parts[i], fns, rendered)
                    if progress is not None:
                        progress(len(groups[rep]))
        return out


_LIBRARIES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kz-libraries")


def warm_libraries(libraries: Iterable[Callable[[], object]] | None = None) -> None:
    """Build ``libraries`` one after another on a background thread: by default every fixed library of the
    CPU runtime (the workers, pools and layout copies, the GEMM tiles where they run the GEMMs), which no
    graph's source changes, so each is compiled once per machine. Loading an ONNX model calls it when the
    model is not in the graph cache (likely a first start): the front end runs Python on one core while the
    compiler builds them on another (BERT-base cold, empty caches: ~3 s of compiler time, ~1.2 s of the
    start). The GEMM library may not be needed: it starts at once, at the lowest CPU priority, so it takes
    only the cores the builds a graph waits for leave (AlexNet cold: 4.3-4.9 -> 3.5-4.5 s; on a machine
    kept busy by other work it waits for a free core). A library already built is a lookup; a failed build
    raises again where it is used."""
    if libraries is None:
        libraries = (cpu_build.workers, cpu_pool.library)
        prebuild({PLAIN} if cpu_gemm() == "generated" else set(), idle=True)
    for library in libraries:
        _LIBRARIES.submit(library)


# ---- per kind: what a kernel compiles to, and how its functions become one CompiledKernel -----------------
Parts = list[tuple[Kernel, tuple]]  # the kernels a kernel's functions are rendered from, with temporaries


class _LoopKind:
    """POINTWISE and ROW kernels: one generated function, launched with (reads, writes, sizes, threads)."""

    alone = False  # built in a translation unit of its own
    libraries: tuple[Callable[[], object], ...] = ()  # the fixed runtime libraries its calls use

    def generates(self, kernel: Kernel) -> bool:
        return True

    def parts(self, kernel: Kernel) -> Parts:
        return [(_generic(kernel)[0], ())]

    def source(self, kernel: Kernel, renderer: CpuRenderer) -> str:
        return render(_generic(kernel)[0], renderer)[0]

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        generic = _generic(kernel)
        fn = _typed(fns[0], generic[0])
        source = rendered[kernel.name][0]
        launch, c_call = _launcher(fn, kernel, generic), _c_caller(fn, kernel, generic)
        return CompiledKernel(kernel.name, backend, source, launch, kernel, c_call=c_call)


class _AttentionKind(_LoopKind):
    """ATTENTION kernels: a template with its own arguments (operand strides), in the units with the others
    (each in a namespace of its own: ``templates/cpu_attention.cpp``)."""

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        fn = fns[0]
        fn.restype, fn.argtypes = ctypes.c_int, ATTENTION_ARGTYPES
        launch = attention_launcher(fn, kernel)

        def c_call(reads, writes, sizes) -> CCall | None:
            """The launch's call for a replay, where it copies nothing (keys and values with a unit last
            stride, sinks f32 and contiguous): a copy made once would be read on every later run."""
            _, k, v, _, sinks = split_operands(reads, kernel.node.arg)
            if unit_last(k) is not k or unit_last(v) is not v:
                return None
            if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
                return None
            return launch.c_call(reads, writes)

        return CompiledKernel(kernel.name, backend, rendered[kernel.name][0], launch, kernel, None, c_call)


class _ExpertsKind(_LoopKind):
    """EXPERTS kernels: a template with its own arguments (operand strides), built alone; many rows run on
    library GEMMs (:mod:`kernelize.codegen.cpu_experts`)."""

    alone = True

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        launch = experts_launcher(fns[0], kernel)
        return CompiledKernel(kernel.name, backend, rendered[kernel.name][0], launch, kernel)


class _ConvKind(_LoopKind):
    """CONV kernels: generated when :func:`cpu_conv.algorithm` takes them, else run by the library."""

    libraries = (cpu_pool.library,)  # an NCHW input copied NHWC

    def generates(self, kernel: Kernel) -> bool:
        return cpu_conv.algorithm(kernel) is not None

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        call = cpu_conv.ConvCall(fns[0], kernel)
        source = rendered[kernel.name][0]
        return CompiledKernel(kernel.name, backend, source, call.launch, kernel, call.fresh, call.c_call)


class _ConvChainKind(_LoopKind):
    """CONV_CHAIN kernels: the stages as one generated function (``kz_conv_chain``)."""

    libraries = (cpu_pool.library,)  # an NCHW input copied NHWC

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        chain = cpu_conv.ChainCall(fns[0], kernel)
        source = rendered[kernel.name][0]
        return CompiledKernel(kernel.name, backend, source, chain.launch, kernel, c_call=chain.c_call)


class _LibraryKind(_LoopKind):
    """LIBRARY kernels: the runtime runs them with torch."""

    libraries = (cpu_pool.library,)  # pools, global sums and means

    def generates(self, kernel: Kernel) -> bool:
        return False


class _MatmulKind(_LoopKind):
    """MATMUL kernels: the few-row function (up to ``FEW_ROWS`` rows) and the epilogue kernel run after
    torch's GEMM (more rows). Only the side a kernel's row count can reach is built (``matmul.row_sides``):
    a matmul of static rows above ``FEW_ROWS`` (or a dynamic one whose static dims alone pass it) never runs
    the few-row function (two thirds of ViT-base's and ConvNeXt's C++), one of static rows up to it never
    the epilogue (the squeeze-excitation matmuls of EfficientNet-B0 at batch 1: 15 of them)."""

    def parts(self, kernel: Kernel) -> Parts:
        few, more = row_sides(kernel)
        epi, temps = _epilogue_of(kernel)
        return [(_generic(kernel)[0], ())] * few + [(_generic(epi)[0], temps)] * more

    def source(self, kernel: Kernel, renderer: CpuRenderer) -> str:
        epi, _ = _epilogue_of(kernel)
        return _matmul_source(render(_generic(kernel)[0], renderer)[0], render(_generic(epi)[0], renderer)[0])

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        epi, temps = _epilogue_of(kernel)
        built, few_call = {}, None
        for fn, (part, _) in zip(fns, parts, strict=True):
            own = kernel if part.name == kernel.name else epi
            generic = _generic(own)
            fn = _typed(fn, generic[0])
            built[own is kernel] = (rendered[part.name][0], _launcher(fn, own, generic))
            few_call = _c_caller(fn, own, generic) if own is kernel else few_call
        few = built.get(True) or _never(kernel, "the few-row path")
        more = built.get(False) or _never(kernel, "the GEMM epilogue")
        return _matmul_kernel(backend, kernel, few, more, epi, temps, few_call)


_KINDS = {
    PointwiseKernel: _LoopKind(),
    RowKernel: _LoopKind(),
    MatmulKernel: _MatmulKind(),
    AttentionKernel: _AttentionKind(),
    ExpertsKernel: _ExpertsKind(),
    RouterKernel: _LoopKind(),
    ConvKernel: _ConvKind(),
    ConvChainKernel: _ConvChainKind(),
    LibraryKernel: _LibraryKind(),
}


def _typed(fn, kernel: Kernel):
    """``fn`` with the argument types of a loop kernel's function: buffers, sizes, the thread count."""
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * (len(kernel.reads) + len(kernel.writes))
        + [ctypes.c_int64] * len(kernel.symbols)
        + [ctypes.c_int]
    )
    return fn


def kernel_parts(kernel: Kernel) -> Parts:
    """The kernels ``kernel``'s functions are rendered from (a matmul: its few-row function and epilogue)."""
    return dispatch(_KINDS, kernel, "the cpu backend").parts(kernel)


def _never(kernel: Kernel, side: str) -> tuple[str, Callable]:
    """The side of a matmul kernel its row count never reaches: not built (said so if it is called)."""

    def call(reads, writes, sizes) -> None:
        raise AssertionError(f"cpu kernel {kernel.name}: {side} of a kernel of {kernel.domain[:-1]} rows")

    return f"// {side}: not built (rows {kernel.domain[:-1]})", call


def _epilogue_of(kernel: Kernel) -> tuple[Kernel, tuple]:
    """The pointwise kernel a matmul kernel runs after torch's GEMM (its own function name), and the
    temporaries it reads."""
    from kernelize.autokernel.matmul import epilogue_kernel

    epi, temps = epilogue_kernel(kernel)
    return replace(epi, name=f"{kernel.name}_epilogue"), temps


def _matmul_kernel(
    backend: str, kernel: Kernel, few_built, epi_built, epi: Kernel, temps, few_call=None
) -> CompiledKernel:
    """A matmul kernel: up to FEW_ROWS rows the generated few-row function (``few_call``: its C call, for
    replay); more, torch's GEMM then the epilogue function."""
    from kernelize.autokernel.matmul import FEW_ROWS, rows_of
    from kernelize.codegen.cpu_gemv import GeneratedGemm, direct_gemm, library_matmuls, run_direct

    (source, few), (epi_source, epi_launch) = few_built, epi_built
    slots = [(b in temps, temps.index(b) if b in temps else kernel.reads.index(b)) for b in epi.reads]
    packs: dict = {}  # oneDNN-packed constant weights of this kernel, made on first use
    spare: list = []  # the last call's GEMM outputs, written again by the next (a pop: each call its own)

    plan = direct_gemm(kernel, gelu=True)
    generated = GeneratedGemm(kernel, plan) if plan is not None and plan.packed else None

    def launch(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]):
        rows = rows_of(kernel, sizes)
        if rows == 0:  # nothing to compute (the few-row function may not be built: row_sides)
            return None
        if rows <= FEW_ROWS:
            return few(reads, writes, sizes)
        y = None if generated is None else generated.run(reads, sizes, writes[0])
        if y is not None:
            if y is not writes[0]:
                writes[0].copy_(y)
            return None
        mms = library_matmuls(kernel, reads, sizes, packs, spare.pop() if spare else ())
        epi_launch([mms[i] if t else reads[i] for t, i in slots], writes, sizes)
        if not spare:
            spare.append(mms)

    direct = direct_gemm(kernel)

    def fresh(reads: Sequence[torch.Tensor], sizes: Mapping[str, int]) -> list[torch.Tensor] | None:
        # oneDNN allocates its output; the generated tiles write the kernel's own buffer (launch)
        if direct is None or rows_of(kernel, sizes) <= FEW_ROWS:
            return None
        return run_direct(kernel, direct, reads, sizes, packs)

    def c_call(reads, writes, sizes: Mapping[str, int]) -> CCall | None:
        if rows_of(kernel, sizes) <= FEW_ROWS:
            return None if few_call is None else few_call(reads, writes, sizes)
        return None if generated is None else generated.c_call(reads, writes, sizes)

    return CompiledKernel(
        kernel.name,
        backend,
        _matmul_source(source, epi_source),
        launch,
        kernel,
        fresh if direct is not None else None,
        c_call if few_call is not None or generated is not None else None,
    )


def _matmul_source(few_rows: str, epilogue: str) -> str:
    """The source of a MATMUL kernel as it reads: the few-row function, then the epilogue kernel."""
    from kernelize.autokernel.matmul import FEW_ROWS

    return f"{few_rows}\n// more than {FEW_ROWS} rows: torch's matmul, then\n{epilogue}"


__all__ = ["CpuBackend", "kernel_parts"]
