"""The ONNX backend node test cases through ``load_onnx`` + ``evaluate``.

``onnx.backend.test.case.node.collect_testcases()`` builds ~1,900 one-node models (and their "_expanded"
function bodies) with inputs and expected outputs in memory. Every case must either pass (outputs equal the
expected ones within dtype-aware tolerances) or raise ``UnsupportedOpError`` while loading; any other
exception, and any wrong dtype, shape or value, fails the test. Run as a script for a per-case listing:
``python tests/ir/test_onnx_node_cases.py [name-substring]``.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from kernelize.ir import VerifyError, evaluate, verify
from kernelize.ir.errors import UnsupportedOpError
from kernelize.ir.onnx_frontend import load_onnx

MIN_PASSED = 450

# Cases skipped outright because their data cannot even be represented here: the expected outputs are
# sequences / optionals (lists, None) or strings. load_onnx must (and is checked to) raise
# UnsupportedOpError for these models; only the comparison is skipped.
UNREPRESENTABLE_DATA = "sequence, optional or string data"

# dtype -> (rtol, atol) floor; the case's own rtol/atol are used when larger. Half types compute in f32
# and round once per op, so they get their own precision's tolerance.
_TOL = {
    np.dtype(np.float64): (1e-7, 1e-9),
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float16): (4e-3, 1e-3),
}
_BF16_TOL = (2e-2, 1e-2)


def _to_torch(a) -> torch.Tensor:
    if isinstance(a, onnx.TensorProto):
        a = numpy_helper.to_array(a)
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype is torch.bfloat16 else t.numpy()


def _representable(x) -> bool:
    if isinstance(x, onnx.TensorProto):
        return x.data_type != onnx.TensorProto.STRING
    if isinstance(x, (list, tuple)) or x is None:
        return False
    return np.asarray(x).dtype.kind not in "OUS"


def _compare(got: torch.Tensor, want, rtol: float, atol: float) -> str | None:
    """None when ``got`` equals ``want``; else what differs."""
    if isinstance(want, onnx.TensorProto):
        want = numpy_helper.to_array(want)
    want = np.asarray(want)
    bf16 = want.dtype.name == "bfloat16"
    want_t = _to_torch(want)
    if got.dtype != want_t.dtype:
        return f"dtype {got.dtype}, expected {want_t.dtype}"
    if tuple(got.shape) != want.shape:
        return f"shape {tuple(got.shape)}, expected {want.shape}"
    g, w = _to_numpy(got), (want.astype(np.float32) if bf16 else want)
    if w.dtype.kind in "biu":
        same = np.array_equal(g, w)
        return None if same else f"values differ: got {g.ravel()[:8]}, expected {w.ravel()[:8]}"
    lo_r, lo_a = _BF16_TOL if bf16 else _TOL[w.dtype]
    try:
        np.testing.assert_allclose(g, w, rtol=max(rtol, lo_r), atol=max(atol, lo_a), equal_nan=True)
    except AssertionError as e:
        return str(e).strip().splitlines()[-4:].__str__()
    return None


def _freeze(model: onnx.ModelProto, inputs, first: int) -> onnx.ModelProto:
    """``model`` with graph inputs ``first..`` baked in as initializers holding their test values."""
    frozen = onnx.ModelProto()
    frozen.CopyFrom(model)
    for vi, a in list(zip(frozen.graph.input, inputs))[first:]:
        t = onnx.TensorProto()
        if isinstance(a, onnx.TensorProto):
            t.CopyFrom(a)
        else:
            t = numpy_helper.from_array(np.asarray(a))
        t.name = vi.name
        frozen.graph.initializer.append(t)
    return frozen


def run_case(case, freeze: int | None = None) -> tuple[str, str]:
    """Classify one case: ("passed" | "unsupported" | "crash" | "wrong", detail).

    ``freeze=k`` first bakes graph inputs ``k..`` into the model as initializers, for ops whose shape-like
    inputs (Slice starts, Resize sizes, Reduce axes...) are graph inputs in the test but must be known when
    loading; the model computes the same outputs either way.
    """
    graph = None
    for inputs, outputs in case.data_sets:
        if graph is None or freeze is not None:
            model = case.model if freeze is None else _freeze(case.model, inputs, freeze)
            try:
                graph = load_onnx(model.SerializeToString())
            except UnsupportedOpError as e:
                return "unsupported", str(e)
            except Exception as e:  # noqa: BLE001 - every other exception is a crash of the front end
                return "crash", f"load: {type(e).__name__}: {e}"
            try:
                verify(graph)
            except VerifyError as e:
                return "crash", f"verify: {e}"
        if not all(map(_representable, list(inputs) + list(outputs))):
            return "crash", f"loaded although its data is {UNREPRESENTABLE_DATA}"
        inits = {t.name for t in model.graph.initializer}
        names = [i.name for i in model.graph.input if i.name not in inits]
        feeds = {n: _to_torch(a) for n, a in zip(names, inputs)}
        try:
            got = evaluate(graph, feeds)
        except Exception as e:  # noqa: BLE001
            return "crash", f"evaluate: {type(e).__name__}: {e}"
        if len(got) != len(outputs):
            return "wrong", f"{len(got)} outputs, expected {len(outputs)}"
        for k, (g, w) in enumerate(zip(got, outputs)):
            diff = _compare(g, w, case.rtol, case.atol)
            if diff:
                return "wrong", f"output {k}: {diff}"
    return "passed", ""


def collect() -> list:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [c for c in collect_testcases() if c.kind == "node"]


_LOAD_TIME = "must be known at load time"


def classify(case) -> tuple[str, str]:
    """run_case; a case unsupported only because an input must be a load-time constant is retried with
    inputs 1.. frozen, then all inputs frozen, and counted as "frozen" when it then passes."""
    kind, msg = run_case(case)
    for first in (1, 0):
        if kind != "unsupported" or _LOAD_TIME not in msg and "known only at run time" not in msg:
            break
        kind, msg = run_case(case, freeze=first)
        kind = "frozen" if kind == "passed" else kind
    return kind, msg


def run_all(cases) -> tuple[Counter, dict[str, list[tuple[str, str]]]]:
    counts: Counter = Counter()
    detail: dict[str, list[tuple[str, str]]] = {}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for case in cases:
            kind, msg = classify(case)
            counts[kind] += 1
            detail.setdefault(kind, []).append((case.name, msg))
    return counts, detail


@pytest.fixture(scope="module")
def cases() -> list:
    return collect()


def test_onnx_backend_node_cases(cases):
    start, cpu_start = time.perf_counter(), time.process_time()
    counts, detail = run_all(cases)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    bad = detail.get("crash", []) + detail.get("wrong", [])
    summary = (
        f"passed {counts['passed']} (+{counts['frozen']} with shape inputs frozen), unsupported "
        f"{counts['unsupported']}, crashed {counts['crash']}, wrong {counts['wrong']} of "
        f"{sum(counts.values())} cases in {seconds:.1f} s ({cpu:.1f} s CPU)"
    )
    print(summary)
    assert not bad, summary + "\n" + "\n".join(f"{n}: {m}" for n, m in bad[:30])
    assert counts["passed"] >= MIN_PASSED, summary
    assert cpu < 60, summary  # CPU time: wall time depends on what else shares the machine


@pytest.mark.parametrize("name", ["test_abs", "test_relu", "test_softmax_axis_0", "test_equal", "test_mish"])
def test_known_cases_pass(cases, name):
    case = next(c for c in cases if c.name == name)
    assert run_case(case) == ("passed", "")


def test_harness_detects_wrong_results(cases, monkeypatch):
    """The comparison can fail: a Relu that negates, an Equal that is inverted (Kyanite's bug) are caught."""
    from kernelize.ir import onnx_frontend

    monkeypatch.setitem(onnx_frontend.OPS, "Relu", lambda ctx: ctx.g.neg(ctx.x(0)))
    monkeypatch.setitem(onnx_frontend.OPS, "Equal", lambda ctx: ctx.g.ne(ctx.x(0), ctx.x(1)))
    for name in ("test_relu", "test_equal"):
        kind, msg = run_case(next(c for c in cases if c.name == name))
        assert kind == "wrong", (name, kind, msg)


def test_frozen_inputs_reach_shape_ops(cases):
    """Resize/Slice cases take their sizes as graph inputs: unsupported as is, passing once frozen."""
    case = next(c for c in cases if c.name == "test_resize_upsample_sizes_nearest")
    kind, msg = run_case(case)
    assert kind == "unsupported" and "Resize" in msg and _LOAD_TIME in msg
    assert classify(case) == ("frozen", "")


if __name__ == "__main__":
    pattern = sys.argv[1] if len(sys.argv) > 1 else ""
    counts, detail = run_all([c for c in collect() if pattern in c.name])
    for kind in ("crash", "wrong"):
        for n, m in detail.get(kind, []):
            print(f"{kind:6} {n}: {m[:300]}")
    if "-v" in sys.argv:
        for n, m in detail.get("unsupported", []):
            print(f"unsup  {n}: {m[:200]}")
    print(dict(counts))
