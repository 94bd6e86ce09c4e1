"""Runtime: compiled graphs (a torch callable per graph, backend and device), backends and caches."""

from kernelize.runtime.backend import Backend, CompiledKernel, KernelCompileError
from kernelize.runtime.compiled import (
    BACKENDS,
    CompiledGraph,
    CompiledModule,
    compile_graph,
    print_kernels,
)
from kernelize.runtime.graph_cache import load_optimized_onnx

__all__ = [
    "BACKENDS",
    "Backend",
    "CompiledGraph",
    "CompiledKernel",
    "CompiledModule",
    "KernelCompileError",
    "compile_graph",
    "load_optimized_onnx",
    "print_kernels",
]
