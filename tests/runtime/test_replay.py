"""Replay (``kernelize.runtime.replay``): runs of generated CPU steps from one C call, against Python."""

from __future__ import annotations

import pytest
import torch

import kernelize.runtime.compiled as compiled_mod
from kernelize.ir import evaluate
from kernelize.ir.graph import Graph
from kernelize.ir.shapes import Sym
from kernelize.runtime.compiled import compile_graph
from kernelize.runtime.replay import Batch

B = Sym.of("batch")


def _graph() -> Graph:
    """pointwise -> library GEMM (many rows) -> pointwise -> row, conv-free: two batches around the GEMM."""
    g = Graph()
    x = g.input("x", (B, 64), "f32")
    w = g.const(torch.randn(64, 48) * 0.1)
    h = g.exp(g.mul(x, g.const(0.5)))
    y = g.add(g.matmul(h, w), g.const(1.0))
    z = g.softmax(g.mul(y, y))
    g.output(z, g.add(z, g.const(2.0)))
    return g


def _program(cg):
    return next(iter(cg._arenas.values())).program


def test_replayed_runs_match_python_and_the_reference():
    g = _graph()
    cg = compile_graph(g, backend="cpu", cache=False)
    programs = {}
    for n in (3, 300, 3):  # a signature whose GEMM is the few-row kernel, one where it is torch's
        x = torch.randn(n, 64)
        got = cg(x)
        for a, b in zip(got, evaluate(g, [x]), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        programs[n] = next(reversed(cg._arenas.values())).program  # the arena used last
    # 3 rows: everything replays in one batch; 300 rows: the library GEMM runs in Python between two
    assert len(programs[3]) == 1 and isinstance(programs[3][0], Batch)
    assert [type(u) for u in programs[300]] == [Batch, int, Batch]


def test_outputs_are_fresh_and_inputs_patched_on_every_call():
    g = _graph()
    cg = compile_graph(g, backend="cpu", cache=False)
    xs = [torch.randn(5, 64) for _ in range(3)]
    outs = [cg(x) for x in xs]
    assert _program(cg) is not None
    for x, out in zip(xs, outs, strict=True):  # each call's outputs survive the later calls
        for a, b in zip(out, evaluate(g, [x]), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert outs[0][0].data_ptr() != outs[1][0].data_ptr()


def test_replay_off_and_thread_count_changes(monkeypatch):
    g = _graph()
    x = torch.randn(400, 64)
    monkeypatch.setattr(compiled_mod, "REPLAY", False)
    python = compile_graph(g, backend="cpu", cache=False)
    want = python(x)
    assert _program(python) is None
    monkeypatch.setattr(compiled_mod, "REPLAY", True)
    replayed = compile_graph(g, backend="cpu", cache=False)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for a, b in zip(replayed(x), want, strict=True):
                torch.testing.assert_close(a, b)
    finally:
        torch.set_num_threads(threads)


def test_a_failing_kernel_in_a_batch_names_itself():
    g = Graph()
    x = g.input("x", (B, 8), "f32")
    idx = g.input("i", (B,), "i64")
    rows = g.gather(g.softmax(x), idx, 0)  # out-of-range indices set the gathering kernel's error flag
    g.output(g.add(rows, g.const(1.0)))
    cg = compile_graph(g, backend="cpu", cache=False)
    x, good = torch.randn(4, 8), torch.tensor([3, 0, 1, 2])
    torch.testing.assert_close(cg(x, good)[0], evaluate(g, [x, good])[0])
    assert [type(u) for u in _program(cg)] == [Batch]  # softmax, then the gather: both in one batch
    with pytest.raises(IndexError, match="gather index is out of range"):
        cg(x, torch.tensor([9, 0, 1, 2]))


def test_a_library_gemm_returning_its_own_tensor_is_read_from_there(monkeypatch):
    """A GEMM over a constant f32 weight with many rows is one oneDNN call allocating its output
    (``CompiledKernel.fresh``), not the arena buffer planned for it: a replayed reader must follow it."""
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "onednn")  # (not the default: the generated tiles are)
    g = Graph()
    x = g.input("x", (B, 64), "f32")
    y = g.matmul(g.exp(x), g.const(torch.randn(64, 32) * 0.1))  # exp first: the GEMM reads an intermediate
    g.output(g.softmax(g.add(y, g.const(torch.randn(32)))))
    cg = compile_graph(g, backend="cpu", cache=False)
    x = torch.randn(500, 64)
    for _ in range(2):
        torch.testing.assert_close(cg(x)[0], evaluate(g, [x])[0], rtol=1e-5, atol=1e-6)
    assert any(cg._steps[u].compiled.fresh is not None for u in _program(cg) if isinstance(u, int))


@pytest.mark.parametrize("first", ["intermediate", "input"])
def test_generated_gemms_replay_in_the_batch(monkeypatch, first):
    """Many-row GEMMs over constant weights in the generated tiles (bias + GELU, then bias + residual) are
    fixed C calls: the layer is one batch; the first GEMM reads an intermediate or the graph's input (its
    pointer and the residual's patched per run), rows that fill no whole tile."""
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "generated")
    g = Graph()
    x = g.input("x", (B, 40), "f32")
    h = g.exp(g.mul(x, g.const(0.1))) if first == "intermediate" else x
    u = g.gelu(g.add(g.matmul(h, g.const(torch.randn(40, 72) * 0.2)), g.const(torch.randn(72))))
    y = g.add(g.add(g.matmul(u, g.const(torch.randn(72, 40) * 0.1)), g.const(torch.randn(40))), h)
    g.output(g.softmax(y))
    cg = compile_graph(g, backend="cpu", cache=False)
    for n in (67, 67, 130):
        x = torch.randn(n, 40)
        torch.testing.assert_close(cg(x)[0], evaluate(g, [x])[0], rtol=1e-5, atol=1e-6)
        assert [type(u) for u in next(reversed(cg._arenas.values())).program] == [Batch]


def test_attention_over_views_of_a_fused_qkv_buffer_replays_in_the_batch():
    """A transformer layer's attention reads its heads through views (reshape, permute, slice) of the
    fused QKV buffer a kernel writes: the views are made once over the arena buffer and the attention call
    joins the batch; each run reads that run's values."""
    g = Graph()
    s, h, d = 7, 2, 8
    x = g.input("x", (B, s, 3 * h * d), "f32")
    qkv = g.mul(x, g.const(0.5))  # an arena buffer [B, s, 3 * h * d]
    heads = g.permute(g.view(qkv, (B, s, 3, h, d)), (2, 0, 3, 1, 4))  # [3, B, h, s, d]
    q, k, v = (g.view(g.slice(heads, 0, i, i + 1), (B, h, s, d)) for i in range(3))
    g.output(g.exp(g.attention(q, k, v, None, scale=0.3, causal=False)))
    cg = compile_graph(g, backend="cpu", cache=False)
    for _ in range(2):
        x = torch.randn(2, s, 3 * h * d)
        torch.testing.assert_close(cg(x)[0], evaluate(g, [x])[0], rtol=1e-5, atol=1e-6)
    (attention,) = [i for i, st in enumerate(cg._steps) if st.kernel.kind.name == "ATTENTION"]
    assert [type(u) for u in _program(cg)] == [Batch] and attention in _program(cg)[0].steps


def _conv_pool_graph(kind: str, count_pad: bool) -> Graph:
    """conv -> pool -> conv -> relu: the pool reads and writes NHWC buffers between two generated convs."""
    g = Graph()
    x = g.input("x", (B, 8, 13, 11), "f32")
    w = g.const(torch.randn(16, 8, 3, 3) * 0.2)
    c = g.clamp(g.conv(g.mul(x, g.const(2.0)), w, padding=(1, 1, 1, 1)), 0.0)
    p = g.pool(c, kind, (3, 3), (2, 2), padding=(1, 1, 1, 1), ceil_mode=True, count_include_pad=count_pad)
    y = g.conv(p, g.const(torch.randn(12, 16, 1, 1) * 0.2), g.const(torch.randn(12)))
    g.output(g.clamp(y, 0.0))
    return g


@pytest.mark.parametrize("kind,count_pad", [("max", False), ("avg", True), ("avg", False)])
def test_a_pool_between_convs_replays_in_the_batch(monkeypatch, kind, count_pad):
    """A pool over NHWC buffers runs from C inside the batch (no Python step, its output in the arena)
    and matches the reference and the Python steps; with replay off the pool's own tensor is read."""
    g = _conv_pool_graph(kind, count_pad)
    x = torch.randn(2, 8, 13, 11)
    want = evaluate(g, [x])[0]
    cg = compile_graph(g, backend="cpu", cache=False)
    for _ in range(2):
        torch.testing.assert_close(cg(x)[0], want, rtol=1e-4, atol=1e-5)
    pools = [i for i, st in enumerate(cg._steps) if st.library]
    assert pools and all(any(i in u.steps for u in _program(cg) if isinstance(u, Batch)) for i in pools)
    monkeypatch.setattr(compiled_mod, "REPLAY", False)
    python = compile_graph(g, backend="cpu", cache=False)
    torch.testing.assert_close(python(x)[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("split", [False, True])
def test_a_conv_reading_reordered_channels_replays_with_a_gather(split):
    """conv -> channel shuffle (or a channel slice) -> depthwise conv: the second conv's input is gathered
    from the first's NHWC output inside the batch, not materialised by torch in a Python step."""
    g = Graph()
    x = g.input("x", (2, 24, 9, 7), "f32")
    y = g.clamp(g.conv(x, g.const(torch.randn(48, 8, 1, 1) * 0.3), groups=3), 0.0)
    if split:
        v = g.slice(y, 1, 8, 40)
    else:
        v = g.view(g.transpose(g.view(y, (2, 3, 16, 9, 7)), 1, 2), (2, 48, 9, 7))
    c = v.shape[1]
    z = g.conv(v, g.const(torch.randn(c, 1, 3, 3) * 0.3), padding=(1, 1, 1, 1), groups=c)
    g.output(g.clamp(g.conv(z, g.const(torch.randn(6, c, 1, 1) * 0.3)), 0.0))
    xs = torch.randn(2, 24, 9, 7)
    want = evaluate(g, [xs])[0]
    cg = compile_graph(g, backend="cpu", cache=False)
    for _ in range(2):
        torch.testing.assert_close(cg(xs)[0], want, rtol=1e-4, atol=1e-5)
    convs = [i for i, st in enumerate(cg._steps) if st.conv is not None]
    batched = {i for u in _program(cg) if isinstance(u, Batch) for i in u.steps}
    assert convs[1] in batched  # the conv reading the view


def test_a_pool_to_one_pixel_before_a_classifier_replays_in_the_batch():
    """An average pool whose window covers the image (EfficientNet's global average, exported as a pool):
    its [N, C, 1, 1] output is the same memory NCHW or NHWC, so it runs from C inside the batch even though
    the classifier reads it NCHW."""
    g = Graph()
    x = g.input("x", (2, 8, 7, 7), "f32")
    y = g.clamp(g.conv(x, g.const(torch.randn(24, 8, 3, 3) * 0.3), padding=(1, 1, 1, 1)), 0.0)
    p = g.pool(y, "avg", (16, 16), (16, 16), ceil_mode=True, count_include_pad=True)
    g.output(g.matmul(g.view(p, (2, 24)), g.const(torch.randn(24, 10) * 0.3)))
    xs = torch.randn(2, 8, 7, 7)
    want = evaluate(g, [xs])[0]
    cg = compile_graph(g, backend="cpu", cache=False)
    for _ in range(2):
        torch.testing.assert_close(cg(xs)[0], want, rtol=1e-5, atol=1e-5)
    (pool,) = [i for i, st in enumerate(cg._steps) if st.library and st.kernel.node is p]
    assert any(pool in u.steps for u in _program(cg) if isinstance(u, Batch))


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_a_global_reduction_of_a_conv_replays_in_the_batch(monkeypatch, op):
    """A lone mean (sum) over the image axes of a conv's NHWC output (a global average pool before a
    classifier, 17 x 17: too long a row to read across channels) runs from C inside the batch, and matches
    the reference, the Python steps and the library function on an NCHW tensor with NaN and inf in it."""
    from kernelize.codegen import cpu_pool
    from kernelize.ir.graph import Op

    g = Graph()
    x = g.input("x", (2, 8, 17, 17), "f32")
    y = g.clamp(g.conv(x, g.const(torch.randn(24, 8, 3, 3) * 0.3), padding=(1, 1, 1, 1)), 0.0)
    r = g.reduce(Op.MEAN if op == "mean" else Op.SUM, y, (2, 3), keepdim=True)
    g.output(g.matmul(g.view(r, (2, 24)), g.const(torch.randn(24, 10) * 0.3)))
    xs = torch.randn(2, 8, 17, 17)
    want = evaluate(g, [xs])[0]
    cg = compile_graph(g, backend="cpu", cache=False)
    for _ in range(2):
        torch.testing.assert_close(cg(xs)[0], want, rtol=1e-5, atol=1e-5)
    (lib,) = [i for i, st in enumerate(cg._steps) if st.library]
    assert cg._steps[lib].kernel.node is r
    assert any(lib in u.steps for u in _program(cg) if isinstance(u, Batch))
    monkeypatch.setattr(compiled_mod, "REPLAY", False)
    python = compile_graph(g, backend="cpu", cache=False)
    torch.testing.assert_close(python(xs)[0], want, rtol=1e-5, atol=1e-5)
    t = torch.randn(3, 5, 4, 7)
    t[0, 1, 2, 3], t[1, 2, 0, 0], t[2, 4, 3, 6] = float("nan"), float("inf"), -float("inf")
    ref = t.mean((2, 3), keepdim=True) if op == "mean" else t.sum((2, 3), keepdim=True)
    node = g.reduce(r.op, g.input("t", (3, 5, 4, 7), "f32"), (2, 3), keepdim=True)
    assert cpu_pool.global_supports(node, t) and not cpu_pool.global_supports(node, t.double())
    torch.testing.assert_close(cpu_pool.global_reduce(node, t, {}), ref, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("channels", [8, 3])
def test_a_conv_reading_the_graph_input_replays_with_an_nhwc_copy(channels):
    """The stem conv reads the NCHW graph input: the batch copies it NHWC (its pointer patched per call)
    before the conv, or over 3 channels the conv reads it as it comes; either way conv -> pool -> conv is
    one batch, and each call sees its own input."""
    g = Graph()
    x = g.input("x", (B, channels, 13, 11), "f32")
    c = g.clamp(g.conv(x, g.const(torch.randn(16, channels, 3, 3) * 0.2), padding=(1, 1, 1, 1)), 0.0)
    p = g.pool(c, "max", (3, 3), (2, 2), padding=(1, 1, 1, 1))
    g.output(g.clamp(g.conv(p, g.const(torch.randn(12, 16, 1, 1) * 0.2)), 0.0))
    cg = compile_graph(g, backend="cpu", cache=False)
    xs = [torch.randn(2, channels, 13, 11) for _ in range(3)]
    outs = [cg(x)[0] for x in xs]
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, evaluate(g, [x])[0], rtol=1e-4, atol=1e-5)
    batch = _program(cg)[0]
    assert isinstance(batch, Batch) and 0 in batch.steps
    assert len(batch.nargs) == len(batch.steps) + (channels == 8)  # the NHWC copy: a call of its own


def test_a_conv_reading_a_slice_of_a_materialized_channel_shuffle_replays_in_the_batch(monkeypatch):
    """ShuffleNet v2's unit: two convs concatenated, a channel shuffle (view / transpose / view) the plan
    materializes row-major, split in halves: one to a conv, one to the next concat. The conv's half is a
    contiguous NCHW slice of that buffer: copied NHWC from C inside the batch, not in a Python step."""
    from kernelize.runtime import replay

    g = Graph()
    x = g.input("x", (1, 16, 10, 10), "f32")
    a = g.clamp(g.conv(x, g.const(torch.randn(8, 16, 1, 1) * 0.3)), 0.0)
    b = g.clamp(g.conv(x, g.const(torch.randn(8, 16, 3, 3) * 0.3), padding=(1, 1, 1, 1)), 0.0)
    s = g.view(g.transpose(g.view(g.concat([a, b], 1), (1, 2, 8, 10, 10)), 1, 2), (1, 16, 10, 10))
    r = g.clamp(g.conv(g.slice(s, 1, 8, 16), g.const(torch.randn(8, 8, 1, 1) * 0.3)), 0.0)
    g.output(g.concat([g.slice(s, 1, 0, 8), r], 1))
    xs = torch.randn(1, 16, 10, 10)
    want = evaluate(g, [xs])[0]
    for dense_view, batched in ((replay._dense_view, True), (lambda *a: None, False)):
        monkeypatch.setattr(replay, "_dense_view", dense_view)
        cg = compile_graph(g, backend="cpu", cache=False)
        for _ in range(2):
            torch.testing.assert_close(cg(xs)[0], want, rtol=1e-4, atol=1e-5)
        # the shuffle, materialized
        assert any(len(w.shape) == 5 for st in cg._steps for w in st.kernel.writes)
        program = _program(cg)
        assert (len(program) == 1 and isinstance(program[0], Batch)) is batched


def test_a_conv_reading_a_permuted_row_major_buffer_replays_in_the_batch():
    """ConvNeXt's order: a layer norm over the channels of an NHWC-ordered [N, H, W, C] value, permuted to
    NCHW for a depthwise conv. The permuted view of that row-major buffer is channels-last already: the conv
    reads it in place inside the batch."""
    g = Graph()
    x = g.input("x", (2, 9, 7, 16), "f32")
    h = g.layernorm(g.exp(x), g.const(torch.rand(16) + 0.5), g.const(torch.randn(16)))
    c = g.conv(
        g.permute(h, (0, 3, 1, 2)), g.const(torch.randn(16, 1, 7, 7) * 0.2), padding=(3, 3, 3, 3), groups=16
    )
    g.output(g.clamp(g.conv(c, g.const(torch.randn(8, 16, 1, 1) * 0.3)), 0.0))
    xs = torch.randn(2, 9, 7, 16)
    want = evaluate(g, [xs])[0]
    cg = compile_graph(g, backend="cpu", cache=False)
    for _ in range(2):
        torch.testing.assert_close(cg(xs)[0], want, rtol=1e-4, atol=1e-5)
    depthwise = next(i for i, st in enumerate(cg._steps) if st.conv is not None)
    assert any(depthwise in u.steps for u in _program(cg) if isinstance(u, Batch))


def test_a_program_of_fixed_calls_patches_its_slots_on_every_run():
    """`CompiledGraph.fixed_call` + `Program`: a graph's calls on fixed buffers, the varying input patched
    (through a view of it at an offset), then `kz_copy_rows` into a patched output: equal to the graph's own
    runs, bit for bit, for inputs at new addresses."""
    from kernelize.runtime.replay import Program, copy_rows_call

    g = Graph()
    x = g.input("x", (B, 64), "f32")
    g.output(g.softmax(g.mul(g.exp(g.mul(x, g.const(0.5))), g.const(3.0))))
    cg = compile_graph(g, backend="cpu", cache=False)
    fixed = cg.fixed_call([torch.randn(4, 64)], varying=(0,))
    assert fixed is not None and fixed.patches and all(p[2] == 0 for p in fixed.patches)
    program = Program()
    program.add_graph(fixed, {0: "x"})
    program.add(copy_rows_call(fixed.outputs[0], torch.empty(4, 64)), threads_at=-1, out=1)
    for _ in range(3):
        xs, out = torch.randn(4, 64), torch.empty(4, 64)
        program.run(x=xs.data_ptr(), out=out.data_ptr())
        assert torch.equal(out, cg(xs)[0])


def test_copy_rows_takes_evenly_spaced_rows_only():
    from kernelize.runtime.replay import Program, copy_rows_call

    src = torch.randn(3, 5, 8)[:, 1:4]  # rows 8 apart within a block, blocks 40 apart: not evenly spaced
    assert copy_rows_call(src, torch.empty(3, 3, 8)) is None
    buf, new = torch.zeros(2, 6, 10, 4), torch.randn(2, 6, 1, 4)  # a cache row: rows 40 apart
    program = Program()
    program.add(copy_rows_call(new, buf[:, :, 7:8]), threads_at=-1)
    program.run()
    assert torch.equal(buf[:, :, 7:8], new) and not buf[:, :, :7].any() and not buf[:, :, 8:].any()


def test_programs_included_in_one_run_with_their_slots_renamed():
    """`Program.include`: two programs' calls as one call, each one's slots renamed; `add_cell` writes a
    slot into an int64 array a call points to; `seal(order)` lays the slots out for `run_values`."""
    import ctypes

    from kernelize.runtime.replay import Program, copy_rows_call

    def copier() -> tuple[Program, ctypes.Array]:
        program, cell = Program(), (ctypes.c_int64 * 3)()
        program.add(copy_rows_call(torch.empty(2, 8), torch.empty(2, 8)), threads_at=-1, src=0, dst=1)
        program.add_cell(cell, 2, "n")
        return program, cell

    (first, cell0), (second, cell1) = copier(), copier()
    chain = Program()
    chain.include(first, {"dst": "mid", "n": "n0"})
    chain.include(second, {"src": "mid", "n": "n1"})
    assert chain.seal(["src", "dst", "n1"]) == ("src", "dst", "n1", "mid", "n0")
    x, mid, y = torch.randn(2, 8), torch.empty(2, 8), torch.empty(2, 8)
    chain.run_values([x.data_ptr(), y.data_ptr(), 11, mid.data_ptr(), 7])
    assert torch.equal(mid, x) and torch.equal(y, x) and (cell0[2], cell1[2]) == (7, 11)
