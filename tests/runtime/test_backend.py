"""The Backend protocol: every registered generator provides what the runtime calls, with no probing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.plan import plan
from kernelize.codegen.cpu_backend import CpuBackend
from kernelize.ir import Graph
from kernelize.runtime.backend import Backend
from kernelize.runtime.compiled import BACKENDS


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_is_a_backend(name):
    impl = BACKENDS[name]()
    assert Backend in type(impl).__mro__ and impl.name == name  # inherits the defaults
    assert impl.plan_settings is None or impl.plan_settings.__class__.__name__ == "PlanSettings"
    assert isinstance(impl.device_ok(torch.device("cpu")), bool)


def test_cpu_render_is_the_source_compile_builds():
    g = Graph()
    x, w = g.input("x", ("tokens", 32), "f32"), g.input("w", (48, 32), "f32")
    g.output(g.unary("tanh", g.matmul(x, g.transpose(w))), g.softmax(x))
    impl = CpuBackend()
    kernels = plan(g, impl.plan_settings).kernels
    assert {k.kind for k in kernels} >= {KernelKind.MATMUL, KernelKind.ROW}
    for k in kernels:
        assert impl.render(k) == impl.compile(k).source


def test_compile_many_defaults_to_one_compile_each():
    class Counting(Backend):
        name = "counting"

        def compile(self, kernel):
            return kernel.name

    done = []
    kernels = [SimpleNamespace(name="a"), SimpleNamespace(name="b")]
    assert Counting().compile_many(kernels, done.append) == ["a", "b"]
    assert done == [1, 1]
    assert Counting().plan_settings is None
