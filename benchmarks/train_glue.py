"""Where a kernelized layer's training call spends its time outside its kernels, with cold caches.

For each layer and dtype (2048 x 2048 unless ``--rows``, every input trained) one process times, in
alternation, each call after a 64 MiB write (cold caches, as in a training step where other work ran in
between; medians):

- ``kernelize``: ``hub.run`` + backward, as a model calls it;
- ``graphs``: the layer's compiled training forward and backward graphs called directly (no signature
  lookup, no autograd);
- ``kernels``: the generated kernels alone, writing new buffers (allocated per call, as a call's outputs and
  gradients are: a new buffer's first touch can page-fault, with other allocations in between);
- ``autograd floor``: an empty ``torch.autograd.Function`` (its forward allocates the outputs, its backward
  the gradients) through the same backward call, plus ``kernels``: what any glue over torch autograd costs;
- with ``--cpp``: the same empty function as a C++ ``torch::autograd::Function`` behind a ``TORCH_LIBRARY``
  op (built once with the C++ compiler against torch's headers, ~15 s): what the Python of an
  autograd.Function costs over C++;
- with ``--compile``: the layer under ``torch.compile`` (its forward + backward, same cold caches).

``kernelize`` minus ``autograd floor`` is the glue that is ours (the signature lookup, the compiled graphs'
buffer bookkeeping, the Function's two methods); ``torch.compile`` pays the autograd floor too.

Usage:
    python benchmarks/train_glue.py                    # RMSNorm, add+RMSNorm, LayerNorm, softmax; f32, bf16
    python benchmarks/train_glue.py --layers RMSNorm --dtypes bfloat16 --reps 60 --cpp
    python benchmarks/train_glue.py --rows 4 --cpp     # tiny rows: the glue alone
    python benchmarks/train_glue.py --layers softmax --cpp --compile   # what a perfect C++ path could reach
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_layers import LAYERS, _inputs  # noqa: E402
from row_prefetch import cold_medians  # noqa: E402

from kernelize import hub, hub_autograd  # noqa: E402
from kernelize.codegen.cpu_build import compiler  # noqa: E402
from kernelize.hub.signatures import entry_for  # noqa: E402
from kernelize.ir.shapes import bind  # noqa: E402

ACTIVATIONS = {"RMSNorm": 1, "add+RMSNorm": 2, "LayerNorm": 1, "softmax": 1}
ROWS = COLS = 2048
RESULTS = Path(__file__).resolve().parent / "results"

CPP_EMPTY = r"""
#include <torch/library.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/ATen.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
// xs: the inputs, then one tensor shaped like each output; forward allocates the outputs, backward one
// gradient per input (nothing computed: the cost of the autograd machinery alone)
struct Empty : public torch::autograd::Function<Empty> {
    static variable_list forward(AutogradContext* ctx, at::TensorList xs, int64_t n_inputs) {
        ctx->save_for_backward(xs.slice(0, n_inputs).vec());
        ctx->saved_data["n"] = (int64_t)xs.size();
        variable_list outs;
        for (size_t i = n_inputs; i < xs.size(); ++i) outs.push_back(at::empty_like(xs[i]));
        return outs;
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        variable_list out;
        for (auto& t : ctx->get_saved_variables()) out.push_back(at::empty_like(t));
        out.resize(ctx->saved_data["n"].toInt() + 1);  // the output templates and n_inputs get none
        return out;
    }
};
std::vector<at::Tensor> empty_fn(at::TensorList xs, int64_t n_inputs) { return Empty::apply(xs, n_inputs); }
TORCH_LIBRARY(kz_glue, m) { m.def("empty_fn(Tensor[] xs, int n_inputs) -> Tensor[]"); }
TORCH_LIBRARY_IMPL(kz_glue, CompositeImplicitAutograd, m) { m.impl("empty_fn", empty_fn); }
"""


def load_cpp_empty():
    """Build (once, into benchmarks/results/) and load the C++ empty autograd function."""
    from torch.utils.cpp_extension import include_paths

    so = RESULTS / f"kz_glue_empty-torch{torch.__version__}.so"  # built against this torch's headers
    if not so.exists():
        RESULTS.mkdir(exist_ok=True)
        src = RESULTS / "kz_glue_empty.cpp"
        src.write_text(CPP_EMPTY)
        lib = Path(torch.__file__).parent / "lib"
        abi = int(torch.compiled_with_cxx11_abi())
        cmd = [compiler()[0], "-O2", "-std=c++20", "-shared", "-fPIC", "-w"]
        cmd.append(f"-D_GLIBCXX_USE_CXX11_ABI={abi}")
        cmd += [f"-I{p}" for p in include_paths()] + [str(src), "-o", str(so), f"-L{lib}"]
        cmd += ["-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
        print("building the C++ autograd function (~15 s) ...", flush=True)
        subprocess.run(cmd, check=True)
    torch.ops.load_library(str(so))
    return torch.ops.kz_glue.empty_fn


def variants(name: str, dtype: torch.dtype, cpp, rows: int = ROWS, with_compile: bool = False) -> dict:
    """The callables timed for one layer (each one forward + backward)."""
    fn, _ = LAYERS[name]
    n_act = ACTIVATIONS[name]
    inputs = [t.requires_grad_() for t in _inputs(name, rows, COLS, dtype)]
    with torch.no_grad():
        ref = fn(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    seeds = [torch.randn_like(r) for r in refs]
    pair = hub_autograd.training_graphs(entry_for(fn, inputs, n_act, {}, "cpu").compiled, range(len(inputs)))
    detached = [t.detach() for t in inputs]
    launches = []
    for cg in (pair.forward, pair.backward):
        for ck in cg.kernels:
            env = {s: rows for s in ck.kernel.symbols}
            reads = [torch.randn(bind(b.shape, env)).to(b.dtype.torch) for b in ck.kernel.reads]
            writes = [(bind(b.shape, env), b.dtype.torch) for b in ck.kernel.writes]
            launches.append((ck, reads, writes, env))

    def backward(outs) -> None:
        torch.autograd.backward(outs if isinstance(outs, (tuple, list)) else (outs,), seeds)
        for t in inputs:
            t.grad = None

    def kernels() -> None:  # into new buffers, as a call writes its outputs and gradients
        for ck, reads, writes, env in launches:
            ck.launch(reads, [torch.empty(shape, dtype=dtype) for shape, dtype in writes], env)

    def graphs() -> None:
        with torch.no_grad():
            outs = pair.forward(*detached)
            saved = [detached[i] for i in pair.primals_read] + [outs[i] for i in pair.saved_index]
            pair.backward(*saved, *seeds)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(*tensors)
            return tuple(torch.empty_like(r) for r in refs)

        @staticmethod
        def backward(ctx, *grads):  # type: ignore[no-untyped-def]
            return tuple(torch.empty_like(t) for t in ctx.saved_tensors)

    out = {
        "kernelize": lambda: backward(hub.run(None, fn, inputs[:n_act], inputs[n_act:])),
        "graphs": graphs,
        "kernels": kernels,
        "autograd floor": lambda: (backward(Empty.apply(*inputs)), kernels()),
    }
    if with_compile:
        compiled = torch.compile(fn, dynamic=False)
        out["torch.compile"] = lambda: backward(compiled(*inputs))
    if cpp is not None:
        templates = [torch.empty_like(r) for r in refs]
        out["C++ autograd floor"] = lambda: (backward(cpp([*inputs, *templates], len(inputs))), kernels())
    return out


def bench(impls: dict, reps: int) -> dict[str, float]:
    """Median ms per implementation after two warm-up calls each (builds, first allocations)."""
    for f in impls.values():
        f()
        f()
    return cold_medians(impls, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=ROWS, help="rows of each layer's input (2048 columns)")
    ap.add_argument("--layers", nargs="+", default=list(ACTIVATIONS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--cpp", action="store_true", help="also time the empty function as C++ autograd")
    ap.add_argument("--compile", action="store_true", help="also time the layer under torch.compile")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cpp = load_cpp_empty() if args.cpp else None
    cols = ["kernelize", "graphs", "kernels", "autograd floor"] + (["C++ autograd floor"] if cpp else [])
    cols += ["torch.compile"] if args.compile else []
    print("| layer | dtype | " + " | ".join(f"{c} ms" for c in cols) + " | ours over the floor ms |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for name in args.layers:
        for dtype_name in args.dtypes:
            m = bench(variants(name, getattr(torch, dtype_name), cpp, args.rows, args.compile), args.reps)
            cells = " | ".join(f"{m[c]:.3f}" for c in cols)
            over = m["kernelize"] - m["autograd floor"]
            print(f"| {name} | {dtype_name} | {cells} | {over:.3f} |", flush=True)


if __name__ == "__main__":
    main()
