"""Command line: ``kernelize demo | inspect | run`` (also ``python -m kernelize``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# subcommand -> "module:function" taking the parsed args; imported lazily so `--help` stays fast
COMMANDS = {
    "demo": "kernelize.demo:main",
    "inspect": "kernelize.tools:inspect_main",
    "run": "kernelize.tools:run_main",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kernelize", description="Fused kernels for marked PyTorch layers.")
    p.add_argument("-v", "--verbose", action="store_true", help="log every substitution (INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="kernelize a small Llama-style decoder on the CPU and time it")
    demo.add_argument("--out", default="out", help="folder for the SVG and JSON written by the demo")
    demo.add_argument("--quick", action="store_true", help="smaller model and fewer timing repetitions")

    ins = sub.add_parser("inspect", help="print an ONNX model's graph, op counts, and optionally its kernels")
    ins.add_argument("model", help="path to an .onnx file")
    ins.add_argument("--optimize", action="store_true", help="run the optimizer first")
    ins.add_argument("--svg", metavar="OUT", help="write the graph as SVG (needs Graphviz `dot`)")
    ins.add_argument(
        "--kernels", action="store_true", help="print the fusion plan and generated kernel source"
    )
    ins.add_argument(
        "--backend", default="triton", choices=["triton", "cuda", "cpu"], help="code generator for --kernels"
    )

    run = sub.add_parser("run", help="run an ONNX model through a backend and compare with the reference")
    run.add_argument("model", help="path to an .onnx file")
    run.add_argument("--backend", default="cpu", choices=["reference", "triton", "cuda", "cpu"])
    run.add_argument("--inputs", help=".npz file with one array per graph input (random inputs otherwise)")
    run.add_argument(
        "--dim",
        action="append",
        metavar="NAME=SIZE",
        help="pin a symbolic input dim (dim_param name, or INPUT:AXIS); repeatable. Default: the size in "
        "--inputs, else 2",
    )
    run.add_argument("--repeat", type=int, default=10, help="timed repetitions")
    run.add_argument(
        "--compare",
        choices=["onnxruntime"],
        help="also run the model with onnxruntime (same inputs and threads): both times, largest difference",
    )
    return p


def _interpret_triton_without_gpu() -> None:
    """Without a GPU, Triton kernels run on CPU tensors under its interpreter. Triton binds its own library
    functions to interpreter or compiler when it is first imported (torch's shape code imports it), so the
    switch must be set before anything of kernelize is imported."""
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        format="%(name)s %(levelname)s: %(message)s", level=logging.INFO if args.verbose else logging.WARNING
    )
    if getattr(args, "backend", None) == "triton":
        _interpret_triton_without_gpu()
    module, func = COMMANDS[args.command].split(":")
    return int(getattr(importlib.import_module(module), func)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
