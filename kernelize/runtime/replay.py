"""Replay: runs of a CPU graph's generated kernels called from one C loop, without Python between them.

With an arena (:class:`~kernelize.runtime.memory.Arena`) every intermediate buffer of a compiled CPU graph
has a fixed address for a given input signature, and constants and packed weights are fixed for the
graph's life. So the C call each generated kernel makes (:attr:`CompiledKernel.c_call`: function address
plus integer arguments) is fixed too, but for the few pointers that change per call: the graph's inputs,
its outputs, and buffers that library steps (torch, oneDNN) allocate. A :class:`Batch` holds a run of
consecutive generated steps as an array of such calls, patches the changing pointers and the thread count
in, and hands the array to ``kz_replay`` (``templates/cpu_replay.cpp``) in one ctypes call. Library steps
between batches run as before.

Why: between its kernels, a compiled graph's Python (binding values, materialising views, allocating,
ctypes argument conversion) cost 9-13 us per step; MobileNetV2 at batch 1 has 54 steps, ~0.7 ms of a
~9 ms run on one thread, and more of a 2-thread run.

Example:
    >>> units = schedule.program(steps, bound, views, consts, channels_last)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kernelize.autokernel.layout import channel_map
from kernelize.codegen import cpu_build, cpu_pool
from kernelize.ir.graph import LAYOUT, Node, Op
from kernelize.ir.shapes import bind
from kernelize.runtime.backend import CCall
from kernelize.runtime.library import materialize

# library ops one of our compiled C functions runs (op -> c_call(node, input, output) -> CCall | None)
C_LIBRARY = {Op.POOL: cpu_pool.c_call, Op.SUM: cpu_pool.global_c_call, Op.MEAN: cpu_pool.global_c_call}


def c_library(node: Node, channels_last: Container[Node]) -> bool:
    """Whether one of our C functions (:data:`C_LIBRARY`) writes the LIBRARY ``node``'s output when its step
    is replayed: a pool into an NHWC buffer, or into a ``[N, C, 1, 1]`` one (the same memory in either
    layout: EfficientNet's global average as an average pool), a global sum or mean into its
    ``[N, C, 1, 1]``."""
    if node.op not in C_LIBRARY:
        return False
    if node.op is Op.POOL:
        return node in channels_last or tuple(node.shape[2:]) == (1, 1)
    return cpu_pool.is_global(node)


REPLAY_ARGS = 16  # KZ_REPLAY_ARGS: the most integer arguments (the thread count included) a call passes


class KzCall(ctypes.Structure):
    """``struct kz_call`` of ``cpu_replay.cpp``."""

    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_int64 * REPLAY_ARGS)]


@functools.cache
def _replay_lib() -> ctypes.CDLL:
    """``cpu_replay.cpp`` compiled once (disk-cached like every kernel)."""
    from kernelize.codegen.cpu_build import build_shared_object, load
    from kernelize.codegen.template import load_template

    lib = load(build_shared_object(load_template("cpu_replay.cpp"), "kz_replay"))
    lib.kz_replay.argtypes, lib.kz_replay.restype = [ctypes.POINTER(KzCall), ctypes.c_int], ctypes.c_int
    return lib


def _replay_fn():
    """``kz_replay``."""
    return _replay_lib().kz_replay


@functools.cache
def _patched_fn():
    """``kz_replay_patched``."""
    fn = _replay_lib().kz_replay_patched
    i64 = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes, fn.restype = [ctypes.POINTER(KzCall), ctypes.c_int, i64, ctypes.c_int, i64], ctypes.c_int
    return fn


_TREE_EPOCH = [0]


def _bump(*_: object) -> None:
    _TREE_EPOCH[0] += 1


@functools.cache
def _watch_tree() -> None:
    for register in (
        torch.nn.modules.module.register_module_module_registration_hook,
        torch.nn.modules.module.register_module_parameter_registration_hook,
        torch.nn.modules.module.register_module_buffer_registration_hook,
    ):
        register(_bump)


def tree_epoch() -> int:
    """A count of the submodule, parameter and buffer assignments made in this process since the first call
    (torch's global registration hooks; a deletion is not counted): equal counts mean no module got another
    submodule, parameter or buffer in between, which a replay program built from a module tree checks per
    run in one comparison instead of walking the tree."""
    _watch_tree()
    return _TREE_EPOCH[0]


def copy_rows_call(src: torch.Tensor, dst: torch.Tensor) -> CCall | None:
    """The call copying ``src`` into ``dst`` (same shape and dtype) as rows of their last axis, for a replay
    program (``kz_copy_rows``); None when the last axis is not dense in both or the rows are not evenly
    spaced (one stride over the leading axes)."""
    if src.shape != dst.shape or src.dtype != dst.dtype or not src.numel():
        return None
    rows, width = src.numel() // src.shape[-1], src.shape[-1] * src.element_size()
    spaced = [_row_stride(t) for t in (src, dst)]
    if None in spaced or (src.shape[-1] > 1 and (src.stride(-1) != 1 or dst.stride(-1) != 1)):
        return None
    size = src.element_size()
    fn = ctypes.cast(_replay_lib().kz_copy_rows, ctypes.c_void_p).value
    args = (src.data_ptr(), dst.data_ptr(), rows, width, spaced[0] * size, spaced[1] * size)
    return CCall(fn, args, "kz_copy_rows cannot fail")


def _row_stride(t: torch.Tensor) -> int | None:
    """The element distance between consecutive rows (over all leading axes) of ``t``, or None when the
    rows are not evenly spaced."""
    lead = [(n, st) for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n > 1]
    if not lead:
        return t.shape[-1]
    step = lead[-1][1]
    for (_, st), (n_in, st_in) in zip(lead[:-1], lead[1:]):
        if st != st_in * n_in:
            return None
    return step


class Program:
    """A fixed sequence of C calls run by one ``kz_replay`` call, with named slots written per run: the few
    pointers and sizes that change from one run to the next (a decode step's input and output, the cache
    position). Everything else the calls read and write is fixed: the program holds those buffers
    (:meth:`hold`) for as long as it lives. The slots are written from C (``kz_replay_patched``), so a run
    costs the same Python however many calls read a slot.

    Example:
        >>> program = Program()  # doctest: +SKIP
        >>> program.add(norm_call, x=0)  # argument 0 of the call is the slot "x"
        >>> program.run(x=hidden.data_ptr())
    """

    def __init__(self) -> None:
        self._entries: list[tuple[CCall, int, dict[tuple[int, int], str]]] = []
        self._cells: list[tuple[ctypes.Array, int, str]] = []  # int64 cells outside the calls: (array, index)
        self._held: list = []
        self._calls: ctypes.Array | None = None
        self._patches: ctypes.Array | None = None
        self._values: ctypes.Array | None = None
        self._npatches = 0
        self.slots: tuple[str, ...] = ()  # the slot names, in the order :meth:`run_values` takes them

    def add(self, call: CCall, threads_at: int | None = None, **slots: int | tuple[int, int]) -> int:
        """Append ``call``; its thread count goes to argument ``threads_at`` (default: after its arguments,
        :class:`CCall`'s convention; -1: it takes none); ``slots``: slot name -> argument index, or
        (argument index, byte offset added to the slot's value). Returns the call's index."""
        assert self._calls is None, "Program.add after the first run"
        at = len(call.args) if threads_at is None else threads_at
        assert len(call.args) <= REPLAY_ARGS and at < REPLAY_ARGS, "too many arguments for kz_replay"
        where = {(a, 0) if isinstance(a, int) else a: name for name, a in slots.items()}
        self._entries.append((call, at, where))
        self.hold(*call.keep)
        return len(self._entries) - 1

    def add_cell(self, array: ctypes.Array, index: int, slot: str) -> None:
        """Element ``index`` of the int64 ``array`` (an argument array a call points to: the attention's
        sizes) takes the value of ``slot`` on every run."""
        assert self._calls is None, "Program.add_cell after the first run"
        self._cells.append((array, index, slot))
        self.hold(array)

    def add_graph(self, fixed, names: dict[int, str]) -> None:
        """Append a graph's calls (:class:`kernelize.runtime.compiled.FixedCall`); ``names``: varying input
        index -> the slot its data pointer comes from. Holds the graph's buffers."""
        for c, call in enumerate(fixed.calls):
            slots = {}
            for pc, a, j, offset in fixed.patches:
                if pc == c:
                    slots[(a, offset)] = names[j]
            assert self._calls is None, "Program.add_graph after the first run"
            self._entries.append((call, len(call.args), slots))
            self.hold(*call.keep)
        self.hold(*fixed.writes)

    def include(self, other: Program, rename: Mapping[str, str]) -> None:
        """Append ``other``'s calls and cells, its slots renamed by ``rename`` (the others keep their names):
        several programs run as one call. The buffers stay shared with ``other``: the two must not run at
        the same time."""
        assert self._calls is None, "Program.include after the first run"
        for call, at, slots in other._entries:
            self._entries.append((call, at, {k: rename.get(n, n) for k, n in slots.items()}))
        self._cells += [(a, i, rename.get(n, n)) for a, i, n in other._cells]
        self.hold(*other._held)

    def hold(self, *objects) -> None:
        """Keep ``objects`` (the buffers the calls' pointers point into) alive with the program."""
        self._held.extend(objects)

    def __len__(self) -> int:
        return len(self._entries)

    def _seal(self, order: Sequence[str] = ()) -> None:
        calls = (KzCall * len(self._entries))()
        for c, (call, _, _) in enumerate(self._entries):
            calls[c].fn = call.fn
            for a, v in enumerate(call.args):
                calls[c].args[a] = v
        names = [n for _, _, s in self._entries for n in s.values()] + [n for _, _, n in self._cells]
        names = list(dict.fromkeys([*(n for n in order if n in names), *names]))
        index = {n: i for i, n in enumerate(names)}
        base, size, argument = ctypes.addressof(calls), ctypes.sizeof(KzCall), KzCall.args.offset
        patches = [
            (base + c * size + argument + 8 * a, index[name], offset)
            for c, (_, _, s) in enumerate(self._entries)
            for (a, offset), name in s.items()
        ]
        patches += [(ctypes.addressof(arr) + 8 * i, index[name], 0) for arr, i, name in self._cells]
        threads = len(names)  # the thread count is the value after the slots'
        at_threads = [(c, at) for c, (_, at, _) in enumerate(self._entries) if at >= 0]
        patches += [(base + c * size + argument + 8 * at, threads, 0) for c, at in at_threads]
        self._patches = (ctypes.c_int64 * (3 * len(patches)))(*(v for p in patches for v in p))
        self._npatches = len(patches)
        self._values = (ctypes.c_int64 * (len(names) + 1))()
        self.slots = tuple(names)
        self._calls = calls

    def run(self, **values: int) -> None:
        """Write ``values`` (slot name -> value) into their slots and the thread count into every call, then
        make the calls.

        Raises:
            the first failing call's exception type (:attr:`CCall.raises`) with its message.
        """
        if self._calls is None:
            self._seal()
        self.run_values([values[n] for n in self.slots])

    def run_values(self, values: Sequence[int]) -> None:
        """:meth:`run` with the slots' values in the order of :attr:`slots` (see :meth:`seal`)."""
        if self._calls is None:
            self._seal()
        self._values[:] = [*values, cpu_build.threads()]
        rc = _patched_fn()(self._calls, len(self._entries), self._patches, self._npatches, self._values)
        if rc:
            call = self._entries[rc - 1][0]
            raise call.raises(call.error)

    def seal(self, order: Sequence[str] = ()) -> tuple[str, ...]:
        """Fix the calls (no more :meth:`add`); returns :attr:`slots`: the slots named in ``order`` first, in
        that order (a caller that writes its values as a list lays them out as it likes)."""
        if self._calls is None:
            self._seal(order)
        return self.slots


@dataclass
class Batch:
    """Consecutive generated steps run by one ``kz_replay`` call.

    Attributes:
        steps: the step indices, in order.
        calls: their calls (the thread count and ``patches`` filled in per run).
        patches: ``(call, argument, buffer)``: the buffer's data pointer goes there on every run.
        fresh: steps whose writes are allocated per run (graph outputs): their writes are patched.
        errors: per call, what a non-zero return means, and the exception type it raises.
    """

    steps: tuple[int, ...]
    calls: ctypes.Array
    patches: tuple[tuple[int, int, Node], ...]
    fresh: tuple[int, ...]
    errors: tuple[tuple[type[Exception], str], ...]
    nargs: tuple[int, ...]  # per call, the index of its thread-count argument
    keep: tuple = field(default=(), repr=False)  # what the calls' pointers point into (CCall.keep)

    def run(self, tensor: Callable[[Node], torch.Tensor], allocate: Callable[[int], None]) -> None:
        """Allocate the per-run writes (``allocate(step)`` puts them where ``tensor`` finds them), patch the
        pointers and the thread count, and make the calls."""
        for i in self.fresh:
            allocate(i)
        calls = self.calls
        for c, a, b in self.patches:
            calls[c].args[a] = tensor(b).data_ptr()
        threads = cpu_build.threads()
        for c, a in enumerate(self.nargs):
            calls[c].args[a] = threads
        rc = _replay_fn()(calls, len(self.nargs))
        if rc:
            kind, message = self.errors[rc - 1]
            raise kind(message)


def batch_of(
    entries: Sequence[tuple[int, CCall | tuple[CCall, ...], Sequence[tuple[int, Node]], bool]],
) -> Batch:
    """A batch from ``(step, call, dynamic arguments (index, buffer), writes allocated per run)`` entries;
    a step may make several calls (a channel gather or an NHWC copy before a conv): its dynamic arguments
    are its first call's."""
    per_step = [(e[1],) if isinstance(e[1], CCall) else e[1] for e in entries]
    flat = [c for cs in per_step for c in cs]
    calls = (KzCall * len(flat))()
    patches = []
    for c, call in enumerate(flat):
        calls[c].fn = call.fn
        for a, v in enumerate(call.args):
            calls[c].args[a] = v
    first = 0
    for (_, _, dynamic, _), cs in zip(entries, per_step, strict=True):
        patches += [(first, a, b) for a, b in dynamic]
        first += len(cs)
    return Batch(
        steps=tuple(e[0] for e in entries),
        calls=calls,
        patches=tuple(patches),
        fresh=tuple(e[0] for e in entries if e[3]),
        errors=tuple((c.raises, c.error) for c in flat),
        nargs=tuple(len(c.args) for c in flat),
        keep=tuple(k for c in flat for k in c.keep),
    )


def step_call(
    step,
    shapes: Sequence[tuple[int, ...]],
    sizes: Mapping[str, int],
    fixed: Callable[[Node], torch.Tensor | None],
    channels_last: Container[Node],
    env: Mapping[str, int] | None = None,
) -> tuple[CCall, list[tuple[int, Node]], bool] | None:
    """The C call of a generated step, the arguments to patch per run and whether its writes are allocated
    per run; None when the step must run in Python. ``fixed(b)`` is the tensor of buffer ``b`` when it is
    the same on every run of this signature (arena views, constants), else None; ``channels_last`` the
    buffers the plan lays out NHWC; ``env`` the graph's symbol values (for the views an attention step
    reads)."""
    k, compiled = step.kernel, step.compiled
    if step.library and not step.operands and all(map(_size, shapes)):
        return _library_call(step, fixed, channels_last)
    if compiled is None or compiled.c_call is None or not all(map(_size, shapes)):
        return None
    if step.conv is not None:
        return _conv_call(step, sizes, fixed, channels_last)
    if step.operands:
        return _operands_call(step, env, fixed)
    reads = [fixed(b) for b in k.reads]
    writes = [fixed(b) for b in k.writes]
    per_run = any(w is None for w in writes)
    call = compiled.c_call(reads, writes, sizes)
    if call is None or len(call.args) >= REPLAY_ARGS:  # None: not one C call at these sizes
        return None
    slots = call.slots or range(len(reads) + len(writes))
    dynamic = [(a, b) for a, b, t in zip(slots, (*k.reads, *k.writes), (*reads, *writes)) if t is None]
    if any(a is None for a, _ in dynamic):  # a changing tensor the call only sees through a derived one
        return None
    return call, dynamic, per_run


def _operands_call(step, env, fixed) -> tuple[CCall, list, bool] | None:
    """A step launched on its node's operands seen through their views (attention over the heads of a
    fused QKV buffer): the views made once over fixed buffers, when every buffer it reads and writes is
    fixed and every view is one (a layout op that copies would leave the call reading a stale copy)."""
    k = step.kernel
    bases = {b: fixed(b) for b in k.reads}
    writes = [fixed(b) for b in k.writes]
    if env is None or any(t is None for t in (*bases.values(), *writes)):
        return None
    vals = dict(bases)
    reads = [materialize(s, vals, dict(env)) for s in k.node.src]
    storages = {t.untyped_storage().data_ptr() for t in bases.values()}
    if any(t.untyped_storage().data_ptr() not in storages for t in reads):
        return None
    call = step.compiled.c_call(reads, writes, {})
    return None if call is None or len(call.args) >= REPLAY_ARGS else (call, [], False)


def _conv_call(step, sizes, fixed, channels_last):
    """A generated conv's call, when its input (or the buffer whose channels a view of it reorders: a gather
    into a scratch buffer first), residual and output are fixed channels-last buffers, the plan reads its
    output NHWC (else the Python path hands readers an NCHW copy) and its weight is a constant (packed
    once)."""
    ep, conv = step.kernel.epilogue, step.conv
    x, w = (fixed(s) for s in ep.conv.src)
    r = None if ep.residual is None else fixed(ep.residual)
    y = fixed(ep.tail)
    cl = torch.channels_last
    if w is None or y is None or ep.conv.src[1].op is not Op.CONST or ep.tail not in channels_last:
        return None
    # the output may be a channel slice of a concat's NHWC buffer (the conv writes its pixels' channels there)
    if (ep.residual is not None and r is None) or (r is not None and not r.is_contiguous(memory_format=cl)):
        return None
    if not y.is_contiguous(memory_format=cl) and y.stride(1) != 1:
        return None
    gather, dynamic, src, nchw = None, [], ep.conv.src[0], None
    if x is None and src.op in LAYOUT:
        gather, x = _gathered(src, fixed, channels_last)
        view = _dense_view(src, fixed, sizes) if x is None else None
        if view is not None and view.is_contiguous(memory_format=cl):
            x = view  # an NHWC buffer seen through a permute (ConvNeXt: a layer norm over channels, a conv)
        else:
            nchw = view
    elif x is None and src.op is Op.INPUT and src.dtype.torch == torch.float32:  # NCHW, patched per run
        nchw, dynamic = torch.empty(bind(src.shape, sizes)), [(0, src)]
    if nchw is not None:  # read as it lies (a stem over the image), else copied NHWC first
        call = conv.generated.c_call([nchw, w, conv.bias, r], [y], sizes)
        if call is not None:
            return call._replace(keep=(*call.keep, nchw)), dynamic, False
        x = torch.empty_like(nchw, memory_format=cl)
        gather = cpu_pool.to_nhwc_call(x, None if dynamic else nchw)  # the input's pointer: patched per run
        x = None if gather is None else x
    if x is None or not x.is_contiguous(memory_format=cl):
        return None
    call = conv.generated.c_call([x, w, conv.bias, r], [y], sizes)
    return (call if gather is None else (gather, call._replace(keep=(*call.keep, x)))), dynamic, False


def _gathered(view: Node, fixed, channels_last) -> tuple[CCall | None, torch.Tensor | None]:
    """The call gathering ``view``'s channels from the NHWC buffer it views into a new NHWC scratch buffer,
    and that buffer (the conv's input), when ``view`` only reorders or selects channels; else None, None."""
    b = view
    while b.op in LAYOUT and len(b.src) == 1 and fixed(b) is None:
        b = b.src[0]
    xb = fixed(b)
    channels = None if xb is None or b not in channels_last else channel_map(view, b)
    if channels is None:
        return None, None
    n, _, h, w = xb.shape
    scratch = torch.empty((n, h, w, len(channels)), dtype=xb.dtype, device=xb.device).permute(0, 3, 1, 2)
    call = cpu_pool.gather_call(channels, xb, scratch)
    return (None, None) if call is None else (call, scratch)


def _dense_view(view: Node, fixed, sizes) -> torch.Tensor | None:
    """``view`` as a view of the fixed buffer under its layout ops when that is a dense NCHW f32 tensor,
    contiguous or channels-last (a channel slice of a row-major buffer: ShuffleNet v2's split of its
    materialized channel shuffle; a row-major NHWC buffer permuted to NCHW: ConvNeXt's), so the conv reading
    it needs no Python step; else None."""
    b = view
    while b.op in LAYOUT and len(b.src) == 1 and fixed(b) is None:
        b = b.src[0]
    xb = fixed(b)
    if xb is None or b is view:
        return None
    t = materialize(view, {b: xb}, dict(sizes))
    shared = t.untyped_storage().data_ptr() == xb.untyped_storage().data_ptr()
    dense = t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
    return t if shared and t.dtype == torch.float32 and t.dim() == 4 and dense else None


def _library_call(step, fixed, channels_last):
    """A library step's call where one of ours runs it from C (:data:`C_LIBRARY`), when it reads and writes
    fixed buffers the plan lays out NHWC."""
    node = step.kernel.node
    x = fixed(node.src[0]) if c_library(node, channels_last) and len(node.src) == 1 else None
    y = fixed(node)
    if x is None or y is None or node.src[0] not in channels_last:
        return None
    call = C_LIBRARY[node.op](node, x, y)
    return None if call is None else (call, [], False)


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["Batch", "KzCall", "Program", "batch_of", "c_library", "copy_rows_call", "step_call", "tree_epoch"]
